"""Registered calibrated formats the kernels' argument specs use (tests, lowering, benchmarks).

INTB tables here are synthetic: widths 2, 6, 3, 5, 4, 4, 7, 1 (4 bits per channel on average)
repeated over the channels and rolled per (layer, head), so every row differs; registering is
idempotent (the same table, the same name).
"""

from __future__ import annotations

import numpy as np

_PATTERN = (2, 6, 3, 5, 4, 4, 7, 1)


def _row(head_dim: int, shift: int) -> list[int]:
    return np.roll(np.resize(np.array(_PATTERN), head_dim), shift).tolist()


def intb_format(heads: int, head_dim: int) -> str:
    """A registered INTB format of one [heads, head_dim] table (FORMAT.md 2b)."""
    from kvq_jax.codecs.formats.intb import register_table

    return register_table([_row(head_dim, h) for h in range(heads)])


def intb_layers_format(heads: int, head_dim: int, layers: int = 3) -> str:
    """A registered INTB format with one table per model layer (layer l, head h rolled by
    3 l + h)."""
    from kvq_jax.codecs.formats.intb import register_layer_tables

    tables = [[_row(head_dim, 3 * layer + h) for h in range(heads)] for layer in range(layers)]
    return register_layer_tables(tables)
