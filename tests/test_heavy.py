"""Heavy rows (docs/FORMAT.md section 5a) on every stack and in the report, hooks and engine.

The oracle's selection is checked against an independent numpy computation (on data where
every float32 sum is exact) and hand-worked ties; its storage against hand-worked rows; the
jitted and eager JAX paths and the Torch path against the oracle byte for byte (selection,
payload, heavy rows, decode; special values, partial and empty groups); the report's heavy
row against explicit `heavy_kv` calls, anchored on the oracle for one slice; the model hook
against `heavy_kv` on the K/V it saw; the engine refuses heavy policies; bad arguments raise
naming the argument. Planted defects (strict xfails) show the checks can fail.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_packed_equal, assert_same_bytes, assert_same_values, numpy_to_torch

import kvq_jax as kq
from kvq_jax import oracle
from kvq_jax.codecs.heavy import heavy_kv, heavy_scores
from kvq_jax.core import calibration
from kvq_jax.core.policies import POLICIES, Policy, serving_support
from kvq_jax.core.rope import rope_tables

torch = pytest.importorskip("torch")
import kvq_torch_bridge as kt  # noqa: E402
from kvq_torch_bridge.codecs._dtypes import to_numpy  # noqa: E402
from kvq_torch_bridge.codecs.heavy import heavy_kv as torch_heavy_kv  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
DTYPES = (BF16, F16, F32)


def _table(rng, h=2, r=3, d=8):
    return rng.standard_normal((h, r, d)).astype(BF16)


def _kv(rng, shape, dtype):
    x = rng.standard_normal(shape) + rng.standard_normal((1, *shape[1:]))
    return x.astype(np.float32).astype(dtype)


# ------------------------------------------------------------------------------------------
# the oracle


def test_oracle_selection_equals_numpy_on_exact_data():
    """Small-integer keys and dyadic table entries: every float32 product and sum is exact,
    so the selection is numpy's argmax of float64 dots (max over the query heads)."""
    rng = np.random.default_rng(0)
    keys = rng.integers(-8, 8, size=(100, 2, 16)).astype(np.float32)
    table = (rng.integers(-16, 16, size=(2, 3, 16)) / 4).astype(BF16)
    rows = oracle.select_heavy(keys, table, group_size=32)
    score = np.einsum("thd,hrd->thr", keys.astype(np.float64), table.astype(np.float64)).max(-1)
    want = np.stack([np.argmax(score[g : g + 32], axis=0) for g in range(0, 100, 32)])
    assert rows.dtype == np.uint8 and rows.shape == (4, 2)
    assert (rows == want).all()


def test_oracle_selection_ties_nan_and_bf16_rounding():
    table = np.ones((1, 1, 4), BF16)
    keys = np.zeros((6, 1, 4), np.float32)
    keys[1] = keys[3] = 1.0  # a tie between rows 1 and 3: the first wins
    keys[4, 0, 0] = np.nan  # a NaN score never wins
    assert oracle.select_heavy(keys, table, group_size=6).tolist() == [[1]]
    keys[:] = np.nan  # all NaN: -inf everywhere, row 0
    assert oracle.select_heavy(keys, table, group_size=3).tolist() == [[0], [0]]
    # keys are rounded to bfloat16 first: 1 + 2^-9 rounds to 1 (ties to even), a tie with 1
    keys = np.array([1.0, 1.0 + 2.0**-9], np.float32).reshape(2, 1, 1)
    assert oracle.select_heavy(keys, np.ones((1, 1, 1), BF16), group_size=2).tolist() == [[0]]


def test_oracle_storage_hand_worked():
    """T = 5, G = 4: groups [0..3] and [4]. Head 0 keeps rows 2 and 0 heavy; the payload holds
    rows 0, 1, 3 of group 0 (rows past a partial group's end are clamped: group 1 has one row,
    so its payload part is empty)."""
    x = np.arange(5 * 1 * 4, dtype=np.float32).reshape(5, 1, 4)
    enc = oracle.pack_heavy(x, np.array([[2], [7]]), format="fp8_e4m3", kind="value", group_size=4)
    assert enc.arrays["rows"].tolist() == [[2], [0]]
    assert enc.payload.shape == (3, 1, 4)
    rest = oracle.unpack(enc.payload, np.float32)
    np.testing.assert_allclose(rest[:, 0, 0], [0, 4, 12], rtol=0.04)  # FP8: 3 mantissa bits
    # heavy row 2 = [8, 9, 10, 11]: min 8, scale 3/255, codes 0, 85, 170, 255
    assert enc.arrays["codes"][0, 0].tolist() == [0, 85, 170, 255]
    assert enc.arrays["minimum"][0, 0] == 8 and enc.arrays["scale"][0, 0] == np.float16(3 / 255)
    out = oracle.unpack_heavy(enc)
    np.testing.assert_allclose(out, x, rtol=0.04)
    scale16 = np.float32(np.float16(3 / 255))  # decode: code * f16 scale + f16 minimum
    want = np.array([0, 85, 170, 255], np.float32) * scale16 + np.float32(8)
    assert out[2, 0].tolist() == want.tolist()


