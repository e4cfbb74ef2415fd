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
  hint4     as int4      `decode_tile`: the rows still rotated (FORMAT.md 2c: the payload's
  hint2     as int2      INT4 decode, `unpack_rotated`), for attention in the rotated space;
                         `decode_plain_tile`: un-rotated in the tile (`unrotate_tile`)
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

  heavy<G>  the base's arrays (INT4 / INT2 / HINT4 / HINT2 / INTB on token groups of G - 1,
            one per heavy group) for the page's ps - ps/G payload rows, then (FORMAT.md 5a)
            heavy_rows    uint8   [ps/G]     the row of each group of G held in INT8
            heavy_codes   uint8   [ps/G, D]  INT8 codes of those rows
            heavy_minimum float16 [ps/G]     per row, INT4's arithmetic with L = 255
            heavy_scale   float16 [ps/G]
            (`load_heavy_tile`: the payload's codes are loaded row by row, output row
            g*G + i from payload row g*(G-1) + i - (i > rows[g]), so the payload decodes
            straight into the page's rows; the heavy rows are put in by a select)

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
from kvq_jax.core.layouts import HEAVY_FIELDS, HeavyLayout, IntBLayout, rotation_shifts
from kvq_jax.kernels import _exact

__all__ = [
    "FIELDS",
    "FORMATS",
    "HEAVY_BASES",
    "INTB_FIELDS",
    "ROTATED",
    "add_in_dtype_tile",
    "affine_tile",
    "butterfly_tile",
    "chain_steps",
    "decode_plain_tile",
    "decode_tile",
    "depth_tile",
    "e4m3_to_f32",
    "expand_groups",
    "fields",
    "fp8_tile",
    "gather_bytes",
    "gather_rows",
    "heavy_layout",
    "heavy_parts",
    "heavy_row_index",
    "heavy_support",
    "int2_tile",
    "int4_tile",
    "intb_codes",
    "intb_maps",
    "intb_row",
    "is_intb",
    "kernel_arrays",
    "layer_operand",
    "load_heavy_tile",
    "load_intb_tile",
    "load_tile",
    "nvfp4_tile",
    "reconstruct_tile",
    "rotate_tile",
    "rotated_format",
    "tile_support",
    "unpack_crumbs_tile",
    "unpack_nibbles_tile",
    "unrotate_tile",
    "unwiden",
]

FORMATS = ("int4", "int2", "hint4", "hint2", "nvfp4", "fp8_e4m3")
#: Hadamard-rotated formats (FORMAT.md 2c) -> the format of their payload; their tiles decode
#: to the rotated rows (`decode_tile`); `unrotate_tile` turns a tile back (page reconstruction).
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


#: Base formats of a heavy-row format the kernels decode (INTB too): an affine payload whose
#: codes are loaded row by row (`load_heavy_tile`).
HEAVY_BASES = ("int4", "int2", "hint4", "hint2")


def heavy_layout(fmt: str) -> HeavyLayout | None:
    """The `HeavyLayout` of a heavy-row format (FORMAT.md 5a), None for other formats."""
    try:
        layout = registry.layout(fmt)
    except ValueError:  # not a registered format
        return None
    return layout if isinstance(layout, HeavyLayout) else None


def rotated_format(fmt: str) -> bool:
    """True for a Hadamard-rotated format (HINT4 / HINT2) or heavy rows over one."""
    heavy = heavy_layout(fmt)
    return (heavy.base.name if heavy is not None else fmt) in ROTATED


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
    if is_intb(fmt):
        return INTB_FIELDS
    heavy = heavy_layout(fmt)
    if heavy is not None and (heavy.base.name in HEAVY_BASES or is_intb(heavy.base.name)):
        return fields(heavy.base.name) + HEAVY_FIELDS
    return None


@functools.cache
def intb_maps(fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """int32 [N, H, D] (first stream bit, width) of each channel's code, per layer table of
    INTB format `fmt` (N = 1 for a format of one table): `IntBLayout.code_starts`."""
    return registry.layout(fmt).stacked_maps()[3:]


def kernel_arrays(packed, prepare) -> list:
    """A packed plane's kernel arrays in `fields` order: each PackedKV field through
    `prepare` (a kernel's dtype view), an INTB plane's code maps appended (`intb_maps`)."""
    heavy = heavy_layout(packed.format)
    base = packed.format if heavy is None else heavy.base.name
    out = []
    for name in fields(packed.format):
        if name in ("starts", "bits"):
            out.append(jnp.asarray(intb_maps(base)[name == "bits"]))
        else:
            out.append(prepare(getattr(packed, name)))
    return out


def unwiden(x):
    """uint16 [..., n] tile -> the uint8 [..., 2n] tile it holds (byte 2j low, 2j + 1 high:
    the kernels take uint8 arrays of 2**31 bytes or more as uint16 pairs)."""
    lo, hi = (x & 0xFF).astype(jnp.uint8), (x >> 8).astype(jnp.uint8)
    return jnp.stack([lo, hi], axis=-1).reshape(*x.shape[:-1], 2 * x.shape[-1])


def _row_grid(rows, n: int):
    """int32 [R, n]: the row of each element: rows an int R (rows 0..R-1) or row ids [R]."""
    if isinstance(rows, int):
        return lax.broadcasted_iota(jnp.int32, (rows, n), 0)
    return jnp.broadcast_to(rows[:, None], (rows.shape[0], n))


def gather_bytes(ref, lead: tuple, page, head, index, rows):
    """uint32 [R, n]: byte index[j] of rows `rows` (an int R: rows 0..R-1; or int32 row ids
    [R]) of (page, head) of a codes ref [*lead, P, rows, H, W] (a gather load: no tile of
    bytes is materialized); a uint16 view of the bytes (`unwiden`) is read as pairs."""
    r = _row_grid(rows, index.shape[0])
    if ref.dtype == jnp.uint16:
        word = ref[(*lead, page, r, head, (index >> 1)[None, :])].astype(jnp.uint32)
        return (word >> ((index & 1) * 8).astype(jnp.uint32)[None, :]) & 0xFF
    return ref[(*lead, page, r, head, index[None, :])].astype(jnp.uint32)


def gather_rows(ref, lead: tuple, page, head, rows):
    """[R, W]: rows `rows` (int32 [R]) of (page, head) of a ref [*lead, P, rows, H, W] (codes,
    or per-row metadata; a uint16 view of uint8 codes is read back as bytes, `unwiden`), one
    gather load."""
    width = ref.shape[-1]
    c = lax.broadcasted_iota(jnp.int32, (rows.shape[0], width), 1)
    tile = ref[(*lead, page, _row_grid(rows, width), head, c)]
    return unwiden(tile) if ref.dtype == jnp.uint16 else tile


def intb_codes(codes_ref, lead: tuple, page, head, start, bits, rows):
    """uint32 codes [R, D] of an INTB tile (`rows`: an int R, rows 0..R-1, or row ids [R]):
    channel c's bits[c] stream bits from bit start[c] (int32 [D] each, the layer's row of
    `intb_maps`), read from the two bytes they lie in
    (`kvq_jax.codecs.formats.intb.unpack_stream`'s arithmetic)."""
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


def heavy_row_index(rows, group: int):
    """(is_heavy bool [ps, 1], payload row int32 [ps]) of a heavy-row tile from its heavy
    rows uint8 [n] (ps = n * group): output row g*G + i is group g's heavy row when i ==
    rows[g], else payload row g*(G-1) + i - (i > rows[g]) (clamped into the payload: the
    heavy row's own entry is never used)."""
    n = rows.shape[0]
    ps = n * group
    r = jnp.broadcast_to(rows.astype(jnp.int32)[:, None], (n, group)).reshape(ps)
    t = lax.broadcasted_iota(jnp.int32, (ps,), 0)
    i = t % group
    payload = (t // group) * (group - 1) + i - (i > r).astype(jnp.int32)
    payload = jnp.clip(payload, 0, n * (group - 1) - 1)
    return (i == r)[:, None], payload


def heavy_support(heavy: HeavyLayout, axis: str, group_size: int, head_dim: int) -> str | None:
    """None when the kernels decode heavy-row format `heavy` with payload `axis` and
    `group_size` at `head_dim`, else why not (Triton tile shapes: every block a power of
    two)."""
    g = heavy.heavy_group
    if g & (g - 1):
        return f"heavy group {g} is not a power of two"
    if axis == "tokens" and group_size not in (g - 1, 1):
        return f"payload token groups of {group_size} rows (the kernels take {g - 1} or 1)"
    if axis == "channels" and (group_size & (group_size - 1) or head_dim % group_size):
        return f"payload channel groups of {group_size}: not a power of two dividing {head_dim}"
    return None


def tile_support(fmt: str, axis: str, group_size: int, page_size: int,
                 head_dim: int) -> str | None:  # fmt: skip
    """None when the tile decoders take a plane in `fmt` with `axis` / `group_size` at
    [page_size, head_dim] tiles, else why not (Triton tile shapes: every block a power of
    two). Rotation is the callers' question (which kernel reads rotated rows)."""
    if fields(fmt) is None:
        return f"format {fmt!r} has no kernel decoder"
    heavy = heavy_layout(fmt)
    if heavy is not None:
        why = heavy_support(heavy, axis, group_size, head_dim)
        return None if why is None else f"format {fmt!r}: {why}"
    if fmt in ("int2", "hint2") and head_dim < 4:
        return f"head_dim {head_dim}: INT2 tiles need head_dim >= 4 (four codes per byte)"
    if fmt == "fp8_e4m3":
        return None
    length = page_size if axis == "tokens" else head_dim
    if group_size & (group_size - 1) or length % group_size:
        return (f"{fmt} group size {group_size} along {axis} must be a power of two dividing "
                f"{length} (Triton tile shapes)")  # fmt: skip
    return None


def load_heavy_tile(fmt: str, refs, lead: tuple, page, head, layer, load) -> dict:
    """The `decode_tile` arrays of one (page, head) tile of heavy-row format `fmt`: the
    payload's codes gathered row by row into the page's rows (`heavy_row_index`; uint32
    codes [ps, D]); its metadata as `load(ref)` loads a metadata tile where it holds one
    token group per heavy group ([n, D]), else (one entry per payload row: channel groups,
    or token groups of one row) gathered the same way ([ps, D / G_b]); the heavy fields as
    `load` loads them. refs: `fields(fmt)` order."""
    heavy = heavy_layout(fmt)
    base, group = heavy.base.name, heavy.heavy_group
    n_base = len(fields(base))
    out = {f: load(r) for f, r in zip(HEAVY_FIELDS, refs[n_base:], strict=True)}
    _, payload = heavy_row_index(out["heavy_rows"], group)
    if is_intb(base):
        codes_ref, min_ref, scale_ref, starts_ref, bits_ref = refs[:n_base]
        row = intb_row(layer, starts_ref.shape[0])
        start, bits = starts_ref[row, head, :], bits_ref[row, head, :]
        codes = intb_codes(codes_ref, lead, page, head, start, bits, payload)
    else:
        codes_ref, min_ref, scale_ref = refs[:n_base]
        unpack = unpack_nibbles_tile if ROTATED.get(base, base) == "int4" else unpack_crumbs_tile
        codes = unpack(gather_rows(codes_ref, lead, page, head, payload))
    if min_ref.shape[-3] == codes_ref.shape[-3]:  # an entry per payload row
        meta = {f: gather_rows(r, lead, page, head, payload)
                for f, r in (("minimum", min_ref), ("scale", scale_ref))}  # fmt: skip
    else:
        meta = {"minimum": load(min_ref), "scale": load(scale_ref)}
    return {**out, "codes": codes, **meta}


def heavy_parts(group: int, axis: str, group_size: int, arrays: dict, *, interpret: bool):
    """(payload float32 [ps, D], heavy float32 [ps, D], is_heavy bool [ps, 1]) of a heavy-row
    tile (`load_heavy_tile`'s arrays; heavy group `group`, the payload's axis and group size):
    every row's payload decode (INT4's arithmetic with its payload row's metadata; rotated
    rows for a HINT base), every row's group's INT8 heavy row, and which rows are the heavy
    ones. Merged: `where(is_heavy, heavy, payload)`."""
    is_heavy, _ = heavy_row_index(arrays["heavy_rows"], group)
    ps = is_heavy.shape[0]
    if arrays["minimum"].shape[0] != ps:  # one token group per heavy group
        axis, group_size = "tokens", group
    payload = affine_tile(arrays["codes"], arrays["minimum"], arrays["scale"], axis=axis,
                          group_size=group_size, interpret=interpret)  # fmt: skip
    codes = arrays["heavy_codes"]
    d = codes.shape[-1]
    heavy = affine_tile(codes.astype(jnp.uint32), arrays["heavy_minimum"][:, None],
                        arrays["heavy_scale"][:, None], axis="channels", group_size=d,
                        interpret=interpret)  # fmt: skip
    return payload, expand_groups(heavy, "tokens", group), is_heavy


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
    heavy = heavy_layout(fmt)
    if heavy is not None:  # over a rotated base the parts live in two spaces: heavy_parts
        if heavy.base.name in ROTATED:
            raise ValueError(f"{fmt}: heavy rows over a rotated base decode with heavy_parts")
        payload, rows, is_heavy = heavy_parts(heavy.heavy_group, axis, group_size, arrays,
                                              interpret=interpret)  # fmt: skip
        return jnp.where(is_heavy, rows, payload)
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


def butterfly_tile(y, *, interpret: bool):
    """float32 [R, D] (D a power of two) -> `kvq_jax.codecs.formats.hadamard.butterfly` of each
    row, bit for bit: stage s pairs channel i (bit s clear) with i + 2^s, (a + b, a - b) each
    one IEEE add (`_exact.add`; a - b as a + (-b), the same IEEE result) and flushed.

    Triton takes a stage as a split of [R, D / 2h, 2h] into its halves (`tt.split`), the sums
    and differences joined on a new last axis (`tt.join`), a transpose and a reshape."""
    r, d = y.shape
    h = 1
    while h < d:
        a, b = jnp.split(y.reshape(r, d // (2 * h), 2 * h), 2, axis=-1)
        s = _exact.flush_subnormal(_exact.add(a, b, interpret=interpret))
        t = _exact.flush_subnormal(_exact.add(a, -b, interpret=interpret))
        y = jnp.stack([s, t], axis=-1).transpose(0, 1, 3, 2).reshape(r, d)
        h *= 2
    return y


def _scaled_butterfly(y, shift: int, *, interpret: bool):
    scale = jnp.full(y.shape, 2.0**-shift, jnp.float32)
    return _exact.flush_subnormal(
        _exact.multiply(butterfly_tile(y, interpret=interpret), scale, interpret=interpret)
    )


def rotate_tile(x, *, interpret: bool):
    """float32 [R, D] rows (flushed) -> `hadamard.rotate` of each row (FORMAT.md 2c: the
    butterfly, then times 2^-floor(log2(D) / 2), exact but for a flushed underflow)."""
    return _scaled_butterfly(x, rotation_shifts(x.shape[-1])[0], interpret=interpret)


def unrotate_tile(y, *, interpret: bool):
    """float32 [R, D] rotated rows -> `hadamard.unrotate` of each row (FORMAT.md 2c: the
    butterfly, then times 2^-ceil(log2(D) / 2), exact but for a flushed underflow)."""
    return _scaled_butterfly(y, rotation_shifts(y.shape[-1])[1], interpret=interpret)


def decode_plain_tile(fmt: str, axis: str, group_size: int, arrays: dict, *, interpret: bool):
    """`decode_tile` in the plain space: float32 [ps, D] as the XLA codec's `unpack` before its
    cast, for every format; a rotated one (HINT4 / HINT2, heavy rows over one) un-rotated
    here (`unrotate_tile` of its payload rows; a heavy row is its INT8 decode, plain)."""
    if not rotated_format(fmt):
        return decode_tile(fmt, axis, group_size, arrays, interpret=interpret)
    heavy = heavy_layout(fmt)
    if heavy is None:
        rows = decode_tile(fmt, axis, group_size, arrays, interpret=interpret)
        return unrotate_tile(rows, interpret=interpret)
    payload, rows, is_heavy = heavy_parts(heavy.heavy_group, axis, group_size, arrays,
                                          interpret=interpret)  # fmt: skip
    return jnp.where(is_heavy, rows, unrotate_tile(payload, interpret=interpret))


def add_in_dtype_tile(prev, delta, dtype, *, interpret: bool):
    """One residual step: (prev + delta) in `dtype` (bf16/fp16/fp32), as `add_in_dtype`.

    prev: the reconstruction so far, in `dtype` (or float32 holding a `dtype` value).
    delta: the decoded delta, float32 from `decode_tile` (rounded to `dtype` here first,
    exactly as `unpack` returns it) or already in `dtype`. Both are widened to float32 and
    flushed, added once (IEEE, never fused), flushed, and rounded once to `dtype`.
    """
    dtype = jnp.dtype(dtype)

    def rounded(x):
        return _exact.round_to(jnp.asarray(x), dtype, interpret=interpret).astype(jnp.float32)

    a = _exact.flush_subnormal(rounded(prev))
    b = _exact.flush_subnormal(rounded(delta))
    total = _exact.flush_subnormal(_exact.add(a, b, interpret=interpret))
    return _exact.round_to(total, dtype, interpret=interpret)


def chain_steps(cache, kind: str, loop: int) -> tuple[tuple, list]:
    """The static plan of reconstructing loop `loop` of `kind` in a kernel, and the packed
    planes it reads, each once (a run of loops in one format is one plane).

    Returns (steps, planes): steps ((format, axis, group_size, plane, level, absolute), ...)
    in the order of `PagedCacheConfig.chain`: the first is loop 0 or the last loop stored
    absolute at or before `loop` (decoded alone), every later one a delta, or (adaptive-exit
    caches, whose chains start at loop 0) a loop stored absolute (`absolute`: its rows replace
    the reconstruction); plane indexes `planes`; level is the loop's index on that plane's
    loop axis (None for the base plane [P, ...])."""
    config = cache.config
    index: dict = {}
    planes, steps = [], []
    absolute = config.absolute_loops(kind)
    for i in config.chain(kind, loop):
        field, run, level = config.plane_of(kind, i)
        if (field, run) not in index:
            index[field, run] = len(planes)
            planes.append(cache.loop_plane(kind, i)[0])
        args = config.loop_pack_args(kind, i)
        steps.append((args["format"], args["axis"], args["group_size"], index[field, run], level,
                      i in absolute))  # fmt: skip
    return tuple(steps), planes


def depth_tile(depth_ref, page):
    """int32 [page_size, 1]: each row's exit loop, the row of page `page` of an adaptive-exit
    cache's depth map uint8 [P, page_size] (None without one), for `reconstruct_tile`."""
    return None if depth_ref is None else depth_ref[page, :].astype(jnp.int32)[:, None]


def reconstruct_tile(steps, load, dtype, *, rotated: bool = False, depth=None, interpret: bool):
    """One (page, head) tile of a loop through its chain, in `dtype`, as the XLA path's
    `decode_pages`: the first step decoded alone, each later delta added in the cache dtype
    (`add_in_dtype_tile`) or an absolute step's rows taken, rotated formats un-rotated first
    (`decode_plain_tile`).
    steps: from `chain_steps`; load(fmt, plane, lead) -> the tile's `decode_tile` arrays,
    lead () for a base plane or (level,) for a plane with a loop axis. depth (adaptive exits;
    the chain then starts at loop 0, step j is loop j): int32 [ps, 1], each row's exit loop:
    a row keeps its reconstruction once step j passes its depth. rotated (every step a
    rotated format): (float32 rows still in the rotated space, the steps summed in float32,
    as `decode_pages(rotated=True)`; float32 [ps, D] heavy rows in the plain space, zero
    elsewhere, or None): a first step with heavy rows leaves them out of the rotated rows
    (their INT8 decode is plain; attention adds them to its output after un-rotating the
    rest, which is the same up to rounding, FORMAT.md 2c)."""
    recon, plain = None, None
    for j, (fmt, axis, group_size, plane, level, absolute) in enumerate(steps):
        lead = () if level is None else (level,)
        arrays = load(fmt, plane, lead)
        heavy = heavy_layout(fmt)
        if rotated and heavy is not None:  # the first step (heavy formats have no deltas)
            values, rows, is_heavy = heavy_parts(heavy.heavy_group, axis, group_size, arrays,
                                                 interpret=interpret)  # fmt: skip
            values = jnp.where(is_heavy, jnp.float32(0.0), values)
            plain = jnp.where(is_heavy, rows, jnp.float32(0.0))
        elif rotated:
            values = decode_tile(fmt, axis, group_size, arrays, interpret=interpret)
        else:
            values = decode_plain_tile(fmt, axis, group_size, arrays, interpret=interpret)
        if rotated and (recon is None or absolute):
            step = values
        elif rotated:
            step = _exact.add(recon, values, interpret=interpret)
        elif recon is None or absolute:
            step = _exact.round_to(values, dtype, interpret=interpret)
        else:
            step = add_in_dtype_tile(recon, values, dtype, interpret=interpret)
        recon = step if recon is None or depth is None else jnp.where(depth >= j, step, recon)
    return (recon, plain) if rotated else recon
