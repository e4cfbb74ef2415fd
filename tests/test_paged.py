"""Paged KV (kvq_jax.cache.paged, kvq_torch_bridge.cache.paged): page-local ownership, group-size
rules, storage accounting, JAX == Torch bytes, argument errors and unpacking."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import (
    assert_same_bytes,
    assert_same_values,
    assert_trees_same_bytes,
    numpy_to_torch,
    torch_to_numpy,
)

import kvq_jax
import kvq_torch_bridge
from kvq_jax.cache.paged import page_storage_bytes, resolve_paged
from kvq_torch_bridge.cache.paged import page_storage_bytes as torch_page_storage_bytes

FORMATS = ("int4", "nvfp4", "fp8_e4m3")
KINDS = ("key", "value")
PAGE_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)
H = 2
NUM_PAGES = 5


def make_pages(page_size: int, d: int, *, seed: int = 0) -> np.ndarray:
    """float32 [5, page_size, H, d] pages whose per-page state differs: a normal page, a
    page 1000x larger, an all-zero page, a page of tiny values (NVFP4 global scale
    saturates) and a page with one NaN (its metadata is NaN, the others' must not be)."""
    rng = np.random.default_rng(seed + page_size * 1000 + d)
    x = rng.standard_normal((NUM_PAGES, page_size, H, d)).astype(np.float32)
    x[1] *= 1000.0
    x[2] = 0.0
    x[3] *= np.float32(1e-36)
    x[4, page_size // 2, 1, 3] = np.nan
    return x


def page(packed, index):
    """Pages `index` (an int or an index array) of a packed cache with a leading page axis."""
    return jax.tree.map(lambda a: a[index], packed)


def torch_tree_to_numpy(packed):
    """A kvq_torch_bridge PackedKV -> {field: numpy array} plus its static metadata."""
    meta = (packed.format, packed.kind, packed.axis, packed.group_size, packed.shape, packed.dtype)
    return {k: torch_to_numpy(v) for k, v in packed.arrays.items()}, meta


def assert_torch_equals_jax(tp, jp, what):
    arrays, meta = torch_tree_to_numpy(tp)
    assert meta == (jp.format, jp.kind, jp.axis, jp.group_size, jp.shape, jp.dtype), what
    assert set(arrays) == set(jp.arrays), what
    for name, a in jp.arrays.items():
        assert_same_bytes(arrays[name], a, f"{what}.{name}")


def stack_torch(packs):
    """Per-page torch PackedKVs -> {field: numpy [P, ...]}."""
    return {
        name: np.stack([torch_to_numpy(p.arrays[name]) for p in packs]) for name in packs[0].arrays
    }


@functools.cache
def packed_pages(format, kind, page_size, d):
    """(pages, jax pack_paged, torch pack_paged) of `make_pages`, shared by the tests."""
    x = make_pages(page_size, d)
    packed = kvq_jax.pack_paged(jnp.asarray(x), kind=kind, format=format)
    tpacked = kvq_torch_bridge.pack_paged(numpy_to_torch(x), kind=kind, format=format)
    return x, packed, tpacked


case = pytest.mark.parametrize(
    "format,kind,page_size,d",
    [(f, k, p, d) for f in FORMATS for k in KINDS for p in PAGE_SIZES for d in HEAD_DIMS],
)


# (a) page-local ownership, (d) JAX == Torch, (f) unpack_paged == page by page ------------
@pytest.mark.thin(3)
@case
def test_pages_own_their_bytes(format, kind, page_size, d):
    x, packed, tpacked = packed_pages(format, kind, page_size, d)
    pack = functools.partial(kvq_jax.pack_paged, kind=kind, format=format)
    tpack = functools.partial(kvq_torch_bridge.pack_paged, kind=kind, format=format)
    assert packed.batch_shape == (NUM_PAGES,)
    g = packed.group_size
    assert (packed.axis, g) == resolve_paged(format, kind, (page_size, H, d), None, None)

    # page by page with pack_kv (same resolved group size)
    for i in range(NUM_PAGES):
        alone = kvq_jax.pack_kv(jnp.asarray(x[i]), kind=kind, format=format, group_size=g)
        assert_trees_same_bytes(page(packed, i), alone, f"page {i}")
    # permuted and dropped pages
    for index in (np.array([3, 0, 4, 2, 1]), np.array([4, 1])):
        assert_trees_same_bytes(pack(jnp.asarray(x[index])), page(packed, index), f"{index}")

    # torch: the same bytes, and the same ownership
    assert_torch_equals_jax(tpacked, packed, "torch")
    for index in (np.array([3, 0, 4, 2, 1]), np.array([4, 1])):
        assert_torch_equals_jax(tpack(numpy_to_torch(x[index])), page(packed, index), "torch perm")
    alone = [
        kvq_torch_bridge.pack_kv(numpy_to_torch(x[i]), kind=kind, format=format, group_size=g)
        for i in range(NUM_PAGES)
    ]
    for name, a in stack_torch(alone).items():
        assert_same_bytes(a, packed.arrays[name], f"torch pack_kv per page .{name}")

    # unpack_paged == unpacking page by page, on both stacks, in the input and another dtype
    for dtype in (None, jnp.bfloat16):
        out = kvq_jax.unpack_paged(packed, dtype)
        by_page = np.stack([kvq_jax.unpack_kv(page(packed, i), dtype) for i in range(NUM_PAGES)])
        assert_same_values(out, by_page, "jax unpack_paged")
        tdtype = None if dtype is None else torch.bfloat16
        tout = torch_to_numpy(kvq_torch_bridge.unpack_paged(tpacked, tdtype))
        assert_same_values(tout, out, "torch unpack_paged")
    t_by_page = np.stack([torch_to_numpy(kvq_torch_bridge.unpack_kv(p)) for p in alone])
    assert_same_values(torch_to_numpy(kvq_torch_bridge.unpack_paged(tpacked)), t_by_page, "t")
    # the NaN page decodes to NaN somewhere, the others are finite
    out = np.asarray(kvq_jax.unpack_paged(packed))
    assert np.isnan(out[4]).any() and np.isfinite(out[:4]).all()


# (c) storage accounting -----------------------------------------------------------------
def expected_bits(format, kind, page_size, d):
    if format == "int4":
        g = page_size if kind == "key" else 64  # token groups = gcd(64, page); channels 64
        return 4 + 32 / g
    if format == "nvfp4":
        return 4.5 + 32 / (page_size * H * d)
    return 8 + 32 / d


@case
def test_storage_accounting(format, kind, page_size, d):
    x, *both = packed_pages(format, kind, page_size, d)
    for packed in both:
        real = sum(
            (torch_to_numpy(a) if isinstance(a, torch.Tensor) else np.asarray(a)).nbytes
            for a in packed.arrays.values()
        )
        assert packed.storage_bytes == real
        per_page = (
            torch_page_storage_bytes(packed)
            if isinstance(packed.codes, torch.Tensor)
            else page_storage_bytes(packed)
        )
        assert per_page * NUM_PAGES == packed.storage_bytes
        assert packed.num_elements == x.size
        assert packed.bits_per_element == expected_bits(format, kind, page_size, d)


def test_bits_table():
    """The numbers of the module doc, exactly."""
    ones = np.ones((2, 64, 16, 128), np.float32)
    for page_size, bits in ((16, 6.0), (32, 5.0), (64, 4.5)):
        packed = kvq_jax.pack_paged(jnp.asarray(ones[:, :page_size]), kind="key")
        assert packed.bits_per_element == bits
    nv = kvq_jax.pack_paged(jnp.asarray(ones[:, :16]), kind="key", format="nvfp4")
    assert nv.bits_per_element == 4.5 + 32 / (16 * 16 * 128) == 4.5009765625
    one_head = kvq_jax.pack_paged(jnp.asarray(ones[:, :16, :1]), kind="key", format="nvfp4")
    assert one_head.bits_per_element == 4.515625
    fp8 = kvq_jax.pack_paged(jnp.asarray(ones[:, :16]), kind="key", format="fp8_e4m3")
    assert fp8.bits_per_element == 8.25


# (b) group sizes --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "format,group_size,page_size",
    [("int4", 24, 16), ("int4", 32, 16), ("int4", 64, 96), ("nvfp4", None, 8), ("nvfp4", 16, 24)],
)
def test_group_must_divide_page(format, group_size, page_size):
    resolved = 16 if group_size is None else group_size
    match = f"group_size {resolved} must divide page_size {page_size}"
    x = np.ones((2, page_size, H, 64), np.float32)
    with pytest.raises(ValueError, match=match):
        kvq_jax.pack_paged(jnp.asarray(x), kind="key", format=format, group_size=group_size)
    with pytest.raises(ValueError, match=match):
        kvq_torch_bridge.pack_paged(
            numpy_to_torch(x), kind="key", format=format, group_size=group_size
        )


@pytest.mark.parametrize(
    "page_size,expected", [(16, 16), (32, 32), (64, 64), (128, 64), (48, 16), (100, 4), (1, 1)]
)
def test_gcd_default(page_size, expected):
    assert resolve_paged("int4", "key", (page_size, H, 64), None, None) == ("tokens", expected)
    # channel groups do not depend on the page
    assert resolve_paged("int4", "value", (page_size, H, 128), None, None) == ("channels", 64)


def test_explicit_divisor_and_channel_groups_accepted():
    x = make_pages(64, 64)
    for kind, axis, g in (("key", "tokens", 16), ("key", "channels", 24), ("value", None, 48)):
        packed = kvq_jax.pack_paged(jnp.asarray(x), kind=kind, axis=axis, group_size=g)
        tpacked = kvq_torch_bridge.pack_paged(numpy_to_torch(x), kind=kind, axis=axis, group_size=g)
        assert packed.group_size == g
        assert_torch_equals_jax(tpacked, packed, f"{kind} {axis} {g}")
        for i in (0, 3):
            alone = kvq_jax.pack_kv(jnp.asarray(x[i]), kind=kind, axis=axis, group_size=g)
            assert_trees_same_bytes(page(packed, i), alone, f"page {i}")


# (e) argument errors, raised while tracing ------------------------------------------------
@pytest.mark.parametrize(
    "shape,dtype,error,match",
    [
        ((16, H, 64), jnp.float32, ValueError, "rank 4"),
        ((1, 2, 16, H, 64), jnp.float32, ValueError, "rank 4"),
        ((2, 16, H, 64), jnp.int32, TypeError, "pages.dtype"),
        ((2, 16, H, 64), jnp.float8_e4m3fn, TypeError, "pages.dtype"),
        ((2, 16, H, 0), jnp.float32, ValueError, "page_size, H, D >= 1"),
    ],
)
def test_bad_pages_fail_at_trace_time(shape, dtype, error, match):
    spec = jax.ShapeDtypeStruct(shape, dtype)  # abstract: no data, errors come from tracing
    with pytest.raises(error, match=match):
        jax.eval_shape(functools.partial(kvq_jax.pack_paged, kind="key"), spec)
    tdtype = {jnp.float32: torch.float32, jnp.int32: torch.int32}.get(dtype, torch.float8_e4m3fn)
    with pytest.raises(error, match=match):
        kvq_torch_bridge.pack_paged(torch.zeros(shape, dtype=tdtype), kind="key")


def test_bad_arguments():
    x = np.ones((2, 16, H, 64), np.float32)
    with pytest.raises(ValueError, match="kind"):
        kvq_jax.pack_paged(jnp.asarray(x), kind="query")
    with pytest.raises(ValueError, match="kind"):
        kvq_torch_bridge.pack_paged(numpy_to_torch(x), kind="query")
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        kvq_torch_bridge.pack_paged(x, kind="key")
    # unpack_paged needs exactly one leading page axis
    flat = kvq_jax.pack_kv(jnp.asarray(x[0]), kind="key")
    with pytest.raises(TypeError, match="leading page axis"):
        kvq_jax.unpack_paged(flat)
    tflat = kvq_torch_bridge.pack_kv(numpy_to_torch(x[0]), kind="key")
    with pytest.raises(TypeError, match="leading page axis"):
        kvq_torch_bridge.unpack_paged(tflat)
    with pytest.raises(TypeError, match="dtype"):
        kvq_torch_bridge.unpack_paged(
            kvq_torch_bridge.pack_paged(numpy_to_torch(x), kind="key"), torch.int32
        )


def test_bf16_and_fp16_inputs_match():
    x = make_pages(32, 64)
    for np_dtype, t_dtype in ((jnp.bfloat16, torch.bfloat16), (jnp.float16, torch.float16)):
        xd = np.asarray(jnp.asarray(x, np_dtype))
        for format in FORMATS:
            packed = kvq_jax.pack_paged(jnp.asarray(xd), kind="key", format=format)
            tpacked = kvq_torch_bridge.pack_paged(numpy_to_torch(xd), kind="key", format=format)
            assert tpacked.codes.dtype == tpacked.arrays["codes"].dtype
            assert_torch_equals_jax(tpacked, packed, f"{format} {np_dtype}")
            out = kvq_torch_bridge.unpack_paged(tpacked)
            assert out.dtype == t_dtype
            assert_same_values(torch_to_numpy(out), kvq_jax.unpack_paged(packed), format)


@pytest.mark.parametrize("fmt", ["int4", "nvfp4", "fp8_e4m3"])
def test_zero_pages(fmt):
    empty = np.zeros((0, 16, 2, 8), np.float32)
    ours = kvq_jax.pack_paged(empty, kind="key", format=fmt)
    theirs = kvq_torch_bridge.pack_paged(numpy_to_torch(empty), kind="key", format=fmt)
    assert ours.batch_shape == (0,) and ours.storage_bytes == 0
    assert tuple(theirs.codes.shape) == ours.codes.shape
    assert kvq_jax.unpack_paged(ours).shape == (0, 16, 2, 8)
    assert tuple(kvq_torch_bridge.unpack_paged(theirs).shape) == (0, 16, 2, 8)
