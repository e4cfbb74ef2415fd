"""The Torch paged cache (kvq_torch_bridge.cache.paged_cache) and paged decode attention
(kvq_torch_bridge.cache.paged_attention) against kvq_jax's: the same cache bytes after the same
appends (prefill and token-by-token decode, seq_id subsets, dropped writes), the same gather
bits, and attention equal to JAX's to float32 round-off.

Device: the tests that take `device` run on CPU and, with `--run-gpu` on a CUDA machine, on
CUDA. The shapes, data and JAX reference caches are those of test_paged_cache.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import assert_same_bytes, numpy_to_torch, rotated_space_atol, torch_to_numpy
from test_paged_cache import CONFIGS, D, H, L, S, T, filled, make_config, make_kv, make_tables

import kvq_torch_bridge as ktb
from kvq_jax.cache import paged_attention as jpa
from kvq_jax.cache import paged_cache as jpc
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_torch_bridge.cache import paged_attention as tpa
from kvq_torch_bridge.cache import paged_cache as tpc

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
FIELDS = ("k_base", "v_base", "k_delta", "v_delta", "k_stage", "v_stage", "k_sink", "v_sink")

#: Torch vs JAX attention: float32 round-off of differently ordered sums / exp (observed
#: max |difference| <= 7.2e-7 on outputs of magnitude <= 3.3).
ATOL = RTOL = 2e-6


def assert_cache_same_bytes(actual: tpc.PagedKVCache, expected: jpc.PagedKVCache, what: str):
    """Every array of the Torch cache has the bytes of the JAX cache's (field by field)."""
    assert actual.config == expected.config
    for name in FIELDS:
        a, e = getattr(actual, name), getattr(expected, name)
        if e is None or not hasattr(e, "arrays"):
            assert (a is None) == (e is None), f"{what}.{name}"
            if e is not None:
                assert_same_bytes(torch_to_numpy(a), e, f"{what}.{name}")
            continue
        assert set(a.arrays) == set(e.arrays), f"{what}.{name} fields"
        assert (a.format, a.kind, a.axis, a.group_size, a.shape, a.dtype) == (
            e.format,
            e.kind,
            e.axis,
            e.group_size,
            e.shape,
            e.dtype,
        ), f"{what}.{name} metadata"
        for field, array in e.arrays.items():
            assert_same_bytes(torch_to_numpy(a.arrays[field]), array, f"{what}.{name}.{field}")
    assert_same_bytes(torch_to_numpy(actual.seq_lens), expected.seq_lens, f"{what}.seq_lens")


def torch_fill(config, k, v, chunks, device):
    """test_paged_cache.fill in torch: per chunk, loops 0, 1, ... in turn."""
    cache = tpc.init_cache(config, device=device)
    tables = torch.from_numpy(make_tables(config)).to(device)
    ids = torch.arange(S, dtype=torch.int32, device=device)
    kt, vt = numpy_to_torch(k, device), numpy_to_torch(v, device)
    start = 0
    for n in chunks:
        for loop in range(L):
            kw = dict(block_tables=tables, seq_ids=ids, loop=loop)
            kk, vv = kt[loop, :, start : start + n], vt[loop, :, start : start + n]
            tpc.check_append(cache, kk, vv, **kw)
            cache = tpc.append(cache, kk, vv, **kw)
        start += n
    assert start == T
    return cache


