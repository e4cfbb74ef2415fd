"""`pack_paged`: pack full KV pages, through the XLA reference or the Pallas Triton kernel.

The only place that validates a page-pack call and picks its implementation:
`pack_paged(pages, kind=..., format=..., group_size=..., axis=..., backend=...)` returns the
same bytes whichever backend runs (`kvq_jax.kernels.backend`: "auto" takes the kernel where
the device and the configuration allow, else XLA). `dispatch` is the same call for callers
that have validated and resolved the arguments already (the paged cache's append).

The kernel takes (`config_support` says why not otherwise):
  - formats int4, int2, hint4 / hint2 (INT4 / INT2 of rows rotated in registers), nvfp4 and
    fp8_e4m3 (INTB, heavy rows and a codec registered by a user run on XLA);
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

from kvq_jax.codecs.packed import PackedKV
from kvq_jax.core import checks
from kvq_jax.core.cache_config import resolve_paged
from kvq_jax.core.layouts import is_power_of_two
from kvq_jax.kernels import backend as _backend
from kvq_jax.kernels import launch as _launch
from kvq_jax.kernels.page_pack import pallas_triton, xla

#: Formats the kernel implements.
KERNEL_FORMATS = ("int4", "int2", "hint4", "hint2", "nvfp4", "fp8_e4m3")
#: Largest page_size * D the kernel takes (one head tile in registers: 32 K elements).
MAX_TILE_ELEMENTS = 2**15


def _reason(page_shape, format: str, axis: str, group_size: int) -> str | None:
    """Why the kernel cannot pack pages of `page_shape` = (page_size, H, D) with the resolved
    (format, axis, group_size), or None."""
    page_size, _, d = page_shape
    if format not in KERNEL_FORMATS:
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
) -> str | None:
    """None when the page-pack kernel takes this `pack_paged` call, else the reason.

    pages_shape / dtype: those of `pages` [P, page_size, H, D]; the other arguments as for
    `pack_paged`. Invalid arguments raise as `pack_paged` would (ValueError / TypeError).
    """
    pages = jax.ShapeDtypeStruct(tuple(pages_shape), dtype)
    _, page_size, h, d = checks.check_pages(pages)
    axis, group_size = resolve_paged(format, kind, (page_size, h, d), axis, group_size)
    return _reason((page_size, h, d), format, axis, group_size)


def dispatch(
    pages, *, kind: str, format: str, group_size: int, axis: str, backend: str, launch=None,
    layer=None, rows=None,
):  # fmt: skip
    """`pack_paged` for validated pages and resolved (axis, group_size): picks the backend
    and runs it (traceable). rows: the heavy rows of each page for a heavy-row format that
    takes them (`xla.pack_paged`; the kernel declines heavy-row formats)."""
    page_shape = tuple(pages.shape[1:])
    impl = _backend.resolve_backend(backend, _reason(page_shape, format, axis, group_size))
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
        (`pack_kv`'s layer; served by XLA); ignored by the other formats.

    Returns:
      A `PackedKV` whose arrays carry a leading page axis (`batch_shape == (P,)`), the same
      bytes from every backend. Every argument is checked while tracing, never the data.
    """
    pages = jnp.asarray(pages)
    _, page_size, h, d = checks.check_pages(pages)
    axis, group_size = resolve_paged(format, kind, (page_size, h, d), axis, group_size)
    return dispatch(
        pages, kind=kind, format=format, group_size=group_size, axis=axis, backend=backend,
        launch=_launch.check_launch(launch), layer=layer,
    )  # fmt: skip


def storage_bytes(pages_shape, dtype, **kwargs) -> tuple[int, int]:
    """(bytes read, bytes written) by one `pack_paged` call: the pages, and every packed array
    (the effective-bandwidth numerator of the benchmark; NVFP4's second read of each page is
    not counted)."""
    pages = jax.ShapeDtypeStruct(tuple(pages_shape), dtype)
    out = jax.eval_shape(functools.partial(pack_paged, backend="xla", **kwargs), pages)
    read = int(np.prod(pages_shape)) * np.dtype(dtype).itemsize
    written = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(out))
    return read, written
