"""HINT4 and HINT2 in torch (mirrors kvq_jax.codecs.formats.hadamard): INT4 / INT2 of
Hadamard-rotated (token, head) rows. docs/FORMAT.md section 2c.
"""

from __future__ import annotations

import torch

from kvq_jax.core.layouts import HInt2Layout, HInt4Layout, rotation_shifts
from kvq_torch_bridge.codecs._dtypes import torch_dtype
from kvq_torch_bridge.codecs._numerics import F32, flush_subnormal, widen
from kvq_torch_bridge.codecs.codec import Codec
from kvq_torch_bridge.codecs.formats import int2, int4


def butterfly(y: torch.Tensor) -> torch.Tensor:
    """float32 [..., D] (D a power of two) -> the unnormalized Sylvester-Hadamard transform
    along the last axis: stage s pairs channel i (bit s clear) with i + 2^s."""
    d = y.shape[-1]
    h = 1
    while h < d:
        pairs = y.reshape(*y.shape[:-1], d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([flush_subnormal(a + b), flush_subnormal(a - b)], dim=-2)
        y = y.reshape(*y.shape[:-3], d)
        h *= 2
    return y


def _scale(y: torch.Tensor, shift: int) -> torch.Tensor:
    return flush_subnormal(y * 2.0**-shift)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """R: float32 [..., D] -> butterfly * 2^-floor(n/2), n = log2 D."""
    return _scale(butterfly(x), rotation_shifts(x.shape[-1])[0])


def unrotate(y: torch.Tensor) -> torch.Tensor:
    """Rinv: float32 [..., D] -> butterfly * 2^-ceil(n/2)."""
    return _scale(butterfly(y), rotation_shifts(y.shape[-1])[1])


class _Rotated(Codec):
    """A base codec's data paths on rotated rows (the layout comes from the subclass)."""

    base_codec: Codec

    def encode(self, values, *, axis, group_size) -> dict:
        return self.base_codec.encode(rotate(widen(values)), axis=axis, group_size=group_size)

    def unpack(self, packed, dtype) -> torch.Tensor:
        out = unrotate(self.base_codec.unpack(packed, F32))
        return out.to(torch_dtype(dtype)).contiguous()


class HInt4Codec(HInt4Layout, _Rotated):
    base_codec = int4.CODEC


class HInt2Codec(HInt2Layout, _Rotated):
    base_codec = int2.CODEC


HINT4 = HInt4Codec()
HINT2 = HInt2Codec()
