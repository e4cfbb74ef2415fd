"""Pallas kernel (Triton backend; interpret mode anywhere): loop `l` of paged KV in one pass.

Grid (N, H): program (i, h) reads physical page `pages[i]` (loaded inside the kernel; the
packed planes are whole-array refs indexed with that id), head h: the tiles of that page on
loop l's chain (`PagedKVCache.loop_chain`: loop 0 or the last loop stored absolute at or
before l, then every later loop up to l, each plane in its own format), and writes loop l's
tile [page_size, D] in the cache dtype. The running reconstruction stays in registers: the
chain's first plane is decoded alone, each later delta is added and rounded to the cache
dtype exactly as `decode_residual` (`add_in_dtype`) does, so the output is bit for bit
`kvq_jax.cache.paged_cache.decode_pages` (NaNs compared as NaN). Intermediate loops are never
written to memory. An adaptive-exit cache's chain starts at loop 0 (loops stored absolute
replace the running rows) and each row keeps its reconstruction once the chain passes its
exit loop (the depth map's row of the page, loaded with the page).

E4M3 arrays (NVFP4 block scales, FP8 codes) are bitcast to uint8 in XLA before the call and
decoded from their bits in the kernel (`_tile_decode.e4m3_to_f32`), so no fp8 convert
instruction is needed (sm80+).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvq_jax.kernels import _tile_decode
from kvq_jax.kernels import launch as _launch


def _as_bits(a):
    """float8_e4m3fn -> uint8 bits (same width, free in XLA); other dtypes unchanged."""
    if a.dtype == jnp.float8_e4m3fn:
        return lax.bitcast_convert_type(a, jnp.uint8)
    return a


def _kernel(ids_ref, layer_ref, *refs, steps, fields, dtype, adaptive, interpret):
    *in_refs, out_ref = refs
    depth_ref = in_refs.pop(0) if adaptive else None
    plane_refs, at = [], 0
    for n in fields:  # each plane's refs, in `_tile_decode.kernel_arrays` order
        plane_refs.append(in_refs[at : at + n])
        at += n
    i, h = pl.program_id(0), pl.program_id(1)
    page = ids_ref[i]

    def meta(ref, lead):
        """A metadata tile of (page, h): [rows, cols], or [rows] of a [*lead, P, rows, H]
        array (heavy rows' fields)."""
        if len(ref.shape) - len(lead) == 3:
            return ref[(*lead, page, slice(None), h)]
        return ref[(*lead, page, slice(None), h, slice(None))]

    def load(fmt, plane, lead):
        refs_ = plane_refs[plane]
        load_meta = functools.partial(meta, lead=lead)
        if _tile_decode.heavy_layout(fmt) is not None:
            return _tile_decode.load_heavy_tile(fmt, refs_, lead, page, h, layer_ref[0],
                                                load_meta)  # fmt: skip
        if _tile_decode.is_intb(fmt):
            return _tile_decode.load_intb_tile(refs_, lead, page, h, layer_ref[0], load_meta)
        return _tile_decode.load_tile(fmt, refs_, lead, page, h)

    out_ref[...] = _tile_decode.reconstruct_tile(
        steps, load, dtype, depth=_tile_decode.depth_tile(depth_ref, page), interpret=interpret
    )


@functools.partial(jax.jit, static_argnames=("steps", "interpret", "launch"))
def decode_pages(planes, pages, layer=None, depth=None, *, steps, interpret: bool = False,
                 launch=None):  # fmt: skip
    """One loop of physical pages `pages` (int32 [N]) -> [N, page_size, H, D].

    planes: the packed planes the loop's chain reads (`_tile_decode.chain_steps`): a base plane
    has batch shape (P,), a later-loop plane (loops, P); steps: the chain's static plan (same
    function); layer: the model layer (int32 scalar) whose table a per-layer INTB plane reads
    (None: 0); depth: an adaptive-exit cache's depth map uint8 [P, page_size] (each row's exit
    loop; the chain then starts at loop 0) or None. Page ids are normalized as XLA indexing does
    (negative ids wrap once, then clamp to [0, P)), so out-of-range ids read the same page as
    the reference instead of stray memory. launch: the Triton launch parameters (None:
    `kvq_jax.kernels.launch.page_reconstruct`).
    """
    first = planes[0]
    ps, h, d = first.shape
    dtype = np.dtype(first.dtype)
    num_pages = first.codes.shape[-4]  # codes [..., P, rows, H, cols]
    pages = jnp.asarray(pages, jnp.int32)
    n = pages.shape[0]
    if n == 0:
        return jnp.zeros((0, ps, h, d), dtype)
    pages = jnp.clip(jnp.where(pages < 0, pages + num_pages, pages), 0, num_pages - 1)
    args = [pages, _tile_decode.layer_operand(layer)]
    if depth is not None:
        args.append(depth)
    for plane in planes:
        args += _tile_decode.kernel_arrays(plane, _as_bits)
    kernel = functools.partial(
        _kernel,
        steps=steps,
        fields=tuple(len(_tile_decode.fields(plane.format)) for plane in planes),
        dtype=dtype,
        adaptive=depth is not None,
        interpret=interpret,
    )
    compiler_params = None
    if not interpret:
        if launch is None:
            launch = _launch.page_reconstruct(ps, d)
        compiler_params = pltriton.CompilerParams(
            num_warps=launch.num_warps, num_stages=launch.num_stages
        )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, ps, h, d), dtype),
        grid=(n, h),
        in_specs=[pl.no_block_spec] * len(args),
        out_specs=pl.BlockSpec((None, ps, None, d), lambda i, j: (i, 0, j, 0)),
        interpret=interpret,
        compiler_params=compiler_params,
        name="kvq_page_reconstruct",
    )(*args)
