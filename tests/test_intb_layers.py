"""INTB with one bit table per model layer (`IntBLayersCodec`, FORMAT.md section 2b): layer l's
bytes are the INTB bytes of table l, judged against the plain-Python oracle of that table (and
the JAX codec of the table alone), with the layer a traced index; the traced stream maps equal
the static ones; the paged cache with such a key format equals, byte for byte, a cache whose
keys use the layer's own INTB format; bad tables and a missing layer are errors naming the
argument. (The engine's one-compile layer scan over these caches: test_engine.py.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bytes, assert_same_values

import kvq_jax
from kvq_jax import oracle
from kvq_jax.cache import paged_cache
from kvq_jax.codecs.formats.intb import (
    IntBCodec,
    IntBLayersCodec,
    register_layer_tables,
    register_table,
)
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.kernels.paged_attention.api import paged_decode_attention

F32 = np.dtype(np.float32)


def _table(rng, h: int, d: int, total: int):
    """A random [h, d] table of widths 1..8, every row summing to `total` bits."""
    rows = []
    for _ in range(h):
        row = np.ones(d, np.int64)
        while row.sum() < total:
            i = rng.integers(d)
            if row[i] < 8:
                row[i] += 1
        rows.append(tuple(int(b) for b in row))
    return tuple(rows)


RNG = np.random.default_rng(20261205)
#: Three layers of [2, 8] tables, 32 bits per head row (W = 4), widths spread over 1..8.
TABLES = tuple(_table(RNG, 2, 8, 32) for _ in range(3))


@pytest.fixture(scope="module")
def name():
    name = register_layer_tables(TABLES)
    yield name
    kvq_jax.unregister_codec(name)


def test_traced_layer_maps_equal_the_static_maps_of_its_table():
    """`IntBLayersCodec.maps` at a traced layer (one compiled function for every layer) is
    `IntBCodec`'s static maps of that layer's table."""
    rng = np.random.default_rng(5)
    tables = [_table(rng, 3, 12, 40) for _ in range(4)]
    codec = IntBLayersCodec(tables)
    maps = jax.jit(codec.maps)
    for layer, table in enumerate(tables):
        levels, stream, code = maps(jnp.int32(layer))
        static = IntBCodec(table)
        np.testing.assert_array_equal(levels, static.levels())
        for got, want in zip((*stream, *code), (*static.stream_maps(), *static.code_starts()),
                             strict=True):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("group_size", [1, 3, 16])
def test_each_layer_is_the_oracle_of_its_table(name, group_size):
    """Layer l (traced under jit, and a Python int eagerly) packs to the oracle's INTB bytes of
    table l and decodes to the oracle's values."""
    x = (np.random.default_rng(group_size).standard_normal((16, 2, 8)) * 3).astype(F32)
    x[3, 1, 2] = np.nan
    pack = jax.jit(
        lambda x, layer: kvq_jax.pack_kv(
            x, kind="key", format=name, group_size=group_size, layer=layer
        )
    )
    for layer, table in enumerate(TABLES):
        expected = oracle.pack(x, format="intb", kind="key", bits=table, group_size=group_size)
        for packed in (pack(x, jnp.int32(layer)),
                       kvq_jax.pack_kv(x, kind="key", format=name, group_size=group_size,
                                       layer=layer)):  # fmt: skip
            assert packed.format == name and set(packed.arrays) == set(expected.arrays)
            for field, array in expected.arrays.items():
                assert_same_bytes(np.asarray(packed.arrays[field]), array, f"{layer} {field}")
            got = jax.jit(kvq_jax.unpack_kv)(packed, layer=jnp.int32(layer))
            assert_same_values(np.asarray(got), oracle.unpack(expected, F32), f"layer {layer}")


def test_another_layers_table_gives_other_bytes(name):
    """The layer index matters: layer 1's bytes are not layer 0's (tables of one width)."""
    x = np.random.default_rng(1).standard_normal((8, 2, 8)).astype(F32)
    p0, p1 = (kvq_jax.pack_kv(x, kind="key", format=name, group_size=8, layer=i) for i in (0, 1))
    assert not np.array_equal(np.asarray(p0.codes), np.asarray(p1.codes))


