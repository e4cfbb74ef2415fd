"""FP8 E4M3 with one float32 scale per (token, head) over the D channels.

docs/FORMAT.md section 4. The group is always the whole channel axis (axis "channels",
group_size D); the codes are the float8_e4m3fn values themselves, 8 bits each.
"""

from __future__ import annotations

import jax.numpy as jnp

from kvq_jax.codecs._numerics import divide, flush_subnormal, widen
from kvq_jax.codecs.codec import Codec
from kvq_jax.core.constants import E4M3_MAX
from kvq_jax.core.layouts import FP8E4M3Layout


class FP8E4M3Codec(FP8E4M3Layout, Codec):
    def encode(self, values, *, axis, group_size) -> dict:
        x = widen(values)
        finite = jnp.all(jnp.isfinite(values), axis=-1)
        # max |x| = max(max x, -min x) on the input dtype (exact; flushed after: FTZ is
        # monotone): XLA:CPU reduces the input buffer instead of a float32 copy of |x|.
        mn = flush_subnormal(jnp.min(values, axis=-1).astype(jnp.float32))
        mx = flush_subnormal(jnp.max(values, axis=-1).astype(jnp.float32))
        amax = jnp.abs(jnp.maximum(mx, -mn))
        s = flush_subnormal(divide(amax, E4M3_MAX, fuse=False))
        ok = (finite & (s > 0))[..., None]
        q = jnp.clip(divide(x, jnp.where(ok, s[..., None], 1.0)), -E4M3_MAX, E4M3_MAX)
        codes = jnp.where(ok, q, 0.0).astype(jnp.float8_e4m3fn)
        scale = jnp.where(finite, s, jnp.float32(jnp.nan))
        return {"codes": codes, "scale": scale}

    def unpack(self, packed, dtype) -> jnp.ndarray:
        out = flush_subnormal(
            packed.codes.astype(jnp.float32) * flush_subnormal(packed.scale)[..., None]
        )
        return out.astype(dtype)


CODEC = FP8E4M3Codec()