@functools.cache
def torch_filled(name: str, mode: str, device: str):
    config, k, v, _ = filled(name, "prefill")
    chunks = {"prefill": [T], "decode": [1] * T}[mode]
    return torch_fill(config, k, v, chunks, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("name", CONFIGS)
def test_cache_bytes_equal_jax(name, mode, device):
    """After the same appends (one prefill, or token by token in loop order) every packed page,
    staging row, sink row and seq_lens entry of the Torch cache has the JAX cache's bytes.

    The JAX reference is its prefill cache: test_paged_cache.test_append_order_independent
    shows that JAX's token-by-token cache has the same bytes (and compiling JAX's decode
    appends here too would double this module's run time)."""
    _, _, _, expected = filled(name, "prefill")
    cache = torch_filled(name, mode, device)
    assert cache.device.type == device
    assert_cache_same_bytes(cache, expected, f"{name} {mode}")
    assert cache.storage_bytes == expected.storage_bytes


@pytest.mark.parametrize("device", DEVICES)
def test_partial_subset_and_dropped_writes_equal_jax(device):
    """A seq_id subset ([1] only, loops 0 and 1, a partial page) and an append whose block
    table holds an invalid page id (that page's write is dropped, as in JAX) leave the JAX
    bytes; the input cache is not modified (append is functional)."""
    config = make_config("int4-p4-sink2")
    k, v = make_kv(config, seed=3)
    tables = make_tables(config)
    jcache, tcache = jpc.init_cache(config), tpc.init_cache(config, device=device)
    ids = np.asarray([1], np.int32)
    for loop in range(2):  # a base and a residual plane (each loop is one more JAX compile)
        kw = dict(block_tables=tables, seq_ids=ids, loop=loop)
        kk, vv = k[loop, 1:, :6], v[loop, 1:, :6]
        jcache = jpc.append(jcache, kk, vv, **kw)
        tcache = tpc.append(tcache, numpy_to_torch(kk, device), numpy_to_torch(vv, device), **kw)
    assert_cache_same_bytes(tcache, jcache, "subset")

    bad = tables.copy()
    bad[0, 0] = -1  # sequence 0's first page: its write is dropped
    bad[1, 1] = config.num_pages  # unused by this call
    ids = np.asarray([0], np.int32)  # the (B, n) of the calls above: no new JAX compile
    before = [torch_to_numpy(a) for a in torch.utils._pytree.tree_leaves(tcache)]
    kk, vv = k[0, :1, :6], v[0, :1, :6]
    kw = dict(block_tables=bad, seq_ids=ids, loop=0)
    jafter = jpc.append(jcache, kk, vv, **kw)
    tafter = tpc.append(tcache, numpy_to_torch(kk, device), numpy_to_torch(vv, device), **kw)
    assert_cache_same_bytes(tafter, jafter, "dropped writes")
    for i, a in enumerate(torch.utils._pytree.tree_leaves(tcache)):
        assert_same_bytes(torch_to_numpy(a), before[i], f"input leaf {i} unchanged")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CONFIGS)
def test_gather_bits_equal_jax(name, device):
    """Torch gather == JAX gather bit for bit (every loop and sequence, the Torch cache built
    token by token); prefix gathers (seq_len < stored) equal the full gather's rows."""
    config, _, _, jcache = filled(name, "prefill")
    cache = torch_filled(name, "decode", device)
    tables = make_tables(config)
    for loop in range(L):
        for s in range(S):
            kw = dict(seq_id=s, seq_len=T, block_table=tables[s], loop=loop)
            kj, vj = jpc.gather(jcache, **kw)
            kt, vt = tpc.gather(cache, **kw)
            assert kt.device.type == device
            assert_same_bytes(torch_to_numpy(kt), kj, f"K loop {loop} seq {s}")
            assert_same_bytes(torch_to_numpy(vt), vj, f"V loop {loop} seq {s}")
            for n in (config.page_size + 1, 1):
                kp, vp = tpc.gather(cache, **{**kw, "seq_len": n})
                assert_same_bytes(torch_to_numpy(kp), kj[:n], f"prefix K len {n}")
                assert_same_bytes(torch_to_numpy(vp), vj[:n], f"prefix V len {n}")
    k0, v0 = tpc.gather(cache, seq_id=0, seq_len=0, block_table=tables[0], loop=0)
    assert k0.shape == v0.shape == (0, H, D)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", CONFIGS)
