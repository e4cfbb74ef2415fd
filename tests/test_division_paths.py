"""Both exact-division paths of `kvq_jax.codecs._numerics.divide`, whatever platform runs the tests.

On XLA:CPU `divide` divides in float64 and rounds to float32 (`divide_f64`, it fuses); on
every other platform it divides float32 behind an optimization barrier (`divide_barrier`).
Each path is forced here (`division_path`) and held to (a) numpy's float32 division (IEEE,
correctly rounded) on adversarial operands, broadcast and under vmap, and (b) the scalar
oracle, byte for byte, for every format and both default layouts on random and hand-built
edge-case tensors (ties, midpoints, tiny and huge values, non-finite values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from codec_cases import AXIS_OF, BF16, EDGE_CASES, F32, FORMATS, G4, KINDS, SHAPE, mixed_values
from helpers import assert_packed_equal, assert_same_values

from kvq_jax import oracle
from kvq_jax.codecs import _numerics
from kvq_jax.codecs.registry import get_codec

PATHS = ("f64", "barrier")


def _operands(rng, n):
    """float32 pairs: random bit patterns (normal range), ties-prone small integers, powers of
    two, zeros, infinities, NaN, huge / tiny magnitudes (overflowing and underflowing)."""
    bits = rng.integers(0x00800000, 0x7F000000, n, dtype=np.uint32)
    a = bits.view(np.float32) * rng.choice([-1, 1], n).astype(np.float32)
    b = rng.integers(1, 16, n).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 20, n)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, 1.2e-38, 15.0, 448.0, 1.0])
    a[: special.size * special.size] = np.repeat(special, special.size)
    b[: special.size * special.size] = np.tile(special, special.size)
    return a.astype(np.float32), b.astype(np.float32)


def _ftz(x):
    x = np.asarray(x, np.float32).copy()
    tiny = (x != 0) & (np.abs(x) < np.float32(2.0**-126))
    x[tiny] = np.copysign(np.float32(0.0), x[tiny])
    return x


@pytest.mark.parametrize("path", PATHS)
def test_divide_is_ieee_float32(path):
    rng = np.random.default_rng(0)
    a, b = _operands(rng, 4096)
    with np.errstate(all="ignore"):
        expected = _ftz(a / b)
    with _numerics.division_path(path):
        elementwise = jax.jit(_numerics.divide)(a, b)
        # A broadcast divisor (per-group statistic) and a scalar: XLA's reciprocal rewrite.
        per_row = jax.jit(_numerics.divide)(a.reshape(64, 64), b[:64, None])
        scalar = jax.jit(lambda x: _numerics.divide(x, np.float32(15.0)))(a)
        vmapped = jax.jit(jax.vmap(_numerics.divide, in_axes=(0, None)))(a.reshape(64, 64), b[:64])
    with np.errstate(all="ignore"):
        exp_row = _ftz(a.reshape(64, 64) / b[:64, None])
        exp_scalar = _ftz(a / np.float32(15.0))
        exp_vmap = _ftz(a.reshape(64, 64) / b[None, :64])
    for got, exp, what in (
        (elementwise, expected, "element-wise"),
        (per_row, exp_row, "broadcast divisor"),
        (scalar, exp_scalar, "scalar divisor"),
        (vmapped, exp_vmap, "vmap, unbatched divisor"),
    ):
        got, keep = _ftz(np.asarray(got)), ~np.isnan(exp)
        np.testing.assert_array_equal(
            got.view(np.uint32)[keep], exp.view(np.uint32)[keep], err_msg=what
        )
        assert np.array_equal(np.isnan(got), np.isnan(exp)), what


def test_division_path_rejects_unknown_paths():
    with pytest.raises(ValueError, match="path must be one of"), _numerics.division_path("f16"):
        pass


class _Codec:
    """`fmt`'s jitted pack / unpack traced on division path `path`: one trace per input
    shape and dtype (the path is read at trace time, so these functions are fresh per test)."""

    def __init__(self, fmt, kind, path):
        self.codec, self.fmt, self.kind, self.path = get_codec(fmt), fmt, kind, path
        self.jitted = {}

    def check(self, x, what):
        codec, fmt, kind = self.codec, self.fmt, self.kind
        axis, g = codec.resolve(x.shape, kind, None, G4 if fmt == "int4" else None)
        expected = oracle.pack(x, format=fmt, kind=kind, group_size=g, axis=axis)
        key = (x.shape, x.dtype, axis, g)
        if key not in self.jitted:
            pack = functools.partial(codec.pack, kind=kind, axis=axis, group_size=g)
            unpack = functools.partial(codec.unpack, dtype=np.dtype(F32))
            self.jitted[key] = (jax.jit(pack), jax.jit(unpack))
        pack, unpack = self.jitted[key]
        with _numerics.division_path(self.path):
            packed = pack(jnp.asarray(x))
            decoded = unpack(packed)
        assert_packed_equal(packed, expected.arrays, what)
        assert_same_values(decoded, oracle.unpack(expected, F32), what + " decoded")


@pytest.mark.thin(2)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_codecs_match_the_oracle_on_each_path(fmt, kind, path):
    rng = np.random.default_rng(7)
    codec = _Codec(fmt, kind, path)
    for dtype in (BF16, F32):
        codec.check(mixed_values(rng, SHAPE, dtype), f"{fmt} {kind} {dtype} mixed")
    for name, (build, dtypes) in EDGE_CASES[fmt].items():
        dtype = BF16 if BF16 in dtypes else dtypes[0]
        for i, x in enumerate(build(dtype, AXIS_OF[kind])):
            codec.check(np.asarray(x), f"{fmt} {kind} {name} #{i} ({path})")
