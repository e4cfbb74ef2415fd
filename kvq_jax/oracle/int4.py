"""INT4 affine format (docs/FORMAT.md section 2), element by element.

Per group, in float32 (every operation through `scalar`: rounded and flushed)::

    mn    = min(group)                 (a zero minimum is +0.0)
    mx    = max(group)
    span  = mx - mn
    scale = span / 15  if span > 0 else 1.0
    code  = clamp(round_half_even((x - mn) / scale), 0, 15)    (NaN -> 0)
    stored: minimum = f16(mn), scale = f16(scale)

A group that holds inf or NaN stores minimum = scale = NaN (0x7E00) and codes 0.
Decode: ``f32(code) * scale16 + minimum16``.

Inputs to `encode` are flat lists of float32 values that were already flushed on entry
(see `kvq_jax.oracle.widen`); outputs are flat lists of raw bit patterns.
"""

from __future__ import annotations

from kvq_jax.oracle import affine, layout

#: Largest code.
CODE_MAX = 15


def encode_group(xs: list[float]) -> tuple[list[int], int, int]:
    """One group's float32 values -> (codes 0..15, minimum f16 bits, scale f16 bits)
    (`affine.encode_group` with L = 15)."""
    return affine.encode_group(xs, CODE_MAX)


def encode(xs: list[float], shape, axis: str, group_size: int) -> dict[str, list[int]]:
    """Flat float32 values of `shape` -> raw bits: codes (bytes), minimum, scale (f16)."""
    codes, minimum, scale = affine.encode_groups(xs, shape, axis, group_size, lambda m: CODE_MAX)
    return {"codes": layout.pack_nibbles(codes, shape), "minimum": minimum, "scale": scale}


def decode(bits: dict[str, list[int]], shape, axis: str, group_size: int) -> list[float]:
    """Raw bits -> flat float32 values ``code * scale16 + minimum16``."""
    codes = layout.unpack_nibbles(bits["codes"], shape)
    return affine.decode_groups(codes, bits, shape, axis, group_size)
