"""`pack_paged`: pack full KV pages, through the XLA reference or the Pallas Triton kernel.

The only place that validates a page-pack call and picks its implementation:
`pack_paged(pages, kind=..., format=..., group_size=..., axis=..., backend=...)` returns the
same bytes whichever backend runs (`kvq_jax.kernels.backend`: "auto" takes the kernel where
the device and the configuration allow, else XLA). `dispatch` is the same call for callers
that have validated and resolved the arguments already (the paged cache's append).

The kernel takes (`config_support` says why not otherwise):
  - formats int4, int2, hint4 / hint2 (INT4 / INT2 of rows rotated in registers), nvfp4 and
    fp8_e4m3; INTB (one table or one per layer, on token groups; a per-layer format packs
    with `layer`'s table); heavy rows (FORMAT.md 5a) given their rows (`dispatch(rows=...)`:
    the paged cache's append hands in the rows the keys chose) over INT4 / INT2 / HINT4 /
    HINT2 on channel groups (values) or INT4 / INT2 / INTB on token groups of G - 1 rows
    (keys); a codec registered by a user runs on XLA;
  - page_size and D powers of two (Triton blocks), D >= 2 (two codes per byte; INT2 / HINT2:
    D >= 4, four codes per byte), and a
    [page_size, D] head tile of at most MAX_TILE_ELEMENTS elements (registers); any H;
  - INT4: token groups divide page_size (always: `resolve_paged`), channel groups divide D;
    NVFP4 channel groups: D >= 16 (no partial group).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import next_power_of_2 as pl_next_power_of_2

from kvq_jax.codecs.packed import PackedKV
from kvq_jax.core import checks, registry
from kvq_jax.core.cache_config import resolve_paged
from kvq_jax.core.layouts import is_power_of_two
from kvq_jax.kernels import _tile_decode
from kvq_jax.kernels import backend as _backend
from kvq_jax.kernels import launch as _launch
from kvq_jax.kernels.page_pack import pallas_triton, xla

#: Formats the kernel implements.
KERNEL_FORMATS = ("int4", "int2", "hint4", "hint2", "nvfp4", "fp8_e4m3")
#: Bases of heavy-row formats the kernel packs on channel groups (values: each payload row
#: alone); on token groups of G - 1 rows (keys) it takes INT4, INT2 and INTB.
HEAVY_BASES = ("int4", "int2", "hint4", "hint2")
#: Largest page_size * D the kernel takes (one head tile in registers: 32 K elements).
MAX_TILE_ELEMENTS = 2**15


def _reason(page_shape, format: str, axis: str, group_size: int, rows: bool = False) -> str | None:
    """Why the kernel cannot pack pages of `page_shape` = (page_size, H, D) with the resolved
    (format, axis, group_size), or None; rows: the call hands in each page's heavy rows."""
    page_size, _, d = page_shape
    heavy = _tile_decode.heavy_layout(format)
    if heavy is not None:
        base, g = heavy.base.name, heavy.heavy_group
        if not rows:
            return f"format {format!r}: the kernel takes the heavy rows (rows), not a table"
        if axis == "channels" and base not in HEAVY_BASES:
            return f"format {format!r}: no heavy-row kernel over {base!r} on channel groups"
        if axis == "tokens" and not (base in ("int4", "int2") or _tile_decode.is_intb(base)):
            return f"format {format!r}: no heavy-row kernel over {base!r} on token groups"
        if axis == "tokens" and group_size != g - 1:
            return (f"format {format!r}: the kernel packs the payload on token groups of one "
                    f"heavy group (G - 1 = {g - 1} rows), not {group_size}")  # fmt: skip
        if not is_power_of_two(g) or page_size % g:
            return f"format {format!r}: heavy group {g} is not a power of two dividing page_size"
        # the kernel packs the base; on token groups, those of the gathered heavy groups
        format, group_size = base, (group_size if axis == "channels" else g)
    if _tile_decode.is_intb(format):
        stream = 8 * pl_next_power_of_2(registry.layout(format).row_bytes)
        if axis != "tokens" or not is_power_of_two(group_size) or page_size % group_size:
            return (f"format {format!r}: the kernel packs INTB on token groups of a power of "
                    f"two dividing page_size, not {axis} groups of {group_size}")  # fmt: skip
        if page_size * stream > MAX_TILE_ELEMENTS:
            return (f"format {format!r}: page_size * 8W (padded) = {page_size} * {stream} "
                    f"exceeds the kernel's tile limit of {MAX_TILE_ELEMENTS} elements")  # fmt: skip
    elif format not in KERNEL_FORMATS:
        return f"format {format!r} has no page-pack kernel (kernels: {KERNEL_FORMATS})"
    if not is_power_of_two(page_size):
        return f"page_size {page_size} (pages.shape[1]) is not a power of two"
    codes_per_byte = 4 if format in ("int2", "hint2") else 2
    if not is_power_of_two(d) or d < codes_per_byte:
        return f"head dim D={d} (pages.shape[3]) is not a power of two >= {codes_per_byte}"
    if page_size * d > MAX_TILE_ELEMENTS:
        return (
            f"page_size * D = {page_size} * {d} exceeds the kernel's tile limit of "
            f"{MAX_TILE_ELEMENTS} elements"
        )
    if axis == "channels" and d % group_size:
        return f"group_size {group_size} does not divide D={d} (a partial channel group)"
    return None


