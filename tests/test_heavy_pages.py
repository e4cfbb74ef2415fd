"""Heavy-row pages (FORMAT.md 5a in the paged cache): a heavy-row format (`HeavyCodec`) packs
each page as `pack_heavy` does, the rows chosen from the key page with the layer's mean-query
table and used by the value page of the same tokens. Checked against `select_heavy` /
`pack_heavy` / `unpack_heavy` (themselves checked against the oracle in test_heavy.py) and
dense attention on rows rebuilt from them."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import unshifted_payload_positions

import kvq_jax
from kvq_jax.cache import paged_cache
from kvq_jax.cache.paged_attention import dense_decode_attention, paged_decode_attention
from kvq_jax.codecs.api import pack_kv, unpack_kv
from kvq_jax.codecs.formats.heavy_rows import HeavyCodec, payload_positions, register_heavy
from kvq_jax.codecs.heavy import pack_heavy, select_heavy, unpack_heavy
from kvq_jax.codecs.registry import get_codec
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.kernels.page_reconstruct import config_support as reconstruct_support
from kvq_jax.kernels.page_reconstruct import xla as page_xla

B, T, H, D, PS, G = 2, 150, 2, 16, 32, 32
F32 = np.dtype(np.float32)
RNG = np.random.default_rng(20261206)
#: Three layers' mean-query tables [N, H, R, D] (R = 3 query heads per KV head).
TABLES = RNG.standard_normal((3, H, 3, D)).astype(ml_dtypes.bfloat16)
K = RNG.standard_normal((2, B, T, H, D)).astype(np.float32)  # [loop, B, T, H, D]
V = RNG.standard_normal((2, B, T, H, D)).astype(np.float32) * 2


@pytest.fixture(scope="module")
def formats():
    """(keys: INT4 payload, one table per layer; keys: one table; values: HINT4 payload)."""
    names = (
        register_heavy("int4", G, TABLES),
        register_heavy("int4", G, TABLES[1]),
        register_heavy("hint4", G),
    )
    yield names
    for name in names:
        kvq_jax.unregister_codec(name)


def _same(got, heavy, where):
    """A cache page / HeavyCodec PackedKV equals `pack_heavy`'s HeavyKV, byte for byte."""
    pairs = [(getattr(got, f), getattr(heavy.payload, f)) for f in heavy.payload.arrays]
    pairs += [(got.heavy_rows, heavy.rows), (got.heavy_codes, heavy.codes),
              (got.heavy_minimum, heavy.minimum), (got.heavy_scale, heavy.scale)]  # fmt: skip
    for a, b in pairs:
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), where


@pytest.mark.thin(2)
@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("t", [100, 97, 64])
def test_codec_is_pack_heavy(formats, jit, t):
    """HeavyCodec: keys choose their rows with the layer's table (a traced layer under jit),
    values take them; bytes and decode equal pack_heavy / unpack_heavy (T = 97: a last group
    of one row, decoded by merging; the others by spreading the payload codes)."""
    layered, _, values = formats
    k, v = K[0, 0, :t], V[0, 0, :t]
    pack = jax.jit(pack_kv, static_argnames=("kind", "format")) if jit else pack_kv
    for layer in range(3):
        rows = select_heavy(k, TABLES[layer], group_size=G)
        got = pack(k, kind="key", format=layered, layer=jnp.int32(layer) if jit else layer)
        want = pack_heavy(k, rows, kind="key", format="int4", group_size=G)
        _same(got, want, f"keys, layer {layer}")
        np.testing.assert_array_equal(
            unpack_kv(got, F32, layer), unpack_heavy(want, F32), err_msg=f"layer {layer}"
        )
        codec = get_codec(values)
        got_v = codec.pack(jnp.asarray(v), kind="value", axis="channels", group_size=64,
                           rows=rows)  # fmt: skip
        _same(got_v, pack_heavy(v, rows, kind="value", format="hint4", group_size=G), "values")
    other = pack_kv(k, kind="key", format=layered, layer=0)
    assert np.asarray(other.heavy_rows).tobytes() != np.asarray(got.heavy_rows).tobytes()


