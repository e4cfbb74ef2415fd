"""`pack_pages`: pack full KV pages, through the XLA reference or the Pallas Triton kernel.

`pack_pages(pages, kind=..., format=..., group_size=..., axis=..., backend=...)` takes the
arguments of `kvq_jax.pack_paged` (same defaults, same checks through `resolve_paged`) and
returns exactly what `pack_paged` returns, whichever backend runs (`kvq_jax.kernels.backend`:
"auto" takes the kernel where the device and the configuration allow, else XLA).

The kernel takes (`config_support` says why not otherwise):
  - formats int4, nvfp4 and fp8_e4m3 (a codec registered by a user has no kernel);
  - page_size and D powers of two (Triton blocks), D >= 2 (two codes per byte), and a
    [page_size, D] head tile of at most MAX_TILE_ELEMENTS elements (registers); any H;
  - INT4: token groups divide page_size (always: `resolve_paged`), channel groups divide D;
    NVFP4 channel groups: D >= 16 (no partial group).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvq_jax.kernels import backend as _backend
from kvq_jax.kernels.page_pack import pallas_triton, xla
from kvq_jax.packed import PackedKV
from kvq_jax.paged import check_pages, resolve_paged

#: Formats the kernel implements.
KERNEL_FORMATS = ("int4", "nvfp4", "fp8_e4m3")
#: Largest page_size * D the kernel takes (one head tile in registers: 32 K elements).
MAX_TILE_ELEMENTS = 2**15


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _reason(page_shape, format: str, axis: str, group_size: int) -> str | None:
    """Why the kernel cannot pack pages of `page_shape` = (page_size, H, D) with the resolved
    (format, axis, group_size), or None."""
    page_size, _, d = page_shape
    if format not in KERNEL_FORMATS:
        return f"format {format!r} has no page-pack kernel (kernels: {KERNEL_FORMATS})"
    if not _power_of_two(page_size):
        return f"page_size {page_size} (pages.shape[1]) is not a power of two"
    if not _power_of_two(d) or d < 2:
        return f"head dim D={d} (pages.shape[3]) is not a power of two >= 2"
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
    """None when the page-pack kernel takes this call of `pack_pages`, else the reason.

    pages_shape / dtype: those of `pages` [P, page_size, H, D]; the other arguments as for
    `pack_pages`. Invalid arguments raise as `pack_pages` would (ValueError / TypeError).
    """
    pages = jax.ShapeDtypeStruct(tuple(pages_shape), dtype)
    _, page_size, h, d = check_pages(pages)
    axis, group_size = resolve_paged(format, kind, (page_size, h, d), axis, group_size)
    return _reason((page_size, h, d), format, axis, group_size)


#: The kernel path, jitted (static: everything but the pages).
_pack_pages_kernel = jax.jit(
    pallas_triton.pack_pages, static_argnames=("kind", "format", "axis", "group_size", "interpret")
)


def pack_pages(
    pages,
    *,
    kind: str,
    format: str = "int4",
    group_size: int | None = None,
    axis: str | None = None,
    backend: str = "auto",
) -> PackedKV:
    """Pack every page of `pages` [P, page_size, H, D] on its own, like `kvq_jax.pack_paged`.

    Args:
      pages: [P, page_size, H, D] bfloat16, float16 or float32.
      kind, format, group_size, axis: as for `kvq_jax.pack_paged` (token-axis groups must
        divide page_size; INT4's default group size is gcd(64, page_size) on tokens).
      backend: "auto" (the Pallas kernel where supported, else XLA), "xla", "pallas" or
        "pallas_interpret". "pallas" / "pallas_interpret" raise ValueError when the kernel
        does not take the configuration (`config_support`) or, for "pallas", the device.

    Returns:
      The `PackedKV` of `pack_paged` (arrays with a leading page axis), byte for byte.

    Not itself jitted (the XLA path is the jitted `pack_paged`, the kernel path a jitted
    wrapper of the kernel), so it can be called inside or outside `jax.jit`; every argument
    is checked when it is called or traced, never against the data.
    """
    pages = jnp.asarray(pages)
    num_pages, page_size, h, d = check_pages(pages)
    axis, group_size = resolve_paged(format, kind, (page_size, h, d), axis, group_size)
    impl = _backend.resolve_backend(backend, _reason((page_size, h, d), format, axis, group_size))
    if impl == "xla" or num_pages == 0:  # nothing to launch for zero pages
        return xla.pack_pages(pages, kind=kind, format=format, group_size=group_size, axis=axis)
    return _pack_pages_kernel(
        pages,
        kind=kind,
        format=format,
        axis=axis,
        group_size=group_size,
        interpret=impl == "pallas_interpret",
    )


def storage_bytes(pages_shape, dtype, **kwargs) -> tuple[int, int]:
    """(bytes read, bytes written) by one `pack_pages` call: the pages, and every packed array
    (the effective-bandwidth numerator of the benchmark; NVFP4's second read of each page is
    not counted)."""
    pages = jax.ShapeDtypeStruct(tuple(pages_shape), dtype)
    out = jax.eval_shape(functools.partial(pack_pages, backend="xla", **kwargs), pages)
    read = int(np.prod(pages_shape)) * np.dtype(dtype).itemsize
    written = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(out))
    return read, written
