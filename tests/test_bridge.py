"""The DLPack bridge: whole packed containers cross between JAX and Torch without a copy,
keep their metadata, survive the source being dropped, and never copy silently."""

from __future__ import annotations

import gc
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_same_bytes, torch_to_numpy

import kvq_jax as kq
import kvq_torch_bridge as kt
from kvq_jax.conformance import check_pack, load_vectors

WINDOW = kq.Window(sink=2, recent=4)


def jax_leaves(tree):
    return jax.tree.leaves(tree)


def torch_leaves(tree):
    return torch.utils._pytree.tree_leaves(tree)


def loops_jax(t=48, seed=0):
    x = jax.random.normal(jax.random.key(seed), (4, t, 2, 16), jnp.float32)
    return jnp.cumsum(x * jnp.array([1.0, 0.2, 0.2, 0.2])[:, None, None, None], axis=0).astype(
        jnp.bfloat16
    )


def containers():
    loops = loops_jax()
    positions = [None, np.arange(0, 48, 3, dtype=np.int32), np.arange(0, 48, 6, dtype=np.int32)]
    yield "int4", kq.pack_kv(loops[0], kind="key", format="int4", group_size=16)
    yield "nvfp4", kq.pack_kv(loops[0], kind="value", format="nvfp4")
    yield "fp8", kq.pack_kv(loops[0], kind="key", format="fp8_e4m3")
    yield "windowed", kq.pack_kv(loops[0], kind="key", window=WINDOW)
    yield "loops", kq.encode_loops(loops, kind="key", residual_format="nvfp4", positions=positions)
    yield "loops_window", kq.encode_loops(loops, kind="value", window=WINDOW)


CONTAINERS = dict(containers())


def decode_jax(packed):
    if isinstance(packed, kq.LoopCode):
        return kq.decode_loops(packed)
    return kq.unpack_kv(packed)


def decode_torch(packed):
    if isinstance(packed, kt.LoopCode):
        return kt.decode_loops(packed)
    return kt.unpack_kv(packed)


def metadata(tree, leaves):
    """The static part of a container tree: everything but the arrays."""
    out = []

    def walk(obj):
        import dataclasses

        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))
        elif isinstance(obj, tuple) and obj and not isinstance(obj[0], int):
            for o in obj:
                walk(o)
        elif not isinstance(obj, jax.Array | torch.Tensor):
            out.append(obj)

    walk(tree)
    return out