def config_support(
    pages_shape,
    dtype,
    *,
    kind: str,
    format: str = "int4",
    group_size: int | None = None,
    axis: str | None = None,
    rows: bool = False,
) -> str | None:
    """None when the page-pack kernel takes this `pack_paged` call, else the reason.

    pages_shape / dtype: those of `pages` [P, page_size, H, D]; the other arguments as for
    `pack_paged`; rows: the call hands in each page's heavy rows (as the paged cache's
    append does for heavy-row formats). Invalid arguments raise as `pack_paged` would
    (ValueError / TypeError).
    """
    pages = jax.ShapeDtypeStruct(tuple(pages_shape), dtype)
    _, page_size, h, d = checks.check_pages(pages)
    axis, group_size = resolve_paged(format, kind, (page_size, h, d), axis, group_size)
    return _reason((page_size, h, d), format, axis, group_size, rows)


def dispatch(
    pages, *, kind: str, format: str, group_size: int, axis: str, backend: str, launch=None,
    layer=None, rows=None,
):  # fmt: skip
    """`pack_paged` for validated pages and resolved (axis, group_size): picks the backend
    and runs it (traceable). rows: uint8 [P, page_size / G, H], the heavy rows of each page
    for a heavy-row format that takes them (the values': those chosen from the keys)."""
    page_shape = tuple(pages.shape[1:])
    why = _reason(page_shape, format, axis, group_size, rows is not None)
    impl = _backend.resolve_backend(backend, why)
    if impl == "xla" or pages.shape[0] == 0:  # nothing to launch for zero pages
        return xla.pack_paged(pages, kind=kind, format=format, group_size=group_size, axis=axis,
                              layer=layer, rows=rows)  # fmt: skip
    if launch is None:
        launch = _launch.page_pack(page_shape[0], page_shape[2], format)
    return pallas_triton.pack_paged(
        pages,
        kind=kind,
        format=format,
        axis=axis,
        group_size=group_size,
        interpret=impl == "pallas_interpret",
        launch=launch,
        rows=rows,
        layer=layer,
    )


@functools.partial(
    jax.jit, static_argnames=("kind", "format", "group_size", "axis", "backend", "launch")
)
def pack_paged(
    pages,
    *,
    kind: str,
    format: str = "int4",
    group_size: int | None = None,
    axis: str | None = None,
    backend: str = "auto",
    launch: _launch.Launch | None = None,
    layer=None,
    rows=None,
) -> PackedKV:
    """Pack every page of `pages` [P, page_size, H, D] on its own (`kvq_jax.cache.paged`).

    Args:
      pages: [P, page_size, H, D] bfloat16, float16 or float32.
      kind, format, axis: as for `pack_kv`.
      group_size: as for `pack_kv`; token-axis groups must divide page_size, and INT4's
        default is gcd(64, page_size) on tokens (`resolve_paged`).
      backend: "auto" (the Pallas kernel where supported, else XLA), "xla", "pallas" or
        "pallas_interpret". "pallas" / "pallas_interpret" raise ValueError when the kernel
        does not take the configuration (`config_support`) or, for "pallas", the device.
      launch: the kernel's `kvq_jax.kernels.launch.Launch` (warps, stages); None: the rule
        of `kvq_jax.kernels.launch.page_pack`. Ignored by XLA.
      layer: the model layer (int or int32 scalar) of a format with one table per layer
        (`pack_kv`'s layer); ignored by the other formats.
      rows: integer [P, page_size / G, H], each page's heavy rows for a heavy-row format
        (FORMAT.md 5a; values take the rows their keys chose), else None.

    Returns:
      A `PackedKV` whose arrays carry a leading page axis (`batch_shape == (P,)`), the same
      bytes from every backend. Every argument is checked while tracing, never the data.
    """
    pages = jnp.asarray(pages)
    p, page_size, h, d = checks.check_pages(pages)
    axis, group_size = resolve_paged(format, kind, (page_size, h, d), axis, group_size)
    if rows is not None:
        heavy = _tile_decode.heavy_layout(format)
        if heavy is None:
            raise ValueError(f"rows: format {format!r} stores no heavy rows")
        rows = jnp.asarray(rows)
        want = (p, page_size // heavy.heavy_group, h)
        if rows.shape != want or not jnp.issubdtype(rows.dtype, jnp.integer):
            raise ValueError(f"rows must be an integer array {want}, got {rows.dtype} "
                             f"{rows.shape}")  # fmt: skip
        # an index past a group is its last row (FORMAT.md 5a), as the XLA path clamps it
        rows = jnp.clip(rows, 0, heavy.heavy_group - 1).astype(jnp.uint8)
    return dispatch(
        pages, kind=kind, format=format, group_size=group_size, axis=axis, backend=backend,
        launch=_launch.check_launch(launch), layer=layer, rows=rows,
    )  # fmt: skip


def storage_bytes(pages_shape, dtype, rows=None, **kwargs) -> tuple[int, int]:
    """(bytes read, bytes written) by one `pack_paged` call: the pages, and every packed array
    (the effective-bandwidth numerator of the benchmark; NVFP4's second read of each page and
    the heavy rows handed in are not counted)."""
    pages = jax.ShapeDtypeStruct(tuple(pages_shape), dtype)
    out = jax.eval_shape(functools.partial(pack_paged, backend="xla", **kwargs), pages, rows=rows)
    read = int(np.prod(pages_shape)) * np.dtype(dtype).itemsize
    written = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(out))
    return read, written