def test_missing_layer_and_bad_tables_are_errors_naming_them(name):
    x = jnp.ones((4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"layer: format .* one INTB bit table per model layer"):
        kvq_jax.pack_kv(x, kind="key", format=name)
    packed = kvq_jax.pack_kv(x, kind="key", format=name, layer=0)
    with pytest.raises(ValueError, match="layer"):
        kvq_jax.unpack_kv(packed)
    with pytest.raises(ValueError, match="one row width"):
        IntBLayersCodec([TABLES[0], ((8,) * 8, (8,) * 8)])
    with pytest.raises(ValueError, match=r"tables\[1\]: bits must hold widths in 1..8"):
        IntBLayersCodec([TABLES[0], ((0, 8, 8, 8, 8, 0, 0, 0), (4,) * 8)])
    with pytest.raises(ValueError, match="tables must hold one INTB bit table per layer"):
        IntBLayersCodec([])
    # the name is a function of the tables, and one format serves any of its layers
    assert IntBLayersCodec(TABLES).name == name != IntBLayersCodec(TABLES[::-1]).name


def _configs(name, layer):
    common = dict(num_pages=6, page_size=8, num_heads=2, head_dim=8, num_loops=2, max_seqs=2,
                  v_base_format="int4", v_residual_format="int4", k_group_size=8)  # fmt: skip
    plain = register_table(TABLES[layer])
    return (
        PagedCacheConfig(k_base_format=name, k_residual_format=name, **common),
        PagedCacheConfig(k_base_format=plain, k_residual_format=plain, **common),
    )


@pytest.mark.parametrize("layer", [0, 2])
def test_paged_cache_at_a_layer_is_the_cache_of_its_own_format(name, layer):
    """Appends, page reconstruction and decode attention of a cache read as layer l equal, byte
    for byte, those of a cache whose keys are stored in table l's own INTB format."""
    layered, plain = _configs(name, layer)
    assert layered.layered and not plain.layered
    cache = paged_cache.init_cache(layered)
    assert int(cache.layer) == 0 and paged_cache.init_cache(plain).layer is None
    cache = paged_cache.at_layer(cache, jnp.int32(layer))
    ref = paged_cache.init_cache(plain)
    rng = np.random.default_rng(layer)
    tables = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
    ids = jnp.asarray([0, 1], jnp.int32)
    for n in (13, 1, 6):
        for loop in range(2):
            k, v = (jnp.asarray(rng.standard_normal((2, n, 2, 8)), jnp.float32) for _ in "kv")
            cache = paged_cache.append(cache, k, v, block_tables=tables, seq_ids=ids, loop=loop)
            ref = paged_cache.append(ref, k, v, block_tables=tables, seq_ids=ids, loop=loop)
    got = {n: a for n, _, a in cache.page_arrays()} | dict(cache.slot_arrays())
    want = {n: a for n, _, a in ref.page_arrays()} | dict(ref.slot_arrays())
    assert sorted(got) == sorted(want)
    for key in want:
        assert_same_bytes(np.asarray(got[key]), np.asarray(want[key]), key)
    pages = jnp.arange(6, dtype=jnp.int32)
    for loop in range(2):
        want = np.asarray(paged_cache.decode_pages(ref, "key", pages, loop=loop))
        for backend in ("xla", "pallas_interpret"):  # the kernel reads the layer's code maps
            got = paged_cache.decode_pages(cache, "key", pages, loop=loop, backend=backend)
            assert_same_bytes(np.asarray(got), want, f"loop {loop} {backend}")
        q = jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.float32)
        lens = jnp.asarray([20, 17], jnp.int32)
        want = np.asarray(paged_decode_attention(q, ref, tables, lens, loop=loop, seq_ids=ids))
        out = paged_decode_attention(q, cache, tables, lens, loop=loop, seq_ids=ids)
        np.testing.assert_array_equal(np.asarray(out), want)
    # read as another layer, the same pages decode to other keys
    other = paged_cache.at_layer(cache, jnp.int32((layer + 1) % 3))
    assert not np.array_equal(
        np.asarray(paged_cache.decode_pages(other, "key", pages, loop=0)),
        np.asarray(paged_cache.decode_pages(cache, "key", pages, loop=0)),
    )


def test_the_kernels_serve_the_per_layer_format(name):
    from kvq_jax.kernels.page_pack.api import config_support as pack_support
    from kvq_jax.kernels.page_reconstruct.api import config_support as reconstruct_support

    layered, _ = _configs(name, 0)
    assert pack_support((2, 8, 2, 8), jnp.float32, kind="key", format=name) is None
    assert reconstruct_support(layered, "key") is None
    cache = paged_cache.init_cache(dataclasses.replace(layered))
    assert cache.layer is not None