@pytest.mark.parametrize("name", list(CONTAINERS))
def test_to_torch_shares_every_buffer_and_keeps_metadata(name):
    packed = CONTAINERS[name]
    moved = kt.to_torch(packed)
    jl, tl = jax_leaves(packed), torch_leaves(moved)
    assert len(jl) == len(tl) > 0
    for a, t in zip(jl, tl, strict=True):
        assert a.unsafe_buffer_pointer() == t.data_ptr(), "copied"
        assert_same_bytes(torch_to_numpy(t), np.asarray(a))
    assert metadata(moved, tl) == metadata(packed, jl)
    assert_same_bytes(torch_to_numpy(decode_torch(moved)), np.asarray(decode_jax(packed)))
    # and back: the JAX arrays we get are the very buffers we started from
    back = kt.from_torch(moved)
    assert type(back) is type(packed)
    for a, b in zip(jl, jax_leaves(back), strict=True):
        assert a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()
    assert jax.tree.structure(back) == jax.tree.structure(packed)


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8_e4m3"])
def test_torch_packed_read_by_jax(fmt):
    x = torch.randn(40, 2, 24, dtype=torch.float32).to(torch.bfloat16)
    packed = kt.pack_kv(x, kind="value", format=fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", kt.CopyWarning)  # torch allocations are 64-byte aligned
        moved = kt.from_torch(packed, copy=False)
    for t, a in zip(torch_leaves(packed), jax_leaves(moved), strict=True):
        assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert_same_bytes(np.asarray(kq.unpack_kv(moved)), torch_to_numpy(kt.unpack_kv(packed)))


def test_source_may_be_dropped():
    loops = loops_jax(seed=3)
    code = kq.encode_loops(loops, kind="key")
    expected = np.asarray(kq.decode_loops(code))
    moved = kt.to_torch(code)
    del code, loops
    gc.collect()
    jax.clear_caches()
    assert_same_bytes(torch_to_numpy(kt.decode_loops(moved)), expected)

    tx = torch.randn(32, 2, 16).to(torch.bfloat16)
    tp = kt.pack_kv(tx, kind="key", format="nvfp4")
    expected = torch_to_numpy(kt.unpack_kv(tp))
    back = kt.from_torch(tp)
    del tp, tx
    gc.collect()
    assert_same_bytes(np.asarray(kq.unpack_kv(back)), expected)


def test_copy_true_is_independent():
    packed = CONTAINERS["int4"]
    original = np.asarray(packed.codes).copy()
    moved = kt.to_torch(packed, copy=True)
    assert moved.codes.data_ptr() != packed.codes.unsafe_buffer_pointer()
    moved.codes.zero_()
    assert_same_bytes(np.asarray(packed.codes), original)

    t = torch.arange(64, dtype=torch.float32)
    a = kt.torch_to_jax(t, copy=True)
    assert a.unsafe_buffer_pointer() != t.data_ptr()
    t.zero_()
    assert float(a[5]) == 5.0


def test_misaligned_cpu_buffer_is_copied_loudly_or_refused():
    base = torch.arange(65, dtype=torch.float32)
    view = base[1:]  # 4 bytes past a 64-byte boundary
    assert view.data_ptr() % 64
    with pytest.warns(kt.CopyWarning, match="64-byte aligned"):
        a = kt.torch_to_jax(view)
    np.testing.assert_array_equal(np.asarray(a), view.numpy())
    with pytest.raises(ValueError, match="cannot share the buffer"):
        kt.torch_to_jax(view, copy=False)


def test_never_a_silent_copy_for_strided_views():
    t = torch.arange(96, dtype=torch.float32).reshape(8, 12).T  # non-contiguous
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = kt.torch_to_jax(t)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    shared = a.unsafe_buffer_pointer() == t.data_ptr()
    warned = any(issubclass(w.category, kt.CopyWarning) for w in caught)
    assert shared != warned  # either shared, or copied with a warning: never silently


def test_bad_arguments():
    with pytest.raises(TypeError, match="copy must be"):
        kt.to_torch(CONTAINERS["int4"], copy="yes")
    with pytest.raises(TypeError, match="kvq_jax packed container"):
        kt.to_torch(np.zeros(3))
    with pytest.raises(TypeError, match="kvq_torch_bridge packed container"):
        kt.from_torch(CONTAINERS["int4"])
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        kt.torch_to_jax(np.zeros(3))
    with pytest.raises(TypeError, match=r"jax\.Array"):
        kt.jax_to_torch(torch.zeros(3))


def test_vllm_kv_cache_dtype_names():
    for name in ("int4", "nvfp4", "kvq:fp8"):
        assert kt.format_for_kv_cache_dtype(name) in kq.CODECS
        assert kt.format_for_kv_cache_dtype(name) in kt.CODECS
    for refused in ("fp8_e5m2", "fp8_e4m3", "fp8", "bfloat16"):  # vLLM's fp8: other bytes
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            kt.format_for_kv_cache_dtype(refused)


def test_torch_codec_passes_the_shared_vectors():
    from kvq_torch_bridge.codecs.formats.intb import register_table

    results = check_pack(
        kt.pack_kv,
        unpack_fn=kt.unpack_kv,
        input_kind="torch",
        cases=load_vectors(),
        register_table=register_table,
    )
    failed = [f"{r.name}: {r.detail}" for r in results if not r.passed]
    assert not failed, failed[:5]


@pytest.mark.gpu
def test_cuda_handoff_is_zero_copy_and_stream_ordered():
    gpu = jax.devices("gpu")[0]
    x = jax.device_put(jax.random.normal(jax.random.key(0), (4096, 8, 128), jnp.bfloat16), gpu)
    packed = kq.pack_kv(x * 3, kind="key")  # still running when handed over
    moved = kt.to_torch(packed)
    assert all(t.is_cuda for t in torch_leaves(moved))
    for a, t in zip(jax_leaves(packed), torch_leaves(moved), strict=True):
        assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert_same_bytes(torch_to_numpy(kt.unpack_kv(moved)), np.asarray(kq.unpack_kv(packed)))
    tp = kt.pack_kv(torch.randn(4096, 8, 128, device="cuda").to(torch.bfloat16), kind="value")
    back = kt.from_torch(tp, copy=False)
    assert_same_bytes(np.asarray(kq.unpack_kv(back)), torch_to_numpy(kt.unpack_kv(tp)))
