"""INTB in torch (mirrors kvq_jax.codecs.formats.intb): grouped affine INT with a static bit width
per (head, channel), token groups, FP16 minimum and scale per group, any G >= 1.

docs/FORMAT.md section 2b. INT4's arithmetic (`kvq_torch_bridge.codecs.formats.int4`'s `quantize`
and `dequantize`) with 2^b - 1 levels per channel, b from the codec's bit table: codes are computed
with the float32 minimum and scale (span / levels, IEEE division); the stored FP16 metadata is
rounded afterwards and used by decode. Each (token, head) row's codes are one
least-significant-first bit stream of W bytes. One codec instance per table, not registered by
default: `register_codec(IntBCodec(bits))` registers it under `intb_name(bits)` (the name of the
kvq_jax instance for the same table) unless named.
"""

from __future__ import annotations

import numpy as np
import torch

from kvq_jax.core.layouts import IntBLayout
from kvq_torch_bridge.codecs import _grouping
from kvq_torch_bridge.codecs._dtypes import torch_dtype
from kvq_torch_bridge.codecs._numerics import F32, widen
from kvq_torch_bridge.codecs.codec import Codec
from kvq_torch_bridge.codecs.formats.int4 import dequantize, quantize


def pack_stream(codes: torch.Tensor, channel: np.ndarray, bit: np.ndarray) -> torch.Tensor:
    """uint8 codes [..., H, D] -> uint8 [..., H, W]: stream bit j of head h is bit `bit[h, j]`
    of channel `channel[h, j]`'s code (int32 [H, 8W] maps, `IntBLayout.stream_maps`)."""
    h, n = channel.shape
    device = codes.device
    index = torch.as_tensor(channel, dtype=torch.int64, device=device)
    shift = torch.as_tensor(bit, dtype=torch.uint8, device=device)
    picked = torch.gather(codes, -1, index.expand(*codes.shape[:-2], h, n))  # [..., H, 8W]
    bits = ((picked >> shift) & 1).reshape(*codes.shape[:-2], h, n // 8, 8)
    weights = torch.arange(8, dtype=torch.uint8, device=device)
    return torch.sum(bits << weights, dim=-1, dtype=torch.uint8)  # distinct bits: sum == or


def unpack_stream(packed: torch.Tensor, index: np.ndarray, valid: np.ndarray) -> torch.Tensor:
    """uint8 [..., H, W] -> uint8 codes [..., H, D]: bit i of channel c's code is stream bit
    `index[h, c, i]` where `valid[h, c, i]` (int32 / bool [H, D, 8], `IntBLayout.code_maps`)."""
    device = packed.device
    lanes = torch.arange(8, dtype=torch.uint8, device=device)
    bits = (packed.unsqueeze(-1) >> lanes) & 1
    bits = bits.reshape(*packed.shape[:-1], 8 * packed.shape[-1])  # [..., H, 8W]
    h, d, _ = index.shape
    flat = torch.as_tensor(index.reshape(h, d * 8), dtype=torch.int64, device=device)
    gathered = torch.gather(bits, -1, flat.expand(*bits.shape[:-2], h, d * 8))
    gathered = gathered.reshape(*bits.shape[:-2], h, d, 8)
    weights = np.where(valid, 1 << np.arange(8), 0).astype(np.uint8)
    weights = torch.as_tensor(weights, device=device)  # [H, D, 8]: 2^i, or 0 past b
    return torch.sum(gathered * weights, dim=-1, dtype=torch.uint8)


class IntBCodec(IntBLayout, Codec):
    def encode(self, values, *, axis, group_size) -> dict:
        layout = _grouping.GroupLayout(tuple(values.shape), axis, group_size)
        levels = torch.as_tensor(self.levels(), dtype=F32, device=values.device)  # [H, D]
        codes, minimum, scale = quantize(widen(values), layout, levels)
        return {
            "codes": pack_stream(codes, *self.stream_maps()),
            "minimum": minimum,
            "scale": scale,
        }

    def unpack(self, packed, dtype) -> torch.Tensor:
        layout = _grouping.GroupLayout(packed.shape, packed.axis, packed.group_size)
        codes = unpack_stream(packed.codes, *self.code_maps())
        out = dequantize(codes, packed.minimum, packed.scale, layout)
        return out.to(torch_dtype(dtype)).contiguous()


def register_table(bits) -> str:
    """Register the INTB format of bit table `bits` in the Torch registry unless a codec of
    that name is there already; returns the name (`intb_name(bits)`). The conformance
    runner's `register_table` for this stack."""
    from kvq_torch_bridge.codecs.registry import CODECS, register_codec

    codec = IntBCodec(bits)
    if codec.name not in CODECS:
        register_codec(codec)
    return codec.name
