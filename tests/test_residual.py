"""Cross-loop residuals, loop stacks and the BF16 window, judged by the scalar oracle."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_packed_equal, assert_same_bytes, assert_trees_same_bytes

import kvq_jax as kq
from kvq_jax.oracle import residual as oracle_residual

FORMATS = ("int4", "nvfp4", "fp8_e4m3")
BF16 = np.dtype(ml_dtypes.bfloat16)
WINDOW = kq.Window(sink=4, recent=6)


def make_chain(loops=4, t=40, h=2, d=20, step=0.3, seed=0, dtype=BF16) -> np.ndarray:
    """[L, T, H, D]: loop 0 KV-like, each later loop = previous + step * noise."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h, d)).astype(np.float32) + rng.standard_normal((1, h, d)) * 2
    out = [x]
    for _ in range(loops - 1):
        out.append(out[-1] + step * rng.standard_normal((t, h, d)).astype(np.float32))
    return np.stack(out).astype(dtype)


def sparse_maps(t: int, seed: int = 0, window: kq.Window | None = None):
    """Loop 2 keeps ~25% of the rows, loop 3 a ~10% subset of those (0-based loops)."""
    rng = np.random.default_rng(seed)
    p2 = np.sort(rng.choice(t, size=max(1, t // 4), replace=False))
    p3 = np.sort(rng.choice(p2, size=max(1, t // 10), replace=False))
    if window is not None:
        head, _, tail = window.split_sizes(t)
        must = np.r_[np.arange(head), np.arange(t - tail, t)]
        p2, p3 = np.union1d(p2, must), np.union1d(p3, must)
    return [None, p2.astype(np.int32), p3.astype(np.int32)]


def rel_err(approx, ref) -> float:
    a, r = np.asarray(approx, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(a - r) / np.linalg.norm(r))


def assert_code_matches_oracle(code: kq.LoopCode, base, residuals, window=None):
    if window is None:
        assert_packed_equal(code.base, base.arrays, "base")
    else:
        assert_same_bytes(code.base.head, base.head, "base.head")
        assert_same_bytes(code.base.tail, base.tail, "base.tail")
        assert_packed_equal(code.base.middle, base.middle.arrays, "base.middle")
    assert len(code.residuals) == len(residuals)
    for i, (ours, theirs) in enumerate(zip(code.residuals, residuals, strict=True)):
        assert_packed_equal(ours.payload, theirs.payload.arrays, f"residual {i + 1}")
        for field in ("positions", "head", "tail"):
            if getattr(theirs, field) is None:
                assert getattr(ours, field) is None, f"residual {i + 1}.{field}"
            else:
                assert_same_bytes(getattr(ours, field), getattr(theirs, field), field)


# ------------------------------------------------------------------ the oracle decides


@pytest.mark.thin(2)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("base_format,residual_format", list(itertools.product(FORMATS, FORMATS)))
def test_chain_matches_oracle(base_format, residual_format, sparse):
    loops = make_chain()
    kind = "value" if sparse else "key"
    group_size = 16 if base_format != "fp8_e4m3" else None  # partial token groups (T = 40)
    positions = sparse_maps(loops.shape[1]) if sparse else None
    args = dict(
        kind=kind,
        base_format=base_format,
        residual_format=residual_format,
        group_size=group_size,
        positions=positions,
    )
    code = kq.encode_loops(loops, **args)
    base, residuals = oracle_residual.encode_loops(loops, **args)
    assert_code_matches_oracle(code, base, residuals)
    assert_same_bytes(kq.decode_loops(code), oracle_residual.decode_loops(base, residuals))


@pytest.mark.parametrize("residual_format", FORMATS)
def test_window_sparse_chain_matches_oracle(residual_format):
    loops = make_chain(t=48, seed=3)
    positions = sparse_maps(48, seed=3, window=WINDOW)
    for p in positions[1:]:
        kq.validate_positions(p, 48, window=WINDOW)
    args = dict(
        kind="key",
        base_format="int4",
        residual_format=residual_format,
        group_size=8,
        positions=positions,
        window=WINDOW,
    )
    code = kq.encode_loops(loops, **args)
    base, residuals = oracle_residual.encode_loops(loops, **args)
    assert_code_matches_oracle(code, base, residuals, WINDOW)
    recon = kq.decode_loops(code)
    assert_same_bytes(recon, oracle_residual.decode_loops(base, residuals, WINDOW))
    for loop in range(4):  # window rows of every loop are exact
        assert_same_bytes(recon[loop, :4], loops[loop, :4], f"loop {loop} sink rows")
        assert_same_bytes(recon[loop, -6:], loops[loop, -6:], f"loop {loop} recent rows")


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["fp16", "fp32"])
def test_single_residual_matches_oracle_other_dtypes(dtype):
    loops = make_chain(loops=2, t=17, d=9, dtype=dtype)
    previous = kq.unpack_kv(kq.pack_kv(loops[0], kind="value"))
    res = kq.encode_residual(loops[1], previous, kind="value", format="nvfp4")
    expected = oracle_residual.encode_residual(
        loops[1], np.asarray(previous), kind="value", format="nvfp4"
    )
    assert_packed_equal(res.payload, expected.payload.arrays)
    assert_same_bytes(
        kq.decode_residual(res, previous),
        oracle_residual.decode_residual(expected, np.asarray(previous)),
    )


# ------------------------------------------------------------------ closed vs open loop


def test_closed_loop_error_stays_flat_open_loop_grows():
    # Each loop moves as far as the data's own scale, so open-loop errors add up.
    loops = make_chain(loops=6, t=256, h=4, d=64, step=1.0, seed=7, dtype=np.float32)

    def abs_err(approx, ref):
        return float(np.linalg.norm(np.asarray(approx, np.float32) - ref))

    code = kq.encode_loops(loops, kind="key")
    closed = [abs_err(r, x) for r, x in zip(kq.decode_loops(code), loops, strict=True)]

    recon = kq.unpack_kv(kq.pack_kv(loops[0], kind="key"))
    open_ = [abs_err(recon, loops[0])]
    for prev, cur in itertools.pairwise(loops):
        recon = kq.decode_residual(kq.encode_residual(cur, prev, kind="key"), recon)
        open_.append(abs_err(recon, cur))

    assert closed[0] == open_[0]  # the same base encoding
    # closed loop: every loop's error is one encoding of its own delta, no accumulation
    assert max(closed[1:]) < 1.25 * min(closed[1:]), closed
    # open loop: the errors of the base and of every delta add up (~sqrt(l + 1) growth)
    assert all(b > a for a, b in itertools.pairwise(open_)), open_
    assert open_[-1] > 2.0 * open_[0], open_
    assert open_[-1] > 2.0 * closed[-1], (open_, closed)


# ------------------------------------------------------------------ sparse semantics


def test_nested_sparse_rows_inherit_bit_exact():
    loops = make_chain(t=64, seed=1)
    positions = sparse_maps(64, seed=1)
    assert set(positions[2]) <= set(positions[1])
    recon = np.asarray(kq.decode_loops(kq.encode_loops(loops, kind="key", positions=positions)))
    for loop, p in ((2, positions[1]), (3, positions[2])):
        absent = np.setdiff1d(np.arange(64), p)
        assert_same_bytes(recon[loop, absent], recon[loop - 1, absent], f"loop {loop} absent")
        assert not np.array_equal(recon[loop, p], recon[loop - 1, p])  # listed rows moved


@pytest.mark.parametrize("format", FORMATS)
def test_empty_position_map_inherits_everything(format):
    loops = make_chain(loops=2)
    previous = kq.unpack_kv(kq.pack_kv(loops[0], kind="key", format=format))
    empty = np.zeros((0,), np.int32)
    res = kq.encode_residual(loops[1][empty], previous, kind="key", format=format, positions=empty)
    assert res.payload.codes.shape[0] == 0
    assert_same_bytes(kq.decode_residual(res, previous), previous)


@pytest.mark.parametrize("format", FORMATS)
def test_full_position_map_equals_dense(format):
    loops = make_chain(loops=2, t=33)
    previous = kq.unpack_kv(kq.pack_kv(loops[0], kind="value"))
    every = np.arange(33, dtype=np.int32)
    dense = kq.encode_residual(loops[1], previous, kind="value", format=format)
    sparse = kq.encode_residual(loops[1], previous, kind="value", format=format, positions=every)
    assert_trees_same_bytes(dense.payload, sparse.payload)
    assert_same_bytes(kq.decode_residual(sparse, previous), kq.decode_residual(dense, previous))


def test_residual_arithmetic_in_input_dtype():
    loops = make_chain(loops=2)
    previous = jnp.asarray(loops[0])
    res = kq.encode_residual(loops[1], previous, kind="key")
    assert res.payload.dtype == BF16
    expected_delta = (loops[1].astype(np.float32) - loops[0].astype(np.float32)).astype(BF16)
    np.testing.assert_array_equal(
        np.asarray(kq.unpack_kv(kq.pack_kv(expected_delta, kind="key"))),
        np.asarray(kq.unpack_kv(res.payload)),
    )


# ------------------------------------------------------------------ scan / jit / vmap


@pytest.mark.parametrize("base_format,residual_format", [("int4", "int4"), ("int4", "nvfp4")])
def test_scan_equals_python_loop(base_format, residual_format):
    loops = make_chain(t=64, d=32)
    code = kq.encode_loops(
        loops, kind="key", base_format=base_format, residual_format=residual_format
    )
    recon = kq.unpack_kv(kq.pack_kv(loops[0], kind="key", format=base_format))
    assert_trees_same_bytes(code.base, kq.pack_kv(loops[0], kind="key", format=base_format))
    decoded = kq.decode_loops(code)
    for loop in range(1, 4):
        res = kq.encode_residual(loops[loop], recon, kind="key", format=residual_format)
        assert_trees_same_bytes(code.residuals[loop - 1], res, f"loop {loop}")
        recon = kq.decode_residual(res, recon)
        assert_same_bytes(decoded[loop], recon, f"recon {loop}")
        assert_same_bytes(kq.decode_loop(code, loop=loop), recon, f"decode_loop {loop}")


def test_jit_equals_eager():
    loops = make_chain(t=24)
    positions = sparse_maps(24)
    code = kq.encode_loops(loops, kind="value", residual_format="nvfp4", positions=positions)
    recon = kq.decode_loops(code)
    with jax.disable_jit():
        eager = kq.encode_loops(loops, kind="value", residual_format="nvfp4", positions=positions)
        eager_recon = kq.decode_loops(eager)
    assert_trees_same_bytes(code, eager)
    assert_same_bytes(recon, eager_recon)


def test_vmap_over_sequences():
    batch = np.stack([make_chain(t=32, seed=s) for s in range(3)])  # [B, L, T, H, D]
    encode = jax.vmap(lambda x: kq.encode_loops(x, kind="key", residual_format="nvfp4"))
    codes = encode(batch)
    decoded = jax.vmap(kq.decode_loops)(codes)
    last = jax.vmap(lambda c: kq.decode_loop(c, loop=3))(codes)
    for b in range(3):
        one = kq.encode_loops(batch[b], kind="key", residual_format="nvfp4")
        assert_trees_same_bytes(jax.tree.map(lambda a, b=b: a[b], codes), one, f"seq {b}")
        assert_same_bytes(decoded[b], kq.decode_loops(one))
        assert_same_bytes(last[b], decoded[b, 3])


# ------------------------------------------------------------------ window


@pytest.mark.parametrize("format", FORMATS)
def test_window_single_tensor(format):
    x = make_chain(loops=1, t=40)[0]
    packed = kq.pack_kv(x, kind="key", format=format, window=WINDOW)
    assert isinstance(packed, kq.WindowedKV)
    out = kq.unpack_kv(packed)
    assert_same_bytes(out[:4], x[:4])
    assert_same_bytes(out[-6:], x[-6:])
    # token groups are formed over the quantized middle rows only
    assert_trees_same_bytes(packed.middle, kq.pack_kv(x[4:-6], kind="key", format=format))
    assert_same_bytes(kq.unpack_kv(packed, jnp.float32)[:4], x[:4].astype(np.float32))


def test_window_covering_every_row():
    x = make_chain(loops=1, t=7)[0]
    packed = kq.pack_kv(x, kind="key", window=WINDOW)
    assert packed.head.shape[0] == 4 and packed.tail.shape[0] == 3
    assert packed.middle.shape[0] == 0
    assert_same_bytes(kq.unpack_kv(packed), x)


def test_window_dense_chain_matches_oracle():
    loops = make_chain(t=40)
    args = dict(kind="value", base_format="nvfp4", residual_format="int4", window=WINDOW)
    code = kq.encode_loops(loops, **args)
    base, residuals = oracle_residual.encode_loops(loops, **args)
    assert_code_matches_oracle(code, base, residuals, WINDOW)
    recon = kq.decode_loops(code)
    for loop in range(4):
        assert_same_bytes(recon[loop, :4], loops[loop, :4])
        assert_same_bytes(recon[loop, -6:], loops[loop, -6:])


# ------------------------------------------------------------------ accounting


def leaf_bytes(tree) -> int:
    return sum(np.asarray(a).nbytes for a in jax.tree.leaves(tree))


def test_storage_bytes_are_real_bytes():
    loops = make_chain(t=48)
    positions = sparse_maps(48, window=WINDOW)
    code = kq.encode_loops(
        loops, kind="key", residual_format="nvfp4", positions=positions, window=WINDOW
    )
    assert code.storage_bytes == leaf_bytes(code)
    assert code.base.storage_bytes == leaf_bytes(code.base)
    for res in code.residuals:
        assert res.storage_bytes == leaf_bytes(res)
        assert res.bits_per_element == pytest.approx(res.storage_bytes * 8 / (48 * 2 * 20))
    assert code.bits_per_element == pytest.approx(code.storage_bytes * 8 / loops.size)
    # the window rows cost 16 bits each, counted at their real size
    head, tail = code.base.head, code.base.tail
    assert code.base.storage_bytes == head.nbytes + tail.nbytes + code.base.middle.storage_bytes


def test_dense_int4_g64_stack_costs_4_5_bits():
    loops = make_chain(t=128, d=64)
    code = kq.encode_loops(loops, kind="key")
    assert code.bits_per_element == 4.5


# ------------------------------------------------------------------ errors


def test_validate_positions_rejects_bad_maps():
    kq.validate_positions(np.array([0, 3, 9], np.int32), 10)
    kq.validate_positions(np.zeros((0,), np.int32), 10)
    bad = {
        "increasing": np.array([0, 5, 3], np.int32),
        "increasing ": np.array([1, 1, 2], np.int32),
        "lie in": np.array([0, 10], np.int32),
        "lie in ": np.array([-1, 2], np.int32),
        "int32": np.array([0, 1], np.int64),
        "rank 1": np.array([[0, 1]], np.int32),
    }
    for message, p in bad.items():
        with pytest.raises(ValueError, match=message.strip()):
            kq.validate_positions(p, 10)
    with pytest.raises(ValueError, match="window row"):
        kq.validate_positions(np.arange(4, 20, dtype=np.int32), 20, window=kq.Window(4, 2))


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_errors_at_trace_time():
    enc = kq.encode_residual
    cur, prev = _spec((8, 2, 4)), _spec((8, 2, 4))
    cases = [
        (
            ValueError,
            "H, D",
            lambda: jax.eval_shape(lambda c, p: enc(c, p, kind="key"), _spec((8, 2, 5)), prev),
        ),
        (
            TypeError,
            "dtype",
            lambda: jax.eval_shape(
                lambda c, p: enc(c, p, kind="key"), _spec((8, 2, 4), jnp.float32), prev
            ),
        ),
        (
            ValueError,
            "dense residual",
            lambda: jax.eval_shape(lambda c, p: enc(c, p, kind="key"), _spec((6, 2, 4)), prev),
        ),
        (
            TypeError,
            "int32",
            lambda: jax.eval_shape(
                lambda c, p, q: enc(c, p, kind="key", positions=q),
                _spec((3, 2, 4)),
                prev,
                _spec((3,), jnp.uint8),
            ),
        ),
        (
            ValueError,
            "entries",
            lambda: jax.eval_shape(
                lambda c, p, q: enc(c, p, kind="key", positions=q),
                _spec((3, 2, 4)),
                prev,
                _spec((2,), jnp.int32),
            ),
        ),
        (
            ValueError,
            "rank 1",
            lambda: jax.eval_shape(
                lambda c, p, q: enc(c, p, kind="key", positions=q),
                _spec((3, 2, 4)),
                prev,
                _spec((3, 1), jnp.int32),
            ),
        ),
        (ValueError, "kind", lambda: jax.eval_shape(lambda c, p: enc(c, p, kind="k"), cur, prev)),
        (
            ValueError,
            "format",
            lambda: jax.eval_shape(lambda c, p: enc(c, p, kind="key", format="int3"), cur, prev),
        ),
        (
            TypeError,
            "window",
            lambda: jax.eval_shape(lambda c, p: enc(c, p, kind="key", window=(4, 16)), cur, prev),
        ),
        (
            ValueError,
            "rank 4",
            lambda: jax.eval_shape(lambda x: kq.encode_loops(x, kind="key"), _spec((8, 2, 4))),
        ),
        (
            ValueError,
            "one entry per later loop",
            lambda: jax.eval_shape(
                lambda x: kq.encode_loops(x, kind="key", positions=[None]), _spec((4, 8, 2, 4))
            ),
        ),
        (
            ValueError,
            "format",
            lambda: jax.eval_shape(
                lambda x: kq.encode_loops(x, kind="key", residual_format="fp4"), _spec((4, 8, 2, 4))
            ),
        ),
        (
            ValueError,
            "group_size",
            lambda: jax.eval_shape(
                lambda x: kq.encode_loops(
                    x, kind="key", residual_format="nvfp4", residual_group_size=32
                ),
                _spec((2, 8, 2, 4)),
            ),
        ),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    with pytest.raises(ValueError, match=r"Window\.sink"):
        kq.Window(sink=-1)


def test_decode_errors():
    loops = make_chain(loops=2)
    code = kq.encode_loops(loops, kind="key")
    with pytest.raises(ValueError, match=r"loop must be in \[0, 2\)"):
        kq.decode_loop(code, loop=2)
    with pytest.raises(TypeError, match="LoopCode"):
        kq.decode_loops(code.base)
    res = code.residuals[0]
    with pytest.raises(ValueError, match="encoded against"):
        kq.decode_residual(res, jnp.zeros((40, 2, 20), jnp.float32))
    with pytest.raises(ValueError, match="encoded against"):
        kq.decode_residual(res, jnp.zeros((41, 2, 20), jnp.bfloat16))
    with pytest.raises(TypeError, match="KVResidual"):
        kq.decode_residual(code.base, loops[0])


def test_no_data_needed_to_compile_sparse_path():
    """The jitted encode/decode lower with abstract positions: nothing reads the map."""

    def roundtrip(cur, prev, pos):
        res = kq.encode_residual(cur, prev, kind="key", positions=pos, window=WINDOW)
        return kq.decode_residual(res, prev)

    lowered = (
        jax.jit(roundtrip)
        .trace(_spec((20, 2, 8)), _spec((64, 2, 8)), _spec((20,), jnp.int32))
        .lower()
    )
    text = lowered.as_text()
    assert "callback" not in text and "scatter" in text


def test_positions_dtype_checked_before_jit_converts_it():
    loops = make_chain(loops=2, t=8)
    with pytest.raises(TypeError, match="positions must have dtype int32, got int64"):
        kq.encode_residual(loops[1][:2], loops[0], kind="key", positions=np.array([1, 2]))
    with pytest.raises(TypeError, match="int32 array, got list"):
        kq.encode_residual(loops[1][:2], loops[0], kind="key", positions=[1, 2])
    with pytest.raises(TypeError, match=r"positions\[1\] must have dtype int32"):
        kq.encode_loops(
            make_chain(loops=3, t=8), kind="key", positions=[None, np.array([0, 1], np.int64)]
        )


def test_out_of_range_position_is_visible_not_clamped():
    loops = make_chain(loops=2, t=8)
    bad = np.array([1, 8], np.int32)  # 8 is out of [0, 8)
    with pytest.raises(ValueError, match="lie in"):
        kq.validate_positions(bad, 8)
    res = kq.encode_residual(loops[1][bad[:1]].repeat(2, 0), loops[0], kind="key", positions=bad)
    assert np.isnan(np.asarray(res.payload.minimum, np.float32)).any()
    rebuilt = np.asarray(kq.decode_residual(res, loops[0]), np.float32)
    assert np.isnan(rebuilt[1]).all()  # the valid row shares the poisoned group
    assert not np.isnan(np.delete(rebuilt, 1, axis=0)).any()  # nothing else is touched
