"""One registry implementation per stack: a codec registered from outside kvq works in every
entry point of its stack, like a built-in one.

The outside codec (`pow2_int8`, defined here) stores int8 codes and one float32 power-of-two
scale per tensor: scale = 2**e with amax = m * 2**e (m in [0.5, 1)), code = round(x * 2**(7-e)),
decoded code * 2**(e-7). Every step is exact in float32, so a NumPy reference of the same
arithmetic predicts its bytes independently of either stack, and its per-tensor scale makes
it a format with per-tensor state (like NVFP4): the paged paths must pack it page by page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import assert_same_bytes, numpy_to_torch, torch_to_numpy

import kvq_jax
import kvq_torch_bridge as kvt
from kvq_jax.cache.paged_cache import append, gather, init_cache
from kvq_jax.core import registry
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.layouts import FormatLayout, check_kind
from kvq_torch_bridge.cache import paged_attention as tpa
from kvq_torch_bridge.cache import paged_cache as tpc
from kvq_torch_bridge.codecs._dtypes import torch_dtype

NAME = "pow2_int8"


class Pow2Int8Layout(FormatLayout):
    name = NAME
    array_fields = ("codes", "global_scale")
    default_group_size = 0
    fixed_group_size = True

    def resolve(self, shape, kind, axis, group_size):
        check_kind(kind)
        return "channels", shape[2]

    def array_shapes(self, shape, axis, group_size):
        return {
            "codes": (tuple(shape), np.dtype(np.int8)),
            "global_scale": ((), np.dtype(np.float32)),
        }


class JaxPow2Int8(Pow2Int8Layout, kvq_jax.Codec):
    def encode(self, values, *, axis, group_size):
        x = values.astype(jnp.float32)
        _, e = jnp.frexp(jnp.max(jnp.abs(x), initial=0.0))
        codes = jnp.clip(jnp.round(jnp.ldexp(x, 7 - e)), -127, 127).astype(jnp.int8)
        return {"codes": codes, "global_scale": jnp.ldexp(jnp.float32(1.0), e)}

    def unpack(self, packed, dtype):
        return (packed.codes.astype(jnp.float32) * packed.global_scale / 128).astype(dtype)


class TorchPow2Int8(Pow2Int8Layout, kvt.Codec):
    def encode(self, values, *, axis, group_size):
        x = values.to(torch.float32)
        amax = x.abs().amax() if x.numel() else x.new_zeros(())
        e = torch.frexp(amax).exponent
        codes = torch.clamp(torch.round(torch.ldexp(x, 7 - e)), -127, 127).to(torch.int8)
        return {"codes": codes, "global_scale": torch.ldexp(torch.ones(()), e)}

    def unpack(self, packed, dtype):
        out = packed.codes.to(torch.float32) * packed.global_scale / 128
        return out.to(torch_dtype(dtype))


def numpy_pack(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """The format's bytes from NumPy alone (the independent reference)."""
    x = x.astype(np.float32)
    _, e = np.frexp(np.max(np.abs(x), initial=0.0))
    codes = np.clip(np.round(np.ldexp(x, 7 - e)), -127, 127).astype(np.int8)
    return codes, np.float32(np.ldexp(1.0, e))


def numpy_unpack(codes, scale, dtype) -> np.ndarray:
    return (codes.astype(np.float32) * scale / 128).astype(dtype)


@pytest.fixture(scope="module", autouse=True)
def registered():
    kvq_jax.register_codec(JaxPow2Int8())
    kvt.register_codec(TorchPow2Int8())
    yield
    kvq_jax.unregister_codec(NAME)
    kvt.unregister_codec(NAME)


