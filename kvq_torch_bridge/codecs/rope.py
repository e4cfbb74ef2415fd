"""RoPE in Torch (mirrors `kvq_jax.codecs.rope` bit for bit: float64 arithmetic on the float32
inputs, one rounding to float32; tables from `kvq_jax.core.rope.rope_tables`)."""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _rotate(x, cos, sin, sign: float) -> torch.Tensor:
    x = x.to(torch.float32).to(torch.float64)
    cos, sin = cos.to(torch.float64), sin.to(torch.float64)
    return (x * cos + sign * (_rotate_half(x) * sin)).to(torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> x * cos + rotate_half(x) * sin as float32 (cos, sin: float32 [T, 1, D])."""
    return _rotate(x, cos, sin, 1.0)


def invert_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse rotation: x * cos - rotate_half(x) * sin, float32."""
    return _rotate(x, cos, sin, -1.0)
