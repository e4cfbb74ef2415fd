"""Pack / unpack throughput of every registered kvq format against plain peer codecs.

    python bench/codec_speed.py [--quick] [--json PATH] [--repeats N] [--shapes T,H,D ...]

For each bf16 [T, H, D] shape, format in `kvq_jax.CODECS` and kind (key / value):
pack_kv and unpack_kv (to bf16) are timed after a warm-up, as the median of N runs, each
blocked until ready. GB/s counts the bf16 tensor: the input of pack, the output of unpack.

Measured in the same process, on the same tensor:
- "(copy)": a jitted copy of the same bf16 bytes (`x * one`, read once and written once);
- peers: plain codecs of the same format and groups written the obvious way, a `jax.jit`
  one and a vectorized Torch one (torchao / qwix as well when installed: neither is here).
  They skip kvq's exactness rules (division barrier, FTZ, NaN policy), so they are the speed
  anyone gets from twenty lines of array code.

Columns: "x peer" = best peer time / kvq time (2.0: kvq is twice as fast as the fastest
peer); "% copy" = copy time / kvq time in percent (the share of copy bandwidth reached).
"""

from __future__ import annotations

import functools
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing

import kvq_jax

SHAPES = ((2048, 16, 128), (32768, 8, 128))
KINDS = ("key", "value")
COLUMNS = (
    ("shape", "shape [T,H,D]", None),
    ("format", "format", None),
    ("impl", "impl", None),
    ("kind", "kind", None),
    ("axis", "axis", None),
    ("op", "op", None),
    ("ms", "ms", ".3f"),
    ("gbps", "GB/s", ".2f"),
    ("x_peer", "x peer", ".2f"),
    ("pct_copy", "% copy", ".1f"),
    ("bits_per_element", "bits/elem", ".4f"),
)


def _pack(values, *, kind, fmt):
    return kvq_jax.pack_kv(values, kind=kind, format=fmt)


# ---------------------------------------------------------------------------------------------
# Peers: plain codecs of the same formats, the way one writes them without kvq's exactness
# rules (no division barrier, no FTZ, no NaN policy). Same groups, same stored arrays.


def _groups(x, axis, g):
    """[T, H, D] -> grouped view and the member axis (full groups only)."""
    t, h, d = x.shape
    if axis == "tokens":
        return x.reshape(t // g, g, h, d), 1
    return x.reshape(t, h, d // g, g), 3


@functools.partial(jax.jit, static_argnames=("axis", "g"))
def jax_int4_pack(x, *, axis, g):
    xg, m = _groups(x.astype(jnp.float32), axis, g)
    mn, mx = xg.min(m, keepdims=True), xg.max(m, keepdims=True)
    scale = jnp.where(mx > mn, (mx - mn) / 15.0, 1.0)
    q = jnp.clip(jnp.round((xg - mn) / scale), 0, 15).astype(jnp.uint8).reshape(x.shape)
    codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return codes, mn.squeeze(m).astype(jnp.float16), scale.squeeze(m).astype(jnp.float16)


@functools.partial(jax.jit, static_argnames=("axis", "g"))
def jax_int4_unpack(codes, mn, scale, *, axis, g):
    t, h, half = codes.shape
    q = jnp.stack([codes & 15, codes >> 4], -1).reshape(t, h, 2 * half).astype(jnp.float32)
    qg, m = _groups(q, axis, g)
    out = qg * jnp.expand_dims(scale, m).astype(jnp.float32) + jnp.expand_dims(mn, m)
    return out.reshape(t, h, 2 * half).astype(jnp.bfloat16)


#: E2M1 rounding midpoints and whether a tie rounds up (to the even code).
E2M1_MIDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
             (3.5, True), (5.0, False))  # fmt: skip


def _e2m1_code(a):
    """|y| in [0, 6] -> 3-bit E2M1 code (uint8), for jax and torch arrays alike."""
    return sum((a >= v) * 1 if up else (a > v) * 1 for v, up in E2M1_MIDS)


@functools.partial(jax.jit, static_argnames=("axis",))
def jax_nvfp4_pack(x, *, axis):
    xf = x.astype(jnp.float32)
    g = 2688.0 / jnp.max(jnp.abs(xf))
    xg, m = _groups(xf, axis, 16)
    s8 = jnp.minimum(g * (jnp.abs(xg).max(m, keepdims=True) / 6.0), 448.0)
    s8 = s8.astype(jnp.float8_e4m3fn)
    y = jnp.clip(xg * (g / s8.astype(jnp.float32)), -6.0, 6.0)
    q = (
        _e2m1_code(jnp.abs(y)).astype(jnp.uint8) | (jnp.signbit(y).astype(jnp.uint8) << 3)
    ).reshape(x.shape)
    return q[..., 0::2] | (q[..., 1::2] << 4), s8.squeeze(m), g


E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
              -4.0, -6.0)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("axis",))
