"""Pallas kernel (Triton backend; interpret mode anywhere): loop `l` of paged KV in one pass.

Grid (N, H): program (i, h) reads physical page `pages[i]` (loaded inside the kernel; the
packed planes are whole-array refs indexed with that id), head h: the base (loop 0) tile and
the residual tiles of loops 1..l of that page, and writes loop l's tile [page_size, D] in the
cache dtype. The running reconstruction stays in registers; after each residual step it is
rounded to the cache dtype exactly as `decode_residual` (`add_in_dtype`) does, so the output
is bit for bit `kvq_jax.cache.paged_cache.decode_pages` (NaNs compared as NaN). Intermediate loops
are never written to memory.

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

#: PackedKV array fields per format, in the order the kernel takes them.
FIELDS = _tile_decode.FIELDS


def _as_bits(a):
    """float8_e4m3fn -> uint8 bits (same width, free in XLA); other dtypes unchanged."""
    if a.dtype == jnp.float8_e4m3fn:
        return lax.bitcast_convert_type(a, jnp.uint8)
    return a


def _plane_arrays(packed) -> list:
    return [_as_bits(getattr(packed, f)) for f in FIELDS[packed.format]]


def _kernel(ids_ref, *refs, base_plan, delta_plan, loop, dtype, interpret):
    *in_refs, out_ref = refs
    base_fmt, base_axis, base_group = base_plan
    nb = len(FIELDS[base_fmt])
    base_refs, delta_refs = in_refs[:nb], in_refs[nb:]
    i, h = pl.program_id(0), pl.program_id(1)
    page = ids_ref[i]
    tile = _tile_decode.load_tile(base_fmt, base_refs, (), page, h)
    values = _tile_decode.decode_tile(base_fmt, base_axis, base_group, tile, interpret=interpret)
    recon = values.astype(dtype)
    if loop:
        delta_fmt, delta_axis, delta_group = delta_plan
        for r in range(loop):  # static: loops 1..loop, unrolled
            tile = _tile_decode.load_tile(delta_fmt, delta_refs, (r,), page, h)
            delta = _tile_decode.decode_tile(
                delta_fmt, delta_axis, delta_group, tile, interpret=interpret
            )
            recon = _tile_decode.add_in_dtype_tile(recon, delta, dtype, interpret=interpret)
    out_ref[...] = recon


def _plan(packed):
    return (packed.format, packed.axis, packed.group_size)


@functools.partial(jax.jit, static_argnames=("loop", "interpret", "launch"))
def decode_pages(base, delta, pages, *, loop: int, interpret: bool = False, launch=None):
    """Loop `loop` of physical pages `pages` (int32 [N]) -> [N, page_size, H, D].

    base: PackedKV with batch shape (P,) (loop 0 of every page); delta: PackedKV with batch
    shape (L - 1, P) or None (needed when loop > 0). Page ids are normalized as XLA indexing
    does (negative ids wrap once, then clamp to [0, P)), so out-of-range ids read the same
    page as the reference instead of stray memory. launch: the Triton launch parameters
    (None: `kvq_jax.kernels.launch.page_reconstruct`).
    """
    ps, h, d = base.shape
    dtype = np.dtype(base.dtype)
    num_pages = base.codes.shape[0]
    pages = jnp.asarray(pages, jnp.int32)
    n = pages.shape[0]
    if n == 0:
        return jnp.zeros((0, ps, h, d), dtype)
    pages = jnp.clip(jnp.where(pages < 0, pages + num_pages, pages), 0, num_pages - 1)
    args = [pages, *_plane_arrays(base)]
    delta_plan = None
    if loop:
        args += _plane_arrays(delta)
        delta_plan = _plan(delta)
    kernel = functools.partial(
        _kernel,
        base_plan=_plan(base),
        delta_plan=delta_plan,
        loop=loop,
        dtype=dtype,
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
