"""backend= resolution: the rules every kernel API shares (kvq_jax.kernels.backend)."""

from __future__ import annotations

import types

import jax
import pytest

from kvq_jax.kernels import backend as kb

CPU = jax.devices("cpu")[0]


def _gpu(cc: str):
    """A stand-in CUDA device of compute capability `cc`."""
    client = types.SimpleNamespace(platform_version="cuda 13.0")
    return types.SimpleNamespace(platform="gpu", compute_capability=cc, client=client)


def test_device_support():
    assert "CUDA GPU" in kb.pallas_device_support(CPU)
    assert kb.pallas_device_support(_gpu("9.0")) is None  # Hopper
    assert kb.pallas_device_support(_gpu("12.0")) is None  # RTX 5090, SM120
    assert "compute capability >= 8.0" in kb.pallas_device_support(_gpu("7.5"))
    rocm = types.SimpleNamespace(
        platform="gpu",
        compute_capability=None,
        client=types.SimpleNamespace(platform_version="rocm"),
    )
    assert kb.pallas_device_support(rocm) is not None


@pytest.mark.parametrize(
    ("backend", "support", "device", "expected"),
    [
        ("xla", None, _gpu("9.0"), "xla"),
        ("auto", None, _gpu("9.0"), "pallas"),
        ("auto", "page_size 48 is not a power of two", _gpu("9.0"), "xla"),
        ("auto", None, CPU, "xla"),
        ("pallas", None, _gpu("12.0"), "pallas"),
        ("pallas_interpret", None, CPU, "pallas_interpret"),
    ],
)
def test_resolution(backend, support, device, expected, monkeypatch):
    monkeypatch.delenv(kb.AUTO_ENV, raising=False)
    assert kb.resolve_backend(backend, support, device=device) == expected


def test_explicit_kernel_backends_refuse_with_the_reason():
    with pytest.raises(ValueError, match="backend='pallas': the Pallas Triton kernels need a CUDA"):
        kb.resolve_backend("pallas", device=CPU)
    for backend in ("pallas", "pallas_interpret"):
        with pytest.raises(ValueError, match=f"backend='{backend}': head_dim 96"):
            kb.resolve_backend(backend, "head_dim 96 is not a power of two", device=_gpu("9.0"))
    with pytest.raises(ValueError, match="backend must be one of"):
        kb.resolve_backend("triton")


def test_environment_override(monkeypatch):
    monkeypatch.setenv(kb.AUTO_ENV, "xla")
    assert kb.resolve_backend("auto", device=_gpu("9.0")) == "xla"
    assert kb.resolve_backend("pallas", device=_gpu("9.0")) == "pallas"  # explicit wins
    monkeypatch.setenv(kb.AUTO_ENV, "auto")
    assert kb.resolve_backend("auto", device=_gpu("9.0")) == "pallas"
    monkeypatch.setenv(kb.AUTO_ENV, "cuda")
    with pytest.raises(ValueError, match="KVQ_AUTO_BACKEND must be"):
        kb.resolve_backend("auto", device=CPU)
