"""The XLA reference of page reconstruction: loop l of physical pages through the residual
chain (the kernel keeps every loop in registers; here XLA fuses the chain into one loop).

Pages are taken from the stored planes first, as whole pages, and, where the format allows,
decoded as one tensor of N * page_size rows (no per-page `vmap`): the same element-wise
arithmetic on the same operands, so the same bytes. On XLA:CPU the taken pages are
materialized before the decode: a page gather fused into the decode chain is evaluated per
element (measured 5-10x slower per residual loop, see docs/research/issue15).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from kvq_jax.codecs._numerics import add_in_dtype
from kvq_jax.codecs.api import unpack_kv
from kvq_jax.codecs.cache_state import codec_view
from kvq_jax.codecs.registry import get_codec


def _taken(take, arrays: dict, pages) -> dict:
    """`take(arrays, pages)` (a gather of whole pages), materialized on XLA:CPU.

    XLA:CPU drops optimization barriers before fusion, and a gather fused into the decode
    chain is evaluated per element; it never fuses across a conditional, so there the gather
    runs in both branches of one (the same computation: the predicate, a page id that is
    never constant-folded, does not matter). Other platforms take it as it is (a conditional
    would cost them a host round trip for the predicate).
    """

    if pages.shape[0] == 0:
        return take(arrays, pages)
    take = jax.jit(take)  # traced once for the three branches

    def cpu(arrays, pages):
        return lax.cond(pages[0] > 0, take, take, arrays, pages)

    return lax.platform_dependent(arrays, pages, cpu=cpu, default=take)


def _flat_ok(packed) -> bool:
    """Pages of `packed` decode as one stacked tensor of N * page_size rows: token groups never
    straddle pages, and the only per-page scalar is NVFP4's global scale (which broadcasts
    against its block rows)."""
    if packed.axis == "tokens" and packed.shape[0] % packed.group_size:
        return False
    return packed.format == "nvfp4" or all(a.ndim > 1 for a in packed.arrays.values())


def _take(plane, pages, flat: bool, level=None):
    """Pages `pages` of a stored plane (batch shape (P,); with `level`, plane `level` of the
    delta planes, batch shape (L - 1, P), taken in the same gather: slicing the plane out
    first would copy it whole on XLA:CPU) with its format's dtypes (`codec_view`, after the
    take: never a pass over the pool). flat: one PackedKV of N * page_size rows (NVFP4's
    global scale as [R, 1, 1] against its R block-scale rows per page), else a batch of N
    pages."""
    take_pages = functools.partial(_take_pages, level=level)
    if not flat:
        return codec_view(dataclasses.replace(plane, **_taken(take_pages, plane.arrays, pages)))
    n = pages.shape[0]
    ps, h, d = plane.shape
    axis = 1 if level is None else 2  # the block-scale rows per page
    rows = plane.arrays["block_scale"].shape[axis] if "block_scale" in plane.arrays else 0

    def take(arrays, pages):
        out = {}
        for name, a in take_pages(arrays, pages).items():
            if a.ndim == 1:  # NVFP4's per-page global scale, repeated along its block rows
                out[name] = jnp.broadcast_to(a[:, None], (n, rows)).reshape(n * rows, 1, 1)
            else:
                out[name] = a.reshape(n * a.shape[1], *a.shape[2:])
        return out

    taken = _taken(take, plane.arrays, pages)
    return codec_view(dataclasses.replace(plane, shape=(n * ps, h, d), **taken))


def _take_pages(arrays: dict, pages, level=None) -> dict:
    return {k: _take_rows(a, pages, level) for k, a in arrays.items()}


def _take_rows(a, pages, level=None):
    """a[pages], or a[level, pages] for [L - 1, P, ...] delta planes (one gather); size-1 axes
    squeezed around the gather (XLA:CPU otherwise relayouts the whole plane, e.g. one token
    group per page [P, 1, H, D], before every gather)."""
    lead = 1 if level is None else 2
    ones = tuple(i for i in range(lead, a.ndim) if a.shape[i] == 1)
    if ones:
        a = jnp.squeeze(a, ones)
    out = a[pages] if level is None else a[level, pages]
    return jnp.expand_dims(out, tuple(i - lead + 1 for i in ones)) if ones else out


def rotated_chain(chain) -> bool:
    """True when every plane of `chain` is stored in a Hadamard-rotated format (FORMAT.md 2c,
    one rotation for all): `decode_pages(rotated=True)` can then stay in the rotated space."""
    return all(getattr(get_codec(plane.format), "rotated_space", False) for _, plane, _, _ in chain)


def heavy_chain(chain) -> int | None:
    """G when `chain` is one heavy-row plane (`HeavyCodec`; the paged cache stores heavy rows
    only in loops stored whole, FORMAT.md 5a), else None."""
    if len(chain) != 1:
        return None
    return getattr(get_codec(chain[0][1].format), "heavy_group", None)


def decode_heavy_parts(chain, pages, *, layer=None, rotated=False):
    """The pages `pages` (int32 [N]) of a one-plane heavy-row chain (`heavy_chain`), unmerged
    (`HeavyCodec.unpack_parts` per page): payload float32 [N, R, H, D] in payload order,
    heavy rows float32 [N, nG, H, D], their rows int32 [N, nG, H]."""
    ((_, plane, level, _),) = chain
    codec = get_codec(plane.format)
    return jax.vmap(lambda p: codec.unpack_parts(p, layer, rotated=rotated))(
        _take(plane, pages, False, level=level)
    )


def costly_chain(chain) -> bool:
    """True when a plane of `chain` has a decode costly per element (`Codec.costly_decode`)."""
    return any(get_codec(plane.format).costly_decode for _, plane, _, _ in chain)


def decode_pages(chain, pages, *, depth=None, layer=None, rotated=False) -> jnp.ndarray:
    """One loop of physical pages `pages` (int32 [N]): [N, page_size, H, D] in the cache dtype.

    chain: `cache.loop_chain(kind, loop)`, ((loop_i, plane, level, absolute), ...): the first
    plane (loop 0's base, batch (P,), or an absolute loop's) is decoded on its own; each later
    one (plane `level` of a batch (loops, P) plane) is decoded and, unless `absolute`, added to
    the running reconstruction (`decode_residual`). Planes as the cache stores them or with
    their format's dtypes; XLA index semantics for ids. depth: uint8 [P, page_size] or None
    (adaptive exits, chains from loop 0): a row keeps loop depth[row] once it is passed (the
    later loops are skipped). layer: the cache's layer (`PagedKVCache.layer`), for formats with
    one table per model layer. rotated (a `rotated_chain`): float32 rows still in the rotated
    space, each plane's `unpack_rotated` summed in float32 (attention un-rotates its output
    once; `unrotate` of this is the reconstruction up to rounding: the reference rounds every
    loop in the cache dtype).
    """
    n = pages.shape[0]
    ps, h, d = chain[0][1].shape
    flat = all(
        _flat_ok(plane if level is None else jax.tree.map(lambda a: a[0], plane))
        for _, plane, level, _ in chain
    )  # (_flat_ok looks at one page plane: a delta's loop axis must not count as a page axis)
    rows = None
    if depth is not None:  # [N * page_size, 1, 1] or [N, page_size, 1, 1]
        rows = depth[pages].reshape((n * ps,) if flat else (n, ps))[..., None, None]
    if rotated:

        def one(packed):
            return get_codec(packed.format).unpack_rotated(packed)

    else:
        one = functools.partial(unpack_kv, layer=layer)
    decode = one if flat else jax.vmap(one)
    recon = None
    for loop, plane, level, absolute in chain:
        decoded = decode(_take(plane, pages, flat, level=level))
        if recon is None:
            recon = decoded
            continue
        # A dense residual without a window adds its decoded delta (`decode_residual`); an
        # absolute one is the decoded rows alone.
        add = jnp.add if rotated else add_in_dtype
        step = decoded if absolute else add(recon, decoded)
        recon = step if rows is None else jnp.where(rows >= loop, step, recon)
    return recon.reshape(n, ps, h, d)
