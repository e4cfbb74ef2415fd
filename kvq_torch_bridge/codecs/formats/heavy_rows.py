"""Heavy rows as a format in Torch (FORMAT.md 5a; `kvq_jax.core.layouts.HeavyLayout`), the
bytes of `kvq_jax.codecs.formats.heavy_rows.HeavyCodec`: what a paged cache stores per page
for a heavy-row policy, one `PackedKV` holding the base format's fields for the other rows
and `HEAVY_FIELDS` for the INT8 heavy rows.

`HeavyCodec(base, G, tables)`: a codec with a mean-query table (keys) chooses its rows itself
(`select_heavy`; one table per model layer: `layer` picks it); one without (values) takes
`rows`, those chosen from its keys (`pack(..., rows=...)`).
"""

from __future__ import annotations

import torch

from kvq_jax.core.codec_base import layer_arg
from kvq_jax.core.heavy import check_heavy_rows
from kvq_jax.core.layouts import HEAVY_FIELDS, HeavyLayout
from kvq_torch_bridge.codecs._dtypes import from_numpy, meta
from kvq_torch_bridge.codecs.codec import Codec
from kvq_torch_bridge.codecs.packed import PackedKV

__all__ = ["HeavyCodec", "register_heavy"]


class HeavyCodec(HeavyLayout, Codec):
    """Heavy rows over `base` (a Torch codec). pack(..., layer, rows): `rows` uint8 [nG, H]
    (None: chosen from the values with the format's table, which it must then hold)."""

    def __init__(self, base: Codec, heavy_group: int, tables=None, name: str | None = None):
        super().__init__(base, heavy_group, tables, name)
        self.base_codec = base

    def _table(self, layer, device) -> torch.Tensor:
        if self.tables is None:
            raise ValueError(
                f"format {self.name!r} holds no mean-query table: pass rows (those chosen "
                "from the keys of the same tokens)"
            )
        table = self.tables
        if table.ndim == 4:
            if isinstance(layer, bool) or not isinstance(layer, int):
                raise ValueError(
                    f"layer: format {self.name!r} holds one mean-query table per model layer "
                    f"({table.shape[0]}); pass the layer (an int), got {layer!r}"
                )
            table = table[layer]
        return from_numpy(table, device)

    def select_rows(self, keys: torch.Tensor, layer=None) -> torch.Tensor:
        """uint8 [ceil(T/G), H]: the heavy row of each group of keys [T, H, D] (FORMAT.md 5a)
        under the format's table (the layer's, for a table per layer)."""
        from kvq_torch_bridge.codecs.heavy import select_heavy

        table = self._table(layer, keys.device)
        return select_heavy(keys, table, group_size=self.heavy_group)

    def pack(self, values, *, kind, axis, group_size, layer=None, rows=None) -> PackedKV:
        from kvq_torch_bridge.codecs.heavy import pack_heavy

        t, h, _ = values.shape
        if rows is None:
            rows = self.select_rows(values, layer)
        check_heavy_rows(meta(rows), t, h, self.heavy_group)
        base = self.base_codec
        if layer_arg(base, layer):
            raise ValueError(f"format {self.name!r}: a base with one table per layer "
                             f"({base.name!r}) is not packed by the Torch stack")  # fmt: skip
        heavy = pack_heavy(values, rows, kind=kind, format=base.name,
                           group_size=self.heavy_group, base_group_size=group_size,
                           axis=axis)  # fmt: skip
        arrays = {**heavy.payload.arrays, "heavy_rows": heavy.rows, "heavy_codes": heavy.codes,
                  "heavy_minimum": heavy.minimum, "heavy_scale": heavy.scale}  # fmt: skip
        return self._packed(arrays, kind=kind, axis=axis, group_size=group_size,
                            shape=values.shape, dtype=values.dtype)  # fmt: skip

    def unpack(self, packed, dtype, layer=None) -> torch.Tensor:
        from kvq_torch_bridge.codecs.heavy import HeavyKV, unpack_heavy

        t, h, d = packed.shape
        base = self.base_codec
        payload = PackedKV(
            **{f: getattr(packed, f) for f in base.array_fields}, format=base.name,
            kind=packed.kind, axis=packed.axis, group_size=packed.group_size,
            shape=(t - self.num_groups(t), h, d), dtype=packed.dtype,
        )  # fmt: skip
        fields = dict(zip(("rows", "codes", "minimum", "scale"), HEAVY_FIELDS, strict=True))
        heavy = HeavyKV(payload=payload, group_size=self.heavy_group, shape=(t, h, d),
                        **{k: getattr(packed, f) for k, f in fields.items()})  # fmt: skip
        return unpack_heavy(heavy, dtype)


def register_heavy(base: str, heavy_group: int, tables=None) -> str:
    """Register the heavy-row format over registered format `base` (with mean-query
    `tables`: None, [H, R, D] or [N, H, R, D] bfloat16) in the Torch registry unless a codec
    of that name is there already; returns its name (`kvq_jax`'s `register_heavy`'s)."""
    from kvq_torch_bridge.codecs.registry import CODECS, get_codec, register_codec

    codec = HeavyCodec(get_codec(base), heavy_group, tables)
    if codec.name not in CODECS:
        register_codec(codec)
    return codec.name
