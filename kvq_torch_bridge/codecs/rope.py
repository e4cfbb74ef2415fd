"""RoPE in Torch (mirrors `kvq_jax.codecs.rope` bit for bit: float64 arithmetic on the float32
inputs, one rounding to float32; tables from `kvq_jax.core.rope.rope_tables`)."""

from __future__ import annotations

import torch

from kvq_jax.core.rope import inverse_frequencies


def _rotate(x, cos, sin, sign: float) -> torch.Tensor:
    """x * cos + sign * rotate_half(x) * sin in binary64 on the row halves, rounded once to
    float32 (`kvq_jax.codecs.rope._rotate`)."""
    h = x.shape[-1] // 2
    x = x.to(torch.float32).to(torch.float64)
    lo, hi = x[..., :h], x[..., h:]
    cos, sin = cos[..., :h].to(torch.float64), sin[..., :h].to(torch.float64)
    out = (lo * cos - sign * (hi * sin), hi * cos + sign * (lo * sin))
    return torch.cat([a.to(torch.float32) for a in out], dim=-1)


def rope_at(positions: torch.Tensor, dim: int, theta: float):
    """(cos, sin) float32 [..., 1, D] of int positions [...] on their device: the numbers of
    `kvq_jax.core.rope.rope_tables` (`kvq_jax.codecs.rope.rope_at`)."""
    inv = torch.from_numpy(inverse_frequencies(dim, theta)).to(positions.device)
    angle = positions.to(torch.float64)[..., None] * inv
    cos, sin = (f(angle).to(torch.float32) for f in (torch.cos, torch.sin))
    return tuple(torch.cat([a, a], dim=-1)[..., None, :] for a in (cos, sin))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> x * cos + rotate_half(x) * sin as float32 (cos, sin: float32 [T, 1, D])."""
    return _rotate(x, cos, sin, 1.0)


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse rotation: x * cos - rotate_half(x) * sin, float32."""
    return _rotate(x, cos, sin, -1.0)
