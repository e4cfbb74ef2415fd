"""Heavy rows (docs/FORMAT.md section 5a) in Torch, the same bytes as `kvq_jax.codecs.heavy`:
`select_heavy`, `pack_heavy`, `unpack_heavy` and the `HeavyKV` container of torch tensors.
"""

from __future__ import annotations

import numpy as np
import torch

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
from kvq_torch_bridge.codecs import _grouping
from kvq_torch_bridge.codecs._dtypes import meta, torch_dtype
from kvq_torch_bridge.codecs._numerics import F32, flush_subnormal, widen
from kvq_torch_bridge.codecs.codec import check_float_dtype, check_tensor, check_values
from kvq_torch_bridge.codecs.formats.int4 import dequantize, quantize
from kvq_torch_bridge.codecs.packed import register_pytree
from kvq_torch_bridge.codecs.registry import get_codec
from kvq_torch_bridge.codecs.rope import apply_rope, invert_rope

__all__ = ["HeavyKV", "pack_heavy", "select_heavy", "unpack_heavy"]


class HeavyKV(HeavyKVBase):
    """Heavy-row storage of torch tensors (fields: `kvq_jax.core.containers.HeavyKVBase`)."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.payload.torch_dtype


register_pytree(HeavyKV, ("payload", "rows", "codes", "minimum", "scale"), ("group_size", "shape"))


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest bfloat16 value (ties to even) as float32, on the bits; NaN
    stays NaN."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return torch.where(torch.isnan(x), x, _to_int32(bits).view(torch.float32))


def _to_int32(bits: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) -> int32 with the same low 32 bits."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)


def heavy_scores(keys: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """float32 [T, H]: max over r of the exact bf16 dot of each key row with table[h, r]
    (pairwise halving sum, every step flushed); NaN scores become -inf."""
    k = round_bf16(widen(keys))[:, :, None, :]
    y = flush_subnormal(k * table.to(device=keys.device, dtype=F32)[None])
    n = y.shape[-1]
    while n > 1:
        n //= 2
        y = flush_subnormal(y[..., :n] + y[..., n : 2 * n])
    s = y[..., 0]
    s = torch.where(torch.isnan(s), torch.full_like(s, -float("inf")), s)
    return s.amax(dim=-1)


def select_heavy(keys, table, *, group_size: int = HEAVY_DEFAULT_GROUP_SIZE) -> torch.Tensor:
    """The heavy row of each token group: uint8 [ceil(T/G), H] (`kvq_jax.select_heavy`).
    keys: torch [T, H, D], D a power of two; table: bfloat16 [H, R, D]."""
    (t, h, d), _ = check_values(keys, "keys")
    check_tensor(table, "table")
    check_heavy_table(meta(table), h, d)
    g = check_heavy_group_size(group_size)
    n = num_heavy_groups(t, g)
    scores = heavy_scores(keys, table)
    pad = torch.full((n * g - t, h), -float("inf"), dtype=F32, device=keys.device)
    scores = torch.cat([scores, pad]).reshape(n, g, h)
    return (
        torch.argmax(scores, dim=1).to(torch.uint8)
        if n
        else torch.zeros((0, h), dtype=torch.uint8, device=keys.device)
    )


def _group_lengths(t: int, g: int) -> np.ndarray:
    n = num_heavy_groups(t, g)
    return np.minimum(g, t - g * np.arange(n)).astype(np.int64)


def rest_sources(rows: torch.Tensor, t: int, g: int) -> torch.Tensor:
    """int64 [T - nG, H]: the row of [0, T) each payload row holds. rows: int64, clamped."""
    p = np.arange(t - rows.shape[0])
    grp = torch.as_tensor(p // (g - 1), device=rows.device)
    j = torch.as_tensor(p % (g - 1), device=rows.device)[:, None]
    return (grp * g)[:, None] + j + (j >= rows[grp]).to(torch.int64)


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
    """Store one INT8 row per (token group, head) and pack the others (`kvq_jax.pack_heavy`,
    the same arguments and bytes)."""
    (t, h, d), _ = check_values(values)
    check_tensor(rows, "rows")
    g = check_heavy_group_size(group_size)
    check_heavy_rows(meta(rows), t, h, g)
    codec = get_codec(format)
    axis, _ = codec.resolve((max(t - num_heavy_groups(t, g), 0), h, d), kind, axis, None)
    base = heavy_base_group_size(axis, g, base_group_size)
    axis, base = codec.resolve((t, h, d), kind, axis, base)
    last = torch.as_tensor(_group_lengths(t, g) - 1, device=values.device)[:, None]
    rows = torch.minimum(rows.to(device=values.device, dtype=torch.int64), last)
    src = rest_sources(rows, t, g)
    rest = torch.gather(values, 0, src[:, :, None].expand(-1, -1, d))
    payload = codec.pack(rest.contiguous(), kind=kind, axis=axis, group_size=base)
    starts = torch.as_tensor(g * np.arange(rows.shape[0]), device=values.device)[:, None]
    heavy = torch.gather(values, 0, (starts + rows)[:, :, None].expand(-1, -1, d))
    layout = _grouping.GroupLayout((rows.shape[0], h, d), "channels", d)
    codes, minimum, scale = quantize(widen(heavy), layout, HEAVY_LEVELS)
    return HeavyKV(
        payload=payload,
        rows=rows.to(torch.uint8),
        codes=codes.contiguous(),
        minimum=minimum[..., 0].contiguous(),
        scale=scale[..., 0].contiguous(),
        group_size=g,
        shape=(t, h, d),
    )


def unpack_heavy(packed: HeavyKV, dtype=None) -> torch.Tensor:
    """Decode a `HeavyKV` to [T, H, D] in `dtype` (default: the dtype it was packed from)."""
    if not isinstance(packed, HeavyKV):
        raise TypeError(f"packed must be a HeavyKV, got {type(packed).__name__}")
    dtype = np.dtype(packed.dtype if dtype is None else check_float_dtype(dtype, "dtype"))
    t, h, d = packed.shape
    g = packed.group_size
    device = packed.codes.device
    rest = get_codec(packed.payload.format).unpack(packed.payload, np.dtype(np.float32))
    layout = _grouping.GroupLayout((packed.rows.shape[0], h, d), "channels", d)
    heavy = dequantize(packed.codes, packed.minimum[..., None], packed.scale[..., None], layout)
    tok = np.arange(t)
    grp = torch.as_tensor(tok // g, device=device)
    i = torch.as_tensor(tok % g, device=device)[:, None]
    r = packed.rows.to(torch.int64)[grp]
    p = (grp * (g - 1))[:, None] + i - (i > r).to(torch.int64)
    p = p.clamp(0, max(rest.shape[0] - 1, 0))
    from_heavy = heavy[grp]
    if rest.shape[0]:
        from_rest = torch.gather(rest, 0, p[:, :, None].expand(-1, -1, d))
        out = torch.where((i == r)[:, :, None], from_heavy, from_rest)
    else:
        out = from_heavy
    return out.to(torch_dtype(dtype)).contiguous()


def heavy_kv(keys, values, table, *, key_format, value_format, group_size, window=None, rope=None):
    """One layer's keys and values [T, H, D] with heavy rows (`kvq_jax.codecs.heavy.heavy_kv`, the
    same arguments and bytes): rows chosen from the keys' packed rows, window rows kept raw,
    keys stored before RoPE when `rope` = (cos, sin) [T, 1, D] is given. Returns (k_hat,
    v_hat, k_packed, v_packed)."""
    t = keys.shape[0]
    h, m, _ = window.split_sizes(t) if window is not None else (0, t, 0)
    rows = select_heavy(keys[h : h + m], table, group_size=group_size)
    stored = keys if rope is None else invert_rope(keys, *rope).to(keys.dtype)
    out = []
    for kind, x, fmt in (("key", stored, key_format), ("value", values, value_format)):
        packed = pack_heavy(x[h : h + m], rows, kind=kind, format=fmt, group_size=group_size)
        x_hat = unpack_heavy(packed, np.dtype(np.float32))
        if kind == "key" and rope is not None:
            x_hat = apply_rope(x_hat, *(a[h : h + m] for a in rope))
        source = keys if kind == "key" else values
        x_hat = torch.cat([source[:h], x_hat.to(source.dtype), source[h + m :]])
        out.append((x_hat, packed))
    (k_hat, k_packed), (v_hat, v_packed) = out
    return k_hat, v_hat, k_packed, v_packed
