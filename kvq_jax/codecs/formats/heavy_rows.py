"""Heavy rows as a format (FORMAT.md 5a; `kvq_jax.core.layouts.HeavyLayout`): what the paged
cache stores per page for a heavy-row policy.

`HeavyCodec(base, G, tables)` packs [T, H, D] rows as `kvq_jax.pack_heavy` does (the same
bytes: one INT8 row per G tokens and head, the other rows in the base codec), into one
`PackedKV` (the base's fields for the other rows, `HEAVY_FIELDS` for the heavy ones). A codec
with a mean-query table (keys) chooses its rows itself (`select_heavy`; a table per model
layer: the layer's, traced); one without (values) takes `rows`, those chosen from its keys.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvq_jax.codecs.codec import Codec
from kvq_jax.codecs.heavy import choose_rows, heavy_rows_decoded, merge_heavy, split_heavy
from kvq_jax.codecs.packed import PackedKV
from kvq_jax.core.codec_base import layer_arg
from kvq_jax.core.heavy import check_heavy_rows
from kvq_jax.core.layouts import HEAVY_FIELDS, HeavyLayout

__all__ = ["HeavyCodec", "payload_positions", "register_heavy"]


class HeavyCodec(HeavyLayout, Codec):
    """Heavy rows over `base` (a JAX codec). pack(..., layer, rows): `rows` uint8 [nG, H]
    (None: chosen from the values with the format's table, which it must then hold)."""

    def __init__(self, base: Codec, heavy_group: int, tables=None, name: str | None = None):
        super().__init__(base, heavy_group, tables, name)
        self.base_codec = base

    def select_rows(self, keys, layer=None) -> jnp.ndarray:
        """uint8 [ceil(T/G), H]: the heavy row of each group of keys [T, H, D] (FORMAT.md 5a)
        under the format's table (the layer's, for a table per layer)."""
        if self.tables is None:
            raise ValueError(
                f"format {self.name!r} holds no mean-query table: pass rows (those chosen "
                "from the keys of the same tokens)"
            )
        table = jnp.asarray(self.tables)
        if table.ndim == 4:
            if layer is None:
                raise ValueError(
                    f"layer: format {self.name!r} holds one mean-query table per model layer "
                    f"({table.shape[0]}); pass the layer (an int or an int32 scalar)"
                )
            table = table[jnp.asarray(layer, jnp.int32)]
        return choose_rows(keys, table, self.heavy_group)

    def pack(self, values, *, kind, axis, group_size, layer=None, rows=None) -> PackedKV:
        t, h, _ = values.shape
        if rows is None:
            rows = self.select_rows(values, layer)
        check_heavy_rows(rows, t, h, self.heavy_group)
        rest, heavy = split_heavy(values, rows, self.heavy_group)
        base = self.base_codec
        payload = base.pack(rest, kind=kind, axis=axis, group_size=group_size,
                            **layer_arg(base, layer))  # fmt: skip
        return self._packed(
            {**payload.arrays, **heavy}, kind=kind, axis=axis, group_size=group_size,
            shape=values.shape, dtype=values.dtype,
        )  # fmt: skip

    @property
    def costly_decode(self) -> bool:
        return self.base_codec.costly_decode

    @property
    def rotated_space(self) -> bool:
        """Over a Hadamard-rotated base (HINT), attention may read `unpack_rotated`."""
        return getattr(self.base_codec, "rotated_space", False)

    def _payload(self, packed) -> PackedKV:
        t, h, d = packed.shape
        base = self.base_codec
        return PackedKV(
            **{f: getattr(packed, f) for f in base.array_fields}, format=base.name,
            kind=packed.kind, axis=packed.axis, group_size=packed.group_size,
            shape=(t - self.num_groups(t), h, d), dtype=packed.dtype,
        )  # fmt: skip

    def _spread(self, packed) -> PackedKV | None:
        """The payload as a base-format tensor of all T rows: each payload array with a row
        axis gets a filler row at each heavy row's place (a copy of a neighbour), so the base
        decodes the T rows in one pass and the heavy rows overwrite the fillers: the same
        values as decoding the payload and merging (every row decodes on its own, with its
        group's metadata), without shifting decoded rows (XLA:CPU fuses a decode into each
        shifted view: 2x slower for INTB keys, 5x for HINT4 values). Token groups of G - 1
        rows (their metadata is then one entry per heavy group: only the codes are spread,
        the groups become G rows) or channel groups (every array is per row: all are
        spread); None otherwise, or for a last group of one row."""
        t, h, d = packed.shape
        g, n = self.heavy_group, self.num_groups(t)
        tokens = packed.axis == "tokens"
        if (tokens and packed.group_size != g - 1) or t % g == 1:
            return None
        arrays = {f: getattr(packed, f) for f in self.base_codec.array_fields}
        spread = {f for f in arrays if f == "codes" or not tokens}
        if any(arrays[f].ndim < 2 or arrays[f].shape[0] != t - n for f in spread):
            return None  # an array without a payload-row axis (e.g. one scale per page)
        rows = packed.heavy_rows.astype(jnp.int32)  # [nG, H]
        fields = {f: _spread_rows(a, rows, n, g, t) if f in spread else a
                  for f, a in arrays.items()}  # fmt: skip
        return PackedKV(
            **fields, format=self.base_codec.name, kind=packed.kind, axis=packed.axis,
            group_size=g if tokens else packed.group_size, shape=(t, h, d), dtype=packed.dtype,
        )  # fmt: skip

    def _paths(self, layer=None, rotated: bool = False):
        """(the base's data path to float32, the map of the heavy rows' INT8 decode): plain,
        as `unpack` (the layer's table for a per-layer base), or in the base's rotated space,
        as `unpack_rotated` (the heavy rows rotated)."""
        base = self.base_codec
        if rotated:
            from kvq_jax.codecs.formats.hadamard import rotate

            return base.unpack_rotated, rotate

        def decode(p):
            return base.unpack(p, np.dtype(np.float32), **layer_arg(base, layer))

        return decode, None

    @staticmethod
    def _heavy_decoded(packed, heavy_map) -> jnp.ndarray:
        """float32 [nG, H, D]: the heavy rows' INT8 decode (`heavy_map` of it when given)."""
        heavy = {f: getattr(packed, f) for f in HEAVY_FIELDS}
        decoded = heavy_rows_decoded(heavy, *packed.shape[1:])
        return decoded if heavy_map is None else heavy_map(decoded)

    def _decode(self, packed, decode, heavy_map=None) -> jnp.ndarray:
        """float32 [T, H, D]: `decode` (a base data path to float32) of the payload, with the
        heavy rows' INT8 decode (`heavy_map` of it) in their places."""
        heavy = {f: getattr(packed, f) for f in HEAVY_FIELDS}
        spread = self._spread(packed)
        if spread is None:
            return merge_heavy(decode(self._payload(packed)), heavy, packed.shape,
                               self.heavy_group, heavy_map)  # fmt: skip
        decoded = self._heavy_decoded(packed, heavy_map)  # [nG, H, D]
        # the heavy rows written over their fillers in place (a scatter of nG x H rows, not
        # a select over every row: 2.3 -> 0.9 ms for HINT4 values of 8192 x 3 rows on XLA:CPU)
        g = self.heavy_group
        rows = jnp.arange(decoded.shape[0])[:, None] * g + heavy["heavy_rows"].astype(jnp.int32)
        heads = jnp.broadcast_to(jnp.arange(packed.shape[1]), rows.shape)
        return decode(spread).at[rows, heads].set(decoded, mode="drop", unique_indices=True)

    def unpack_parts(self, packed, layer=None, *, rotated: bool = False):
        """The pieces `unpack` merges, unmerged: (payload float32 [T - nG, H, D], heavy
        float32 [nG, H, D], rows int32 [nG, H]): the payload rows decoded by the base in
        payload order (head h's row g*(G-1) + j is row g*G + j + (j >= rows[g, h])), the heavy
        rows' INT8 decode (row g*G + rows[g, h]). rotated (`rotated_space` only): both in the
        base's rotated space, as `unpack_rotated`. For readers that do not need the rows in
        order (decode attention: a softmax over rows is the same in any order)."""
        decode, heavy_map = self._paths(layer, rotated)
        return (decode(self._payload(packed)), self._heavy_decoded(packed, heavy_map),
                packed.heavy_rows.astype(jnp.int32))  # fmt: skip

    def unpack(self, packed, dtype, layer=None) -> jnp.ndarray:
        return self._decode(packed, *self._paths(layer)).astype(dtype)

    def unpack_rotated(self, packed) -> jnp.ndarray:
        """float32 [T, H, D] in the base's rotated space (`rotated_space` only): the payload's
        `unpack_rotated`, the heavy rows' INT8 decode rotated (`unrotate` of this is `unpack`
        before the cast, up to rounding)."""
        return self._decode(packed, *self._paths(rotated=True))


def _spread_rows(a, rows, n: int, g: int, t: int) -> jnp.ndarray:
    """[T - nG, H, ...] payload rows -> [T, H, ...]: group k's rows with a filler (a copy of a
    neighbour) inserted at rows[k, h] for each head h."""
    x = jnp.pad(a, ((0, n * (g - 1) - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))
    x = x.reshape(n, g - 1, *a.shape[1:])
    before = jnp.concatenate([x, x[:, -1:]], axis=1)  # row i of the group, i < rows
    after = jnp.concatenate([x[:, :1], x], axis=1)  # row i - 1, i >= rows
    i = jnp.arange(g).reshape(1, g, *([1] * (a.ndim - 1)))
    r = rows.reshape(n, 1, rows.shape[1], *([1] * (a.ndim - 2)))
    return jnp.where(i < r, before, after).reshape(n * g, *a.shape[1:])[:t]


def payload_positions(rows, g: int, t: int) -> jnp.ndarray:
    """int32 [T - nG, H]: the row (within T) of each payload row of each head, for heavy rows
    `rows` int [nG, H] in groups of `g` (FORMAT.md 5a: row g*(G-1) + j of head h is row
    g*G + j + (j >= rows[g, h]))."""
    n = rows.shape[0]
    j = jnp.arange(g - 1)[None, :, None]
    pos = jnp.arange(n)[:, None, None] * g + j + (j >= rows[:, None, :])
    return pos.reshape(n * (g - 1), rows.shape[1])[: t - n]


def register_heavy(base: str, heavy_group: int, tables=None) -> str:
    """Register the heavy-row format over registered format `base` (with mean-query
    `tables`: None, [H, R, D] or [N, H, R, D] bfloat16) in the JAX registry unless a codec of
    that name is there already; returns its name."""
    from kvq_jax.codecs.registry import CODECS, get_codec, register_codec

    codec = HeavyCodec(get_codec(base), heavy_group, tables)
    if codec.name not in CODECS:
        register_codec(codec)
    return codec.name
