"""Absolute loops in a loop stack (`encode_loops(..., absolute=...)`): a later loop packed on
its own, not as a delta against the reconstructed previous loop.

Judged by independent references: the plain-Python oracle (kvq_jax.oracle.residual) for the
bytes and the decoded loops, a NumPy reference that packs the loop alone with `pack_kv` (an
absolute loop must decode to exactly that, whatever the previous loop holds), and the Torch
stack for identical bytes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import assert_same_bytes, numpy_to_torch, torch_to_numpy
from test_residual import assert_code_matches_oracle, make_chain, sparse_maps
from test_torch_codec import assert_trees_equal, to_jax, to_torch

import kvq_jax as kq
from kvq_jax.core.policies import POLICIES, Policy
from kvq_jax.oracle import residual as oracle_residual
from kvq_torch_bridge.codecs import loops as tloops
from kvq_torch_bridge.codecs import residual as tres

BF16 = np.dtype(ml_dtypes.bfloat16)
WINDOW = kq.Window(sink=4, recent=6)

#: FlashLoop-like per-loop values (2/4/4/2 bits) with loops 1 and 2 absolute, loop 3 a delta.
MIXED = dict(
    kind="value", base_format="int2", residual_format=("int4", "int4", "int2"), group_size=16
)

CASES = {
    "mixed-dense": (MIXED, (1, 2), False),
    "mixed-window": ({**MIXED, "window": WINDOW}, (1, 2), False),
    "keys-all-absolute": (
        dict(kind="key", base_format="int2", residual_format="int2", group_size=8),
        (1, 2, 3),
        False,
    ),
    "sparse-absolute": (
        dict(kind="key", base_format="int4", residual_format="nvfp4", group_size=8),
        (2, 3),
        True,
    ),
    "window-sparse-absolute": (
        dict(kind="value", base_format="int4", residual_format="fp8_e4m3", window=WINDOW),
        (1, 3),
        True,
    ),
}


def _case(name):
    args, absolute, sparse = CASES[name]
    loops = make_chain(t=48, seed=11)
    positions = sparse_maps(48, seed=11, window=args.get("window")) if sparse else None
    return loops, dict(args, positions=positions), absolute


@pytest.mark.parametrize("name", list(CASES))
def test_jax_torch_oracle_same_bytes(name):
    """The oracle, kvq_jax (jitted) and Torch encode to the same bytes and decode every loop
    (decode_loops and decode_loop) to the same bytes."""
    loops, args, absolute = _case(name)
    base, residuals = oracle_residual.encode_loops(loops, absolute=absolute, **args)
    want = oracle_residual.decode_loops(base, residuals, args.get("window"))
    assert [r.absolute for r in residuals] == [i in absolute for i in range(1, 4)]

    code_j = kq.encode_loops(loops, absolute=absolute, **args)
    assert [r.absolute for r in code_j.residuals] == [i in absolute for i in range(1, 4)]
    assert_code_matches_oracle(code_j, base, residuals, args.get("window"))
    assert_same_bytes(kq.decode_loops(code_j), want, "jax decode_loops")
    for loop in range(4):
        assert_same_bytes(kq.decode_loop(code_j, loop=loop), want[loop], f"jax loop {loop}")

    t_positions = args["positions"]
    if t_positions is not None:
        t_positions = [None if p is None else numpy_to_torch(p) for p in t_positions]
    code_t = tloops.encode_loops(
        numpy_to_torch(loops), absolute=list(absolute), **{**args, "positions": t_positions}
    )
    assert_trees_equal(code_t, code_j, name)
    assert_same_bytes(torch_to_numpy(tloops.decode_loops(code_t)), want, "torch decode_loops")
    for loop in range(4):
        got = torch_to_numpy(tloops.decode_loop(code_t, loop=loop))
        assert_same_bytes(got, want[loop], f"torch loop {loop}")
    # across the stacks (the absolute flag travels with the container)
    assert_same_bytes(torch_to_numpy(tloops.decode_loops(to_torch(code_j))), want, "jax->torch")
    assert_same_bytes(kq.decode_loops(to_jax(code_t)), want, "torch->jax")
    assert code_t.storage_bytes == code_j.storage_bytes


@pytest.mark.parametrize("name", ["mixed-dense", "mixed-window", "keys-all-absolute"])
def test_absolute_loop_is_the_loop_packed_alone(name):
    """A dense absolute loop decodes to `unpack_kv(pack_kv(loop))` of that loop alone (same
    format, group size and window), bit for bit, whatever the previous loop held: the
    previous loop is not added. Its payload is the loop's own packed bytes."""
    loops, args, absolute = _case(name)
    code = kq.encode_loops(loops, absolute=absolute, **args)
    recon = np.asarray(kq.decode_loops(code))
    formats = args["residual_format"]
    for loop in absolute:
        fmt = formats if isinstance(formats, str) else formats[loop - 1]
        group = args["group_size"] if fmt == args["base_format"] else None
        alone = kq.pack_kv(
            loops[loop], kind=args["kind"], format=fmt, group_size=group, window=args.get("window")
        )
        assert_same_bytes(recon[loop], kq.unpack_kv(alone), f"loop {loop}")
        middle = alone if args.get("window") is None else alone.middle
        for field, array in middle.arrays.items():
            payload = code.residuals[loop - 1].payload
            assert_same_bytes(payload.arrays[field], array, f"loop {loop} payload.{field}")
    # and a delta loop right after an absolute one adds that loop's reconstruction
    if 3 not in absolute:
        res = code.residuals[2]
        assert not res.absolute
        assert_same_bytes(kq.decode_residual(res, recon[2]), recon[3], "delta after absolute")


