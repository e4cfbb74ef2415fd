"""Heavy rows (docs/FORMAT.md section 5a), element by element: the selection from keys and a
mean-query table, and the storage of one INT8 row per (token group, head) beside a base
format's payload of the other rows.

    score[t, h] = max_r  sum_c  f32(bf16(k[t, h, c])) * table[h, r, c]   (pairwise halving sum)
    rows[g, h]  = first row of group g with the group's largest score (NaN: ignored)

Products of two bfloat16 values are exact in float32; every sum goes through `scalar.add`.
numpy is only the container (raw bits in and out), as in the rest of the oracle.
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

from kvq_jax.oracle import affine
from kvq_jax.oracle.scalar import add, bf16, bits_to_bf16, bits_to_f16, is_nan, mul

#: Largest INT8 code (levels of the heavy row's affine quantization).
HEAVY_LEVELS = 255
_BF16 = np.dtype(ml_dtypes.bfloat16)
_U8 = np.dtype(np.uint8)
_F16 = np.dtype(np.float16)


def num_groups(t: int, group_size: int) -> int:
    return -(-t // group_size)


def _check_group_size(group_size) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    if group_size > 256:
        raise ValueError(f"group_size must be <= 256 (rows are stored as uint8), got {group_size}")
    return group_size


def _table_values(table: np.ndarray, heads: int, dim: int) -> list[list[list[float]]]:
    if not isinstance(table, np.ndarray) or table.dtype != _BF16:
        raise TypeError(f"table must be a bfloat16 numpy array [H, R, D], got {type(table)}")
    if table.ndim != 3 or table.shape[0] != heads or table.shape[2] != dim or table.shape[1] < 1:
        raise ValueError(f"table must be [H={heads}, R >= 1, D={dim}], got shape {table.shape}")
    bits = np.ascontiguousarray(table).view(np.uint16).tolist()
    return [[[bits_to_bf16(b) for b in row] for row in head] for head in bits]


def dot(k: list[float], mu: list[float]) -> float:
    """sum_c bf16(k_c) * mu_c with the normative pairwise halving order (len a power of two)."""
    y = [mul(bf16(a), b) for a, b in zip(k, mu, strict=True)]
    n = len(y)
    while n > 1:
        n //= 2
        y = [add(y[c], y[c + n]) for c in range(n)]
    return y[0]


def select(xs: list[float], shape, table: np.ndarray, group_size: int) -> list[list[int]]:
    """Flat flushed float32 keys of `shape` [T, H, D] -> rows [ceil(T/G)][H] (ints)."""
    t, h, d = shape
    if d < 1 or d & (d - 1):
        raise ValueError(f"keys: heavy-row selection needs D a power of two, got D={d}")
    mu = _table_values(table, h, d)
    g = _check_group_size(group_size)
    score = [[-math.inf] * h for _ in range(t)]
    for tok in range(t):
        for head in range(h):
            row = xs[(tok * h + head) * d : (tok * h + head + 1) * d]
            best = -math.inf
            for r in mu[head]:
                s = dot(row, r)
                if not is_nan(s) and s > best:
                    best = s
            score[tok][head] = best
    rows = []
    for start in range(0, t, g):
        out = []
        for head in range(h):
            members = [score[tok][head] for tok in range(start, min(start + g, t))]
            top = max(members)
            out.append(members.index(top))
        rows.append(out)
    return rows


@dataclasses.dataclass(frozen=True, eq=False)
class OracleHeavy:
    """Heavy-row storage: `payload` (an `OraclePacked` of the other rows) and `arrays`
    {"rows": uint8 [nG, H], "codes": uint8 [nG, H, D], "minimum", "scale": float16 [nG, H]}."""

    payload: object
    arrays: dict
    group_size: int
    shape: tuple[int, int, int]
    dtype: np.dtype


def clamp_rows(rows: list[list[int]], t: int, group_size: int) -> list[list[int]]:
    """Each rows[g][h] clamped to the last row of group g (FORMAT.md 5a)."""
    out = []
    for g, row in enumerate(rows):
        last = min(group_size, t - g * group_size) - 1
        out.append([min(int(r), last) for r in row])
    return out


def rest_index(rows: list[list[int]], t: int, h: int, group_size: int) -> list[list[int]]:
    """[T - nG][H] source row of each payload row: group g's rows without rows[g][h]."""
    out = [[0] * h for _ in range(t - len(rows))]
    for g, row in enumerate(rows):
        length = min(group_size, t - g * group_size)
        for head in range(h):
            for j in range(length - 1):
                out[g * (group_size - 1) + j][head] = g * group_size + j + (j >= row[head])
    return out


def encode_rows(xs: list[float], shape, rows: list[list[int]], group_size: int):
    """The heavy rows' INT8 arrays as raw bits: codes [nG*H*D], minimum, scale [nG*H]."""
    _, h, d = shape
    codes, minimum, scale = [], [], []
    for g, row in enumerate(rows):
        for head in range(h):
            tok = g * group_size + row[head]
            start = (tok * h + head) * d
            c, mn, sc = affine.encode_group(xs[start : start + d], HEAVY_LEVELS)
            codes.extend(c)
            minimum.append(mn)
            scale.append(sc)
    return codes, minimum, scale


def decode_rows(codes: list[int], minimum: list[int], scale: list[int], d: int) -> list[float]:
    """INT8 decode of the heavy rows, flat [nG*H*D] float32."""
    out = []
    for i, (mn_bits, sc_bits) in enumerate(zip(minimum, scale, strict=True)):
        mn, sc = bits_to_f16(mn_bits), bits_to_f16(sc_bits)
        out.extend(add(mul(float(c), sc), mn) for c in codes[i * d : (i + 1) * d])
    return out
