"""Two 4-bit codes per byte: channel 2j in bits 0-3, channel 2j+1 in bits 4-7."""

from __future__ import annotations

import torch


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., D] (values 0..15) -> uint8 [..., ceil(D/2)]; odd D pads a 0 nibble."""
    if codes.shape[-1] % 2:
        zero = torch.zeros((*codes.shape[:-1], 1), dtype=codes.dtype, device=codes.device)
        codes = torch.cat([codes, zero], dim=-1)
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor, channels: int) -> torch.Tensor:
    """uint8 [..., ceil(D/2)] -> uint8 codes [..., D] with D = `channels`."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])[..., :channels]