def test_absolute_decode_ignores_previous():
    """decode_residual of a dense absolute residual gives the same bytes against any
    `previous` (zeros, garbage); a delta residual does not."""
    loops = make_chain(loops=2, t=32, seed=5)
    prev = np.asarray(kq.unpack_kv(kq.pack_kv(loops[0], kind="key")))
    res = kq.encode_residual(loops[1], prev, kind="key", format="int2", absolute=True)
    want = np.asarray(kq.decode_residual(res, prev))
    for other in (np.zeros_like(prev), (prev.astype(np.float32) * 7 + 3).astype(prev.dtype)):
        assert_same_bytes(kq.decode_residual(res, other), want)
        t_res = to_torch(res)
        assert_same_bytes(torch_to_numpy(tres.decode_residual(t_res, numpy_to_torch(other))), want)
    delta = kq.encode_residual(loops[1], prev, kind="key", format="int2")
    assert not np.array_equal(
        np.asarray(kq.decode_residual(delta, np.zeros_like(prev))),
        np.asarray(kq.decode_residual(delta, prev)),
    )


def test_absolute_storage_bytes_equal_delta():
    """Absolute storage costs exactly the bytes of the delta it replaces (a static flag)."""
    loops = make_chain(seed=2)
    a = kq.encode_loops(loops, absolute=(1, 2, 3), **MIXED)
    d = kq.encode_loops(loops, **MIXED)
    assert a.storage_bytes == d.storage_bytes


@pytest.mark.parametrize(
    "absolute,match",
    [
        ((0,), "absolute: loop 0 is the base"),
        ((4,), r"absolute: loop 4 is out of range \[1, 4\)"),
        ((-1,), r"absolute: loop -1 is out of range"),
        ((1, 1), "absolute: loop 1 is listed twice"),
    ],
)
def test_bad_absolute_raises(absolute, match):
    loops = make_chain()
    with pytest.raises(ValueError, match=match):
        kq.encode_loops(loops, absolute=absolute, **MIXED)
    with pytest.raises(ValueError, match=match):
        tloops.encode_loops(numpy_to_torch(loops), absolute=absolute, **MIXED)


@pytest.mark.parametrize("absolute", [1, "1", (1.0,)])
def test_absolute_of_wrong_type_raises(absolute):
    loops = make_chain()
    with pytest.raises(TypeError, match="absolute"):
        kq.encode_loops(loops, absolute=absolute, **MIXED)
    with pytest.raises(TypeError, match="absolute"):
        tloops.encode_loops(numpy_to_torch(loops), absolute=absolute, **MIXED)


def test_oracle_rejects_bad_absolute():
    loops = make_chain()
    for bad in ((0,), (4,)):
        with pytest.raises(ValueError, match="absolute"):
            oracle_residual.encode_loops(loops, absolute=bad, **MIXED)


def test_encode_residual_absolute_must_be_bool():
    loops = make_chain(loops=2)
    with pytest.raises(TypeError, match="absolute"):
        kq.encode_residual(loops[1], loops[0], kind="key", absolute=1)
    with pytest.raises(TypeError, match="absolute"):
        tres.encode_residual(
            numpy_to_torch(loops[1]), numpy_to_torch(loops[0]), kind="key", absolute="yes"
        )


# ---------------------------------------------------------------------------- the policy


