"""Element-wise float32 helpers shared by every JAX implementation (XLA path and kernels).

All functions take and return float32 arrays unless stated otherwise. They implement the
arithmetic model of docs/FORMAT.md section 0: IEEE binary32, round to nearest even, and
flush-to-zero of subnormal inputs and results.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvq_jax.core.constants import E2M1_MIDPOINTS

_F32_SIGN = np.uint32(0x80000000)
_F32_EXPONENT = np.uint32(0x7F800000)


def flush_subnormal(x: jnp.ndarray) -> jnp.ndarray:
    """Replace float32 subnormals by a zero of the same sign (FTZ/DAZ, on every device).

    Integer operations on the bits (exponent field 0 -> keep only the sign): no float compare
    that a DAZ device could see differently, vectorizes on XLA:CPU (a where/copysign form
    made a residual step 1.6x slower there), and lowers in Pallas Triton kernels as well.
    """
    bits = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
    bits = jnp.where((bits & _F32_EXPONENT) == 0, bits & _F32_SIGN, bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


@jax.custom_batching.custom_vmap
def _barrier_divide(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    a, b = lax.optimization_barrier((a, b))
    return a / b


@_barrier_divide.def_vmap
def _barrier_divide_vmap(axis_size, in_batched, a, b):
    # Batch both operands explicitly: an unbatched divisor would otherwise be broadcast over
    # the batch axis outside the barrier, and the rewrite below would come back.
    a, b = (
        x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
        for x, batched in zip((a, b), in_batched, strict=True)
    )
    return _barrier_divide(a, b), True


def divide_barrier(a, b) -> jnp.ndarray:
    """IEEE float32 a / b through an optimization barrier (both operands materialized at the
    full broadcast shape, under vmap too): XLA cannot see a broadcast divisor to rewrite."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    return _barrier_divide(jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape))


def divide_f64(a, b) -> jnp.ndarray:
    """IEEE float32 a / b computed in float64 and rounded once to float32 (fuses freely).

    Both operands are float32, so the float64 quotient is within 2**-53 (relative) of the
    exact one, and even XLA's reciprocal-multiply rewrite in float64 stays within ~2**-52. The
    exact quotient of two float32 numbers is never a float32 rounding midpoint (a midpoint
    times a 24-bit significand needs more than 24 bits) and lies at least ~2**-49 (relative)
    away from one, so rounding the float64 result to float32 gives the correctly rounded
    quotient (overflow to inf, zero, inf and NaN operands included). float64 is traced under
    `jax.enable_x64` whatever the global setting; the result is float32.
    """
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    with jax.enable_x64(True):
        q = lax.div(*jnp.broadcast_arrays(a.astype(np.float64), b.astype(np.float64)))
        return q.astype(np.float32)


#: The division path forced by `division_path` (None: chosen per platform at lowering).
_FORCED_PATH: str | None = None
DIVISION_PATHS = ("f64", "barrier")


@contextlib.contextmanager
def division_path(path: str | None):
    """Force `divide` to the "f64" or "barrier" path (None: by platform) while tracing inside
    the block. For tests: jit a fresh function inside the block (jax caches traces)."""
    global _FORCED_PATH
    if path is not None and path not in DIVISION_PATHS:
        raise ValueError(f"path must be one of {DIVISION_PATHS} or None, got {path!r}")
    saved, _FORCED_PATH = _FORCED_PATH, path
    try:
        yield
    finally:
        _FORCED_PATH = saved


def divide(a, b, *, fuse: bool = True) -> jnp.ndarray:
    """IEEE float32 a / b (correctly rounded), element-wise with broadcasting.

    XLA's algebraic simplifier rewrites a division by a broadcast operand (a constant, a
    scalar or a per-group statistic) into a multiplication by its reciprocal, which is not
    correctly rounded: measured on XLA:CPU, `x / 15` and `x / scale[..., None]` differ from
    IEEE division in ~20% of elements. Two exact paths: `divide_f64` (fuses, vectorizes; used
    when lowering for CPU) and `divide_barrier` (float32 behind an optimization barrier, which
    stops fusion; every other platform, where float64 is slow). Every division in kvq goes
    through here.

    fuse=False always takes the barrier: for quotients of per-group statistics that element-wise
    loops consume (XLA would otherwise fuse the float64 division into those loops and redo it
    per element; measured 2x slower NVFP4 unpack on XLA:CPU).
    """
    if _FORCED_PATH == "f64":
        return divide_f64(a, b)
    if _FORCED_PATH == "barrier" or not fuse:
        return divide_barrier(a, b)
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
    return lax.platform_dependent(a, b, cpu=divide_f64, default=divide_barrier)


