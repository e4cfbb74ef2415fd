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
    (t, h, d), _ = check_values(keys, "keys")
    check_heavy_table(table, h, d)
    g = check_heavy_group_size(group_size)
    n = num_heavy_groups(t, g)
    scores = jnp.pad(heavy_scores(keys, table), ((0, n * g - t), (0, 0)), constant_values=-jnp.inf)
    return jnp.argmax(scores.reshape(n, g, h), axis=1).astype(jnp.uint8)


def _group_lengths(t: int, g: int) -> np.ndarray:
    n = num_heavy_groups(t, g)
    return np.minimum(g, t - g * np.arange(n)).astype(np.int32)


def rest_sources(rows: jnp.ndarray, t: int, g: int) -> jnp.ndarray:
    """int32 [T - nG, H]: the row of [0, T) each payload row holds (group g's rows without
    rows[g, h], in order). rows: int32 [nG, H], already clamped."""
    p = np.arange(t - rows.shape[0])
    grp, j = p // (g - 1), p % (g - 1)
    j = jnp.asarray(j, jnp.int32)[:, None]
    return jnp.asarray(grp * g, jnp.int32)[:, None] + j + (j >= rows[grp]).astype(jnp.int32)


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
    last = jnp.asarray(_group_lengths(t, g) - 1)[:, None]
    rows = jnp.minimum(rows.astype(jnp.int32), last)
    rest = jnp.take_along_axis(values, rest_sources(rows, t, g)[:, :, None], axis=0)
    payload = codec.pack(rest, kind=kind, axis=axis, group_size=base)
    starts = jnp.asarray(g * np.arange(rows.shape[0]), jnp.int32)[:, None]
    heavy = jnp.take_along_axis(values, (starts + rows)[:, :, None], axis=0)  # [nG, H, D]
    layout = _grouping.GroupLayout(heavy.shape, "channels", d)
    mn, mx, finite = group_range(layout, heavy)
    codes, minimum, scale = quantize_groups(
        layout.split(widen(heavy), 0.0), mn, mx, finite, HEAVY_LEVELS
    )
    m = layout.member_axis
    return HeavyKV(
        payload=payload,
        rows=rows.astype(jnp.uint8),
        codes=layout.merge(codes),
        minimum=minimum.squeeze(m)[..., 0],
        scale=scale.squeeze(m)[..., 0],
        group_size=g,
        shape=(t, h, d),
    )


@functools.partial(jax.jit, static_argnames=("dtype",))
def unpack_heavy(packed: HeavyKV, dtype=None) -> jnp.ndarray:
    """Decode a `HeavyKV` to [T, H, D] in `dtype` (default: the dtype it was packed from)."""
    if not isinstance(packed, HeavyKV):
        raise TypeError(f"packed must be a HeavyKV, got {type(packed).__name__}")
    dtype = np.dtype(packed.dtype if dtype is None else check_float_dtype(dtype, "dtype"))
    t, h, d = packed.shape
    g = packed.group_size
    rest = get_codec(packed.payload.format).unpack(packed.payload, np.dtype(np.float32))
    layout = _grouping.GroupLayout((packed.rows.shape[0], h, d), "channels", d)
    heavy = layout.merge(
        dequantize_groups(
            layout.split(packed.codes, 0),
            packed.minimum[..., None],
            packed.scale[..., None],
            layout.member_axis,
        )
    )
    tok = np.arange(t)
    grp, i = tok // g, jnp.asarray(tok % g, jnp.int32)[:, None]
    r = packed.rows.astype(jnp.int32)[grp]  # [T, H]
    p = jnp.asarray(grp * (g - 1), jnp.int32)[:, None] + i - (i > r).astype(jnp.int32)
    p = jnp.clip(p, 0, max(rest.shape[0] - 1, 0))
    from_rest = jnp.take_along_axis(rest, p[:, :, None], axis=0) if rest.shape[0] else rest
    from_heavy = heavy[grp]
    out = jnp.where((i == r)[:, :, None], from_heavy, from_rest) if t else from_heavy
    return out.astype(dtype)


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
