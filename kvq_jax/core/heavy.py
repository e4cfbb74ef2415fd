"""Heavy rows (docs/FORMAT.md section 5a), framework-neutral: argument checks and defaults.

One row per (group of G tokens, KV head) is stored INT8 beside a base format's payload of the
other rows; the row is chosen from the keys with a static bfloat16 mean-query table
[H, R, D]. The JAX (`kvq_jax.codecs.heavy`) and Torch (`kvq_torch_bridge.codecs.heavy`) stacks
share these checks, so their errors read the same.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kvq_jax.core.checks import is_int

#: Largest INT8 code of a heavy row (INT4's affine arithmetic with L = 255).
HEAVY_LEVELS = np.float32(255.0)
#: Default heavy group: one row per 64 tokens and KV head.
HEAVY_DEFAULT_GROUP_SIZE = 64
_BF16 = np.dtype(ml_dtypes.bfloat16)


def check_heavy_group_size(group_size) -> int:
    """G in 2..256 (rows are stored as uint8, and G - 1 >= 1 rows are left per group)."""
    if not is_int(group_size):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if not 2 <= group_size <= 256:
        raise ValueError(f"group_size must be in 2..256 for heavy rows, got {group_size}")
    return int(group_size)


def num_heavy_groups(tokens: int, group_size: int) -> int:
    """ceil(T / G)."""
    return -(-tokens // group_size)


def check_heavy_table(table, heads: int, dim: int) -> tuple[int, int, int]:
    """A bfloat16 mean-query table [H, R, D] for keys with H heads and D channels (D a power
    of two); returns its shape."""
    dtype = getattr(table, "dtype", None)
    if dtype is None or np.dtype(dtype) != _BF16:
        raise TypeError(f"table must have dtype bfloat16, got {dtype}")
    shape = tuple(np.shape(table))
    if len(shape) != 3 or shape[0] != heads or shape[2] != dim or shape[1] < 1:
        raise ValueError(f"table must be [H={heads}, R >= 1, D={dim}], got shape {shape}")
    if dim & (dim - 1):
        raise ValueError(f"keys: heavy-row selection needs D a power of two, got D={dim}")
    return shape


def check_heavy_rows(rows, tokens: int, heads: int, group_size: int) -> None:
    """rows: an integer array [ceil(T/G), H]."""
    shape = tuple(np.shape(rows))
    want = (num_heavy_groups(tokens, group_size), heads)
    dtype = getattr(rows, "dtype", None)
    if dtype is None or np.dtype(dtype).kind not in "iu":
        raise TypeError(f"rows must have an integer dtype, got {dtype}")
    if shape != want:
        raise ValueError(f"rows must have shape {want} (ceil(T/G), H), got {shape}")


def heavy_base_group_size(axis: str, group_size: int, base_group_size: int | None):
    """The payload's group size: G - 1 on axis tokens unless given (so each payload token
    group is one heavy group without its heavy row), else as given (None: the format's)."""
    if base_group_size is None and axis == "tokens":
        return group_size - 1
    return base_group_size
