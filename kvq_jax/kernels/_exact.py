"""Correctly rounded float32 arithmetic inside Pallas kernels, identical on every backend.

Kernels that must reproduce the XLA codecs' bytes cannot use plain `/`, `*` and `+`:

- Triton lowers float32 division to PTX `div.full.f32` (about 2 ulp, not IEEE), and its
  compiler contracts `a * b + c` into one fused multiply-add (one rounding instead of two).
  On the Triton backend these helpers emit PTX with an explicit rounding mode (`div.rn.f32`,
  `mul.rn.f32`, `add.rn.f32`), which PTX defines as correctly rounded and never contracted.
- In interpret mode the kernel body runs through XLA:CPU, whose simplifier turns a division
  by a broadcast operand into a reciprocal multiply; `divide` goes through
  `kvq_jax.codecs._numerics.divide`, the barrier the XLA codecs use. The same simplifier
  drops a float32 -> bfloat16 -> float32 round trip inside one program (XLA's "excess
  precision"): `round_to` rounds first with `lax.reduce_precision`, which it keeps.

Every helper takes `interpret` (static): True for `pallas_call(..., interpret=True)`, False
when the kernel lowers through Triton. Inputs are float32 arrays of one shape (broadcast
first); outputs are float32 of that shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as pltriton

from kvq_jax.codecs import _numerics

_SIGN = np.uint32(0x80000000)
_MAGIC = 1.5 * 2**23  # adding it rounds |x| < 2**22 to an integer


def _ptx_binary(op: str, a, b):
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    (out,) = pltriton.elementwise_inline_asm(
        f"{op}.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return out


def divide(a, b, *, interpret: bool):
    """IEEE a / b (round to nearest even; subnormal results are *not* flushed here)."""
    if interpret:
        return _numerics.divide(a, b)
    return _ptx_binary("div", a, b)


def multiply(a, b, *, interpret: bool):
    """IEEE a * b, never fused with a following add."""
    if interpret:
        return jnp.asarray(a, jnp.float32) * jnp.asarray(b, jnp.float32)
    return _ptx_binary("mul", a, b)


def add(a, b, *, interpret: bool):
    """IEEE a + b, never fused with a preceding multiply."""
    if interpret:
        return jnp.asarray(a, jnp.float32) + jnp.asarray(b, jnp.float32)
    return _ptx_binary("add", a, b)


#: float32 subnormals -> zero of the same sign (bit arithmetic: lowers everywhere).
flush_subnormal = _numerics.flush_subnormal


def sign_bit(x):
    """True where the float32 sign bit is set (-0.0 and negative NaN included)."""
    bits = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
    return (bits & _SIGN) != 0


def round_half_even(x, *, interpret: bool):
    """Nearest integer, ties to even, for |x| < 2**22 (float32); NaN stays NaN.

    Pallas has no Triton lowering for round, so on Triton this adds and subtracts 1.5 * 2**23
    with explicitly rounded PTX adds: the first rounds x to an integer (ties to even) in the
    binary32 format itself.
    """
    x = jnp.asarray(x, jnp.float32)
    if interpret:  # XLA folds (x + c) - c back into x; XLA has a round instruction anyway
        return _numerics.round_half_even(x)
    shifted = add(x, jnp.full(x.shape, _MAGIC, jnp.float32), interpret=interpret)
    return add(shifted, jnp.full(x.shape, -_MAGIC, jnp.float32), interpret=interpret)


def round_to(x, dtype, *, interpret: bool):
    """float32 x rounded to `dtype` (round to nearest even), as `x.astype(dtype)`. In
    interpret mode a bfloat16 rounding is first made with `lax.reduce_precision` (8 exponent,
    7 mantissa bits: the same value), so that XLA cannot drop it when the result is widened
    to float32 again in the same program (measured: keys attended unrounded, 5e-4 off)."""
    dtype = jnp.dtype(dtype)
    if interpret and dtype == jnp.bfloat16:
        x = lax.reduce_precision(jnp.asarray(x, jnp.float32), exponent_bits=8, mantissa_bits=7)
    return x.astype(dtype)