def jax_nvfp4_unpack(codes, s8, g, *, axis):
    t, h, half = codes.shape
    q = jnp.stack([codes & 15, codes >> 4], -1).reshape(t, h, 2 * half)
    vg, m = _groups(jnp.asarray(E2M1_TABLE, jnp.float32)[q], axis, 16)
    out = vg * jnp.expand_dims(s8.astype(jnp.float32) / g, m)
    return out.reshape(t, h, 2 * half).astype(jnp.bfloat16)


@jax.jit
def jax_fp8_pack(x):
    xf = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(xf), -1, keepdims=True) / 448.0
    q = jnp.clip(xf / jnp.where(s > 0, s, 1.0), -448.0, 448.0).astype(jnp.float8_e4m3fn)
    return q, s[..., 0]


@jax.jit
def jax_fp8_unpack(q, s):
    return (q.astype(jnp.float32) * s[..., None]).astype(jnp.bfloat16)


def _torch_groups(x, axis, g):
    t, h, d = x.shape
    if axis == "tokens":
        return x.reshape(t // g, g, h, d), 1
    return x.reshape(t, h, d // g, g), 3


def torch_int4_pack(x, *, axis, g):
    xg, m = _torch_groups(x.float(), axis, g)
    mn, mx = xg.amin(m, keepdim=True), xg.amax(m, keepdim=True)
    scale = torch.where(mx > mn, (mx - mn) / 15.0, 1.0)
    q = ((xg - mn) / scale).round_().clamp_(0, 15).to(torch.uint8).reshape(x.shape)
    codes = q[..., 0::2] | (q[..., 1::2] << 4)
    return codes, mn.squeeze(m).half(), scale.squeeze(m).half()


def torch_int4_unpack(codes, mn, scale, *, axis, g):
    t, h, half = codes.shape
    q = torch.stack([codes & 15, codes >> 4], -1).reshape(t, h, 2 * half).float()
    qg, m = _torch_groups(q, axis, g)
    out = qg * scale.unsqueeze(m).float() + mn.unsqueeze(m).float()
    return out.reshape(t, h, 2 * half).bfloat16()


def torch_nvfp4_pack(x, *, axis):
    xf = x.float()
    g = 2688.0 / xf.abs().amax()
    xg, m = _torch_groups(xf, axis, 16)
    s8 = (g * (xg.abs().amax(m, keepdim=True) / 6.0)).clamp_(max=448.0)
    s8 = s8.to(torch.float8_e4m3fn)
    y = (xg * (g / s8.float())).clamp_(-6.0, 6.0)
    q = _e2m1_code(y.abs()).to(torch.uint8) | (torch.signbit(y).to(torch.uint8) << 3)
    q = q.reshape(x.shape)
    return q[..., 0::2] | (q[..., 1::2] << 4), s8.squeeze(m), g


def torch_nvfp4_unpack(codes, s8, g, *, axis):
    t, h, half = codes.shape
    q = torch.stack([codes & 15, codes >> 4], -1).reshape(t, h, 2 * half)
    vg, m = _torch_groups(torch.tensor(E2M1_TABLE)[q.long()], axis, 16)
    out = vg * (s8.float() / g).unsqueeze(m)
    return out.reshape(t, h, 2 * half).bfloat16()


def torch_fp8_pack(x):
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True) / 448.0
    q = (xf / torch.where(s > 0, s, 1.0)).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, s[..., 0]


def torch_fp8_unpack(q, s):
    return (q.float() * s[..., None]).bfloat16()


def peer_codecs(fmt: str, axis: str, group_size: int) -> dict:
    """name -> (pack(x), unpack(packed)) of the peers of one format (x: jax bf16 [T, H, D])."""

    def to_torch(x):
        return torch.from_numpy(np.array(x.astype(jnp.float32))).bfloat16()

    if fmt == "int4":
        jp = functools.partial(jax_int4_pack, axis=axis, g=group_size)
        ju = functools.partial(jax_int4_unpack, axis=axis, g=group_size)
        tp = functools.partial(torch_int4_pack, axis=axis, g=group_size)
        tu = functools.partial(torch_int4_unpack, axis=axis, g=group_size)
    elif fmt == "nvfp4":
        jp, ju = (functools.partial(f, axis=axis) for f in (jax_nvfp4_pack, jax_nvfp4_unpack))
        tp, tu = (functools.partial(f, axis=axis) for f in (torch_nvfp4_pack, torch_nvfp4_unpack))
    elif fmt == "fp8_e4m3":
        jp, ju, tp, tu = jax_fp8_pack, jax_fp8_unpack, torch_fp8_pack, torch_fp8_unpack
    else:
        return {}
    return {"jax.jit": (jp, ju, lambda x: x), "torch": (tp, tu, to_torch)}


def _block(result):
    """Block on jax results; Torch CPU ops are synchronous already."""
    leaves = jax.tree_util.tree_leaves(result)
    return jax.block_until_ready([a for a in leaves if isinstance(a, jax.Array)])


def time_op(fn, *args, warmup, repeats):
    return _timing.median_time(lambda *a: _block(fn(*a)), *args, warmup=warmup, repeats=repeats)


def bench_shape(shape, *, warmup: int, repeats: int) -> list[dict]:
    x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    nbytes = math.prod(shape) * x.dtype.itemsize
    copy_fn, copy_args = _timing.copy_baseline(x)
    copy = _timing.median_time(copy_fn, *copy_args, warmup=warmup, repeats=repeats)
    label = "x".join(map(str, shape))

    def row(fmt, impl, kind, axis, op, t, **extra):
        return {
            "shape": label,
            "format": fmt,
            "impl": impl,
            "kind": kind,
            "axis": axis,
            "op": op,
            "ms": t.median_ms,
            "min_ms": t.min_s * 1e3,
            "gbps": _timing.gbps(nbytes, t.median_s),
            "pct_copy": 100 * copy.median_s / t.median_s,
            **extra,
        }

    rows = [row("(copy)", "jax.jit", "", "", "x*one", copy, bits_per_element=16.0)]
    for fmt in kvq_jax.CODECS:
        for kind in KINDS:
            pack = functools.partial(_pack, kind=kind, fmt=fmt)
            packed = jax.block_until_ready(pack(x))
            out = jax.block_until_ready(kvq_jax.unpack_kv(packed))
            assert out.shape == x.shape and out.dtype == x.dtype
            kvq = {
                "pack": time_op(pack, x, warmup=warmup, repeats=repeats),
                "unpack": time_op(kvq_jax.unpack_kv, packed, warmup=warmup, repeats=repeats),
            }
            best = {}
            peer_rows = []
            for name, (p_pack, p_unpack, convert) in peer_codecs(
                fmt, packed.axis, packed.group_size
            ).items():
                xin = convert(x)
                p_packed = p_pack(xin)
                for op, t in (
                    ("pack", time_op(p_pack, xin, warmup=warmup, repeats=repeats)),
                    ("unpack", time_op(p_unpack, *p_packed, warmup=warmup, repeats=repeats)),
                ):
                    best[op] = min(best.get(op, math.inf), t.median_s)
                    peer_rows.append(row(fmt, name, kind, packed.axis, op, t))
            for op, t in kvq.items():
                rows.append(
                    row(
                        fmt,
                        "kvq",
                        kind,
                        packed.axis,
                        op,
                        t,
                        x_peer=best.get(op, math.nan) / t.median_s,
                        bits_per_element=packed.bits_per_element,
                        storage_bytes=packed.storage_bytes,
                    )
                )
            rows += peer_rows
    return rows


def main(argv=None) -> int:
    parser = _timing.bench_parser(__doc__)
    parser.add_argument(
        "--shapes", nargs="+", default=None, metavar="T,H,D", help="bf16 shapes to measure"
    )
    args = parser.parse_args(argv)
    warmup, repeats = _timing.repeat_counts(args, quick=(1, 3), full=(3, 15))
    shapes = SHAPES if args.shapes is None else [tuple(map(int, s.split(","))) for s in args.shapes]

    header = _timing.device_header() + f", torch {torch.__version__}"
    print(header)
    print(
        f"kvq {kvq_jax.__version__}; formats {', '.join(kvq_jax.CODECS)}; bf16 input; "
        f"median of {repeats} runs after {warmup} warm-up; GB/s = bf16 bytes (pack: input, "
        f"unpack: output) / median time; x peer = fastest peer time / kvq time; "
        f"% copy = jitted-copy time / time"
    )
    rows = []
    for shape in shapes:
        rows += bench_shape(shape, warmup=warmup, repeats=repeats)
    _timing.report(args, header, rows, COLUMNS, warmup=warmup, repeats=repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
