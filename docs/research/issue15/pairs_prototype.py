"""Prototype (not library code): the INT4 residual chain of `decode_loop` in channel pairs.

    PYTHONPATH=. JAX_PLATFORMS=cpu python docs/research/issue15/pairs_prototype.py

For an int4+int4 loop stack (bench/residual_speed.py's data), loop l is rebuilt as two
contiguous [T, H, D/2] chains (the low nibbles = channels 2j, the high nibbles = 2j + 1), each
base + deltas with `add_in_dtype`, and the two bf16 results are joined only at the end, as one
32-bit word per channel pair. Same operations per element, so the same bits (checked against
`kvq_jax.decode_loop`). Token-group (K) metadata is split into its even and odd channels
outside the jit here (the library would have to materialize that split: fused, the stride-2
read of the metadata made K slower than the interleaved decode).
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "bench"))

import _timing
import residual_speed

import kvq_jax
from kvq_jax.codecs._numerics import add_in_dtype


def planes(code):
    """Per plane: (codes, (minimum even, odd), (scale even, odd), axis, group_size)."""
    out = []
    for p in [code.base] + [r.payload for r in code.residuals]:
        if p.axis == "tokens":
            mins = tuple(jnp.asarray(np.asarray(p.minimum)[..., i::2].copy()) for i in (0, 1))
            scales = tuple(jnp.asarray(np.asarray(p.scale)[..., i::2].copy()) for i in (0, 1))
        else:
            mins, scales = (p.minimum, p.minimum), (p.scale, p.scale)
        out.append((p.codes, mins, scales, p.axis, p.group_size))
    return out


def half(plane, part: int, shape):
    codes, mins, scales, axis, g = plane
    t, h, d = shape
    c = (codes >> 4) if part else (codes & 15)
    mn, sc = mins[part].astype(jnp.float32), scales[part].astype(jnp.float32)
    if axis == "tokens":
        q = c.reshape(t // g, g, h, d // 2).astype(jnp.float32)
        return (q * sc[:, None] + mn[:, None]).reshape(t, h, d // 2).astype(jnp.bfloat16)
    q = c.reshape(t, h, d // g, g // 2).astype(jnp.float32)
    return (q * sc[..., None] + mn[..., None]).reshape(t, h, d // 2).astype(jnp.bfloat16)


def decode_pairs(arrays, *, meta, loop, shape):
    ps = [(*a, *m) for a, m in zip(arrays, meta, strict=True)]
    words = []
    for part in (0, 1):
        r = half(ps[0], part, shape)
        for p in ps[1 : loop + 1]:
            r = add_in_dtype(r, half(p, part, shape))
        words.append(lax.bitcast_convert_type(r, jnp.uint16).astype(jnp.uint32))
    joined = words[0] | (words[1] << 16)
    return lax.bitcast_convert_type(joined, jnp.bfloat16).reshape(shape)


def main():
    loops = residual_speed.loop_stack()
    shape = loops.shape[1:]
    for kind in ("key", "value"):
        code = kvq_jax.encode_loops(loops, kind=kind, base_format="int4")
        ps = planes(code)
        arrays = [p[:3] for p in ps]
        meta = tuple(p[3:] for p in ps)
        for loop in (0, 1, 3):
            ref = kvq_jax.decode_loop(code, loop=loop)
            f = jax.jit(functools.partial(decode_pairs, meta=meta, loop=loop, shape=shape))
            same = np.array_equal(
                np.asarray(ref).view(np.uint16), np.asarray(f(arrays)).view(np.uint16)
            )
            t0 = _timing.median_time(
                functools.partial(kvq_jax.decode_loop, loop=loop), code, warmup=2, repeats=15
            )
            t1 = _timing.median_time(f, arrays, warmup=2, repeats=15)
            print(
                f"{kind:5s} loop {loop}: decode_loop {t0.min_s * 1e3:6.2f} ms, "
                f"pairs {t1.min_s * 1e3:6.2f} ms, same bits {same}",
                flush=True,
            )


if __name__ == "__main__":
    main()