def test_heavy_rows_lower_the_decode_error_of_a_sink_like_row():
    """The reason it exists: one row per group that the mean query attends to, much larger
    than the rest, sets its INT4 group's range; kept INT8 it is nearly exact and the others
    quantize finer."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 1, 16)).astype(np.float32)
    x[17] *= 30.0
    table = np.ones((1, 1, 16), BF16)
    keys = x.copy()
    keys[17] = 10.0  # the keys point at row 17
    rows = oracle.select_heavy(keys, table, group_size=64)
    assert rows.tolist() == [[17]]
    plain = oracle.unpack(oracle.pack(x, format="int4", kind="key"))
    heavy = oracle.unpack_heavy(oracle.pack_heavy(x, rows, format="int4", kind="key"))
    rest = np.arange(64) != 17
    assert np.abs(heavy[17] - x[17]).max() < 0.02 * np.abs(x[17]).max()
    assert np.linalg.norm((heavy - x)[rest]) < 0.2 * np.linalg.norm((plain - x)[rest])


# ------------------------------------------------------------------------------------------
# JAX (jit, eager) and Torch against the oracle

CASES = [
    # (T, G, kind, format, base_group_size)
    (70, 16, "key", "int4", None),
    (70, 16, "value", "hint4", None),
    (64, 64, "key", "hint2", None),
    (33, 2, "value", "fp8_e4m3", None),
    (5, 8, "value", "nvfp4", None),
    (40, 8, "key", "int4", 3),
    (0, 4, "key", "int4", None),
]


def _check(values, keys, table, t_g, kind, fmt, base, rows=None, eager=True):
    g = t_g
    want_rows = oracle.select_heavy(keys, table, group_size=g) if rows is None else rows
    enc = oracle.pack_heavy(
        values, want_rows, format=fmt, kind=kind, group_size=g, base_group_size=base
    )
    modes = (False, True) if eager else (False,)  # eager (op by op) is slow: one dtype
    if rows is None:
        for eager in modes:
            if eager:
                with jax.disable_jit():
                    got = kq.select_heavy(keys, table, group_size=g)
            else:
                got = kq.select_heavy(keys, table, group_size=g)
            assert_same_bytes(np.asarray(got), want_rows, "jax rows")
        got = kt.select_heavy(numpy_to_torch(keys), numpy_to_torch(table), group_size=g)
        assert_same_bytes(to_numpy(got), want_rows, "torch rows")
    args = dict(kind=kind, format=fmt, group_size=g, base_group_size=base)
    for eager in modes:
        if eager:
            with jax.disable_jit():
                packed = kq.pack_heavy(values, want_rows, **args)
                decoded = [kq.unpack_heavy(packed, dt) for dt in DTYPES]
        else:
            packed = kq.pack_heavy(values, want_rows, **args)
            decoded = [kq.unpack_heavy(packed, dt) for dt in DTYPES]
        assert_packed_equal(packed.payload, enc.payload.arrays, "jax payload")
        for name, array in enc.arrays.items():
            assert_same_bytes(np.asarray(getattr(packed, name)), array, f"jax {name}")
        for dt, got in zip(DTYPES, decoded, strict=True):
            assert_same_values(np.asarray(got), oracle.unpack_heavy(enc, dt), f"jax as {dt}")
    tp = kt.pack_heavy(numpy_to_torch(values), numpy_to_torch(want_rows), **args)
    for name, array in enc.payload.arrays.items():
        assert_same_bytes(to_numpy(getattr(tp.payload, name)), array, f"torch payload {name}")
    for name, array in enc.arrays.items():
        assert_same_bytes(to_numpy(getattr(tp, name)), array, f"torch {name}")
    for dt in DTYPES:
        got = to_numpy(kt.unpack_heavy(tp, dt))
        assert_same_values(got, oracle.unpack_heavy(enc, dt), f"torch as {dt}")
    return enc, packed, tp


@pytest.mark.thin(3)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t, g, kind, fmt, base", CASES, ids=str)
def test_jax_and_torch_equal_the_oracle(t, g, kind, fmt, base, dtype):
    rng = np.random.default_rng(t + g)
    d = 16
    keys, values = _kv(rng, (t, 2, d), dtype), _kv(rng, (t, 2, d), dtype)
    _, packed, tp = _check(
        values, keys, _table(rng, 2, 3, d), g, kind, fmt, base, eager=dtype == F32
    )
    n = -(-t // g)
    assert packed.storage_bytes == tp.storage_bytes
    assert packed.storage_bytes == packed.payload.storage_bytes + n * 2 * (d + 5)
    assert packed.shape == (t, 2, d) and packed.dtype == dtype and packed.group_size == g
    if base is None and packed.payload.axis == "tokens":
        assert packed.payload.group_size == g - 1


def test_special_values_and_clamped_rows_on_every_stack():
    """NaN and inf in heavy and payload rows, out-of-range rows (clamped), a zero row."""
    rng = np.random.default_rng(5)
    values = _kv(rng, (21, 2, 8), F32)
    values[3, 0, 2] = np.nan  # a heavy row (row 3 of group 0, head 0)
    values[9, 1, 0] = np.inf  # a payload row
    values[16:] = 0.0  # the partial group: all zeros
    rows = np.array([[3, 250], [1, 0], [9, 9]], np.uint8)  # 250 -> 7, 9 -> 4 (clamped)
    enc, _, _ = _check(values, values, None, 8, "value", "int4", None, rows=rows)
    assert enc.arrays["rows"].tolist() == [[3, 7], [1, 0], [4, 4]]
    assert np.isnan(enc.arrays["scale"][0, 0]) and np.isfinite(enc.arrays["scale"][0, 1])
    out = oracle.unpack_heavy(enc)
    assert np.isnan(out[3, 0]).all() and np.isnan(out[9, 1]).all()
    assert (out[16:] == 0).all()


@pytest.mark.parametrize("pre_rope", [False, True], ids=["post-rope", "pre-rope"])
def test_heavy_kv_is_the_same_on_both_stacks_with_a_window(pre_rope):
    rng = np.random.default_rng(6)
    k, v = _kv(rng, (150, 3, 16), BF16), _kv(rng, (150, 3, 16), BF16)
    table = _table(rng, 3, 3, 16)
    window = kq.Window(sink=4, recent=16)
    args = dict(key_format="int4", value_format="hint4", group_size=64, window=window)
    rope = rope_tables(150, 16, 10000.0) if pre_rope else None
    j_rope = None if rope is None else tuple(map(jnp.asarray, rope))
    t_rope = None if rope is None else tuple(map(torch.from_numpy, rope))
    k_hat, v_hat, hk, hv = heavy_kv(
        jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), rope=j_rope, **args
    )
    tk, tv, _, _ = torch_heavy_kv(
        numpy_to_torch(k), numpy_to_torch(v), numpy_to_torch(table), rope=t_rope, **args
    )
    assert_same_bytes(to_numpy(tk), np.asarray(k_hat), "k_hat")
    assert_same_bytes(to_numpy(tv), np.asarray(v_hat), "v_hat")
    # window rows raw; the middle is pack_heavy of the middle with rows from its keys
    assert_same_bytes(np.asarray(k_hat)[:4], k[:4], "sink rows")
    assert_same_bytes(np.asarray(v_hat)[-16:], v[-16:], "recent rows")
    rows = oracle.select_heavy(k[4:134], table, group_size=64)  # from the RoPE'd keys
    assert_same_bytes(np.asarray(hk.rows), rows, "rows from the middle keys")
    assert_same_bytes(np.asarray(hv.rows), rows, "the values use the keys' rows")
    enc = oracle.pack_heavy(v[4:134], rows, format="hint4", kind="value")
    assert_same_values(np.asarray(v_hat)[4:134], oracle.unpack_heavy(enc), "middle")
    if pre_rope:  # the stored keys are the keys rotated back (positions 0 .. T-1)
        cos, sin = (a.astype(np.float64) for a in rope)
        x = k.astype(np.float64)
        pre = x * cos - np.concatenate([-x[..., 8:], x[..., :8]], -1) * sin
        enc = oracle.pack_heavy(pre.astype(np.float32).astype(BF16)[4:134], rows,
                                format="int4", kind="key")  # fmt: skip
        assert_same_bytes(np.asarray(hk.codes), enc.arrays["codes"], "pre-RoPE heavy codes")
        assert np.abs(np.asarray(k_hat, np.float32) - k.astype(np.float32)).max() < 0.5


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="planted defect: last on ties")
def test_planted_defect_last_maximum_is_caught():
    keys = np.zeros((8, 1, 4), np.float32)
    keys[2] = keys[5] = 1.0
    want = oracle.select_heavy(keys, np.ones((1, 1, 4), BF16), group_size=8)
    last = 7 - np.argmax(np.asarray(heavy_scores(keys, jnp.ones((1, 1, 4), jnp.bfloat16)))[::-1], 0)
    assert_same_bytes(last.astype(np.uint8).reshape(1, 1), want, "rows")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="planted defect: row kept")
def test_planted_defect_payload_keeping_the_heavy_row_is_caught():
    rng = np.random.default_rng(7)
    x = _kv(rng, (32, 2, 8), F32)
    rows = np.array([[5, 30]], np.uint8)
    enc = oracle.pack_heavy(x, rows, format="int4", kind="key", group_size=32)
    wrong = kq.pack_kv(x[:31], kind="key", format="int4", group_size=31)  # no row dropped
    assert_packed_equal(wrong, enc.payload.arrays, "payload")


# ------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(group_size=1), ValueError, "group_size must be in 2..256"),
        (dict(group_size=257), ValueError, "group_size must be in 2..256"),
        (dict(group_size=True), TypeError, "group_size must be an int"),
        (dict(table=np.ones((2, 3, 8), np.float32)), TypeError, "table must have dtype bfloat16"),
        (dict(table=np.ones((3, 3, 8), BF16)), ValueError, r"table must be \[H=2"),
        (
            dict(keys=np.ones((8, 2, 12), np.float32), table=np.ones((2, 1, 12), BF16)),
            ValueError,
            "D a power of two",
        ),
        (dict(keys=np.ones((8, 2), np.float32)), ValueError, "keys must have rank 3"),
    ],
)
def test_bad_selection_arguments_name_the_argument(kwargs, error, match):
    args = dict(keys=np.ones((8, 2, 8), np.float32), table=np.ones((2, 3, 8), BF16), group_size=4)
    args.update(kwargs)
    with pytest.raises(error, match=match) as jax_error:
        kq.select_heavy(args["keys"], args["table"], group_size=args["group_size"])
    with pytest.raises(error, match=match) as torch_error:
        kt.select_heavy(
            numpy_to_torch(args["keys"]),
            numpy_to_torch(args["table"]),
            group_size=args["group_size"],
        )
    assert str(jax_error.value) == str(torch_error.value)


@pytest.mark.parametrize(
    "rows, kwargs, error, match",
    [
        (np.zeros((2, 2), np.uint8), {}, ValueError, r"rows must have shape \(3, 2\)"),
        (np.zeros((3, 2), np.float32), {}, TypeError, "rows must have an integer dtype"),
        (np.zeros((3, 2), np.uint8), dict(format="int5"), ValueError, "format must be one of"),
        (np.zeros((3, 2), np.uint8), dict(kind="query"), ValueError, "kind must be one of"),
        (np.zeros((3, 2), np.uint8), dict(group_size=300), ValueError, "group_size must be in"),
    ],
)
def test_bad_storage_arguments_name_the_argument(rows, kwargs, error, match):
    x = np.ones((9, 2, 8), np.float32)
    args = {"kind": "key", "format": "int4", "group_size": 4, **kwargs}
    with pytest.raises(error, match=match) as jax_error:
        kq.pack_heavy(x, rows, **args)
    with pytest.raises(error, match=match) as torch_error:
        kt.pack_heavy(numpy_to_torch(x), numpy_to_torch(rows), **args)
    # the same words; a list of registered formats differs by what each stack's registry
    # holds when the test runs (INTB formats are registered per stack on first use)
    same = [re.sub(r"\[[^\]]*\]", "[...]", str(e.value)) for e in (jax_error, torch_error)]
    assert same[0] == same[1]


# ------------------------------------------------------------------------------------------
# calibration, policy, report, hooks, engine


def test_mean_query_table_and_its_file(tmp_path):
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 40, 6, 8)).astype(np.float32)
    table = calibration.mean_query_table(q, 2)
    assert table.dtype == BF16 and table.shape == (2, 3, 8)
    want = q[:, 4:].mean(axis=(0, 1)).reshape(2, 3, 8).astype(BF16)
    assert_same_bytes(table, want, "mean query")
    tables = calibration.KeyTables(("m",), {0: ((4,) * 8,) * 2}, 64, "test", mean_query={0: table})
    calibration.save_key_tables(tmp_path / "t.npz", tables)
    back = calibration.load_key_tables(tmp_path / "t.npz")
    assert_same_bytes(back.heavy_table("p", 0), table, "round trip")
    with pytest.raises(ValueError, match="no mean-query table for layer 1"):
        back.heavy_table("p", 1)
    plain = dataclasses.replace(tables, mean_query=None)
    with pytest.raises(ValueError, match="has no mean-query tables"):
        plain.heavy_table("p", 0)


def test_shipped_heavy_tables_fit_smollm2():
    tables = calibration.get_key_tables("smollm2-heavy")
    assert sorted(tables.tables) == list(range(30)) and sorted(tables.mean_query) == list(range(30))
    assert all(sum(row) == 240 for t in tables.tables.values() for row in t)  # 3.75 bits
    assert all(m.shape == (3, 3, 64) and m.dtype == BF16 for m in tables.mean_query.values())


def test_policy_checks():
    with pytest.raises(ValueError, match="heavy rows need key_tables"):
        Policy("p", "int4", "int4", heavy=64)
    with pytest.raises(ValueError, match=r"must be in 2\.\.256"):
        Policy("p", "intb", "intb", v_base_format="int4", key_tables="x", heavy=1)
    with pytest.raises(TypeError, match="group size"):
        Policy("p", "intb", "intb", v_base_format="int4", key_tables="x", heavy=True)
    policy = POLICIES["intb-hint4-heavy-smollm2"]
    with pytest.raises(ValueError, match="stores heavy rows"):
        policy.loop_kwargs("value")
    assert policy.absolute_loops("key", 4) == (1, 2, 3)
    with pytest.raises(ValueError, match="heavy_table"):
        policy.for_key_format("int4")
    with pytest.raises(ValueError, match="implemented for heavy-row policies"):
        Policy("p", "intb", "intb", v_base_format="int4", key_tables="x", pre_rope=True)
    table = np.ones((3, 3, 64), BF16)
    with pytest.raises(ValueError, match="must not be calibrated for a RoPE base"):
        policy.for_key_format("int4", table, rope_theta=1e4)
    pre = POLICIES["intb-prerope-hint4-heavy-smollm2"]
    with pytest.raises(ValueError, match="must give a RoPE base"):
        pre.for_key_format("int4", table)
    assert pre.for_key_format("int4", table, 1e5).rope_theta == 1e5


def _oracle_heavy_slice(k, v, table, bits, window, theta):
    """The scalar oracle's reconstruction of one layer's K/V [T, H, D] under a heavy policy:
    window rows raw, the middle rows' heavy rows chosen from the keys (FORMAT.md 5a), keys
    stored before RoPE when `theta` is given (5b), INTB keys, HINT4 values, G = 64."""
    t = k.shape[0]
    head, mid, _ = window.split_sizes(t) if window is not None else (0, t, 0)
    middle = slice(head, head + mid)
    rows = oracle.select_heavy(k[middle], table, group_size=64)
    out = []
    for kind, x, fmt, extra in (("key", k, "intb", {"bits": bits}), ("value", v, "hint4", {})):
        stored = x[middle]
        if kind == "key" and theta is not None:
            stored = oracle.invert_rope(stored, theta, offset=head).astype(x.dtype)
        enc = oracle.pack_heavy(stored, rows, format=fmt, kind=kind, group_size=64, **extra)
        x_hat = oracle.unpack_heavy(enc, F32)
        if kind == "key" and theta is not None:
            x_hat = oracle.apply_rope(x_hat, theta, offset=head)
        full = x.copy()
        full[middle] = x_hat.astype(x.dtype)
        out.append(full)
    return out


@pytest.mark.parametrize(
    "name",
    [
        "intb-prerope-hint4-heavy-smollm2",
        pytest.param("intb-hint4-heavy-smollm2+win", marks=pytest.mark.slow),
    ],
)
def test_report_row_equals_explicit_heavy_calls(name):
    """A heavy policy's row on the embedded capture: K/V bytes and errors equal
    per-(window, loop, layer) heavy_kv calls with each layer's shipped tables (keys rotated
    back before packing for the pre-RoPE policy)."""
    from kvq_jax.codecs.formats.intb import register_table
    from kvq_jax.report.capture import load_capture, select
    from kvq_jax.report.evaluate import evaluate

    capture = select(load_capture(), windows=[0])
    policy = POLICIES[name]
    (row,) = evaluate(capture, [policy], show_progress=False)
    tables = calibration.get_key_tables(policy.key_tables)
    rope = None
    if policy.pre_rope:
        rope = tuple(map(jnp.asarray, rope_tables(capture.num_tokens, 64, tables.rope_theta)))
    k, v = np.asarray(capture.k), np.asarray(capture.v)
    k_hat, v_hat = np.empty_like(k, np.float64), np.empty_like(v, np.float64)
    k_bytes = v_bytes = 0
    window_bytes = 20 * 3 * 64 * 2 if policy.window else 0
    for n, layer in enumerate(capture.meta["layers"]):
        fmt = register_table(tables.table(layer))
        table = jnp.asarray(tables.heavy_table("p", layer))
        for loop in range(capture.num_loops):
            kh, vh, hk, hv = heavy_kv(
                jnp.asarray(k[0, loop, n]), jnp.asarray(v[0, loop, n]), table, key_format=fmt,
                value_format="hint4", group_size=64, window=policy.window, rope=rope,
            )  # fmt: skip
            k_hat[0, loop, n], v_hat[0, loop, n] = np.asarray(kh), np.asarray(vh)
            k_bytes += hk.storage_bytes + window_bytes
            v_bytes += hv.storage_bytes + window_bytes
    assert (row.k_storage_bytes, row.v_storage_bytes) == (k_bytes, v_bytes)
    for x, x_hat, got in ((k, k_hat, row.k_rel_l2), (v, v_hat, row.v_rel_l2)):
        x = x.astype(np.float64)
        assert got == pytest.approx(np.sqrt(np.sum((x_hat - x) ** 2) / np.sum(x**2)), rel=1e-5)
    assert row.k_absolute_loops == [1, 2, 3]
    # the heavy_kv calls above anchored on the oracle for one (loop, layer) slice, so the row is
    # checked against the scalar reference and not only against the function evaluate calls
    layer = capture.meta["layers"][0]
    want_k, want_v = _oracle_heavy_slice(
        k[0, 0, 0], v[0, 0, 0], tables.heavy_table("p", layer), tables.table(layer),
        policy.window, tables.rope_theta if policy.pre_rope else None,
    )  # fmt: skip
    np.testing.assert_array_equal(k_hat[0, 0, 0], want_k.astype(np.float64))
    np.testing.assert_array_equal(v_hat[0, 0, 0], want_v.astype(np.float64))
    # bits from the bytes counted here (codes, metadata, heavy rows, window rows), not a number
    # copied from the README
    assert row.bits_per_element == pytest.approx(8.0 * (k_bytes + v_bytes) / (k.size + v.size))
    if policy.pre_rope:  # not the post-RoPE policy's numbers
        (post,) = evaluate(capture, [POLICIES["intb-hint4-heavy-smollm2"]], show_progress=False)
        assert post.k_rel_l2 != pytest.approx(row.k_rel_l2, rel=1e-2)


@pytest.mark.parametrize("pre_rope", [False, True], ids=["post-rope", "pre-rope"])
def test_hook_codes_heavy_rows_as_heavy_kv(monkeypatch, pre_rope):
    """A tiny model under a heavy policy: each layer's K/V passed on to attention equal
    torch heavy_kv of the K/V that reached the hook (both coders give the same logits)."""
    transformers = pytest.importorskip("transformers")
    from kvq_torch_bridge.model_eval.evaluate import evaluate_policies
    from kvq_torch_bridge.model_eval.loading import LoadedModel

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    rng = np.random.default_rng(9)
    tables = calibration.KeyTables(
        ("tiny",),
        {i: ((4,) * 16,) * 2 for i in range(2)},
        64,
        "test",
        mean_query={i: _table(rng, 2, 2, 16) for i in range(2)},
        rope_theta=10000.0 if pre_rope else None,
    )
    monkeypatch.setattr(calibration, "get_key_tables", lambda name: tables)
    policy = Policy("h", "intb", "intb", group_size=64, v_base_format="hint4",
                    v_residual_format="hint4", key_tables="tiny", heavy=8,
                    pre_rope=pre_rope)  # fmt: skip
    loaded = LoadedModel(model=model, tokenizer=None, loops=1, name="tiny", source={},
                         emulated=False)  # fmt: skip
    windows = rng.integers(3, 64, size=(2, 40))
    res = {
        c: evaluate_policies(loaded, windows, [policy], predictions=4, codec=c, record=True)
        for c in ("torch", "jax")
    }
    assert torch.equal(res["torch"].results[-1].logits, res["jax"].results[-1].logits)
    records = res["torch"].results[-1].quantizer.records
    for layer in range(2):
        rec = records[(layer, 0)]
        table = torch.tensor(tables.mean_query[layer].astype(np.float32), dtype=torch.bfloat16)
        fmt = kt.IntBCodec(tables.tables[layer]).name
        rope = None
        if pre_rope:
            rope = tuple(map(torch.from_numpy, rope_tables(rec["k_in"].shape[1], 16, 10000.0)))
        for b in range(2):
            k_hat, v_hat, _, _ = torch_heavy_kv(
                rec["k_in"][b], rec["v_in"][b], table, key_format=fmt, value_format="hint4",
                group_size=8, rope=rope,
            )  # fmt: skip
            assert torch.equal(k_hat, rec["k_out"][b]) and torch.equal(v_hat, rec["v_out"][b])
            assert not torch.equal(rec["k_in"][b], rec["k_out"][b])


def test_pre_rope_heavy_policies_are_served_per_layer():
    """Heavy rows and keys before RoPE are served (tests/test_heavy_pages.py,
    test_pre_rope_pages.py, test_engine_reference.py) through each layer's policy: the
    policy with key tables itself has no cache configuration."""
    from kvq_jax.engine import engine

    policy = POLICIES["intb-prerope-hint4-heavy-smollm2"]
    assert serving_support(policy, num_loops=4) and serving_support(policy, num_loops=1)
    with pytest.raises(ValueError, match="take one layer's policy"):
        engine.cache_config_for(
            policy, num_pages=2, page_size=64, num_heads=3, head_dim=64, dtype="bfloat16",
            num_loops=1, max_seqs=1,
        )  # fmt: skip


def test_rope_tables_and_both_stacks():
    """cos/sin equal the float64 formula rounded once; JAX and Torch rotate to the same bits;
    the inverse undoes the rotation to float32 rounding."""
    from kvq_jax.codecs.rope import apply_rope, invert_rope
    from kvq_torch_bridge.codecs import rope as trope

    cos, sin = rope_tables(50, 8, 10000.0, offset=3)
    angle = np.arange(3, 53)[:, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)
    angle = np.concatenate([angle, angle], 1)[:, None]
    assert_same_bytes(cos, np.cos(angle).astype(np.float32), "cos")
    assert_same_bytes(sin, np.sin(angle).astype(np.float32), "sin")
    x = np.random.default_rng(10).standard_normal((50, 2, 8)).astype(np.float32)
    for fn, tfn in ((apply_rope, trope.apply_rope), (invert_rope, trope.invert_rope)):
        want = to_numpy(tfn(*map(torch.from_numpy, (x, cos, sin))))
        assert_same_bytes(np.asarray(jax.jit(fn)(x, cos, sin)), want, fn.__name__)
    back = np.asarray(apply_rope(invert_rope(x, cos, sin), cos, sin))
    np.testing.assert_allclose(back, x, atol=1e-6)
    with pytest.raises(ValueError, match="even head dim"):
        rope_tables(4, 7, 10000.0)


def test_rope_on_both_stacks_equals_the_oracle():
    from kvq_jax.codecs.rope import apply_rope, invert_rope
    from kvq_torch_bridge.codecs import rope as trope

    rng = np.random.default_rng(12)
    for dtype in DTYPES:
        x = (rng.standard_normal((21, 2, 16)) * 3).astype(dtype)
        x[3, 0] = 0.0
        x[4, 1, :4] = np.float32(6e4).astype(dtype)
        cos, sin = rope_tables(21, 16, 10000.0, offset=5)
        for name, fn, tfn in (
            ("apply_rope", apply_rope, trope.apply_rope),
            ("invert_rope", invert_rope, trope.invert_rope),
        ):
            want = getattr(oracle, name)(x, 10000.0, offset=5)
            assert_same_bytes(np.asarray(jax.jit(fn)(x, cos, sin)), want, f"jax {name}")
            got = tfn(numpy_to_torch(x), *map(torch.from_numpy, (cos, sin)))
            assert_same_bytes(to_numpy(got), want, f"torch {name}")


def test_pre_rope_tables_weight_keys_before_rope():
    """intb_bit_table(rope_theta=...) allocates on the rotated-back keys, with channel c's
    query energy mixed with its partner's by the share of aligned distances (a numpy
    re-derivation), and differs from the post-RoPE table."""
    from kvq_jax.core.rope import rope_aware_weights

    rng = np.random.default_rng(11)
    t, d = 96, 16
    k = rng.standard_normal((2, t, 1, d)) * np.linspace(0.2, 3, d)
    q = rng.standard_normal((2, t, 2, d)) * np.linspace(3, 0.2, d)
    got = calibration.intb_bit_table(k, q, rope_theta=500.0, group_size=32)
    angle = np.arange(t)[:, None] * 500.0 ** (-np.arange(0, d, 2) / d)
    cos = np.cos(np.concatenate([angle, angle], 1))[:, None].astype(np.float32)
    sin = np.sin(np.concatenate([angle, angle], 1))[:, None].astype(np.float32)

    def unrope(x):
        return x * cos - np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin

    kp, qp = unrope(k), unrope(q)
    energy = (qp**2).mean(axis=(0, 1)).sum(axis=0)[None]
    dist = np.arange(16, t)
    inv = 500.0 ** (-np.arange(0, d, 2) / d)
    a = np.tile((np.cos(inv[:, None] * dist[None]) ** 2).mean(1), 2)
    assert np.allclose(a, rope_aware_weights(d, 500.0, t))
    energy = a * energy + (1 - a) * np.concatenate([energy[:, d // 2 :], energy[:, : d // 2]], 1)
    spans = np.mean(
        [(kp[:, s : s + 32].max(1) - kp[:, s : s + 32].min(1)) ** 2 for s in range(0, t, 32)],
        axis=(0, 1),
    )
    assert got == calibration.allocate_bits(energy * spans)
    assert got != calibration.intb_bit_table(k, q, group_size=32)


# ------------------------------------------------------------------------------------------
# conformance vectors


def test_heavy_vectors_are_the_oracles_and_pass_on_both_stacks():
    from kvq_jax.conformance.heavy import check_heavy, generate_heavy, load_heavy_vectors

    shipped = load_heavy_vectors()
    fresh = generate_heavy()
    assert [c.name for c in shipped] == [c.name for c in fresh] and len(shipped) >= 20
    for old, new in zip(shipped, fresh, strict=True):
        assert_same_bytes(new.rows, old.rows, f"{old.name} rows")
        for name, array in old.arrays.items():
            assert_same_bytes(new.arrays[name], array, f"{old.name} {name}")
        assert_same_bytes(new.decoded, old.decoded, f"{old.name} decoded")
    assert {c.format for c in shipped} >= {"int4", "hint4", "int2", "nvfp4", "fp8_e4m3"}
    assert {c.keys.dtype.name for c in shipped} == {"bfloat16", "float16", "float32"}
    for stack, mod, kind in (("jax", kq, "jax"), ("torch", kt, "torch")):
        results = check_heavy(
            mod.select_heavy, mod.pack_heavy, unpack_fn=mod.unpack_heavy, input_kind=kind
        )
        assert all(r.passed for r in results), (stack, [r.detail for r in results if not r.passed])

    def last_row(keys, table, *, group_size):  # a wrong selection: the last row of each group
        rows = np.asarray(kq.select_heavy(keys, table, group_size=group_size))
        return np.full_like(rows, group_size - 1)

    failed = {
        r.name for r in check_heavy(last_row, kq.pack_heavy, input_kind="jax") if not r.passed
    }
    assert failed == {c.name for c in shipped if c.keys.shape[0]}


def test_kvq_conformance_runs_the_heavy_vectors(capsys):
    from kvq_jax.cli import commands as cli

    argv = ["conformance", "kvq_torch_bridge:pack_kv", "--input", "torch"]
    assert cli.main([*argv, "--heavy", "kvq_torch_bridge"]) == 0
    out = capsys.readouterr().out
    assert "heavy        int4" in out and "0 failed" in out