def widen(values: jnp.ndarray) -> jnp.ndarray:
    """bf16/fp16/fp32 -> float32 (exact), then flush subnormal inputs."""
    return flush_subnormal(values.astype(jnp.float32))


def round_half_even(x: jnp.ndarray) -> jnp.ndarray:
    """Round float32 to the nearest integer, ties to even (float32 result)."""
    return jnp.round(x)


def e2m1_magnitude_code(magnitude: jnp.ndarray) -> jnp.ndarray:
    """|y| in [0, 6] -> 3-bit E2M1 code (uint8), nearest value, ties to the even code.

    Arithmetic (comparisons against the midpoints), so it lowers on every backend. NaN gives 0.
    """
    code = jnp.zeros(magnitude.shape, jnp.uint8)
    for midpoint, tie_rounds_up in E2M1_MIDPOINTS:
        above = magnitude >= midpoint if tie_rounds_up else magnitude > midpoint
        code = code + above.astype(jnp.uint8)
    return code


def e2m1_encode(y: jnp.ndarray, negative: jnp.ndarray) -> jnp.ndarray:
    """float32 y (already clamped to [-6, 6]) and its sign -> 4-bit E2M1 code in a uint8."""
    return e2m1_magnitude_code(jnp.abs(y)) | (negative.astype(jnp.uint8) << 3)


def e2m1_decode(codes: jnp.ndarray) -> jnp.ndarray:
    """4-bit E2M1 codes (uint8, 0..15) -> float32 values (code 8 is -0.0).

    Builds the float32 bits directly (exponent e = bits 1-2, mantissa m = bit 0): no table
    gather, so it vectorizes inside large fusions and lowers in kernels.
    """
    c = codes.astype(jnp.uint32)
    e, m = (c >> 1) & 3, c & 1
    normal = ((e + 126) << 23) | (m << 22)  # 2**(e-1) * (1 + m/2) for e >= 1
    subnormal = m * (126 << 23)  # 0 or 0.5 for e == 0
    bits = jnp.where(e == 0, subnormal, normal) | ((c & 8) << 28)
    return lax.bitcast_convert_type(bits, jnp.float32)


#: float32 value of every 4-bit E2M1 code (code 8 is -0.0), the table `e2m1_decode` computes.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


def e2m1_decode_table(codes: jnp.ndarray) -> jnp.ndarray:
    """`e2m1_decode` as a 16-entry table lookup (same float32 bits, -0.0 included).

    For the XLA:CPU codec path: in the fused NVFP4 unpack loop XLA:CPU emits the bit-building
    decode (after the nibble interleave) as a scalar loop, while a gather from a constant
    16-entry table stays vectorized; measured 15.0 -> 2.6 ms for an NVFP4 V unpack of
    bf16 [2048, 16, 128] (docs/research/issue15/README.md). Codes must be 0..15.
    """
    return jnp.take(jnp.asarray(E2M1_VALUES), codes.astype(jnp.int32), mode="clip")


def e2m1_decode_xla(codes: jnp.ndarray) -> jnp.ndarray:
    """E2M1 decode for the XLA codec path: the table on CPU, the arithmetic elsewhere."""
    return lax.platform_dependent(codes, cpu=e2m1_decode_table, default=e2m1_decode)


def subtract_in_dtype(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """a - b rounded once to a's dtype (bf16/fp16/fp32), computed in float32 with FTZ.

    float32 has more than 2p + 2 significand bits for bf16 and fp16, so this equals the
    correctly rounded subtraction in those dtypes.
    """
    return flush_subnormal(widen(a) - widen(b)).astype(a.dtype)


def add_in_dtype(a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
    """a + b rounded once to a's dtype, computed in float32 with FTZ (see subtract_in_dtype)."""
    return flush_subnormal(widen(a) + widen(b)).astype(a.dtype)
