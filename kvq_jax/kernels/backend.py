"""Choosing an implementation: `backend="auto" | "xla" | "pallas" | "pallas_interpret"`.

- "xla": the jitted XLA reference path (every device).
- "pallas": the Pallas kernel compiled through Triton; needs a CUDA GPU of compute capability
  >= 8.0 (Ampere, Hopper SM90, Blackwell consumer SM120) and a configuration the kernel takes.
- "pallas_interpret": the same kernel body run by Pallas' interpreter through XLA, on any
  device (CPU included). Slow; for tests and debugging.
- "auto": "pallas" where it is supported (device and configuration), else "xla". Setting the
  environment variable KVQ_AUTO_BACKEND=xla makes "auto" take the XLA path everywhere (to rule
  a kernel out in a serving stack without changing code); it is read when a function is
  traced, so set it before the first call.
"""

from __future__ import annotations

import os

import jax

BACKENDS = ("auto", "xla", "pallas", "pallas_interpret")

#: Environment variable: "xla" makes backend="auto" resolve to "xla" on every device.
AUTO_ENV = "KVQ_AUTO_BACKEND"

#: Lowest CUDA compute capability the Triton kernels target.
MIN_COMPUTE_CAPABILITY = (8, 0)


def _compute_capability(device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if not cc:
        return None
    major, _, minor = str(cc).partition(".")
    return int(major), int(minor or 0)


def pallas_device_support(device=None) -> str | None:
    """None when `device` (default: jax.devices()[0]) can run the Triton kernels, else why not."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu" or "cuda" not in getattr(device.client, "platform_version", "cuda"):
        return f"the Pallas Triton kernels need a CUDA GPU, not {device.platform}"
    cc = _compute_capability(device)
    if cc is None or cc < MIN_COMPUTE_CAPABILITY:
        return f"the Pallas Triton kernels need compute capability >= 8.0, got {cc}"
    return None


def resolve_backend(backend: str, config_support: str | None = None, *, device=None) -> str:
    """The implementation to run: "xla", "pallas" or "pallas_interpret".

    config_support: None when the kernel takes the call's configuration (shapes, formats),
    else the reason it does not. "auto" falls back to "xla" for either reason; "pallas" and
    "pallas_interpret" raise ValueError with the reason instead.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "xla":
        return "xla"
    if backend == "auto":
        override = os.environ.get(AUTO_ENV, "").strip().lower()
        if override not in ("", "auto", "xla"):
            raise ValueError(f"{AUTO_ENV} must be 'xla' or 'auto' (or unset), got {override!r}")
        if override == "xla":
            return "xla"
        if config_support is None and pallas_device_support(device) is None:
            return "pallas"
        return "xla"
    if config_support is not None:
        raise ValueError(f"backend={backend!r}: {config_support}")
    if backend == "pallas":
        reason = pallas_device_support(device)
        if reason is not None:
            raise ValueError(
                f"backend='pallas': {reason} (use backend='pallas_interpret' to run the "
                "kernel in interpret mode, or 'xla')"
            )
    return backend
