"""`decode_pages`: loop l of physical pages of a `PagedKVCache`, backend by choice.

The only place that validates a page-reconstruction call and picks its implementation: the
XLA reference (`xla.py`) or the Pallas Triton kernel (`pallas_triton.py`), same bytes (decoded
NaNs compared as NaN). `dispatch` is the same call for callers that validated already.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvq_jax.codecs.cache_state import check_cache
from kvq_jax.core import checks
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.layouts import check_kind, is_power_of_two
from kvq_jax.kernels import launch as _launch
from kvq_jax.kernels._tile_decode import chain_steps, tile_support
from kvq_jax.kernels.backend import resolve_backend
from kvq_jax.kernels.page_reconstruct import pallas_triton, xla

#: Largest tile (page_size * head_dim elements) one kernel program holds in registers.
MAX_TILE_ELEMENTS = 2**15


def config_support(config: PagedCacheConfig, kind: str) -> str | None:
    """None when the Pallas kernel takes `kind` of caches with `config`, else the reason.

    Supported: page_size and head_dim powers of two (head_dim >= 2, >= 4 with INT2,
    page_size * head_dim <= 2**15), any H, L, dtype; INT4, INT2, NVFP4 and FP8 E4M3 in any
    loop (per-loop formats and loops stored absolute included); INT4 / INT2 group sizes that
    are powers of two dividing page_size (axis "tokens") or head_dim (axis "channels").
    INTB (one table or one per layer) with token groups as INT4's. HINT4 / HINT2 (rows
    un-rotated in the tile, `_tile_decode.unrotate_tile`) as INT4 / INT2. Heavy rows
    (FORMAT.md 5a) over INT4 / INT2 / HINT4 / HINT2 / INTB (`_tile_decode.heavy_support`).
    Adaptive exits (the depth map: a row keeps its exit loop's reconstruction).
    """
    if not isinstance(config, PagedCacheConfig):
        raise TypeError(f"config must be a PagedCacheConfig, got {type(config).__name__}")
    check_kind(kind)
    ps, d = config.page_size, config.head_dim
    if not is_power_of_two(ps):
        return f"page_size {ps} is not a power of two"
    if not is_power_of_two(d) or d < 2:
        return f"head_dim {d} is not a power of two >= 2"
    if ps * d > MAX_TILE_ELEMENTS:
        return f"page_size * head_dim = {ps * d} exceeds {MAX_TILE_ELEMENTS} elements per tile"
    for loop in range(config.num_loops):
        args = config.loop_pack_args(kind, loop)
        fmt, axis, group = args["format"], args["axis"], args["group_size"]
        why = tile_support(fmt, axis, group, ps, d)
        if why:
            return f"{kind} loop {loop} {why}"
    return None


def _check_pages(pages):
    shape = np.shape(pages)
    if len(shape) != 1:
        raise ValueError(f"pages must have rank 1 [N], got shape {shape}")
    dtype = getattr(pages, "dtype", None)
    if dtype is None or not np.issubdtype(np.dtype(dtype), np.integer):
        raise TypeError(f"pages must be an int32 array, got dtype {dtype}")
    return jnp.asarray(pages, jnp.int32)


@functools.cache
def _batchable(steps: tuple, interpret: bool, launch):
    """The kernel call with a vmap rule: batched page ids (e.g. `gather_batch`) flatten into
    one longer grid; a batched cache runs one call per batch entry."""

    @jax.custom_batching.custom_vmap
    def call(planes, layer, pages):
        planes, depth = planes  # the chain's planes, the depth map (None: no adaptive exits)
        return pallas_triton.decode_pages(
            planes, pages, layer, depth=depth, steps=steps, interpret=interpret, launch=launch
        )

    @call.def_vmap
    def _rule(axis_size, in_batched, planes, layer, pages):
        planes_b, layer_b, pages_b = in_batched
        if not any(jax.tree.leaves(planes_b)) and not layer_b:
            if not pages_b:
                pages = jnp.broadcast_to(pages, (axis_size, *pages.shape))
            out = call(planes, layer, pages.reshape(-1))
            return out.reshape(axis_size, pages.shape[1], *out.shape[1:]), True

        def bcast(tree, batched):
            return jax.tree.map(
                lambda a, b: a if b else jnp.broadcast_to(a, (axis_size, *a.shape)),
                tree,
                batched,
            )

        args = (bcast(planes, planes_b), bcast(layer, layer_b), bcast(pages, pages_b))
        return lax.map(lambda a: call(*a), args), True

    return call


def dispatch(cache, kind: str, pages, *, loop: int, backend: str, launch=None):
    """`decode_pages` for validated arguments: picks the backend and runs it (traceable)."""
    config = cache.config
    impl = resolve_backend(backend, config_support(config, kind))
    if impl == "xla":
        return xla.decode_pages(
            cache.loop_chain(kind, loop), pages, depth=cache.depth, layer=cache.layer
        )
    steps, planes = chain_steps(cache, kind, loop)
    if launch is None:
        launch = _launch.page_reconstruct(config.page_size, config.head_dim)
    call = _batchable(steps, impl == "pallas_interpret", launch)
    layer = jnp.int32(0) if cache.layer is None else jnp.asarray(cache.layer, jnp.int32)
    return call((tuple(planes), cache.depth), layer, pages)


def decode_pages(cache, kind: str, pages, *, loop: int, backend: str = "auto", launch=None):
    """Loop `loop` of physical pages `pages` of `cache`: [N, page_size, H, D], cache dtype.

    Args:
      cache: a `PagedKVCache`.
      kind: "key" or "value".
      pages: int32 [N] physical page ids in [0, num_pages) (out-of-range ids read the page
        XLA indexing would: negative ids wrap once, then clamp).
      loop: static loop index in [0, num_loops).
      backend: "auto" (the Pallas kernel on a supported CUDA GPU and configuration, else
        XLA), "xla", "pallas" (raises ValueError where unsupported) or "pallas_interpret".
      launch: the kernel's `kvq_jax.kernels.launch.Launch` (None: the rule of
        `kvq_jax.kernels.launch.page_reconstruct`); ignored by XLA.

    Each page is the first plane of the loop's chain decoded (loop 0's base, or the last loop
    stored absolute at or before `loop`), then loop by loop a delta decoded and added in the
    cache dtype (`decode_residual`) or an absolute loop's rows in its place; every backend
    gives the same bytes (decoded NaNs as NaN).
    Pages as stored: the keys of a pre-RoPE cache (`PagedCacheConfig.rope_theta`) come back
    before RoPE (`gather` and decode attention put it back at the rows' positions).
    """
    check_cache(cache)  # before jit flattens it: a clear error for a non-cache
    return _decode_pages(
        cache, kind, pages, loop=loop, backend=backend, launch=_launch.check_launch(launch)
    )


@functools.partial(jax.jit, static_argnames=("kind", "loop", "backend", "launch"))
def _decode_pages(cache, kind: str, pages, *, loop: int, backend: str, launch):
    """The jitted body of `decode_pages`."""
    config = check_cache(cache)
    loop = checks.check_loop_index(loop, config.num_loops)
    check_kind(kind)
    return dispatch(cache, kind, _check_pages(pages), loop=loop, backend=backend, launch=launch)