def test_paged_attention_equals_jax_and_dense(name, device):
    """Torch paged attention: == Torch dense attention on the padded gathered KV exactly, ==
    Torch dense attention on the unpadded `gather` KV (every loop); == JAX paged attention to
    float32 round-off (rtol = atol = 2e-6, last loop); GQA with 2 query heads per KV head;
    custom seq_ids. (gather's bits are checked against JAX's in test_gather_bits_equal_jax.)"""
    config, _, _, jcache = filled(name, "prefill")
    cache = torch_filled(name, "prefill", device)
    tables = make_tables(config)
    ttables = torch.from_numpy(tables).to(device)
    q = np.random.default_rng(7).standard_normal((S, 2 * H, D)).astype(np.float32)
    tq = torch.from_numpy(q).to(device)
    seq_lens = np.array([T, T - config.page_size - 2], np.int32)
    lens = torch.from_numpy(seq_lens).to(device)
    for loop in range(L):
        out = tpa.paged_decode_attention(tq, cache, ttables, lens, loop=loop)
        assert out.dtype == torch.float32 and out.shape == (S, 2 * H, D)
        assert out.device.type == device
        kr, vr = tpc.gather_batch(cache, ttables, lens, loop=loop)
        dense = ktb.dense_decode_attention(tq, kr, vr, lens)
        assert_same_bytes(torch_to_numpy(out), torch_to_numpy(dense), "paged vs dense")
        if loop == L - 1:  # the deepest residual chain (JAX compiles per loop: one is enough)
            tab, sl = jnp.asarray(tables), jnp.asarray(seq_lens)
            expected = jpa.paged_decode_attention(q, jcache, tab, sl, loop=loop)
            atol = rotated_space_atol(jcache, loop, torch_to_numpy(vr), base=ATOL)
            np.testing.assert_allclose(torch_to_numpy(out), expected, rtol=RTOL, atol=atol)
        for s in range(S):
            n = int(seq_lens[s])
            kg, vg = tpc.gather(cache, seq_id=s, seq_len=n, block_table=tables[s], loop=loop)
            one = tpa.dense_decode_attention(tq[s : s + 1], kg[None], vg[None], lens[s : s + 1])
            torch.testing.assert_close(out[s], one[0], rtol=1e-5, atol=1e-5)
    # Reversed slots: seq_ids picks the sequences, as in JAX.
    ids = np.array([1, 0], np.int32)
    rev_lens = seq_lens[::-1].copy()
    out = ktb.paged_decode_attention(
        tq, cache, ttables, torch.from_numpy(rev_lens).to(device), loop=L - 1,
        seq_ids=torch.from_numpy(ids).to(device),
    )  # fmt: skip
    expected = jpa.paged_decode_attention(
        q, jcache, jnp.asarray(tables), jnp.asarray(rev_lens), loop=L - 1, seq_ids=ids
    )
    atol = rotated_space_atol(jcache, L - 1, torch_to_numpy(vr), base=ATOL)
    np.testing.assert_allclose(torch_to_numpy(out), expected, rtol=RTOL, atol=atol)


def test_init_cache_layout_and_pytree():
    config = make_config("mixed-p8-bf16")
    cache, jcache = tpc.init_cache(config), jpc.init_cache(config)
    assert_cache_same_bytes(cache, jcache, "empty")
    assert cache.k_delta.batch_shape == (L - 1, config.num_pages)
    leaves, spec = torch.utils._pytree.tree_flatten(cache)
    again = torch.utils._pytree.tree_unflatten(leaves, spec)
    assert isinstance(again, tpc.PagedKVCache) and again.config == config
    single = tpc.init_cache(PagedCacheConfig(num_pages=2, page_size=4, num_heads=H, head_dim=D))
    assert single.k_delta is None and single.v_delta is None
    with pytest.raises(TypeError, match="PagedCacheConfig"):
        tpc.init_cache(dict(num_pages=2))


def test_argument_errors_match_jax():
    """Shape/dtype errors raise in append, data errors in check_append, with kvq_jax's
    messages."""
    config = make_config("int4-p4-sink2")
    cache, jcache = tpc.init_cache(config), jpc.init_cache(config)
    tables = make_tables(config)
    ids = np.arange(S, dtype=np.int32)
    x = torch.zeros((S, 2, H, D))
    kw = dict(block_tables=tables, seq_ids=ids, loop=0)
    cases = [
        (dict(k=x[..., :8], v=x[..., :8]), "H=2, D=16"),
        (dict(k=x.bfloat16(), v=x.bfloat16()), "cache dtype"),
        (dict(k=x, v=x[:, :1]), "same shape"),
        (dict(k=x, v=x, seq_ids=ids.astype(np.int16)), "int32"),
        (dict(k=x, v=x, loop=L), "loop must be in"),
    ]
    for over, message in cases:
        args = {**kw, **over}
        k, v = args.pop("k"), args.pop("v")
        for fn in (tpc.append, tpc.check_append):
            with pytest.raises((ValueError, TypeError), match=message):
                fn(cache, k, v, **args)
    with pytest.raises(ValueError, match="distinct"):
        tpc.check_append(cache, x, x, **{**kw, "seq_ids": np.array([1, 1], np.int32)})
    with pytest.raises(ValueError, match="append loop 0 first"):
        tpc.check_append(cache, x, x, **{**kw, "loop": 1})
    with pytest.raises(ValueError, match="append loop 0 first"):
        jpc.check_append(jcache, x.numpy(), x.numpy(), **{**kw, "loop": 1})
    q = torch.ones((S, H, D))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        tpa.paged_decode_attention(q[:, :1].repeat(1, 3, 1), cache, tables,
                                   np.ones(S, np.int32), loop=0)  # fmt: skip
    with pytest.raises(TypeError, match="int32"):
        tpa.paged_decode_attention(q, cache, tables, np.ones(S, np.float32), loop=0)
    with pytest.raises(ValueError, match="fewer than"):
        tpc.gather(cache, seq_id=0, seq_len=9, block_table=tables[0, :2], loop=0)
