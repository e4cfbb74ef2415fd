"""INTB (FORMAT.md section 2b) around the codecs: the bit-table calibration against brute
force, argument errors at trace time, the paged cache and kernels with an INTB key format,
and the report's per-layer key tables (intb-smollm2, `python -m kvq_jax.report.calibrate`).
(The oracle comparisons are in test_intb_oracle.py, Torch in test_intb_torch.py.)"""

from __future__ import annotations

import itertools
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_bytes

import kvq_jax
from kvq_jax.cache.paged_cache import append, gather, init_cache
from kvq_jax.cli import commands as cli
from kvq_jax.codecs.formats.intb import IntBCodec
from kvq_jax.core import policies as policies_module
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.calibration import (
    allocate_bits,
    group_span_power,
    intb_bit_table,
    load_key_tables,
    query_energy,
)
from kvq_jax.core.layouts import intb_name
from kvq_jax.core.policies import POLICIES, Policy
from kvq_jax.engine.engine import cache_config_for
from kvq_jax.report import calibrate
from kvq_jax.report import capture as cap
from kvq_jax.report.evaluate import evaluate
from kvq_jax.report.key_tables import get_key_tables, layer_policies

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
    gathered loop-1 keys is the residual chain of `pack_kv` on that page's rows."""
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


def test_the_kernels_serve_intb():
    """Page packing, page reconstruction and decode attention take INTB planes (tests/kernels
    checks their bytes and values)."""
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
        assert attention_support(q, cache, table) is None
        assert reconstruct_support(config, "key") is None
        assert reconstruct_support(config, "value") is None
        assert pack_support((2, 64, 2, 64), jnp.float32, kind="key", format=codec.name) is None
    finally:
        kvq_jax.unregister_codec(codec.name)


# --- per-layer key tables in the report -------------------------------------------------------


def _smol_capture(model="SmolLM2-135M-Instruct", layers=(2, 15, 28), windows=1, loops=2):
    """Random K/V/Q of SmolLM2's shape (3 KV heads, 9 query heads, dim 64), 128 tokens."""
    rng = np.random.default_rng(11)
    n = len(layers)

    def stack(heads, offset):
        x = rng.standard_normal((windows, loops, n, 128, heads, 64)) + offset * rng.standard_normal(
            (1, 1, n, 1, heads, 64)
        )
        return x.astype(ml_dtypes.bfloat16)

    meta = {"model": model, "layers": list(layers)}
    return cap.make_capture(stack(3, 2.0), stack(3, 0.0), stack(9, 1.0), meta=meta)


