"""What differs between the jax versions kvq supports (0.10.x, 0.11.x, 0.12.x), in one place.

One difference matters to kvq: how Pallas's Triton backend picks the GPU it lowers a kernel
for when the process has no GPU (CPU-only tests that lower for "cuda", the deviceless
`cuda_compile` check of `kvq_jax.kernel_checks`).

* jax 0.10: the first GPU of `jax.local_devices`, and with none compute capability 9.0,
  whatever the compile target.
* jax >= 0.11 (`jax._src.pallas.triton.gpu_info`): the *device kind* of the abstract mesh
  in context when the function is **traced** (`jax.sharding.use_abstract_mesh` with an
  `AbstractDevice`), else the default device's. A kind must be one of that jax's table (A100,
  H100, H200, B200, RTX PRO 6000, ...) or belong to the device that is present. With no GPU
  and no abstract device, lowering raises "No supported GPU devices found"; an abstract kind
  outside the table ("NVIDIA GeForce RTX 5090", SM120) raises "Cannot infer architecture"
  (the failure behind the old `jax<0.11` pin: the RTX 5090 target of the compile check).

`gpu_target(capability)` hides this: functions *traced* inside it lower for a GPU of that
compute capability on jax >= 0.11 (through a listed device kind of the same capability, which
is all the lowering reads from it), and as jax 0.10 always did there (9.0 with no GPU).
`lower_for_gpu(fn, *args)` traces and lowers for "cuda" inside it.

Every supported version serves every target kvq compiles for (sm_80, sm_90a, sm_120a: the
table names a kind for 8.0, 9.0 and 12.0), so no kernel's `config_support` refuses a target
for a jax version; `target_support(capability)` says why not where that ever changes.
"""

from __future__ import annotations

import contextlib

import jax

__all__ = [
    "JAX_VERSION",
    "gpu_target",
    "lower_for_gpu",
    "lowering_capability_is_exact",
    "lowering_device_kind",
    "target_support",
]


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


#: (major, minor, patch) of the jax in use
JAX_VERSION = _version(jax.__version__)

#: device kinds per compute capability, in jax >= 0.11's Pallas GPU table (the lowering
#: reads only the capability from the kind); the first one this jax knows is used
_KINDS = {
    (8, 0): ("NVIDIA A100",),
    (9, 0): ("NVIDIA H100", "NVIDIA H200"),
    (10, 0): ("NVIDIA B200",),
    (12, 0): ("NVIDIA RTX PRO 6000", "NVIDIA RTX PRO 5000", "NVIDIA RTX PRO 4500"),
}


def _gpu_info():
    """jax >= 0.11's Pallas Triton GPU table, or None (jax 0.10: no table)."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        return None
    return gpu_info


def lowering_capability_is_exact() -> bool:
    """Whether Pallas lowers for the capability `gpu_target` names with no GPU present
    (jax >= 0.11), rather than for 9.0 whatever the target (jax 0.10)."""
    return _gpu_info() is not None


def lowering_device_kind(capability: tuple[int, int]) -> str | None:
    """A device kind this jax lowers Pallas Triton kernels for as `capability` (major,
    minor); None when this jax needs none (0.10) or names no kind of that capability."""
    info = _gpu_info()
    if info is None:
        return None
    for kind in _KINDS.get(tuple(capability), ()):
        version = info.gpu_version_from_device_kind(kind)
        if version is None:
            continue
        got = info.get_gpu_info_from_version(version).compute_capability
        if got == capability[0] * 10 + capability[1]:
            return kind
    return None


def target_support(capability: tuple[int, int]) -> str | None:
    """None when this jax can lower the Pallas Triton kernels for a GPU of `capability` with
    no such GPU present (the deviceless compile check), else why not."""
    if _gpu_info() is None or lowering_device_kind(capability) is not None:
        return None
    return (
        f"jax {jax.__version__} names no GPU of compute capability {capability[0]}."
        f"{capability[1]} to lower Pallas Triton kernels for without one"
    )


def _default_device_is_gpu() -> bool:
    try:
        return jax.devices()[0].platform in ("gpu", "cuda")
    except RuntimeError:
        return False


@contextlib.contextmanager
def gpu_target(capability: tuple[int, int] | None = None):
    """Trace functions for a GPU of compute capability `capability` (major, minor) in this
    context, with or without a GPU present. None: the GPU present, else 9.0. ValueError when
    this jax cannot lower for that capability (`target_support`). On jax 0.10 nothing can be
    chosen: the GPU present, else 9.0."""
    if _gpu_info() is None or (capability is None and _default_device_is_gpu()):
        yield
        return
    capability = (9, 0) if capability is None else tuple(capability)
    reason = target_support(capability)
    if reason is not None:
        raise ValueError(reason)
    device = jax.sharding.AbstractDevice(
        device_kind=lowering_device_kind(capability), num_cores=None, platform="cuda"
    )
    # Auto axes: only the device kind is meant to change, not how arrays are sharded
    mesh = jax.sharding.AbstractMesh(
        (1,),
        ("kvq_gpu_target",),
        axis_types=(jax.sharding.AxisType.Auto,),
        abstract_device=device,
    )
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_gpu(fn, *args, capability: tuple[int, int] | None = None, **jit_kwargs):
    """`jax.jit(fn, **jit_kwargs).trace(*args).lower(lowering_platforms=("cuda",))` inside
    `gpu_target(capability)`: the GPU module (a `jax.stages.Lowered`), with or without a GPU.
    `args` may be ShapeDtypeStructs."""
    with gpu_target(capability):
        return jax.jit(fn, **jit_kwargs).trace(*args).lower(lowering_platforms=("cuda",))