def test_policy_absolute_loops_and_kwargs():
    p = POLICIES["loops-abs-v2442"]
    assert p.absolute_loops("key", 4) == (1, 2, 3)
    assert p.absolute_loops("value", 4) == (1, 2)
    assert p.absolute_loops("value", 2) == (1,)  # a profile for 4 loops runs on fewer
    assert p.loop_kwargs("value", 4)["absolute"] == (1, 2)
    assert "absolute" not in POLICIES["flashloop-legacy"].loop_kwargs("value", 4)
    assert p.loop_formats("value", 4) == ("int2", "int4", "int4", "int2")
    assert p.loop_formats("key", 4) == ("int2",) * 4
    keys = POLICIES["loops-abs-keys"]
    assert keys.loop_formats("value", 4) == POLICIES["flashloop-legacy"].loop_formats("value", 4)
    assert keys.absolute_loops("key", 4) == (1, 2, 3)
    assert keys.absolute_loops("value", 4) == ()
    for name in ("loops-abs-v2442", "loops-abs-keys"):
        assert f"{name}+win" in POLICIES


@pytest.mark.parametrize("absolute", [(0,), (1, 1), (1.5,), "1"])
def test_policy_bad_absolute_raises(absolute):
    with pytest.raises((ValueError, TypeError), match="absolute"):
        Policy("bad", "int2", "int2", absolute=absolute)
    with pytest.raises((ValueError, TypeError), match="v_absolute"):
        Policy("bad", "int2", "int2", v_absolute=absolute)


def test_policy_bits_equal_flashloop_legacy():
    """loops-abs-v2442 spends FlashLoop legacy's bits: 3.000 bits/element over K, V and 4
    loops (two INT4 slots, six INT2), counted from the actual storage bytes."""
    loops = make_chain(t=128, h=2, d=64, seed=1)
    total = {}
    for name in ("flashloop-legacy", "loops-abs-v2442"):
        p = POLICIES[name]
        nbytes = sum(
            kq.encode_loops(loops, **p.loop_kwargs(kind, 4)).storage_bytes
            for kind in ("key", "value")
        )
        total[name] = 8 * nbytes / (2 * loops.size)
    assert total["loops-abs-v2442"] == total["flashloop-legacy"] == 3.0


def test_paged_cache_takes_absolute_policies():
    """Served since issue 24: the cache config carries the policy's absolute loops (the
    pages: tests/test_paged_cache_loops.py); at one loop nothing is stored absolute."""
    from kvq_jax.engine.engine import cache_config_for

    args = dict(num_pages=8, page_size=64, num_heads=2, head_dim=64, dtype="bfloat16", max_seqs=1)
    uniform = dataclasses.replace(POLICIES["flashloop-kivi"], name="kivi-abs", absolute=(1, 2, 3))
    config = cache_config_for(uniform, num_loops=4, **args)
    assert config.k_absolute == config.v_absolute == (1, 2, 3)
    one = cache_config_for(uniform, num_loops=1, **args)
    assert one.k_absolute == one.v_absolute == ()


def test_torch_model_eval_coder_stores_absolute_loops():
    """The Torch report's loop coder (kvq_torch_bridge.model_eval) follows the policy's
    absolute loops: its reconstruction equals decode_loops of encode_loops."""
    from kvq_torch_bridge.model_eval.codecs import get_loop_coder

    loops = make_chain(t=64, d=64, seed=4)
    p = POLICIES["loops-abs-v2442"]
    want = np.asarray(kq.decode_loops(kq.encode_loops(loops, **p.loop_kwargs("value", 4))))
    for name in ("torch", "jax"):
        coder = get_loop_coder(name)
        x = numpy_to_torch(loops)
        recon = coder.base(x[0], p, "value")
        out = [recon]
        for loop in range(1, 4):
            recon = coder.residual(x[loop], recon, p, "value", loop)
            out.append(recon)
        assert_same_bytes(torch_to_numpy(torch.stack(out)), want, f"coder {name}")


def test_jit_scan_path_unchanged_without_absolute():
    """Without absolute loops the dense one-format stack still runs the scan (same bytes as
    the unrolled path); absolute=() is the same as None."""
    loops = jnp.asarray(make_chain(seed=9))
    args = dict(kind="key", base_format="int4", residual_format="int4", group_size=8)
    a = kq.encode_loops(loops, **args)
    b = kq.encode_loops(loops, absolute=(), **args)
    assert_same_bytes(kq.decode_loops(a), kq.decode_loops(b))
    assert not any(r.absolute for r in b.residuals)
