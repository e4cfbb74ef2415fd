"""Element-wise float32 helpers of the Torch codec: docs/FORMAT.md section 0 in torch.

All functions take and return float32 tensors unless stated otherwise, on the device of their
input (nothing is moved to the host). They implement IEEE binary32 with round to nearest even
and an *explicit* flush of subnormal inputs and results: neither Torch on CPU nor Torch on
CUDA flushes by default, so every place where FORMAT.md flushes calls `flush_subnormal`.

Torch behaviours this module works around (all verified on torch 2.13):
  * `scalar / tensor` is computed as `tensor.reciprocal() * scalar` (two roundings), and on
    CUDA `tensor / cpu_scalar` as `tensor * (1 / scalar)`: `divide` therefore always divides
    two float32 tensors that live on the same device.
  * float -> float8_e4m3fn casts saturate (inf -> 448) and float -> integer casts wrap
    (300.0 -> uint8 44): callers clamp before every cast (`clamp_e4m3`, INT4 codes).
  * `torch.round` rounds half to even; float32 -> float16 / bfloat16 / float8_e4m3fn round to
    nearest even (checked exhaustively against ml_dtypes over every float32 in range).
"""

from __future__ import annotations

import torch

from kvq_jax.core.constants import E2M1_MIDPOINTS, E4M3_MAX, F32_MIN_NORMAL

F32 = torch.float32
_TINY = float(F32_MIN_NORMAL)
_E4M3_MAX = float(E4M3_MAX)


def flush_subnormal(x: torch.Tensor) -> torch.Tensor:
    """Replace float32 subnormals by a zero of the same sign (FTZ/DAZ, on every device)."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(x.abs() < _TINY, torch.copysign(zero, x), x)


def constant(value, like: torch.Tensor) -> torch.Tensor:
    """A float32 0-d tensor holding `value` on `like`'s device (a fill, no host->device copy)."""
    return torch.full((), float(value), dtype=F32, device=like.device)


def _operand(x, device) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        if x.dtype != F32:
            raise TypeError(f"divide expects float32 operands, got {x.dtype}")
        return x if x.device == device else x.to(device)
    return torch.full((), float(x), dtype=F32, device=device)


def divide(a, b) -> torch.Tensor:
    """IEEE float32 a / b (correctly rounded), element-wise with broadcasting.

    Python / numpy scalars become 0-d float32 tensors on the other operand's device, so the
    operation is always `torch.div(tensor, tensor)` on one device: never the reflected
    `scalar / tensor` (reciprocal, then multiply) and never CUDA's division by a CPU scalar
    (multiply by the reciprocal). Every division in the Torch codec goes through here.
    """
    device = a.device if isinstance(a, torch.Tensor) else b.device
    return torch.div(_operand(a, device), _operand(b, device))


def widen(values: torch.Tensor) -> torch.Tensor:
    """bf16/fp16/fp32 -> float32 (exact), then flush subnormal inputs."""
    return flush_subnormal(values.to(F32))


def round_half_even(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to the nearest integer, ties to even (`torch.round`; float32 result)."""
    return torch.round(x)


def clamp_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Clamp to [-448, 448] (NaN stays NaN): the only input a float8_e4m3fn cast may see."""
    return torch.clamp(x, -_E4M3_MAX, _E4M3_MAX)


def e2m1_magnitude_code(magnitude: torch.Tensor) -> torch.Tensor:
    """|y| in [0, 6] -> 3-bit E2M1 code (uint8), nearest value, ties to the even code.

    The code is the number of midpoints below |y| (`kvq_jax.core.constants.E2M1_MIDPOINTS`); a tie
    counts as "below" where it rounds up to the even code. NaN gives 0.
    """
    code = torch.zeros(magnitude.shape, dtype=torch.uint8, device=magnitude.device)
    for midpoint, tie_rounds_up in E2M1_MIDPOINTS:
        above = magnitude >= midpoint if tie_rounds_up else magnitude > midpoint
        code = code + above.to(torch.uint8)
    return code


def e2m1_encode(y: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """float32 y (already clamped to [-6, 6]) and its sign -> 4-bit E2M1 code in a uint8."""
    return e2m1_magnitude_code(y.abs()) | (negative.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, 0..15) -> float32 values (code 8 is -0.0).

    Integer arithmetic instead of a table lookup (a table would need a host->device copy):
    with e = bits 1-2 and m = bit 0 of the magnitude code, the magnitude in halves is m for
    e = 0 and (2 + m) << (e - 1) otherwise: 0, 1, 2, 3, 4, 6, 8, 12.
    """
    c = codes.to(torch.int32)
    magnitude = c & 7
    e = magnitude >> 1
    m = magnitude & 1
    halves = torch.where(e == 0, m, (m + 2) << (e - 1).clamp(min=0))
    value = halves.to(F32) * 0.5
    return torch.where(c >= 8, -value, value)


def subtract_in_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a - b rounded once to a's dtype (bf16/fp16/fp32), computed in float32 with FTZ.

    float32 has more than 2p + 2 significand bits for bf16 and fp16, so this equals the
    correctly rounded subtraction in those dtypes.
    """
    return flush_subnormal(widen(a) - widen(b)).to(a.dtype)


def add_in_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + b rounded once to a's dtype, computed in float32 with FTZ (see subtract_in_dtype)."""
    return flush_subnormal(widen(a) + widen(b)).to(a.dtype)
