"""Keys stored before RoPE (docs/FORMAT.md section 5b), element by element: the rotate-half
RoPE of a [T, H, D] tensor in binary64 arithmetic on the float32 inputs, rounded to float32.

    apply_rope(x)  = f32( x * cos + rotate_half(x) * sin )
    invert_rope(x) = f32( x * cos - rotate_half(x) * sin ),  rotate_half(x) = [-x[D/2:], x[:D/2]]

cos and sin are the float32 roundings of the binary64 cos / sin of position * theta^(-2c/D)
(channel c and c + D/2 share an angle). Python floats are binary64, so each product of two
float32 values is exact and the sum is rounded once to binary64 before `scalar.f32`.
"""

from __future__ import annotations

import math

from kvq_jax.oracle.scalar import f32


def tables(num_tokens: int, dim: int, theta: float, offset: int = 0):
    """(cos, sin): lists [T][D] of float32 values."""
    half = dim // 2
    inv = [float(theta) ** (-(2 * c) / dim) for c in range(half)]
    cos, sin = [], []
    for p in range(offset, offset + num_tokens):
        angles = [p * w for w in inv] * 2
        cos.append([f32(math.cos(a)) for a in angles])
        sin.append([f32(math.sin(a)) for a in angles])
    return cos, sin


def rotate(xs: list[float], shape, theta: float, sign: float, offset: int = 0) -> list[float]:
    """Flat float32 values of `shape` [T, H, D] rotated by RoPE (sign 1) or back (sign -1)."""
    t, h, d = shape
    cos, sin = tables(t, d, theta, offset)
    half = d // 2
    out = []
    for tok in range(t):
        for head in range(h):
            row = xs[(tok * h + head) * d : (tok * h + head + 1) * d]
            turned = [-v for v in row[half:]] + row[:half]
            out.extend(
                f32(row[c] * cos[tok][c] + sign * (turned[c] * sin[tok][c])) for c in range(d)
            )
    return out
