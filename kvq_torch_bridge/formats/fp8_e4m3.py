"""FP8 E4M3 in torch (mirrors kvq_jax.formats.fp8_e4m3): one float32 scale per (token, head)
over the D channels. docs/FORMAT.md section 4.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvq_jax.spec import E4M3_MAX
from kvq_torch_bridge._dtypes import NUMPY_DTYPE, torch_dtype
from kvq_torch_bridge._numerics import F32, clamp_e4m3, divide, flush_subnormal, widen
from kvq_torch_bridge.codec import Codec, check_group_size, check_kind
from kvq_torch_bridge.packed import PackedKV


class FP8E4M3Codec(Codec):
    name = "fp8_e4m3"
    array_fields = ("codes", "scale")
    default_group_size = 0  # resolved to D

    def resolve(self, shape, kind, axis, group_size):
        check_kind(kind)
        d = shape[2]
        if axis not in (None, "channels"):
            raise ValueError(f"axis must be 'channels' (or None) for fp8_e4m3, got {axis!r}")
        if group_size is not None and check_group_size(group_size) != d:
            raise ValueError(
                f"group_size must be D={d} (or None) for fp8_e4m3: one scale per "
                f"(token, head), got {group_size}"
            )
        return "channels", d

    def array_shapes(self, shape, axis, group_size):
        t, h, d = shape
        return {
            "codes": ((t, h, d), NUMPY_DTYPE[torch.float8_e4m3fn]),
            "scale": ((t, h), np.dtype(np.float32)),
        }

    def pack(self, values, *, kind, axis, group_size) -> PackedKV:
        x = widen(values)
        finite = torch.isfinite(x).all(dim=-1)
        s = flush_subnormal(divide(x.abs().amax(dim=-1), E4M3_MAX))
        ok = (finite & (s > 0)).unsqueeze(-1)
        q = clamp_e4m3(divide(x, torch.where(ok, s.unsqueeze(-1), 1.0)))
        codes = torch.where(ok, q, 0.0).to(torch.float8_e4m3fn)
        scale = torch.where(finite, s, math.nan)
        return self._packed(
            {"codes": codes, "scale": scale},
            kind=kind,
            axis=axis,
            group_size=group_size,
            shape=values.shape,
            dtype=values.dtype,
        )

    def unpack(self, packed, dtype) -> torch.Tensor:
        scale = flush_subnormal(packed.scale).unsqueeze(-1)
        out = flush_subnormal(packed.codes.to(F32) * scale)
        return out.to(torch_dtype(dtype)).contiguous()


CODEC = FP8E4M3Codec()
