"""Append-time quantized paged cache (kvq_jax.cache.paged_cache) and the paged decode-attention
reference (kvq_jax.cache.paged_attention): append order independence, page bytes against pack_paged
and page-wise residual encoding, gather against encode_loops/decode_loop, attention against
dense attention, and argument errors."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    assert_same_bytes,
    assert_same_values,
    assert_trees_same_bytes,
    rotated_space_atol,
)

import kvq_jax
from kvq_jax.cache.paged import resolve_paged
from kvq_jax.cache.paged_attention import dense_decode_attention, paged_decode_attention
from kvq_jax.cache.paged_cache import (
    PagedCacheConfig,
    append,
    check_append,
    decode_pages,
    gather,
    gather_batch,
    init_cache,
)
from kvq_jax.codecs.cache_state import codec_view
from kvq_jax.kernels.page_reconstruct import xla as page_xla

H, D, T, L, S = 2, 16, 19, 3, 2
KINDS = (("key", "k"), ("value", "v"))

CONFIGS = {
    # INT4 everywhere, 4-token pages, 2 sink tokens, float32.
    "int4-p4-sink2": dict(page_size=4, sink=2, dtype=np.float32),
    # FP8 key residuals / NVFP4 value base, 8-token pages, no sink, bfloat16.
    "mixed-p8-bf16": dict(
        page_size=8,
        sink=0,
        dtype=ml_dtypes.bfloat16,
        k_residual_format="fp8_e4m3",
        v_base_format="nvfp4",
    ),
    # INT2 keys (FlashLoop's 2-bit stream, served by the XLA path: no kernel decodes it), INT4
    # value base with INT2 value residuals, 8-token pages (groups of 8), 1 sink token.
    "int2-p8-bf16": dict(
        page_size=8,
        sink=1,
        dtype=ml_dtypes.bfloat16,
        k_base_format="int2",
        k_residual_format="int2",
        v_residual_format="int2",
    ),
    # Hadamard-rotated formats (XLA path): key residuals HINT4 over tokens, values HINT4 base
    # with HINT2 residuals, 4-token pages, 1 sink token, float16.
    "hint-p4-f16": dict(
        page_size=4,
        sink=1,
        dtype=np.float16,
        k_residual_format="hint4",
        v_base_format="hint4",
        v_residual_format="hint2",
    ),
}


def make_config(name: str) -> PagedCacheConfig:
    kw = CONFIGS[name]
    pages_per_seq = -(-T // kw["page_size"]) + 1
    return PagedCacheConfig(
        num_pages=S * pages_per_seq + 1, num_heads=H, head_dim=D, num_loops=L, max_seqs=S, **kw
    )


def make_tables(config: PagedCacheConfig) -> np.ndarray:
    """Block tables with non-contiguous, interleaved physical pages (page 0 unused)."""
    per_seq = (config.num_pages - 1) // S
    ids = 1 + np.arange(S * per_seq)[::-1]
    return ids.reshape(per_seq, S).T.astype(np.int32).copy()


def make_kv(config: PagedCacheConfig, seed: int = 0):
    """K, V [L, S, T, H, D]: each loop a perturbation of the previous (as in a looped LM)."""
    rng = np.random.default_rng(seed)
    out = []
    for scale in (1.0, 3.0):
        steps = (
            rng.standard_normal((L, S, T, H, D))
            * np.array([1.0] + [0.2] * (L - 1))[:, None, None, None, None]
        )
        out.append((scale * np.cumsum(steps, axis=0)).astype(config.dtype))
    return out


def fill(config, k, v, chunks):
    """Append K, V to a fresh cache, loop by loop per chunk (a looped LM's order): for each
    chunk of tokens, loops 0, 1, ... in turn."""
    cache, tables = init_cache(config), jnp.asarray(make_tables(config))
    ids = jnp.arange(S, dtype=jnp.int32)
    start = 0
    for n in chunks:
        for loop in range(L):
            kw = dict(block_tables=tables, seq_ids=ids, loop=loop)
            kk, vv = k[loop, :, start : start + n], v[loop, :, start : start + n]
            check_append(cache, kk, vv, **kw)
            cache = append(cache, kk, vv, **kw)
        start += n
    assert start == T
    return cache


@functools.cache
def filled(name: str, mode: str):
    config = make_config(name)
    k, v = make_kv(config)
    chunks = {"prefill": [T], "decode": [1] * T, "chunked": [3, 5, 3, 5, 3]}[mode]
    return config, k, v, fill(config, k, v, chunks)


def page_spec(config, kind, fmt):
    axis, group = resolve_paged(fmt, kind, config.page_shape, None, None)
    return dict(kind=kind, format=fmt, axis=axis, group_size=group)


def take(packed, *index):
    """Pages `index` of a stored plane, with its format's dtypes."""
    return codec_view(jax.tree.map(lambda a: a[index], packed))


@pytest.mark.parametrize(
    "name, mode",
    [
        ("int4-p4-sink2", "decode"),
        pytest.param("int4-p4-sink2", "chunked", marks=pytest.mark.slow),  # int2: chunked
        ("mixed-p8-bf16", "decode"),
        ("int2-p8-bf16", "chunked"),
    ],
)
def test_append_order_independent(name, mode):
    """Token-by-token and chunked appends leave the same cache as one prefill, byte for byte:
    every page (written or not), staging, sink rows and seq_lens."""
    _, _, _, expected = filled(name, "prefill")
    _, _, _, actual = filled(name, mode)
    assert_trees_same_bytes(actual, expected, f"{mode} cache")
    assert np.asarray(actual.seq_lens).tolist() == [[T] * S] * L


@pytest.mark.parametrize("name", CONFIGS)
def test_pages_equal_pack_paged_and_residuals(name):
    """Finished pages equal pack_paged (loop 0) and the page-by-page residual payloads of
    encode_residual against the reconstructed previous loop (loops >= 1); staging holds the
    raw partial page (zeros past the fill), sink rows the raw first tokens."""
    config, k, v, cache = filled(name, "prefill")
    ps, full = config.page_size, T // config.page_size
    tables = make_tables(config)
    for (kind, prefix), x in zip(KINDS, (k, v), strict=True):
        base_fmt = getattr(config, f"{prefix}_base_format")
        res_fmt = getattr(config, f"{prefix}_residual_format")
        for s in range(S):
            phys = tables[s, :full]
            pages = x[:, s, : full * ps].reshape(L, full, ps, H, D)
            packed = kvq_jax.pack_paged(pages[0], kind=kind, format=base_fmt)
            assert_trees_same_bytes(
                take(getattr(cache, f"{prefix}_base"), phys), packed, f"{kind} base seq {s}"
            )
            recon = kvq_jax.unpack_paged(packed)
            spec = page_spec(config, kind, res_fmt)
            for loop in range(1, L):
                residual = jax.vmap(functools.partial(kvq_jax.encode_residual, **spec))(
                    pages[loop], recon
                )
                delta = take(getattr(cache, f"{prefix}_delta"), loop - 1, phys)
                assert_trees_same_bytes(delta, residual.payload, f"{kind} loop {loop} seq {s}")
                recon = jax.vmap(kvq_jax.decode_residual)(residual, recon)
            for loop in range(L):
                stage = np.asarray(getattr(cache, f"{prefix}_stage")[loop, s])
                rest = T - full * ps
                assert_same_bytes(stage[:rest], x[loop, s, full * ps :], "staging rows")
                assert not np.any(stage[rest:].astype(np.float32)), "staging past the fill"
                sink = getattr(cache, f"{prefix}_sink")[loop, s]
                assert_same_bytes(sink, x[loop, s, : config.sink], "sink rows")
    # Pages no sequence owns stay untouched (zero).
    assert not np.any(np.asarray(cache.k_base.codes)[0])


@functools.cache
def loop_reference(name: str):
    """Per loop and sequence, [T, H, D] K and V built independently: full pages from
    decode_loop(encode_loops(page stack)) with the cache's page-local groups, the partial page
    and the sink rows raw."""
    config, k, v, _ = filled(name, "prefill")
    ps, full = config.page_size, T // config.page_size
    out = {}
    for (kind, prefix), x in zip(KINDS, (k, v), strict=True):
        base = page_spec(config, kind, getattr(config, f"{prefix}_base_format"))
        res_fmt = getattr(config, f"{prefix}_residual_format")
        res = page_spec(config, kind, res_fmt)
        ref = np.array(x)
        for s in range(S):
            for j in range(full):
                code = kvq_jax.encode_loops(
                    x[:, s, j * ps : (j + 1) * ps],
                    kind=kind,
                    base_format=base["format"],
                    residual_format=res_fmt,
                    group_size=base["group_size"],
                    residual_group_size=res["group_size"],
                )
                for loop in range(L):
                    ref[loop, s, j * ps : (j + 1) * ps] = kvq_jax.decode_loop(code, loop=loop)
        ref[:, :, : config.sink] = x[:, :, : config.sink]
        out[kind] = ref
    return out["key"], out["value"]


@pytest.mark.parametrize("name", CONFIGS)
def test_gather_equals_loop_reference(name):
    """gather == the logical loop reference (full pages bit-exact, NaN-free data; staging and
    sink rows raw); a prefix gather (seq_len < stored) reads the quantized pages it covers."""
    config, _, _, cache = filled(name, "prefill")
    k_ref, v_ref = loop_reference(name)
    tables = jnp.asarray(make_tables(config))
    for loop in range(L):
        for s in range(S):
            k, v = gather(cache, seq_id=s, seq_len=T, block_table=tables[s], loop=loop)
            assert_same_values(k, k_ref[loop, s], f"K loop {loop} seq {s}")
            assert_same_values(v, v_ref[loop, s], f"V loop {loop} seq {s}")
            cut = config.page_size + 1
            kp, vp = gather(cache, seq_id=s, seq_len=cut, block_table=tables[s], loop=loop)
            assert_same_values(kp, k_ref[loop, s, :cut], "prefix K")
            assert_same_values(vp, v_ref[loop, s, :cut], "prefix V")


def test_decode_pages_and_partial_gather():
    """decode_pages of loop l of a page equals the gathered rows; a partly filled cache
    gathers its partial page from staging."""
    config = make_config("int4-p4-sink2")
    k, v = make_kv(config, seed=3)
    tables = jnp.asarray(make_tables(config))
    cache = init_cache(config)
    ids = jnp.asarray([1], jnp.int32)
    for loop in range(L):
        cache = append(cache, k[loop, 1:, :6], v[loop, 1:, :6], block_tables=tables,
                       seq_ids=ids, loop=loop)  # fmt: skip
    for loop in range(L):
        kg, vg = gather(cache, seq_id=1, seq_len=6, block_table=tables[1], loop=loop)
        page = decode_pages(cache, "key", tables[1, :1], loop=loop)[0]
        assert_same_values(kg[2:4], page[2:4], "page rows past the sink")
        assert_same_bytes(kg[:2], k[loop, 1, :2], "sink rows")
        assert_same_bytes(kg[4:], k[loop, 1, 4:6], "staging rows")
        assert_same_bytes(vg[4:], v[loop, 1, 4:6], "staging rows")
    assert np.asarray(cache.seq_lens).tolist() == [[0, 6]] * L


def attention_bound(q, k_hat, v_hat, k, v, seq_lens):
    """Per (b, query head) bound on |attn(q, K^, V^) - attn(q, K, V)|: with logit error
    delta = ||q||_1 max|K^ - K| / sqrt(D), each softmax weight moves by a factor within
    exp(+-2 delta), so ||p^ - p||_1 <= exp(2 delta) - 1 and the output moves by at most
    (exp(2 delta) - 1) max|V| + max|V^ - V| (maxima over the attended tokens of the KV head)."""
    b, hq, d = q.shape
    g = hq // H
    bound = np.zeros((b, hq))
    for i in range(b):
        n = seq_lens[i]
        ek = np.abs(k_hat[i, :n] - k[i, :n]).max(axis=(0, 2))  # [H]
        ev = np.abs(v_hat[i, :n] - v[i, :n]).max(axis=(0, 2))
        vmax = np.abs(v[i, :n]).max(axis=(0, 2))
        for j in range(hq):
            h = j // g
            delta = np.abs(q[i, j]).sum() * ek[h] / math.sqrt(d)
            bound[i, j] = np.expm1(2 * delta) * vmax[h] + ev[h]
    return bound


@pytest.mark.parametrize("name", CONFIGS)
def test_paged_attention(name):
    """paged_decode_attention == dense attention on the reconstructed (padded) KV and on the
    unpadded gathered KV (last loop) to float32 round-off (rtol = atol = 1e-5: the XLA path
    attends page block by page block with an online softmax, another summation order),
    and within the derived `attention_bound` (plus 1e-4 slack) of attention on the
    unquantized KV; GQA with 2 query heads per KV head."""
    config, k, v, cache = filled(name, "prefill")
    tables = jnp.asarray(make_tables(config))
    rng = np.random.default_rng(7)
    q = rng.standard_normal((S, 2 * H, D)).astype(np.float32)
    seq_lens = np.array([T, T - config.page_size - 2], np.int32)  # a prefix for sequence 1
    lens = jnp.asarray(seq_lens)
    for loop in range(L):
        out = paged_decode_attention(q, cache, tables, lens, loop=loop)
        assert out.dtype == jnp.float32 and out.shape == (S, 2 * H, D)
        kr, vr = gather_batch(cache, tables, lens, loop=loop)
        dense = dense_decode_attention(q, kr, vr, lens)
        atol = rotated_space_atol(cache, loop, vr)
        np.testing.assert_allclose(out, dense, rtol=1e-5, atol=atol, err_msg="paged vs dense")
        for s in range(S) if loop == L - 1 else ():
            n = int(seq_lens[s])
            kg, vg = gather(cache, seq_id=s, seq_len=n, block_table=tables[s], loop=loop)
            one = dense_decode_attention(q[s : s + 1], kg[None], vg[None], lens[s : s + 1])
            np.testing.assert_allclose(out[s], one[0], rtol=1e-5, atol=atol)
        k32, v32 = k[loop].astype(np.float32), v[loop].astype(np.float32)
        exact = np.asarray(dense_decode_attention(q, k32, v32, lens))
        kh, vh = np.asarray(kr, np.float32), np.asarray(vr, np.float32)
        bound = attention_bound(q, kh, vh, k32, v32, seq_lens)
        err = np.abs(np.asarray(out) - exact).max(axis=-1)
        assert np.all(err <= bound + 1e-4), f"loop {loop}: err {err} > bound {bound}"
        assert np.all(err > 0), "quantization must change the output"


def _rotated_f32():
    """hint-p4-f16's formats in a float32 cache: rotated-space attention is then the reference
    to float32 round-off."""
    config = dataclasses.replace(make_config("hint-p4-f16"), dtype=np.float32)
    k, v = make_kv(config, seed=3)
    return config, fill(config, k, v, [3, 5, 3, 5, 3])


def _check_rotated_space(config, cache):
    tables = jnp.asarray(make_tables(config))
    q = np.random.default_rng(8).standard_normal((S, 2 * H, D)).astype(np.float32)
    lens = jnp.asarray([T, T - 3], jnp.int32)
    for loop in range(L):
        assert page_xla.rotated_chain(cache.loop_chain("value", loop))
        out = paged_decode_attention(q, cache, tables, lens, loop=loop)
        kr, vr = gather_batch(cache, tables, lens, loop=loop)
        dense = dense_decode_attention(q, kr, vr, lens)
        np.testing.assert_allclose(out, dense, rtol=1e-5, atol=1e-5, err_msg=f"loop {loop}")


def test_values_attended_in_the_rotated_space():
    """Hadamard-rotated values (every loop HINT) are attended without un-rotating each row:
    equal to dense attention on the reconstructed rows (float32 cache: round-off only), raw
    sink and staging rows included (lengths end mid-page)."""
    _check_rotated_space(*_rotated_f32())


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_rotated_space_planted_defect(monkeypatch):
    """The check fails when the output is not un-rotated (xfail strict)."""
    from kvq_jax.kernels.paged_attention import xla as attention_xla

    config, cache = _rotated_f32()
    monkeypatch.setattr(attention_xla, "unrotate", lambda y: y)
    jax.clear_caches()
    try:
        _check_rotated_space(config, cache)
    finally:
        jax.clear_caches()


def test_paged_attention_single_token_and_gqa_errors():
    config = make_config("int4-p4-sink2")
    k, v = make_kv(config)
    cache, tables = init_cache(config), jnp.asarray(make_tables(config))
    ids = jnp.arange(S, dtype=jnp.int32)
    cache = append(cache, k[0, :, :1], v[0, :, :1], block_tables=tables, seq_ids=ids, loop=0)
    q = np.ones((S, H, D), np.float32)
    out = paged_decode_attention(q, cache, tables, jnp.ones(S, jnp.int32), loop=0)
    # One token: softmax weight 1, the output is that token's (raw sink) V row.
    np.testing.assert_array_equal(out, np.asarray(v[0, :, 0], np.float32))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        paged_decode_attention(q[:, :1].repeat(3, 1), cache, tables, jnp.ones(S, jnp.int32), loop=0)
    with pytest.raises(ValueError, match="D = 8"):
        paged_decode_attention(q[..., :8], cache, tables, jnp.ones(S, jnp.int32), loop=0)
    with pytest.raises(TypeError, match="int32"):
        paged_decode_attention(q, cache, tables, jnp.ones(S, jnp.float32), loop=0)
    with pytest.raises(ValueError, match="loop must be in"):
        paged_decode_attention(q, cache, tables, jnp.ones(S, jnp.int32), loop=L)


def test_cache_is_a_pytree_and_jits():
    config = make_config("int4-p4-sink2")
    cache = init_cache(config)
    leaves, treedef = jax.tree.flatten(cache)
    again = jax.tree.unflatten(treedef, leaves)
    assert again.config == config and hash(config) == hash(make_config("int4-p4-sink2"))
    assert_trees_same_bytes(jax.jit(lambda c: c)(cache), cache, "jit round trip")
    assert cache.k_base.batch_shape == (config.num_pages,)
    assert cache.k_delta.batch_shape == (L - 1, config.num_pages)
    assert cache.k_stage.shape == (L, S, config.page_size, H, D)
    assert cache.k_sink.shape == (L, S, config.sink, H, D)
    assert cache.storage_bytes == sum(a.nbytes for a in leaves)
    single = init_cache(dataclasses.replace(config, num_loops=1))
    assert single.k_delta is None and single.v_delta is None


def test_config_errors():
    base = dict(num_pages=4, page_size=4, num_heads=H, head_dim=D)
    with pytest.raises(ValueError, match="must divide page_size"):
        PagedCacheConfig(**base, k_group_size=3)
    with pytest.raises(ValueError, match="sink must be an int >= 0"):
        PagedCacheConfig(**base, sink=-1)
    with pytest.raises(ValueError, match="page_size must be an int >= 1"):
        PagedCacheConfig(**{**base, "page_size": 0})
    with pytest.raises(TypeError, match="dtype"):
        PagedCacheConfig(**base, dtype=np.int32)
    with pytest.raises(ValueError):
        PagedCacheConfig(**base, v_residual_format="int3")
    with pytest.raises(TypeError, match="PagedCacheConfig"):
        init_cache(base)


def test_append_errors():
    config = make_config("int4-p4-sink2")
    cache, tables = init_cache(config), jnp.asarray(make_tables(config))
    ids = jnp.arange(S, dtype=jnp.int32)
    x = jnp.zeros((S, 2, H, D), jnp.float32)
    kw = dict(block_tables=tables, seq_ids=ids, loop=0)

    def both(k, v, **over):
        args = {**kw, **over}
        errors = []
        for fn in (append, check_append):
            with pytest.raises((ValueError, TypeError)) as info:
                fn(cache, k, v, **args)
            errors.append(str(info.value))
        return errors[0]

    assert "H=2, D=16" in both(x[:, :, :1], x[:, :, :1])
    assert "H=2, D=16" in both(x[..., :8], x[..., :8])
    assert "cache dtype" in both(x.astype(jnp.bfloat16), x.astype(jnp.bfloat16))
    assert "same shape" in both(x, x[:, :1])
    assert "rank 4" in both(x[0], x[0])
    capacity = tables.shape[1] * config.page_size
    big = jnp.zeros((S, capacity + 1, H, D), jnp.float32)
    assert "exceed the block table" in both(big, big)
    assert "seq_ids has 1 entries" in both(x, x, seq_ids=ids[:1])
    assert "int32" in both(x, x, seq_ids=ids.astype(jnp.int16))
    assert "block_tables must be" in both(x, x, block_tables=tables[:1])
    assert "loop must be in" in both(x, x, loop=L)
    assert "static int" in both(x, x, loop=0.0)


def test_check_append_data_errors():
    """check_append catches data errors on the host; append itself drops such writes."""
    config = make_config("int4-p4-sink2")
    cache, tables = init_cache(config), np.asarray(make_tables(config))
    ids = np.arange(S, dtype=np.int32)
    x = jnp.ones((S, 3, H, D), jnp.float32)
    kw = dict(block_tables=tables, seq_ids=ids, loop=0)
    with pytest.raises(ValueError, match="seq_ids must lie in"):
        check_append(cache, x, x, **{**kw, "seq_ids": np.array([0, S], np.int32)})
    with pytest.raises(ValueError, match="distinct"):
        check_append(cache, x, x, **{**kw, "seq_ids": np.array([1, 1], np.int32)})
    bad = tables.copy()
    bad[1, 0] = -1
    with pytest.raises(ValueError, match=r"page id\(s\) \[-1\]"):
        check_append(cache, x, x, **{**kw, "block_tables": bad})
    bad[1, 0] = config.num_pages
    with pytest.raises(ValueError, match="outside"):
        check_append(cache, x, x, **{**kw, "block_tables": bad})
    shared = tables.copy()
    shared[1, 0] = shared[0, 0]
    with pytest.raises(ValueError, match="same physical page"):
        check_append(cache, jnp.ones((S, 4, H, D)), jnp.ones((S, 4, H, D)),
                     **{**kw, "block_tables": shared})  # fmt: skip
    with pytest.raises(ValueError, match="append loop 0 first"):
        check_append(cache, x, x, **{**kw, "loop": 1})
    # Fill sequence 0 to capacity, then one more token is "full".
    capacity = tables.shape[1] * config.page_size
    one = np.array([0], np.int32)
    full = jnp.ones((1, capacity, H, D), jnp.float32)
    filled_cache = append(cache, full, full, block_tables=tables, seq_ids=one, loop=0,
                          donate=False)  # fmt: skip
    tok = jnp.ones((1, 1, H, D), jnp.float32)
    with pytest.raises(ValueError, match="sequence 0 is full"):
        check_append(filled_cache, tok, tok, block_tables=tables, seq_ids=one, loop=0)
    # A write to an invalid page id is dropped, not wrapped around to page P - 1.
    bad[1, 0] = -1
    after = append(cache, jnp.ones((S, 4, H, D)), jnp.ones((S, 4, H, D)),
                   block_tables=bad, seq_ids=ids, loop=0)  # fmt: skip
    untouched = np.ones(config.num_pages, bool)
    untouched[tables[0, 0]] = False
    assert not np.any(np.asarray(after.k_base.codes)[untouched])


def test_gather_errors():
    config = make_config("int4-p4-sink2")
    cache, tables = init_cache(config), jnp.asarray(make_tables(config))
    with pytest.raises(ValueError, match="fewer than"):
        gather(cache, seq_id=0, seq_len=9, block_table=tables[0, :2], loop=0)
    with pytest.raises(ValueError, match="seq_len must be"):
        gather(cache, seq_id=0, seq_len=-1, block_table=tables[0], loop=0)
    with pytest.raises(TypeError, match="PagedKVCache"):
        gather(cache.k_stage, seq_id=0, seq_len=1, block_table=tables[0], loop=0)
    k, v = gather(cache, seq_id=0, seq_len=0, block_table=tables[0], loop=0)
    assert k.shape == v.shape == (0, H, D)
