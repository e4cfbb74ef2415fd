"""Heavy rows (docs/FORMAT.md section 5a) in JAX: `select_heavy` picks one row per (group of G
tokens, KV head) from the keys and a bfloat16 mean-query table; `pack_heavy` stores those rows
INT8 and packs the others in a base format; `unpack_heavy` decodes. Use the same rows for the
keys and the values of a layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvq_jax.codecs import _grouping
from kvq_jax.codecs._numerics import flush_subnormal, widen
from kvq_jax.codecs.formats.int4 import dequantize_groups, group_range, quantize_groups
from kvq_jax.codecs.registry import get_codec
from kvq_jax.codecs.rope import apply_rope, invert_rope
from kvq_jax.core.checks import check_values
from kvq_jax.core.containers import HeavyKVBase
from kvq_jax.core.heavy import (
    HEAVY_DEFAULT_GROUP_SIZE,
    HEAVY_LEVELS,
    check_heavy_group_size,
    check_heavy_rows,
    check_heavy_table,
    heavy_base_group_size,
    num_heavy_groups,
)
from kvq_jax.core.layouts import check_float_dtype

__all__ = ["HeavyKV", "pack_heavy", "select_heavy", "unpack_heavy"]


class HeavyKV(HeavyKVBase):
    """Heavy-row storage of jax arrays (fields: `kvq_jax.core.containers.HeavyKVBase`)."""


jax.tree_util.register_dataclass(
    HeavyKV,
    data_fields=["payload", "rows", "codes", "minimum", "scale"],
    meta_fields=["group_size", "shape"],
)


def round_bf16(x: jnp.ndarray) -> jnp.ndarray:
    """float32 -> the nearest bfloat16 value (ties to even) as float32, on the bits (a
    convert pair could be elided under XLA's excess-precision rules); NaN stays NaN."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    bits = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & 1)) & jnp.uint32(0xFFFF0000)
    return jnp.where(jnp.isnan(x), x, lax.bitcast_convert_type(bits, jnp.float32))


def heavy_scores(keys: jnp.ndarray, table: jnp.ndarray) -> jnp.ndarray:
    """float32 [T, H]: max over r of the exact bf16 dot of each key row with table[h, r]
    (pairwise halving sum, every step flushed); NaN scores become -inf."""
    k = round_bf16(widen(keys))[:, :, None, :]  # [T, H, 1, D]
    y = flush_subnormal(k * table.astype(jnp.float32)[None])  # [T, H, R, D], exact products
    n = y.shape[-1]
    while n > 1:
        n //= 2
        y = flush_subnormal(y[..., :n] + y[..., n : 2 * n])
    s = y[..., 0]
    return jnp.max(jnp.where(jnp.isnan(s), -jnp.inf, s), axis=-1)


@functools.partial(jax.jit, static_argnames=("group_size",))
def select_heavy(keys, table, *, group_size: int = HEAVY_DEFAULT_GROUP_SIZE) -> jnp.ndarray:
    """The heavy row of each token group (FORMAT.md 5a).

    Args:
      keys: [T, H, D] bfloat16, float16 or float32, D a power of two.
      table: bfloat16 [H, R, D], the mean query of each of the R query heads per KV head.
      group_size: G in 2..256 tokens per group.

    Returns:
      uint8 [ceil(T/G), H]: per group and head, the index within the group of the row with
      the largest score (the first on ties).
    """
    keys, table = jnp.asarray(keys), jnp.asarray(table)
    (_, h, d), _ = check_values(keys, "keys")
    check_heavy_table(table, h, d)
    return choose_rows(keys, table, check_heavy_group_size(group_size))


def choose_rows(keys, table, g: int) -> jnp.ndarray:
    """`select_heavy` of validated keys [T, H, D] and table [H, R, D] (traceable, unchecked)."""
    t, h, _ = keys.shape
    n = num_heavy_groups(t, g)
    scores = jnp.pad(heavy_scores(keys, table), ((0, n * g - t), (0, 0)), constant_values=-jnp.inf)
    return jnp.argmax(scores.reshape(n, g, h), axis=1).astype(jnp.uint8)


def _group_lengths(t: int, g: int) -> np.ndarray:
    n = num_heavy_groups(t, g)
    return np.minimum(g, t - g * np.arange(n)).astype(np.int32)


def _by_group(x, rows: int, g: int) -> jnp.ndarray:
    """[R, H, D] -> [rows / g, g, H, D], zero rows appended (R <= rows, g | rows)."""
    x = jnp.pad(x, ((0, rows - x.shape[0]), (0, 0), (0, 0)))
    return x.reshape(rows // g, g, *x.shape[1:])


@functools.partial(
    jax.jit, static_argnames=("kind", "format", "group_size", "base_group_size", "axis")
)
def pack_heavy(
    values,
    rows,
    *,
    kind: str,
    format: str = "int4",
    group_size: int = HEAVY_DEFAULT_GROUP_SIZE,
    base_group_size: int | None = None,
    axis: str | None = None,
) -> HeavyKV:
    """Store one INT8 row per (token group, head) and pack the others (FORMAT.md 5a).

    Args:
      values: [T, H, D] keys or values (bfloat16, float16 or float32).
      rows: integer [ceil(T/G), H], the heavy row of each group (`select_heavy` of the
        layer's keys); an index past a partial group's end means its last row.
      kind, format, axis: the payload's, as for `pack_kv`.
      group_size: G, tokens per heavy group (2..256).
      base_group_size: the payload's group size (None: G - 1 on axis tokens, the format's
        default otherwise).

    Returns:
      A `HeavyKV`.
    """
    values, rows = jnp.asarray(values), jnp.asarray(rows)
    (t, h, d), _ = check_values(values)
    g = check_heavy_group_size(group_size)
    check_heavy_rows(rows, t, h, g)
    codec = get_codec(format)
    axis, _ = codec.resolve((max(t - num_heavy_groups(t, g), 0), h, d), kind, axis, None)
    base = heavy_base_group_size(axis, g, base_group_size)
    axis, base = codec.resolve((t, h, d), kind, axis, base)
    rest, heavy = split_heavy(values, rows, g)
    payload = codec.pack(rest, kind=kind, axis=axis, group_size=base)
    return HeavyKV(
        payload=payload,
        rows=heavy["heavy_rows"],
        codes=heavy["heavy_codes"],
        minimum=heavy["heavy_minimum"],
        scale=heavy["heavy_scale"],
        group_size=g,
        shape=(t, h, d),
    )


def split_heavy(values, rows, g: int) -> tuple[jnp.ndarray, dict]:
    """Validated values [T, H, D] and rows [ceil(T/G), H] (clamped to each group's length) ->
    (the T - nG other rows [T - nG, H, D] in order, {heavy_rows, heavy_codes, heavy_minimum,
    heavy_scale}: the heavy rows INT8 (FORMAT.md 5a)). Traceable."""
    t, _, d = values.shape
    n = rows.shape[0]
    last = jnp.asarray(_group_lengths(t, g) - 1)[:, None]
    rows = jnp.minimum(rows.astype(jnp.int32), last)
    # Payload row j of group k is row j of the group before its heavy row, row j + 1 after:
    # two shifted views and a select (exact; no per-element gather).
    x = _by_group(values, n * g, g)  # [nG, G, H, D]
    j = jnp.arange(g - 1)[None, :, None, None]
    rest = jnp.where(j < rows[:, None, :, None], x[:, :-1], x[:, 1:])
    rest = rest.reshape(n * (g - 1), *values.shape[1:])[: t - n]
    heavy = jnp.take_along_axis(x, rows[:, None, :, None], axis=1)[:, 0]  # [nG, H, D]
    layout = _grouping.GroupLayout(heavy.shape, "channels", d)
    mn, mx, finite = group_range(layout, heavy)
    codes, minimum, scale = quantize_groups(
        layout.split(widen(heavy), 0.0), mn, mx, finite, HEAVY_LEVELS
    )
    m = layout.member_axis
    return rest, {
        "heavy_rows": rows.astype(jnp.uint8),
        "heavy_codes": layout.merge(codes),
        "heavy_minimum": minimum.squeeze(m)[..., 0],
        "heavy_scale": scale.squeeze(m)[..., 0],
    }


@functools.partial(jax.jit, static_argnames=("dtype",))
def unpack_heavy(packed: HeavyKV, dtype=None) -> jnp.ndarray:
    """Decode a `HeavyKV` to [T, H, D] in `dtype` (default: the dtype it was packed from)."""
    if not isinstance(packed, HeavyKV):
        raise TypeError(f"packed must be a HeavyKV, got {type(packed).__name__}")
    dtype = np.dtype(packed.dtype if dtype is None else check_float_dtype(dtype, "dtype"))
    rest = get_codec(packed.payload.format).unpack(packed.payload, np.dtype(np.float32))
    heavy = {"heavy_rows": packed.rows, "heavy_codes": packed.codes,
             "heavy_minimum": packed.minimum, "heavy_scale": packed.scale}  # fmt: skip
    return merge_heavy(rest, heavy, packed.shape, packed.group_size).astype(dtype)


def heavy_rows_decoded(heavy: dict, h: int, d: int) -> jnp.ndarray:
    """float32 [nG, H, D]: the INT8 decode of the heavy rows (`split_heavy`'s dict)."""
    layout = _grouping.GroupLayout((heavy["heavy_rows"].shape[0], h, d), "channels", d)
    return layout.merge(
        dequantize_groups(
            layout.split(heavy["heavy_codes"], 0),
            heavy["heavy_minimum"][..., None],
            heavy["heavy_scale"][..., None],
            layout.member_axis,
        )
    )


def merge_heavy(rest, heavy: dict, shape, g: int, heavy_map=None) -> jnp.ndarray:
    """float32 [T, H, D]: the decoded other rows `rest` [T - nG, H, D] (float32) with the INT8
    decode of the heavy rows (`split_heavy`'s dict; `heavy_map` of it when given, e.g. a
    rotation) put back at their places. Traceable."""
    t, h, d = shape
    rows = heavy["heavy_rows"]
    decoded = heavy_rows_decoded(heavy, h, d)
    if heavy_map is not None:
        decoded = heavy_map(decoded)
    n = rows.shape[0]
    if not t:
        return decoded[:0]
    # Row i of group k: payload row i before the heavy row, i - 1 after it (shifted views).
    x = _by_group(rest, n * (g - 1), g - 1)  # [nG, G - 1, H, D]
    zero = jnp.zeros_like(x[:, :1])
    before, after = jnp.concatenate([x, zero], axis=1), jnp.concatenate([zero, x], axis=1)
    i = jnp.arange(g)[None, :, None, None]
    r = rows.astype(jnp.int32)[:, None, :, None]
    out = jnp.where(i < r, before, jnp.where(i == r, decoded[:, None], after))
    return out.reshape(n * g, h, d)[:t]


def heavy_kv(keys, values, table, *, key_format, value_format, group_size, window=None, rope=None):
    """One layer's keys and values [T, H, D] stored with heavy rows: the rows chosen from the
    keys' packed rows (the window's raw rows, if any, are kept and not chosen from), the same
    rows for the values. `rope`: (cos, sin) [T, 1, D] of the keys' positions to store the keys
    before RoPE (the rows are still chosen from the RoPE'd keys; the decoded keys are rotated
    back), or None. Returns (k_hat, v_hat, k_packed, v_packed): the reconstructions [T, H, D]
    (window rows exact) and the two `HeavyKV` of the packed rows. Traceable (the report and
    the model hooks call it once per loop)."""
    t = keys.shape[0]
    h, m, _ = window.split_sizes(t) if window is not None else (0, t, 0)
    mid = slice(h, h + m)
    rows = select_heavy(keys[mid], table, group_size=group_size)
    stored = keys if rope is None else invert_rope(keys, *rope).astype(keys.dtype)
    out = []
    for kind, x, fmt in (("key", stored, key_format), ("value", values, value_format)):
        packed = pack_heavy(x[mid], rows, kind=kind, format=fmt, group_size=group_size)
        x_hat = unpack_heavy(packed, np.dtype(np.float32))
        if kind == "key" and rope is not None:
            x_hat = apply_rope(x_hat, *(a[mid] for a in rope))
        source = keys if kind == "key" else values
        x_hat = jnp.concatenate([source[:h], x_hat.astype(source.dtype), source[h + m :]])
        out.append((x_hat, packed))
    (k_hat, k_packed), (v_hat, v_packed) = out
    return k_hat, v_hat, k_packed, v_packed