def test_unmerged_parts_are_unpack_heavys_rows(formats):
    """`HeavyCodec.unpack_parts` (what decode attention reads): the payload rows put at
    `payload_positions` and the heavy rows at g*G + rows equal unpack_heavy's rows (keys;
    values in the rotated space against `unpack_rotated`), every row placed once; T = 97:
    three whole groups and a last group of one row."""
    layered, _, values = formats
    t = 97
    k, v = K[0, 0, :t], V[0, 0, :t]
    rows = select_heavy(k, TABLES[1], group_size=G)
    for fmt, x, kind, rotated in ((layered, k, "key", False), (values, v, "value", True)):
        codec = get_codec(fmt)
        packed = pack_kv(x, kind=kind, format=fmt, layer=1) if kind == "key" else codec.pack(
            jnp.asarray(x), kind=kind, axis="channels", group_size=64, rows=rows)  # fmt: skip
        rest, heavy, got_rows = codec.unpack_parts(packed, 1, rotated=rotated)
        np.testing.assert_array_equal(got_rows, np.asarray(rows, np.int32))
        out = np.full((t, H, D), np.nan, np.float32)
        where = np.asarray(payload_positions(got_rows, G, t))  # [T - nG, H]
        for h in range(H):
            out[where[:, h], h] = np.asarray(rest)[:, h]
            out[np.arange(len(rows)) * G + np.asarray(rows)[:, h], h] = np.asarray(heavy)[:, h]
        want = codec.unpack_rotated(packed) if rotated else unpack_kv(packed, F32, 1)
        np.testing.assert_array_equal(out, np.asarray(want), err_msg=kind)


def test_codec_errors(formats):
    layered, _, values = formats
    with pytest.raises(ValueError, match=r"layer: format .* one mean-query table per model layer"):
        pack_kv(K[0, 0, :64], kind="key", format=layered)
    with pytest.raises(ValueError, match="mean-query tables are for H = 2, D = 16; got H = 1"):
        pack_kv(K[0, 0, :64, :1], kind="key", format=layered, layer=0)
    with pytest.raises(ValueError, match="holds no mean-query table: pass rows"):
        pack_kv(V[0, 0, :64], kind="value", format=values)
    with pytest.raises(TypeError, match="tables must be a bfloat16"):
        HeavyCodec(get_codec("int4"), G, np.zeros((H, 3, D), np.float32))
    with pytest.raises(TypeError, match="base must be a non-heavy"):
        HeavyCodec(get_codec(values), G)
    with pytest.raises(ValueError, match=r"group_size must be in 2\.\.256"):
        HeavyCodec(get_codec("int4"), 1)


def _config(k_format, v_format, **kw):
    kw = dict(num_pages=12, page_size=PS, num_heads=H, head_dim=D, max_seqs=B, sink=1) | kw
    return PagedCacheConfig(k_base_format=k_format, v_base_format=v_format, **kw)


TABLES_BS = jnp.asarray(1 + np.arange(10).reshape(B, 5)[:, ::-1], jnp.int32)  # reversed pages


def _fill(config, chunks, layer=None, loops=1):
    cache = paged_cache.init_cache(config)
    if layer is not None:
        cache = paged_cache.at_layer(cache, layer)
    ids = jnp.arange(B, dtype=jnp.int32)
    edges = np.cumsum([0, *chunks])
    for a, b in itertools.pairwise(edges):
        for loop in range(loops):
            cache = paged_cache.append(cache, K[loop, :, a:b], V[loop, :, a:b],
                                       block_tables=TABLES_BS, seq_ids=ids, loop=loop)  # fmt: skip
    return cache