def _attention(q, k, v):
    """Causal GQA attention in float64: q [T, Hq, D], k, v [T, H, D] -> [T, Hq, D]."""
    t, hq, d = q.shape
    k, v = (np.repeat(x, hq // x.shape[1], axis=1) for x in (k, v))
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("hts,shd->thd", probs / probs.sum(-1, keepdims=True), v)


def _expected_keys(capture, layers):
    """(K storage bytes, K rel L2, K reconstruction) with the keys of capture layer n in the
    INTB format of model layer layers[n]'s shipped table, by explicit encode_loops calls."""
    tables = get_key_tables("smollm2")
    x = np.asarray(capture.k, np.float64)
    hat = np.empty_like(x)
    storage = 0
    for w in range(capture.num_windows):
        for n, layer in enumerate(layers):
            codec = IntBCodec(tables.table(layer))
            if codec.name not in kvq_jax.CODECS:
                kvq_jax.register_codec(codec)
            code = kvq_jax.encode_loops(
                capture.k[w, :, n], kind="key", base_format=codec.name,
                residual_format=codec.name, group_size=64,
            )  # fmt: skip
            storage += code.storage_bytes
            hat[w, :, n] = np.asarray(kvq_jax.decode_loops(code), np.float64)
    return storage, np.sqrt(np.sum((hat - x) ** 2) / np.sum(x**2)), hat


def test_report_runs_each_layer_under_its_own_table():
    """The intb-smollm2 row equals explicit per-layer codec calls (K bytes and error, V as
    INT4 G64, attention in float64), and a layer mix-up (every layer under layer 2's table)
    would give other numbers."""
    capture = _smol_capture()
    (row,) = evaluate(capture, [POLICIES["intb-smollm2"]], show_progress=False)
    storage, k_err, k_hat = _expected_keys(capture, [2, 15, 28])
    assert row.k_storage_bytes == storage
    assert row.k_rel_l2 == pytest.approx(k_err, rel=1e-5)
    assert row.bits_per_element == 4.5
    assert _expected_keys(capture, [2, 2, 2])[1] != pytest.approx(k_err, rel=1e-3)
    v_hat = np.empty(capture.v.shape, np.float64)
    for w in range(capture.num_windows):
        for n in range(capture.num_layers):
            code = kvq_jax.encode_loops(
                capture.v[w, :, n], kind="value", base_format="int4", residual_format="int4",
                group_size=64,
            )  # fmt: skip
            v_hat[w, :, n] = np.asarray(kvq_jax.decode_loops(code), np.float64)
    v = np.asarray(capture.v, np.float64)
    assert row.v_rel_l2 == pytest.approx(np.sqrt(np.sum((v_hat - v) ** 2) / np.sum(v**2)), rel=1e-5)
    err_sq = np.zeros((3, 9))
    ref_sq = np.zeros((3, 9))
    k, q = np.asarray(capture.k, np.float64), np.asarray(capture.q, np.float64)
    for i in range(2):
        for n in range(3):
            ref = _attention(q[0, i, n], k[0, i, n], v[0, i, n])
            got = _attention(q[0, i, n], k_hat[0, i, n], v_hat[0, i, n])
            err_sq[n] += np.sum((got - ref) ** 2, axis=(0, 2))
            ref_sq[n] += np.sum(ref**2, axis=(0, 2))
    np.testing.assert_allclose(row.attention_layer_head, np.sqrt(err_sq / ref_sq), rtol=2e-3)


def test_a_layer_subset_keeps_its_model_layers():
    capture = cap.select(_smol_capture(), layers=[1])
    assert capture.meta["layers"] == [15]
    (policy,) = layer_policies(POLICIES["intb-smollm2"], capture.meta, capture.k.shape)
    assert policy.base_format == IntBCodec(get_key_tables("smollm2").table(15)).name
    assert policy.v_base_format == "int4" and policy.key_tables is None


@pytest.mark.parametrize(
    ("meta", "shape", "match"),
    [
        ({"model": "fixture", "layers": [2]}, (1, 1, 1, 64, 3, 64), "key tables are for"),
        ({"model": "smollm2"}, (1, 1, 1, 64, 3, 64), "must list the model layer"),
        ({"model": "smollm2", "layers": [2, 3]}, (1, 1, 1, 64, 3, 64), "must list the model"),
        ({"model": "smollm2", "layers": [30]}, (1, 1, 1, 64, 3, 64), "layer 30 has no key"),
        ({"source": {"model": "smollm2"}, "layers": [2]}, (1, 1, 1, 64, 4, 64), r"\(4, 64\)"),
    ],
)
def test_tables_that_do_not_fit_the_capture_are_refused(meta, shape, match):
    with pytest.raises(ValueError, match=match):
        layer_policies(POLICIES["intb-smollm2"], meta, shape)


def test_report_skips_a_table_policy_on_other_models_and_refuses_it_when_asked(
    tmp_path, monkeypatch, capsys
):
    path = tmp_path / "other.npz"
    cap.save_capture(path, _smol_capture(model="fixture", layers=(0,)))
    few = {name: POLICIES[name] for name in ("bf16", "intb-smollm2")}
    monkeypatch.setattr(policies_module, "POLICIES", few)  # "all" = these two
    assert cli.main(["report", "--kv", str(path), "--policies", "all", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "skipping intb-smollm2: policy 'intb-smollm2': its key tables are for" in err
    assert "intb-smollm2" not in out and "bf16" in out
    rc = cli.main(["report", "--kv", str(path), "--policies", "intb-smollm2", "--no-progress"])
    _, err = capsys.readouterr()
    assert rc == 2 and "its key tables are for" in err and "Traceback" not in err


def test_calibrate_writes_the_tables_of_each_layer(tmp_path):
    capture = _smol_capture(layers=(4, 9), windows=2)
    src, out = tmp_path / "cap.npz", tmp_path / "tables.npz"
    cap.save_capture(src, capture)
    assert calibrate.main([str(src), str(out), "--models", "a,b", "--source", "test"]) == 0
    tables = load_key_tables(out)
    assert tables.models == ("a", "b") and tables.group_size == 64 and tables.source == "test"
    assert sorted(tables.tables) == [4, 9]
    for n, layer in enumerate((4, 9)):
        k = np.asarray(capture.k[:, 0, n], np.float32)
        q = np.asarray(capture.q[:, 0, n], np.float32)
        assert tables.table(layer) == intb_bit_table(k, q)
    assert calibrate.main([str(src), str(out), "--models", "a", "--mean-bits", "4.1"]) == 2


def test_shipped_tables_cover_smollm2_at_4_5_bits():
    tables = get_key_tables("smollm2")
    assert sorted(tables.tables) == list(range(30)) and tables.group_size == 64
    assert {"SmolLM2-135M-Instruct", "smollm2"} <= set(tables.models)
    for table in tables.tables.values():
        assert (
            np.asarray(table).shape == (3, 64)
            and np.asarray(table).sum(axis=1).tolist() == [256] * 3
        )


def test_key_table_policies_are_checked_or_refused_everywhere():
    policy = POLICIES["intb-smollm2"]
    with pytest.raises(ValueError, match="per-layer tables"):
        policy.loop_kwargs("key", 2)
    assert policy.loop_kwargs("value", 2)["base_format"] == "int4"
    with pytest.raises(ValueError, match="per-layer INTB tables"):
        cache_config_for(
            policy, num_pages=4, page_size=64, num_heads=3, head_dim=64, dtype="float32",
            num_loops=1, max_seqs=1,
        )  # fmt: skip
    from kvq_torch_bridge.model_eval.evaluate import check_key_tables
    from kvq_torch_bridge.model_eval.hooks import KVQuantizer

    def loaded(model, layers, kv_heads=3):
        config = types.SimpleNamespace(num_hidden_layers=layers, num_attention_heads=9,
                                       num_key_value_heads=kv_heads, hidden_size=576)  # fmt: skip
        return types.SimpleNamespace(
            source={"model": model}, name=model, model=types.SimpleNamespace(config=config)
        )

    assert check_key_tables(policy, loaded("smollm2", 30)) is get_key_tables("smollm2")
    with pytest.raises(ValueError, match=r"is for \(3, 64\) \(KV heads, head dim\)"):
        check_key_tables(policy, loaded("smollm2", 30, kv_heads=9))
    with pytest.raises(ValueError, match="its key tables are for"):
        check_key_tables(policy, loaded("tiny", 2))
    with pytest.raises(ValueError, match=r"no key table for layers \[30\]"):
        check_key_tables(policy, loaded("smollm2", 31))
    with pytest.raises(ValueError, match="per-layer key tables"):
        KVQuantizer(policy, None, base_implementation="eager")
    with pytest.raises(ValueError, match="names its value formats"):
        Policy("x", "intb", "intb", key_tables="smollm2")
    with pytest.raises(TypeError, match="key_tables"):
        Policy("x", "intb", "intb", v_base_format="int4", key_tables=3)


def test_conformance_vectors_cover_intb_and_catch_a_wrong_code():
    """The INTB vectors (oracle-made): both stacks pass them after registering each table;
    one flipped code bit fails exactly the non-empty cases."""
    import dataclasses

    import kvq_torch_bridge as kt
    from kvq_jax.codecs.formats.intb import register_table as jax_register
    from kvq_jax.conformance import check_pack, load_vectors
    from kvq_torch_bridge.codecs.formats.intb import register_table as torch_register

    cases = [c for c in load_vectors() if c.bits is not None]
    assert len(cases) >= 40 and {c.kind for c in cases} == {"key", "value"}
    widths = {b for c in cases for row in c.bits for b in row}
    assert widths == set(range(1, 9))
    for pack, unpack, kind, register in (
        (kvq_jax.pack_kv, kvq_jax.unpack_kv, "jax", jax_register),
        (kt.pack_kv, kt.unpack_kv, "torch", torch_register),
    ):
        results = check_pack(
            pack, unpack_fn=unpack, input_kind=kind, cases=cases, register_table=register
        )
        assert all(r.passed for r in results), (kind, [r.detail for r in results if not r.passed])

    def flipped(values, **kwargs):
        packed = kvq_jax.pack_kv(values, **kwargs)
        if packed.codes.size == 0:
            return packed
        return dataclasses.replace(packed, codes=packed.codes.at[(0,) * packed.codes.ndim].add(1))

    results = check_pack(flipped, cases=cases, register_table=jax_register)
    assert {r.name for r in results if not r.passed} == {c.name for c in cases if c.values.size}
