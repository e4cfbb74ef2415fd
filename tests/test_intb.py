"""INTB (FORMAT.md section 2b) around the codecs: the bit-table calibration against brute
force, argument errors at trace time, the paged cache and kernels with an INTB key format.
(The oracle comparisons are in test_intb_oracle.py, Torch in test_intb_torch.py.)"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_bytes

import kvq_jax
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.calibration import (
    allocate_bits,
    group_span_power,
    intb_bit_table,
    query_energy,
)
from kvq_jax.core.layouts import intb_name
from kvq_jax.formats.intb import IntBCodec
from kvq_jax.paged_cache import append, gather, init_cache

TABLE = ((1, 3, 8, 4, 2, 6, 5, 3), (4, 4, 4, 4, 4, 4, 4, 4))  # 32 bits per head: W = 4


@pytest.fixture(scope="module")
def codec():
    codec = kvq_jax.register_codec(IntBCodec(TABLE), replace=True)
    yield codec
    kvq_jax.unregister_codec(codec.name)


def objective(weight, table):
    return float(np.sum(np.asarray(weight) / (2.0 ** np.asarray(table) - 1) ** 2))


@pytest.mark.parametrize("seed", range(6))
def test_allocation_is_the_brute_force_optimum(seed):
    """Every table of widths 1..8 summing to 16 over 4 channels, enumerated: the greedy
    allocation reaches the least weighted error (weights spanning 6 decades)."""
    rng = np.random.default_rng(seed)
    weight = 10.0 ** rng.uniform(-3, 3, (2, 4))
    table = allocate_bits(weight, mean_bits=4)
    for head in range(2):
        best = min(
            objective(weight[head], t)
            for t in itertools.product(range(1, 9), repeat=4)
            if sum(t) == 16
        )
        assert sum(table[head]) == 16
        assert objective(weight[head], table[head]) == pytest.approx(best, rel=1e-12)


def test_calibration_weights_are_query_energy_times_span_power():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 10, 2, 8))
    queries = rng.standard_normal((2, 10, 6, 8))
    energy = query_energy(queries, 2)  # 3 query heads per KV head
    np.testing.assert_allclose(energy[1], (queries[:, :, 3:6] ** 2).mean(axis=(0, 1)).sum(0))
    spans = group_span_power(keys, 4)  # groups of tokens 0-3, 4-7, 8-9 per sample
    groups = [keys[:, 0:4], keys[:, 4:8], keys[:, 8:10]]
    expected = np.mean([(g.max(1) - g.min(1)) ** 2 for g in groups], axis=(0, 1))
    np.testing.assert_allclose(spans, expected)
    # a channel that queries weight 100x more gets the most bits
    queries[..., 5] *= 10
    table = np.asarray(intb_bit_table(keys, queries, mean_bits=4, group_size=4))
    assert (table[:, 5] == table.max(axis=1)).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(mean_bits=4.25), ValueError, "multiple of 8"),
        (dict(mean_bits=9), ValueError, "multiple of 8"),
        (dict(min_bits=0), ValueError, "min_bits"),
        (dict(max_bits=9), ValueError, "max_bits"),
    ],
)
def test_allocation_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        allocate_bits(np.ones((1, 16)), **kwargs)
    with pytest.raises(ValueError, match="weight"):
        allocate_bits(np.full((1, 16), np.nan))


def test_pack_errors_name_the_argument_at_trace_time(codec):
    x = jax.ShapeDtypeStruct((8, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="axis must be 'tokens'"):
        jax.eval_shape(
            lambda v: kvq_jax.pack_kv(v, kind="key", format=codec.name, axis="channels"), x
        )
    bad = jax.ShapeDtypeStruct((8, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="values must have H=2 heads and D=8"):
        jax.eval_shape(lambda v: kvq_jax.pack_kv(v, kind="key", format=codec.name), bad)
    with pytest.raises(ValueError, match="group_size"):
        jax.eval_shape(lambda v: kvq_jax.pack_kv(v, kind="key", format=codec.name, group_size=0), x)


def test_name_is_a_function_of_the_table():
    assert intb_name(TABLE) == intb_name(np.array(TABLE)) == IntBCodec(TABLE).name
    other = (TABLE[1], TABLE[0])
    assert intb_name(other) != intb_name(TABLE)
    assert IntBCodec(TABLE, name="mine").name == "mine"


def test_storage_is_the_formula(codec):
    x = np.random.default_rng(1).standard_normal((128, 2, 8)).astype(np.float32)
    packed = kvq_jax.pack_kv(x, kind="key", format=codec.name)
    assert packed.codes.shape == (128, 2, 4)
    assert packed.bits_per_element == 8 * 4 / 8 + 32 / 64


def test_paged_cache_with_intb_keys_matches_the_codec_per_page(codec):
    """Keys INTB (base and residual), values INT4, 2 loops: every complete page of the
    gathered loop-1 keys is the residual chain of `pack_kv` on that page's rows; the kernels
    decline the configuration (the XLA path serves it)."""
    config = PagedCacheConfig(
        num_pages=4, page_size=8, num_heads=2, head_dim=8, num_loops=2, max_seqs=1,
        k_base_format=codec.name, k_residual_format=codec.name, k_group_size=8,
    )  # fmt: skip
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 1, 19, 2, 8)).astype(np.float32)
    x[1] = x[0] + 0.1 * rng.standard_normal((1, 19, 2, 8))
    table = jnp.asarray([[3, 1, 0, 2]], jnp.int32)
    ids = jnp.zeros(1, jnp.int32)
    cache = init_cache(config)
    for loop in range(2):
        cache = append(
            cache, jnp.asarray(x[loop]), jnp.asarray(x[loop]),
            block_tables=table, seq_ids=ids, loop=loop,
        )  # fmt: skip
    k, _ = gather(cache, seq_id=0, seq_len=19, block_table=table[0], loop=1)
    expected = x[1, 0].copy()  # the partial page stays raw in staging
    for i in range(2):
        rows = x[:, 0, 8 * i : 8 * i + 8]
        r0 = kvq_jax.unpack_kv(
            kvq_jax.pack_kv(rows[0], kind="key", format=codec.name, group_size=8)
        )
        d = np.asarray(rows[1] - np.asarray(r0), np.float32)
        r1 = np.asarray(r0) + np.asarray(
            kvq_jax.unpack_kv(kvq_jax.pack_kv(d, kind="key", format=codec.name, group_size=8))
        )
        expected[8 * i : 8 * i + 8] = r1.astype(np.float32)
    assert_same_bytes(np.asarray(k), expected, "gather loop 1")


def test_every_kernel_declines_intb_with_the_reason():
    """INTB has no kernel decoder or packer: each kernel's config_support says so for a
    configuration its other checks accept (D = 64, page 64), and the XLA path serves it."""
    from kvq_jax.kernels.page_pack import config_support as pack_support
    from kvq_jax.kernels.page_reconstruct import config_support as reconstruct_support
    from kvq_jax.kernels.paged_attention import config_support as attention_support

    codec = kvq_jax.register_codec(IntBCodec([[4] * 64, [3, 5] * 32]), replace=True)
    try:
        config = PagedCacheConfig(
            num_pages=2, page_size=64, num_heads=2, head_dim=64, k_base_format=codec.name
        )
        cache = jax.eval_shape(lambda: init_cache(config))
        q = jax.ShapeDtypeStruct((1, 4, 64), jnp.float32)
        table = jax.ShapeDtypeStruct((1, 2), jnp.int32)
        assert "has no kernel decoder" in attention_support(q, cache, table)
        assert "has no kernel decoder" in reconstruct_support(config, "key")
        assert reconstruct_support(config, "value") is None  # INT4 values: the kernel's
        reason = pack_support((2, 64, 2, 64), jnp.float32, kind="key", format=codec.name)
        assert "has no page-pack kernel" in reason
    finally:
        kvq_jax.unregister_codec(codec.name)