def _rebuilt(table, loop=0, v_format="hint4"):
    """K, V [B, T, H, D] as the cache should serve them, from the public functions: every
    full page pack_heavy'd with rows chosen from its key page, the partial page and the sink
    row raw."""
    out = []
    for kind, x, fmt in (("key", K[loop], "int4"), ("value", V[loop], v_format)):
        y = x.copy()
        for s in range(B):
            for i in range(T // PS):
                rows = select_heavy(K[loop, s, i * PS : (i + 1) * PS], table, group_size=G)
                page = x[s, i * PS : (i + 1) * PS]
                packed = pack_heavy(page, rows, kind=kind, format=fmt, group_size=G)
                y[s, i * PS : (i + 1) * PS] = unpack_heavy(packed, F32)
        y[:, :1] = x[:, :1]
        out.append(y)
    return out


@pytest.mark.thin(2)
@pytest.mark.parametrize("chunks", [[T], [37, 1, 112]])
@pytest.mark.parametrize("layer", [None, 2])
def test_pages_and_attention(formats, chunks, layer):
    """Every completed page holds pack_heavy's bytes (rows from its key page with the layer's
    table); decode attention equals dense attention on the rows rebuilt from pack_heavy /
    unpack_heavy (float32 round-off)."""
    layered, single, values = formats
    key_format, table = (single, TABLES[1]) if layer is None else (layered, TABLES[layer])
    config = _config(key_format, values)
    assert config.layered == (layer is not None)
    cache = _fill(config, chunks, layer)
    for s in range(B):
        for i in range(T // PS):
            page = int(TABLES_BS[s, i])
            kp, vp = K[0, s, i * PS : (i + 1) * PS], V[0, s, i * PS : (i + 1) * PS]
            rows = select_heavy(kp, table, group_size=G)
            for plane, x, fmt, kind in ((cache.k_base, kp, "int4", "key"),
                                        (cache.v_base, vp, "hint4", "value")):  # fmt: skip
                got = jax.tree.map(lambda a, page=page: a[page], plane)
                want = pack_heavy(x, rows, kind=kind, format=fmt, group_size=G)
                _same(got, want, f"{kind} page {i} of sequence {s}")
    q = RNG.standard_normal((B, 2 * H, D)).astype(np.float32)
    lens = jnp.asarray([T, T - 40], jnp.int32)
    # HINT4 payload: values attended in the rotated space, heavy rows rotated
    assert page_xla.rotated_chain(cache.loop_chain("value", 0))
    k_ref, v_ref = _rebuilt(table)
    out = paged_decode_attention(q, cache, TABLES_BS, lens, loop=0)
    dense = dense_decode_attention(q, jnp.asarray(k_ref), jnp.asarray(v_ref), lens)
    np.testing.assert_allclose(out, dense, rtol=1e-5, atol=1e-5)
    k_got, v_got = paged_cache.gather(cache, seq_id=0, seq_len=T, block_table=TABLES_BS[0],
                                      loop=0)  # fmt: skip
    np.testing.assert_array_equal(k_got, k_ref[0])
    np.testing.assert_array_equal(v_got, v_ref[0])


def test_absolute_loop_chooses_its_own_rows(formats):
    """A heavy-row loop stored absolute (loop 1) packs loop 1's pages with rows chosen from
    loop 1's keys; attention at loop 1 equals dense attention on those rows."""
    _, single, values = formats
    config = _config(single, values, num_loops=2, k_residual_format=single,
                     v_residual_format=values, k_absolute=(1,), v_absolute=(1,))  # fmt: skip
    cache = _fill(config, [40, 110], loops=2)
    k_ref, v_ref = _rebuilt(TABLES[1], loop=1)
    q = RNG.standard_normal((B, 2 * H, D)).astype(np.float32)
    lens = jnp.asarray([T, T - 7], jnp.int32)
    out = paged_decode_attention(q, cache, TABLES_BS, lens, loop=1)
    dense = dense_decode_attention(q, jnp.asarray(k_ref), jnp.asarray(v_ref), lens)
    np.testing.assert_allclose(out, dense, rtol=1e-5, atol=1e-5)


def _plant_value_rows(monkeypatch):
    """A planted defect: value pages choose rows from the values, not their keys."""
    original = paged_cache._store_pages

    def store(cache, kind, pages, exited_rows, plan, loop, backend, rows=None):
        if kind == "value" and rows is not None:
            rows = jax.vmap(lambda p: get_codec(cache.config.loop_pack_args("key", loop)[
                "format"]).select_rows(p, cache.layer))(pages)  # fmt: skip
        return original(cache, kind, pages, exited_rows, plan, loop, backend, rows)

    monkeypatch.setattr(paged_cache, "_store_pages", store)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_planted_defect_values_choose_their_own_rows(formats, monkeypatch):
    _plant_value_rows(monkeypatch)
    jax.clear_caches()
    try:
        test_pages_and_attention(formats, [T], None)
    finally:
        jax.clear_caches()


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_planted_defect_attention_ignores_the_heavy_row_shift(formats, monkeypatch):
    """Decode attention reads heavy pages unmerged (payload rows and heavy rows as stored,
    each masked at its own position): payload positions that forget the heavy row before
    them mask the wrong rows at the sink and the sequence's end."""
    from kvq_jax.kernels.paged_attention import xla as attention_xla

    monkeypatch.setattr(attention_xla, "payload_positions", unshifted_payload_positions)
    jax.clear_caches()
    try:
        test_pages_and_attention(formats, [T], None)
    finally:
        jax.clear_caches()


def test_config_refuses_what_is_not_served(formats):
    _, single, values = formats
    with pytest.raises(ValueError, match="a delta loop: heavy rows are stored in loops stored"):
        _config(single, values, num_loops=2, k_residual_format=single, v_residual_format="int4")
    with pytest.raises(ValueError, match="not served with adaptive_exit"):
        _config(single, values, adaptive_exit=True)
    with pytest.raises(ValueError, match=r"heavy-row values .* take the rows chosen from their"):
        _config("int4", values)
    with pytest.raises(ValueError, match="keys choose the heavy rows"):
        _config(values, values)
    with pytest.raises(ValueError, match=r"page_size 48 must be a multiple of .* heavy group 32"):
        _config(single, values, page_size=48)
    # page reconstruction's kernel takes the INT4 heavy keys, not the HINT4 heavy values
    assert reconstruct_support(_config(single, values), "key") is None
    reason = reconstruct_support(_config(single, values), "value")
    assert reason is not None and values in reason


def test_swap_and_disk_round_trip(formats, tmp_path):
    """A sequence of heavy-row pages swapped out, saved, loaded and swapped into other pages
    and another slot reads back what it held (the heavy fields travel with the pages)."""
    from kvq_jax.core.offload import load_sequence, save_sequence

    layered, _, values = formats
    config = _config(layered, values)
    cache = _fill(config, [T], layer=1)
    full = T // PS
    seq = paged_cache.swap_out(cache, slot=0, pages=TABLES_BS[0, :full])
    assert any("heavy_codes" in name for name in seq.arrays)
    save_sequence(tmp_path / "seq.safetensors", seq)
    loaded = load_sequence(tmp_path / "seq.safetensors", config)
    fresh = paged_cache.at_layer(paged_cache.init_cache(config), 1)
    fresh = paged_cache.swap_in(fresh, loaded, slot=1, pages=np.asarray(TABLES_BS[1, :full]))
    want = paged_cache.gather(cache, seq_id=0, seq_len=T, block_table=TABLES_BS[0], loop=0)
    got = paged_cache.gather(fresh, seq_id=1, seq_len=T, block_table=TABLES_BS[1], loop=0)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