def data(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def test_known_in_both_registries_and_the_layout_lookup():
    assert NAME in kvq_jax.CODECS and NAME in kvt.CODECS
    assert NAME in registry.known_formats()
    assert isinstance(registry.layout(NAME), Pow2Int8Layout)
    with pytest.raises(ValueError, match="already registered"):
        kvt.register_codec(TorchPow2Int8())
    with pytest.raises(TypeError, match="kvq_torch_bridge Codec"):
        kvt.register_codec(JaxPow2Int8())
    with pytest.raises(ValueError, match="reserved"):
        bad = TorchPow2Int8()
        bad.name = "bf16"
        kvt.register_codec(bad)


def test_pack_kv_and_loops_both_stacks():
    x = data((40, 2, 16))
    codes, scale = numpy_pack(x)
    j = kvq_jax.pack_kv(jnp.asarray(x), kind="value", format=NAME)
    t = kvt.pack_kv(torch.from_numpy(x), kind="value", format=NAME)
    for packed in (j.arrays, torch_to_numpy_packed(t)):
        assert_same_bytes(packed["codes"], codes, "codes")
        assert_same_bytes(packed["global_scale"], scale, "scale")
    loops = np.stack([x, x * 1.5, x * 1.6])
    jc = kvq_jax.encode_loops(jnp.asarray(loops), kind="key", base_format=NAME)
    tc = kvt.encode_loops(torch.from_numpy(loops), kind="key", base_format=NAME)
    recon = numpy_unpack(codes, scale, np.float32)
    for loop in (1, 2):  # the residual chain by hand
        delta = (loops[loop] - recon).astype(np.float32)
        dc, ds = numpy_pack(delta)
        recon = (recon + numpy_unpack(dc, ds, np.float32)).astype(np.float32)
    assert_same_bytes(np.asarray(kvq_jax.decode_loop(jc, loop=2)), recon, "jax loop 2")
    assert_same_bytes(torch_to_numpy(kvt.decode_loop(tc, loop=2)), recon, "torch loop 2")


def torch_to_numpy_packed(packed) -> dict:
    return {name: torch_to_numpy(a) for name, a in packed.arrays.items()}


@pytest.mark.parametrize("stack", ["jax", "torch"])
def test_pack_paged_page_by_page(stack):
    pages = data((3, 8, 2, 16), seed=1)
    if stack == "jax":
        got = kvq_jax.pack_paged(jnp.asarray(pages), kind="key", format=NAME)
        unpacked = np.asarray(kvq_jax.unpack_paged(got))
        arrays = {name: np.asarray(a) for name, a in got.arrays.items()}
    else:
        got = kvt.pack_paged(torch.from_numpy(pages), kind="key", format=NAME)
        unpacked = torch_to_numpy(kvt.unpack_paged(got))
        arrays = torch_to_numpy_packed(got)
    assert got.batch_shape == (3,)
    for i, page in enumerate(pages):  # every page has its own scale
        codes, scale = numpy_pack(page)
        assert_same_bytes(arrays["codes"][i], codes, f"page {i} codes")
        assert_same_bytes(arrays["global_scale"][i], scale, f"page {i} scale")
        assert_same_bytes(unpacked[i], numpy_unpack(codes, scale, np.float32), f"page {i}")


def test_paged_cache_and_attention_both_stacks():
    """A 2-loop cache with the outside codec for K and V (base and residual): the JAX and
    Torch caches hold the same bytes after the same appends, gather equals the residual
    chain computed by hand per page, and attention runs in both stacks."""
    config = PagedCacheConfig(
        num_pages=4, page_size=8, num_heads=2, head_dim=16, num_loops=2, max_seqs=1,
        k_base_format=NAME, k_residual_format=NAME, v_base_format="int4",
        v_residual_format=NAME, sink=1,
    )  # fmt: skip
    assert config.pack_args("key", "base") == dict(
        kind="key", format=NAME, axis="channels", group_size=16
    )
    x = data((2, 1, 19, 2, 16), seed=2)
    x[1] = x[0] + 0.1 * data((1, 19, 2, 16), seed=3)
    table = np.array([[3, 1, 0, 2]], np.int32)
    ids = np.zeros(1, np.int32)
    jcache, tcache = init_cache(config), tpc.init_cache(config)
    for loop in range(2):
        jcache = append(
            jcache,
            jnp.asarray(x[loop]),
            jnp.asarray(x[loop]),
            block_tables=jnp.asarray(table),
            seq_ids=jnp.asarray(ids),
            loop=loop,
        )
        tcache = tpc.append(tcache, torch.from_numpy(x[loop]), torch.from_numpy(x[loop]),
                            block_tables=torch.from_numpy(table), seq_ids=torch.from_numpy(ids),
                            loop=loop)  # fmt: skip
    for a, b in zip(jax.tree.leaves(jcache), torch.utils._pytree.tree_leaves(tcache), strict=True):
        assert_same_bytes(np.asarray(a), torch_to_numpy(b), "cache leaf")
    k, _ = gather(jcache, seq_id=0, seq_len=19, block_table=jnp.asarray(table[0]), loop=1)
    expected = np.empty((19, 2, 16), np.float32)
    for i in range(2):  # complete pages: loop 1 through the chain, page by page
        rows = slice(8 * i, 8 * i + 8)
        c0, s0 = numpy_pack(x[0, 0, rows])
        r0 = numpy_unpack(c0, s0, np.float32)
        c1, s1 = numpy_pack((x[1, 0, rows] - r0).astype(np.float32))
        expected[rows] = (r0 + numpy_unpack(c1, s1, np.float32)).astype(np.float32)
    expected[16:] = x[1, 0, 16:]  # the partial page, raw in staging
    expected[0] = x[1, 0, 0]  # the sink row, raw
    assert_same_bytes(np.asarray(k), expected, "gather loop 1")
    q = data((1, 4, 16), seed=4)
    lens = np.array([19], np.int32)
    out_j = kvq_jax.paged_decode_attention(
        jnp.asarray(q), jcache, jnp.asarray(table), jnp.asarray(lens), loop=1
    )
    out_t = tpa.paged_decode_attention(
        torch.from_numpy(q), tcache, torch.from_numpy(table), torch.from_numpy(lens), loop=1
    )
    np.testing.assert_allclose(np.asarray(out_j), out_t.numpy(), rtol=2e-6, atol=2e-6)


def test_a_format_one_stack_lacks_is_refused_by_that_stack():
    """Registered in Torch only: the config accepts it (the Torch cache can hold it), the JAX
    cache refuses it with the registry's message."""
    layout = TorchPow2Int8()
    layout.name = "pow2_torch_only"
    kvt.register_codec(layout)
    try:
        config = PagedCacheConfig(num_pages=2, page_size=8, num_heads=1, head_dim=16,
                                  k_base_format="pow2_torch_only")  # fmt: skip
        tpc.init_cache(config)
        with pytest.raises(ValueError, match="format must be one of"):
            init_cache(config)
    finally:
        kvt.unregister_codec("pow2_torch_only")
    with pytest.raises(ValueError, match="k_base_format: format must be one of"):
        PagedCacheConfig(num_pages=2, page_size=8, num_heads=1, head_dim=16,
                         k_base_format="pow2_torch_only")  # fmt: skip


def test_bf16_inputs_round_trip():
    x = data((16, 1, 8), seed=5, dtype=ml_dtypes.bfloat16)
    t = kvt.pack_kv(numpy_to_torch(x), kind="key", format=NAME)
    codes, scale = numpy_pack(x)
    assert_same_bytes(torch_to_numpy(t.codes), codes)
    assert_same_bytes(torch_to_numpy(kvt.unpack_kv(t)), numpy_unpack(codes, scale, x.dtype))
