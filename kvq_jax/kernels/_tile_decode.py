"""Dequantize one (page, kv-head) tile inside a Pallas kernel body (Triton and interpret mode).

Every function here takes the *already loaded* arrays of one tile (one physical page, one KV
head; the page and head axes are gone) and returns float32 values [page_size, D] that are bit
for bit those of the XLA codec's `unpack` of that page, sliced to that head, before its cast
to the output dtype (docs/FORMAT.md sections 2-4). ps = page_size, D = head_dim, G = group
size. Block shapes must be powers of two for Triton (ps, D, G, and so ps/G or D/G).

Per-tile arrays (shape, dtype), by format:

  int4      codes        uint8   [ps, D/2]   byte j: channel 2j in bits 0-3, 2j+1 in bits 4-7
            minimum      float16 [ps/G, D]   (axis "tokens")  or [ps, D/G] (axis "channels")
            scale        float16 same shape as minimum
  int2      codes        uint8   [ps, D/4]   byte j: channel 4j + i in bits 2i, 2i + 1
            minimum      float16 as int4
            scale        float16 as int4
  hint4     as int4      the rows still rotated (FORMAT.md 2c: the payload's INT4 decode;
  hint2     as int2      `unpack_rotated`), for attention in the rotated space
  INTB      codes        uint8   [ps, W]     each row a bit stream (FORMAT.md 2b); the kernel
                                             gathers each channel's two bytes from the ref
                                             (`intb_codes`), no tile of bytes is loaded
            minimum      float16 [ps/G, D]   token groups
            scale        float16 as minimum
            starts, bits int32 [N, H, D]     each channel's first stream bit and width, per
                                             layer table (`intb_maps`; N = 1: one table)
  nvfp4     codes        uint8   [ps, D/2]   E2M1 nibbles, same packing
            block_scale  uint8 (E4M3 bits) or float8_e4m3fn, [ps/16, D] (tokens) or
                         [ps, D/16] (channels)
            global_scale float32 []          the page's encode scale g (a scalar)
  fp8_e4m3  codes        uint8 (E4M3 bits) or float8_e4m3fn [ps, D]
            scale        float32 [ps]        one scale per token row of this head

E4M3 values are decoded from their bits with integer arithmetic (no fp8 convert
instruction, so this lowers for every CUDA GPU >= sm80); pass them as uint8 (bitcast in XLA
outside the kernel, free) or as float8_e4m3fn (bitcast here, same width).

Arithmetic follows docs/FORMAT.md with the correctly rounded helpers of `_exact` (no FMA
contraction, IEEE division on Triton; the XLA barrier division in interpret mode):
  int4/int2 f32(code) * f32(scale) + f32(minimum)              (two roundings)
  nvfp4     step = flush(f32(sf) / flush(g)); flush(e2m1(code) * step)
  fp8_e4m3  flush(f32(code) * flush(scale))
Decoded NaNs are NaN (their sign/payload may differ from XLA's; compare them as NaN).

The residual step of a loop chain is `add_in_dtype_tile(prev, delta, dtype)`: the decoded
delta rounded to the cache dtype (as `unpack` returns it), then one flushed float32 add and
one rounding to the cache dtype (`kvq_jax.codecs._numerics.add_in_dtype`). A whole chain
(`PagedKVCache.loop_chain`: per-loop formats, loops stored absolute) is `chain_steps` (static)
and `reconstruct_tile` (in the kernel body), shared by both kernels.

Every function takes `interpret` (keyword, static): True inside `pallas_call(...,
interpret=True)`, False when the kernel lowers through Triton.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from kvq_jax.codecs._numerics import e2m1_decode
from kvq_jax.core import registry
from kvq_jax.core.constants import NVFP4_GROUP_SIZE
from kvq_jax.core.layouts import IntBLayout
from kvq_jax.kernels import _exact

__all__ = [
    "FIELDS",
    "FORMATS",
    "INTB_FIELDS",
    "ROTATED",
    "add_in_dtype_tile",
    "affine_tile",
    "chain_steps",
    "decode_tile",
    "e4m3_to_f32",
    "expand_groups",
    "fields",
    "fp8_tile",
    "gather_bytes",
    "int2_tile",
    "int4_tile",
    "intb_codes",
    "intb_maps",
    "intb_row",
    "is_intb",
    "kernel_arrays",
    "layer_operand",
    "load_intb_tile",
    "load_tile",
    "nvfp4_tile",
    "reconstruct_tile",
    "unpack_crumbs_tile",
    "unpack_nibbles_tile",
]

FORMATS = ("int4", "int2", "hint4", "hint2", "nvfp4", "fp8_e4m3")
#: Hadamard-rotated formats (FORMAT.md 2c) -> the format of their payload; their tiles decode
#: to the rotated rows (un-rotating each row is left to the XLA path).
ROTATED = {"hint4": "int4", "hint2": "int2"}
#: PackedKV array fields per format: the keys of `decode_tile`'s `arrays`.
FIELDS = {
    "int4": ("codes", "minimum", "scale"),
    "int2": ("codes", "minimum", "scale"),
    "hint4": ("codes", "minimum", "scale"),
    "hint2": ("codes", "minimum", "scale"),
    "nvfp4": ("codes", "block_scale", "global_scale"),
    "fp8_e4m3": ("codes", "scale"),
}


#: An INTB plane's kernel arrays: its PackedKV fields, then its code maps (`intb_maps`).
INTB_FIELDS = ("codes", "minimum", "scale", "starts", "bits")


def is_intb(fmt: str) -> bool:
    """True for an INTB format (one bit table or one per layer; FORMAT.md 2b)."""
    try:
        return isinstance(registry.layout(fmt), IntBLayout)
    except ValueError:  # not a registered format
        return False


def fields(fmt: str) -> tuple[str, ...] | None:
    """The kernel arrays of a plane in `fmt`, in the order the kernels take them (None: no
    kernel decoder)."""
    if fmt in FIELDS:
        return FIELDS[fmt]
    return INTB_FIELDS if is_intb(fmt) else None


@functools.cache
def intb_maps(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """int32 [N, H, D] (first stream bit, width) of each channel's code, per layer table of
    INTB format `fmt` (N = 1 for a format of one table): `IntBLayout.code_starts`."""
    layout = registry.layout(fmt)
    tables = layout.tables if layout.per_layer else (layout.bits,)
    maps = [IntBLayout(t, name="table").code_starts() for t in tables]
    return np.stack([m[0] for m in maps]), np.stack([m[1] for m in maps])


def kernel_arrays(packed, prepare) -> list:
    """A packed plane's kernel arrays in `fields` order: each PackedKV field through
    `prepare` (a kernel's dtype view), an INTB plane's code maps appended (`intb_maps`)."""
    out = []
    for name in fields(packed.format):
        if name in ("starts", "bits"):
            out.append(jnp.asarray(intb_maps(packed.format)[name == "bits"]))
        else:
            out.append(prepare(getattr(packed, name)))
    return out


def gather_bytes(ref, lead: tuple, page, head, index, rows: int):
    """uint32 [rows, n]: byte index[j] of every row of (page, head) of a codes ref [*lead, P,
    rows, H, W] (a gather load: no tile of bytes is materialized); a uint16 view of the bytes
    (`paged_attention.pallas_triton._widen`) is read as pairs."""
    r = lax.broadcasted_iota(jnp.int32, (rows, index.shape[0]), 0)
    if ref.dtype == jnp.uint16:
        word = ref[(*lead, page, r, head, (index >> 1)[None, :])].astype(jnp.uint32)
        return (word >> ((index & 1) * 8).astype(jnp.uint32)[None, :]) & 0xFF
    return ref[(*lead, page, r, head, index[None, :])].astype(jnp.uint32)


def intb_codes(codes_ref, lead: tuple, page, head, start, bits, rows: int):
    """uint32 codes [rows, D] of an INTB tile: channel c's bits[c] stream bits from bit
    start[c] (int32 [D] each, the layer's row of `intb_maps`), read from the two bytes they
    lie in (`kvq_jax.codecs.formats.intb.unpack_stream`'s arithmetic)."""
    width = codes_ref.shape[-1] * (2 if codes_ref.dtype == jnp.uint16 else 1)
    lo = start // 8
    b0 = gather_bytes(codes_ref, lead, page, head, lo, rows)
    b1 = gather_bytes(codes_ref, lead, page, head, jnp.minimum(lo + 1, width - 1), rows)
    word = b0 | (b1 << 8)
    shift = (start % 8).astype(jnp.uint32)[None, :]
    mask = ((jnp.uint32(1) << bits.astype(jnp.uint32)) - 1)[None, :]
    return (word >> shift) & mask


def layer_operand(layer) -> jnp.ndarray:
    """The kernels' layer input: int32 [1] (0 for a cache without per-layer formats)."""
    return jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)


def intb_row(layer, tables: int):
    """The row of an INTB plane's code maps (`intb_maps`, [tables, H, D]) that layer `layer`
    reads: 0 for a format of one table (a cache with a per-layer plane beside it carries
    layers >= 1), else the layer clamped to [0, tables - 1] as the XLA path's gather does."""
    return 0 if tables == 1 else jnp.clip(layer, 0, tables - 1)


def load_intb_tile(refs, lead: tuple, page, head, layer, load) -> dict:
    """The `decode_tile` arrays of one INTB (page, head) tile: codes gathered (`intb_codes`)
    with layer `layer`'s maps, minimum and scale as `load(ref)` loads a metadata tile."""
    codes_ref, min_ref, scale_ref, starts_ref, bits_ref = refs
    row = intb_row(layer, starts_ref.shape[0])
    start, bits = starts_ref[row, head, :], bits_ref[row, head, :]
    rows = codes_ref.shape[-3]  # [*lead, P, page_size, H, W]
    return {
        "codes": intb_codes(codes_ref, lead, page, head, start, bits, rows),
        "minimum": load(min_ref),
        "scale": load(scale_ref),
    }


def load_tile(fmt: str, refs, lead: tuple, page, head) -> dict:
    """Load one (page, head) tile from whole-array refs of a paged cache plane.

    refs: the plane's refs in FIELDS[fmt] order, shaped as the cache stores them with
    `lead` leading indices first (() for a base plane [P, ...], (r,) for level r of a plane
    holding a run of loops [len(run), P, ...]): codes / minimum / scale / block_scale
    [*lead, P, rows, H, cols], global_scale [*lead, P], FP8 scale [*lead, P, page_size, H].
    page, head: scalar ints (traced is fine, e.g. a page id loaded in the kernel). Returns the
    `arrays` dict of `decode_tile`.
    """
    out = {}
    for field, ref in zip(FIELDS[fmt], refs, strict=True):
        if field == "global_scale":
            out[field] = ref[(*lead, page)]
        elif fmt == "fp8_e4m3" and field == "scale":
            out[field] = ref[(*lead, page, slice(None), head)]
        else:
            out[field] = ref[(*lead, page, slice(None), head, slice(None))]
    return out


def unpack_nibbles_tile(codes):
    """uint8 [ps, D/2] -> uint32 codes [ps, D] (low nibble = even channel).

    Lowers to Triton's `tt.join` (stack on a new last axis) and a reshape.
    """
    c = codes.astype(jnp.uint32)
    lo, hi = c & 0xF, (c >> 4) & 0xF
    rows, half = codes.shape
    return jnp.stack([lo, hi], axis=-1).reshape(rows, 2 * half)


def unpack_crumbs_tile(codes):
    """uint8 [ps, D/4] -> uint32 codes [ps, D] (bits 2i, 2i + 1 of byte j: channel 4j + i).

    The nibble split twice (a nibble n holds channels 2n, 2n + 1 in bits 0-1, 2-3): two
    `tt.join`s and reshapes, no 4-way stack (Triton joins two tensors)."""
    nib = unpack_nibbles_tile(codes)
    lo, hi = nib & 0x3, (nib >> 2) & 0x3
    rows, half = nib.shape
    return jnp.stack([lo, hi], axis=-1).reshape(rows, 2 * half)


def expand_groups(meta, axis: str, group_size: int):
    """Per-group metadata of a tile -> [ps, D] (each group's value repeated over its members).

    axis "tokens": [ps/G, D] -> [ps, D]; axis "channels": [ps, D/G] -> [ps, D].
    Broadcast on a new axis, then reshape (no gather).
    """
    if group_size == 1:
        return meta
    a, b = meta.shape
    if axis == "tokens":
        return jnp.broadcast_to(meta[:, None, :], (a, group_size, b)).reshape(a * group_size, b)
    if axis == "channels":
        return jnp.broadcast_to(meta[:, :, None], (a, b, group_size)).reshape(a, b * group_size)
    raise ValueError(f"axis must be 'tokens' or 'channels', got {axis!r}")


def e4m3_to_f32(x):
    """E4M3 (float8_e4m3fn or its uint8 bits) -> float32, exact, from the bits.

    Normal: 2**(e-7) * (1 + m/8); subnormal (e = 0): m * 2**-9; 0x7F/0xFF: NaN.
    """
    if x.dtype == jnp.float8_e4m3fn:
        x = lax.bitcast_convert_type(x, jnp.uint8)
    c = x.astype(jnp.uint32)
    sign = (c & 0x80) << 24
    e, m = (c >> 3) & 0xF, c & 0x7
    normal = ((e + 120) << 23) | (m << 20)
    # m * 2**-9 is exact (a small integer times a power of two); 0 for m == 0.
    sub = lax.bitcast_convert_type(m.astype(jnp.float32) * np.float32(2.0**-9), jnp.uint32)
    nan = (e == 15) & (m == 7)
    bits = jnp.where(e == 0, sub, normal)
    bits = jnp.where(nan, jnp.uint32(0x7FC00000), bits) | sign
    return lax.bitcast_convert_type(bits, jnp.float32)


def int4_tile(codes, minimum, scale, *, axis: str, group_size: int, interpret: bool):
    """INT4 tile -> float32 [ps, D]: f32(code) * f32(scale) + f32(minimum), two roundings."""
    q = unpack_nibbles_tile(codes)
    return affine_tile(q, minimum, scale, axis=axis, group_size=group_size, interpret=interpret)


def int2_tile(codes, minimum, scale, *, axis: str, group_size: int, interpret: bool):
    """INT2 tile -> float32 [ps, D]: INT4's arithmetic on 2-bit codes (FORMAT.md 2a)."""
    q = unpack_crumbs_tile(codes)
    return affine_tile(q, minimum, scale, axis=axis, group_size=group_size, interpret=interpret)


def affine_tile(q, minimum, scale, *, axis: str, group_size: int, interpret: bool):
    """Integer codes [ps, D] -> float32 f32(code) * f32(scale) + f32(minimum) (two roundings)."""
    q = q.astype(jnp.float32)
    sc = expand_groups(scale.astype(jnp.float32), axis, group_size)
    mn = expand_groups(minimum.astype(jnp.float32), axis, group_size)
    prod = _exact.multiply(q, sc, interpret=interpret)
    return _exact.add(prod, mn, interpret=interpret)


def nvfp4_tile(codes, block_scale, global_scale, *, axis: str, interpret: bool):
    """NVFP4 tile -> float32 [ps, D]: flush(e2m1(code) * flush(sf / flush(g)))."""
    sf = e4m3_to_f32(block_scale)
    g = _exact.flush_subnormal(jnp.asarray(global_scale, jnp.float32))
    g = jnp.broadcast_to(g, sf.shape)
    step = _exact.flush_subnormal(_exact.divide(sf, g, interpret=interpret))
    step = expand_groups(step, axis, NVFP4_GROUP_SIZE)
    values = e2m1_decode(unpack_nibbles_tile(codes))
    return _exact.flush_subnormal(_exact.multiply(values, step, interpret=interpret))


def fp8_tile(codes, scale, *, interpret: bool):
    """FP8 E4M3 tile -> float32 [ps, D]: flush(f32(code) * flush(scale[row]))."""
    q = e4m3_to_f32(codes)
    s = _exact.flush_subnormal(jnp.asarray(scale, jnp.float32))
    s = jnp.broadcast_to(s[:, None], q.shape)
    return _exact.flush_subnormal(_exact.multiply(q, s, interpret=interpret))


def decode_tile(fmt: str, axis: str, group_size: int, arrays: dict, *, interpret: bool):
    """Dispatch on `fmt`: `arrays` holds the tile's arrays by PackedKV field name
    (int4 / int2: codes, minimum, scale; nvfp4: codes, block_scale, global_scale; fp8_e4m3:
    codes, scale), shaped as in the module doc. Returns float32 [page_size, D] (HINT4 / HINT2:
    the rows still rotated, `unpack_rotated`)."""
    fmt = ROTATED.get(fmt, fmt)
    if is_intb(fmt):  # codes already unpacked (`load_intb_tile`), INT4's arithmetic
        return affine_tile(arrays["codes"], arrays["minimum"], arrays["scale"], axis=axis,
                           group_size=group_size, interpret=interpret)  # fmt: skip
    if fmt in ("int4", "int2"):
        return (int4_tile if fmt == "int4" else int2_tile)(
            arrays["codes"],
            arrays["minimum"],
            arrays["scale"],
            axis=axis,
            group_size=group_size,
            interpret=interpret,
        )
    if fmt == "nvfp4":
        if group_size != NVFP4_GROUP_SIZE:
            raise ValueError(f"nvfp4 group_size must be 16, got {group_size}")
        return nvfp4_tile(
            arrays["codes"],
            arrays["block_scale"],
            arrays["global_scale"],
            axis=axis,
            interpret=interpret,
        )
    if fmt == "fp8_e4m3":
        return fp8_tile(arrays["codes"], arrays["scale"], interpret=interpret)
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def add_in_dtype_tile(prev, delta, dtype, *, interpret: bool):
    """One residual step: (prev + delta) in `dtype` (bf16/fp16/fp32), as `add_in_dtype`.

    prev: the reconstruction so far, in `dtype` (or float32 holding a `dtype` value).
    delta: the decoded delta, float32 from `decode_tile` (rounded to `dtype` here first,
    exactly as `unpack` returns it) or already in `dtype`. Both are widened to float32 and
    flushed, added once (IEEE, never fused), flushed, and rounded once to `dtype`.
    """
    dtype = jnp.dtype(dtype)
    a = _exact.flush_subnormal(jnp.asarray(prev).astype(dtype).astype(jnp.float32))
    b = _exact.flush_subnormal(jnp.asarray(delta).astype(dtype).astype(jnp.float32))
    return _exact.flush_subnormal(_exact.add(a, b, interpret=interpret)).astype(dtype)


def chain_steps(cache, kind: str, loop: int) -> tuple[tuple, list]:
    """The static plan of reconstructing loop `loop` of `kind` in a kernel, and the packed
    planes it reads, each once (a run of loops in one format is one plane).

    Returns (steps, planes): steps ((format, axis, group_size, plane, level), ...) in the
    order of `PagedCacheConfig.chain`: the first is loop 0 or the last loop stored absolute
    at or before `loop` (decoded alone), every later one a delta; plane indexes `planes`;
    level is the loop's index on that plane's loop axis (None for the base plane [P, ...]).
    Adaptive-exit caches (chains from loop 0 through absolute loops, per-row depths) have no
    kernel plan: a ValueError (the kernels' config_support declines them)."""
    config = cache.config
    if config.adaptive_exit:
        raise ValueError("cache.config.adaptive_exit: no kernel plan (the XLA path decodes it)")
    index: dict = {}
    planes, steps = [], []
    for i in config.chain(kind, loop):
        field, run, level = config.plane_of(kind, i)
        if (field, run) not in index:
            index[field, run] = len(planes)
            planes.append(cache.loop_plane(kind, i)[0])
        args = config.loop_pack_args(kind, i)
        steps.append((args["format"], args["axis"], args["group_size"], index[field, run], level))
    return tuple(steps), planes


def reconstruct_tile(steps, load, dtype, *, rotated: bool = False, interpret: bool):
    """One (page, head) tile of a loop through its chain, in `dtype`, as the XLA path's
    `decode_pages`: the first step decoded alone, each later delta added in the cache dtype
    (`add_in_dtype_tile`). steps: from `chain_steps`; load(fmt, plane, lead) -> the tile's
    `decode_tile` arrays, lead () for a base plane or (level,) for a plane with a loop
    axis. rotated (every step a rotated format): float32 rows still in the rotated space, the
    steps summed in float32 (`decode_pages(rotated=True)`)."""
    recon = None
    for fmt, axis, group_size, plane, level in steps:
        lead = () if level is None else (level,)
        values = decode_tile(fmt, axis, group_size, load(fmt, plane, lead), interpret=interpret)
        if rotated:
            recon = values if recon is None else _exact.add(recon, values, interpret=interpret)
        elif recon is None:
            recon = values.astype(dtype)
        else:
            recon = add_in_dtype_tile(recon, values, dtype, interpret=interpret)
    return recon
