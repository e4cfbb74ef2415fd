"""The XLA reference of page pack: the format's codec applied to every page (vmap).

The kernel in `pallas_triton.py` is held to this function byte for byte.
"""

from __future__ import annotations

import jax

from kvq_jax.codecs.packed import PackedKV
from kvq_jax.codecs.registry import get_codec
from kvq_jax.core.codec_base import layer_arg


def pack_paged(pages, *, kind: str, format: str, group_size: int, axis: str,
               layer=None, rows=None) -> PackedKV:  # fmt: skip
    """Pack validated pages [P, page_size, H, D] (axis and group_size resolved) page by page:
    a PackedKV whose arrays carry a leading page axis. layer: the model layer of a format with
    one table per layer (int or int32 scalar; ignored by the others). rows: uint8
    [P, page_size / G, H], each page's heavy rows for a heavy-row format that takes them
    (values: those chosen from the keys), else None."""
    codec = get_codec(format)
    args = dict(kind=kind, axis=axis, group_size=group_size, **layer_arg(codec, layer))
    if rows is not None and hasattr(codec, "heavy_group"):
        return jax.vmap(lambda page, r: codec.pack(page, **args, rows=r))(pages, rows)

    def one(page):
        return codec.pack(page, **args)

    return jax.vmap(one)(pages)
