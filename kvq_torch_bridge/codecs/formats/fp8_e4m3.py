"""FP8 E4M3 in torch (mirrors kvq_jax.codecs.formats.fp8_e4m3): one float32 scale per (token, head)
over the D channels. docs/FORMAT.md section 4.
"""

from __future__ import annotations

import math

import torch

from kvq_jax.core.constants import E4M3_MAX
from kvq_jax.core.layouts import FP8E4M3Layout
from kvq_torch_bridge.codecs._dtypes import torch_dtype
from kvq_torch_bridge.codecs._numerics import F32, clamp_e4m3, divide, flush_subnormal, widen
from kvq_torch_bridge.codecs.codec import Codec


class FP8E4M3Codec(FP8E4M3Layout, Codec):
    def encode(self, values, *, axis, group_size) -> dict:
        x = widen(values)
        finite = torch.isfinite(x).all(dim=-1)
        s = flush_subnormal(divide(x.abs().amax(dim=-1), E4M3_MAX))
        ok = (finite & (s > 0)).unsqueeze(-1)
        q = clamp_e4m3(divide(x, torch.where(ok, s.unsqueeze(-1), 1.0)))
        codes = torch.where(ok, q, 0.0).to(torch.float8_e4m3fn)
        scale = torch.where(finite, s, math.nan)
        return {"codes": codes, "scale": scale}

    def unpack(self, packed, dtype) -> torch.Tensor:
        scale = flush_subnormal(packed.scale).unsqueeze(-1)
        out = flush_subnormal(packed.codes.to(F32) * scale)
        return out.to(torch_dtype(dtype)).contiguous()


CODEC = FP8E4M3Codec()
