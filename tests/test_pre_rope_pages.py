"""Keys stored before RoPE in the paged cache (FORMAT.md 5b, `PagedCacheConfig.rope_theta`).

A completed key page packs `invert_rope` of its rows at their positions in the sequence; reads
(`gather`, decode attention) put RoPE back at the same positions. Checked against the
plain-Python oracle's RoPE (`kvq_jax.oracle.invert_rope` / `apply_rope`) and the codecs' own
packing (`pack_kv`, `pack_heavy`, `encode_residual`, each checked against the oracle
elsewhere), with dense attention on the rows rebuilt from them; the Torch paged cache holds
the same bytes.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kvq_jax
from kvq_jax import oracle
from kvq_jax.cache import paged_cache
from kvq_jax.cache.paged_attention import dense_decode_attention, paged_decode_attention
from kvq_jax.codecs import cache_state
from kvq_jax.codecs.api import pack_kv, unpack_kv
from kvq_jax.codecs.formats.heavy_rows import register_heavy
from kvq_jax.codecs.heavy import pack_heavy, select_heavy
from kvq_jax.codecs.residual import decode_residual, encode_residual
from kvq_jax.codecs.rope import apply_rope_halves, invert_rope, rope_at
from kvq_jax.core import offload
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.rope import rope_tables
from kvq_jax.kernels.paged_attention import api as attention_api

B, T, H, D, PS = 2, 150, 2, 16, 32
THETA = 10000.0
RNG = np.random.default_rng(20261206)
K = RNG.standard_normal((2, B, T, H, D)).astype(np.float32) * 3  # [loop, B, T, H, D]
V = RNG.standard_normal((2, B, T, H, D)).astype(np.float32)
TABLES = jnp.asarray(1 + np.arange(10).reshape(B, 5)[:, ::-1], jnp.int32)  # reversed pages


def _config(**kw):
    kw = dict(num_pages=12, page_size=PS, num_heads=H, head_dim=D, max_seqs=B, sink=1,
              rope_theta=THETA) | kw  # fmt: skip
    return PagedCacheConfig(**kw)


def _fill(config, chunks, loops=1, k=K, v=V, tables=TABLES):
    cache = paged_cache.init_cache(config)
    ids = jnp.arange(B, dtype=jnp.int32)
    for a, b in itertools.pairwise(np.cumsum([0, *chunks])):
        for loop in range(loops):
            cache = paged_cache.append(cache, k[loop, :, a:b].astype(config.dtype),
                                       v[loop, :, a:b].astype(config.dtype),
                                       block_tables=tables, seq_ids=ids, loop=loop)  # fmt: skip
    return cache


def _turn(rows, page, dtype, *, invert):
    """The oracle's RoPE of page `page`'s rows [PS, H, D] (positions page * PS ..), cast."""
    turn = oracle.invert_rope if invert else oracle.apply_rope
    out = turn(np.asarray(rows, np.float32), THETA, offset=page * PS)
    return np.asarray(out, np.float32).astype(dtype)


def _page(plane, page):
    return cache_state.codec_view(jax.tree.map(lambda a: a[page], plane))


def _same_bytes(got, want, where):
    for name in want.arrays:
        a, b = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), f"{where}: {name}"


def test_device_tables_are_the_oracles():
    """`rope_at` (traced positions, binary64 on the device) gives the oracle's float32 cos/sin
    and `rope_tables`' for every position of a 32k context; `key_rope` of static positions
    (NumPy, half width) the oracle's too."""
    for dim, theta in ((16, THETA), (128, 1e6)):
        pos = np.array([0, 1, 2, 777, 4095, 32767])
        cos, sin = jax.jit(rope_at, static_argnums=(1, 2))(jnp.asarray(pos), dim, theta)
        for i, p in enumerate(pos):
            want_cos, want_sin = oracle.rope.tables(1, dim, theta, offset=int(p))
            np.testing.assert_array_equal(np.asarray(cos)[i, 0], np.float32(want_cos[0]))
            np.testing.assert_array_equal(np.asarray(sin)[i, 0], np.float32(want_sin[0]))
        cos, sin = jax.jit(rope_at, static_argnums=(1, 2))(jnp.arange(32768), dim, theta)
        want = rope_tables(32768, dim, theta)
        assert np.asarray(cos).tobytes() == want[0].tobytes()
        assert np.asarray(sin).tobytes() == want[1].tobytes()
        # static positions: NumPy's half-width tables (program constants), the same numbers
        config = _config(head_dim=dim, rope_theta=theta)
        cos, sin = cache_state.key_rope(config, pos)
        assert cos.shape == (len(pos), 1, dim // 2)
        for i, p in enumerate(pos):
            want_cos, want_sin = oracle.rope.tables(1, dim, theta, offset=int(p))
            half = dim // 2
            np.testing.assert_array_equal(np.asarray(cos)[i, 0], np.float32(want_cos[0][:half]))
            np.testing.assert_array_equal(np.asarray(sin)[i, 0], np.float32(want_sin[0][:half]))


def test_float32_rope_is_within_ulps_of_the_oracle():
    """Decode attention turns keys with `apply_rope_halves` (float32 products, the kernel's
    arithmetic): within 2 float32 ulps of the larger input half (two products rounded by
    half an ulp each, their sum by up to one) of the oracle's binary64 rotation, at
    positions across a 32k context, jitted; a sign slip (the inverse rotation) is caught."""
    rng = np.random.default_rng(7)
    pos = np.concatenate([np.arange(64), rng.integers(64, 32768, 448)])
    x = rng.standard_normal((pos.size, 2, 128)) * 10.0 ** rng.uniform(-3, 3, (pos.size, 2, 1))
    x = x.astype(np.float32)
    config = _config(head_dim=128, rope_theta=1e6)
    cos, sin = cache_state.key_rope(config, pos)
    got = np.concatenate(jax.jit(apply_rope_halves)(x, cos, sin), axis=-1)
    want = np.concatenate(
        [oracle.apply_rope(x[i : i + 1], 1e6, offset=int(p)) for i, p in enumerate(pos)]
    )
    # the terms' scale max(|x_lo|, |x_hi|) (cos, sin <= 1) bounds each output's round-offs
    scale = np.maximum(np.abs(x[..., :64]), np.abs(x[..., 64:]))
    ulp = np.spacing(np.concatenate([scale, scale], axis=-1))

    def ulps(rows):
        return np.max(np.abs(rows.astype(np.float64) - want) / ulp)

    assert ulps(got) <= 2
    assert ulps(np.asarray(jax.jit(invert_rope)(x, cos, sin))) > 1e3  # the planted slip


def _turn_float32(rows, page, dtype):
    """Page `page`'s decoded rows turned as decode attention turns them: `apply_rope_halves`
    (float32 products, within 2 float32 ulps of the oracle:
    test_float32_rope_is_within_ulps_of_the_oracle) with the oracle's tables of their
    positions, cast."""
    tables = oracle.rope.tables(PS, D, THETA, offset=page * PS)
    cos, sin = (np.asarray(a, np.float32)[:, None, : D // 2] for a in tables)
    halves = jax.jit(apply_rope_halves)(np.asarray(rows, np.float32), cos, sin)
    return np.concatenate([np.asarray(a) for a in halves], axis=-1).astype(dtype)


def _rebuilt(config, loop=0, absolute=()):
    """(K, K32, V) [B, T, H, D] as the cache serves them, from the oracle's RoPE and the codecs:
    every full key page packed as invert_rope of its rows (loop > 0: the residual against the
    reconstructed previous loop, in the stored space), decoded in the cache dtype and turned
    back (K: with the oracle's RoPE; K32: as decode attention turns them, `_turn_float32`);
    values packed as given; partial pages and the sink row raw."""
    dt = config.dtype
    k, k32, v = (x[loop].astype(dt).copy() for x in (K, K, V))
    for kind, x in (("key", K), ("value", V)):
        for s, i in itertools.product(range(B), range(T // PS)):
            recon = None
            for level in range(loop + 1):
                rows = x[level, s, i * PS : (i + 1) * PS].astype(dt)
                stored = _turn(rows, i, dt, invert=True) if kind == "key" else rows
                args = config.loop_pack_args(kind, level)
                if recon is None or level in absolute:
                    recon = np.asarray(unpack_kv(pack_kv(jnp.asarray(stored), **args)))
                else:
                    res = encode_residual(jnp.asarray(stored), jnp.asarray(recon), **args)
                    recon = np.asarray(decode_residual(res, jnp.asarray(recon)))
            page = slice(i * PS, (i + 1) * PS)
            if kind == "key":
                k[s, page] = _turn(recon, i, dt, invert=False)
                k32[s, page] = _turn_float32(recon, i, dt)
            else:
                v[s, page] = recon
    for y, x in ((k, K), (k32, K), (v, V)):
        y[:, :1] = x[loop, :, :1].astype(dt)  # the sink row, raw
    return k, k32, v


def _check_reads(cache, config, loop=0, absolute=()):
    k_ref, k32_ref, v_ref = _rebuilt(config, loop, absolute)
    for s in range(B):
        k_got, v_got = paged_cache.gather(cache, seq_id=s, seq_len=T, block_table=TABLES[s],
                                          loop=loop)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(k_got), k_ref[s], err_msg=f"keys of {s}")
        np.testing.assert_array_equal(np.asarray(v_got), v_ref[s], err_msg=f"values of {s}")
    # decode attention turns keys in float32: in a 16-bit cache its rounding may land one ulp
    # from the oracle's, so the dense reference takes the keys turned that way
    q = RNG.standard_normal((B, 2 * H, D)).astype(np.float32)
    lens = jnp.asarray([T, T - 40], jnp.int32)
    out = paged_decode_attention(q, cache, TABLES, lens, loop=loop)
    dense = dense_decode_attention(q, jnp.asarray(k32_ref), jnp.asarray(v_ref), lens)
    np.testing.assert_allclose(out, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.thin(2)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunks", [[T], [37, 1, 1, 111]])
@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_pages_and_reads(dtype, chunks, fmt):
    """Every completed key page holds the codec's bytes of invert_rope(page) at the page's
    positions (value pages: the values as given); gather serves RoPE put back on the decoded
    page, in the cache dtype; decode attention equals dense attention on those rows."""
    config = _config(dtype=dtype, k_base_format=fmt, v_base_format=fmt)
    cache = _fill(config, chunks)
    dt = config.dtype
    for s, i in itertools.product(range(B), range(T // PS)):
        page = int(TABLES[s, i])
        rows = K[0, s, i * PS : (i + 1) * PS].astype(dt)
        want = pack_kv(jnp.asarray(_turn(rows, i, dt, invert=True)),
                       **config.loop_pack_args("key", 0))  # fmt: skip
        _same_bytes(_page(cache.k_base, page), want, f"key page {i} of sequence {s}")
        want = pack_kv(jnp.asarray(V[0, s, i * PS : (i + 1) * PS].astype(dt)),
                       **config.loop_pack_args("value", 0))  # fmt: skip
        _same_bytes(_page(cache.v_base, page), want, f"value page {i} of sequence {s}")
    _check_reads(cache, config)


@pytest.mark.parametrize("absolute", [(), pytest.param((1,), marks=pytest.mark.slow)])
def test_later_loops_chain_before_rope(absolute):
    """Loop 1 as a delta (INT2) against the reconstructed loop 0 in the stored space, or packed
    on its own (absolute), both before RoPE; read back with RoPE at the same positions."""
    config = _config(num_loops=2, k_residual_format="int2", v_residual_format="int2",
                     k_absolute=absolute, v_absolute=absolute)  # fmt: skip
    cache = _fill(config, [37, 1, 112], loops=2)
    _check_reads(cache, config, loop=0)
    _check_reads(cache, config, loop=1, absolute=absolute)


def test_heavy_rows_chosen_from_the_roped_keys():
    """A heavy-row key format in a pre-RoPE cache: rows chosen from the keys as handed over
    (RoPE'd), payload and heavy rows packed from invert_rope of the page."""
    table = RNG.standard_normal((H, 3, D)).astype(ml_dtypes.bfloat16)
    keys, values = register_heavy("int4", PS, table), register_heavy("int4", PS)
    try:
        config = _config(k_base_format=keys, v_base_format=values)
        cache = _fill(config, [37, 113])
        for s, i in itertools.product(range(B), range(T // PS)):
            page = int(TABLES[s, i])
            rows = K[0, s, i * PS : (i + 1) * PS]
            chosen = select_heavy(jnp.asarray(rows), jnp.asarray(table), group_size=PS)
            stored = jnp.asarray(_turn(rows, i, np.float32, invert=True))
            want = pack_heavy(stored, chosen, kind="key", format="int4", group_size=PS)
            got = _page(cache.k_base, page)
            for name in want.payload.arrays:
                assert np.asarray(getattr(got, name)).tobytes() == np.asarray(
                    getattr(want.payload, name)).tobytes(), (s, i, name)  # fmt: skip
            assert np.asarray(got.heavy_rows).tobytes() == np.asarray(want.rows).tobytes()
            assert np.asarray(got.heavy_codes).tobytes() == np.asarray(want.codes).tobytes()
        # the rows differ from those chosen from the stored (pre-RoPE) keys somewhere
        unturned = [select_heavy(jnp.asarray(_turn(K[0, s, i * PS : (i + 1) * PS], i,
                                                   np.float32, invert=True)),
                                 jnp.asarray(table), group_size=PS)
                    for s, i in itertools.product(range(B), range(T // PS))]  # fmt: skip
        chosen = [np.asarray(_page(cache.k_base, int(TABLES[s, i])).heavy_rows)
                  for s, i in itertools.product(range(B), range(T // PS))]  # fmt: skip
        assert any(np.any(np.asarray(a) != b) for a, b in zip(unturned, chosen, strict=True))
    finally:
        kvq_jax.unregister_codec(keys)
        kvq_jax.unregister_codec(values)


def test_fork_and_swap_keep_positions(tmp_path):
    """A sequence swapped out, saved, loaded and swapped into other pages and another slot
    reads the same rows (positions are logical, not physical); a fork's child attends its
    shared prefix at the parent's positions. A cache keeping the keys as handed over refuses
    the saved sequence (its configuration differs)."""
    config = _config(max_seqs=3, num_pages=20)
    other = jnp.asarray([15, 11, 19, 12, 18], jnp.int32)
    cache = _fill(config, [T], tables=jnp.concatenate([TABLES, other[None]]))
    k0, v0 = paged_cache.gather(cache, seq_id=0, seq_len=T, block_table=TABLES[0], loop=0)
    seq = paged_cache.swap_out(cache, slot=0, pages=TABLES[0])
    offload.save_sequence(tmp_path / "s.safetensors", seq)
    loaded = offload.load_sequence(tmp_path / "s.safetensors", config)
    cache = paged_cache.swap_in(cache, loaded, slot=2, pages=other)
    k2, v2 = paged_cache.gather(cache, seq_id=2, seq_len=T, block_table=other, loop=0)
    assert np.asarray(k2).tobytes() == np.asarray(k0).tobytes()
    assert np.asarray(v2).tobytes() == np.asarray(v0).tobytes()
    with pytest.raises(ValueError, match="rope_theta"):
        offload.load_sequence(tmp_path / "s.safetensors", _config(max_seqs=3, num_pages=20,
                                                                  rope_theta=None))  # fmt: skip
    cache = paged_cache.fork(cache, parent=0, child=1, num_tokens=2 * PS)
    k1, _ = paged_cache.gather(cache, seq_id=1, seq_len=2 * PS, block_table=TABLES[0], loop=0)
    assert np.asarray(k1).tobytes() == np.asarray(k0)[: 2 * PS].tobytes()


def test_planted_defect_wrong_positions(monkeypatch):
    """The read checks can fail: the tables one position late (a planted defect in
    `key_rope`, static and traced positions alike: RoPE taken off at packing and put back at
    reading one position late) move every served key of a complete page."""
    config = _config(num_pages=13)  # a configuration of its own: traced with the defect
    key_rope = cache_state.key_rope

    def late(config, positions):
        return key_rope(config, positions + 1)

    monkeypatch.setattr(cache_state, "key_rope", late)
    cache = _fill(config, [T])
    with pytest.raises(AssertionError, match="keys of 0"):
        _check_reads(cache, config)


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_torch_cache_has_the_same_bytes(dtype):
    """The Torch paged cache given the same appends (a delta loop, chunks) holds the JAX
    cache's bytes, gathers the same rows and attends over them (float32 round-off against
    dense attention on its gathered rows); for a float32 cache its output is the JAX cache's
    (for a 16-bit one JAX turns keys in float32 and Torch in binary64, each rounded to the
    cache dtype: a key may differ by one ulp, so each is checked against its own dense
    reference, `_check_reads` for JAX); its device tables are `rope_tables`' for every
    position of a 32k context."""
    import torch

    from kvq_torch_bridge.cache import paged_attention as tattention
    from kvq_torch_bridge.cache import paged_cache as tpc
    from kvq_torch_bridge.codecs.rope import rope_at as torch_rope_at

    cos, sin = torch_rope_at(torch.arange(32768), 128, 1e6)
    want = rope_tables(32768, 128, 1e6)
    assert cos.numpy().tobytes() == want[0].tobytes() and sin.numpy().tobytes() == want[1].tobytes()
    config = _config(dtype=dtype, num_loops=2, k_residual_format="int2", v_residual_format="int2")
    jcache, tcache = paged_cache.init_cache(config), tpc.init_cache(config)
    ids = np.arange(B, dtype=np.int32)
    tables = np.array(TABLES)  # writable: Torch wraps it
    for a, b in itertools.pairwise(np.cumsum([0, 37, 1, 112])):
        for loop in range(2):
            k, v = (x[loop, :, a:b].astype(config.dtype) for x in (K, V))
            kw = dict(block_tables=tables, seq_ids=ids, loop=loop)
            jcache = paged_cache.append(jcache, k, v, **kw)
            tk, tv = (torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
                      if dtype == "bfloat16" else torch.from_numpy(x) for x in (k, v))  # fmt: skip
            tcache = tpc.append(tcache, tk, tv, **kw)
    jleaves = jax.tree.leaves(jcache)
    tleaves = torch.utils._pytree.tree_leaves(tcache)
    assert len(jleaves) == len(tleaves)
    for i, (a, b) in enumerate(zip(jleaves, tleaves, strict=True)):
        b = b.view(torch.uint16) if b.dtype == torch.bfloat16 else b
        a = np.asarray(a)
        a = a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a
        assert a.tobytes() == b.numpy().tobytes(), f"leaf {i}"
    q = RNG.standard_normal((B, 2 * H, D)).astype(np.float32)
    lens = np.asarray([T, T - 40], np.int32)
    for loop in range(2):
        rows = []
        for s in range(B):
            jk, _ = paged_cache.gather(jcache, seq_id=s, seq_len=T, block_table=TABLES[s],
                                       loop=loop)  # fmt: skip
            tk, tv = tpc.gather(tcache, seq_id=s, seq_len=T, block_table=tables[s], loop=loop)
            rows.append([x.float().numpy() for x in (tk, tv)])
            tk = tk.view(torch.uint16) if dtype == "bfloat16" else tk
            jk = np.asarray(jk)
            jk = jk.view(np.uint16) if dtype == "bfloat16" else jk
            assert jk.tobytes() == tk.numpy().tobytes(), f"gathered keys of {s}, loop {loop}"
        tq, tt, tl = (torch.from_numpy(a) for a in (q, tables, lens))
        tout = tattention.paged_decode_attention(tq, tcache, tt, tl, loop=loop).numpy()
        k_rows, v_rows = (jnp.asarray(np.stack(x)) for x in zip(*rows, strict=True))
        dense = dense_decode_attention(q, k_rows, v_rows, jnp.asarray(lens))
        np.testing.assert_allclose(tout, np.asarray(dense), rtol=1e-5, atol=1e-5)
        if dtype == "float32":
            out = paged_decode_attention(q, jcache, TABLES, jnp.asarray(lens), loop=loop)
            np.testing.assert_allclose(tout, np.asarray(out), rtol=1e-5, atol=1e-5)
        else:  # the JAX cache against its own reference
            _check_reads(jcache, config, loop=loop)


def test_kernels_and_config():
    """The fused attention kernel takes a pre-RoPE cache (RoPE goes back in registers; its
    numbers: tests/kernels/test_paged_attention.py); bad bases are refused naming the field;
    the base travels in the saved configuration."""
    config = _config(head_dim=64, page_size=64)
    q = jax.ShapeDtypeStruct((1, 2 * H, 64), jnp.float32)
    cache = jax.eval_shape(lambda: paged_cache.init_cache(config))
    assert attention_api.config_support(q, cache, None) is None
    for bad in (0.0, -1.0, float("nan"), float("inf"), "1e4", True):
        with pytest.raises(ValueError, match=r"PagedCacheConfig\.rope_theta"):
            _config(rope_theta=bad)
    with pytest.raises(ValueError, match="even head_dim"):
        _config(head_dim=15)
    assert '"rope_theta": 10000.0' in offload.config_metadata(_config())
    assert "rope_theta" not in offload.config_metadata(_config(rope_theta=None))
