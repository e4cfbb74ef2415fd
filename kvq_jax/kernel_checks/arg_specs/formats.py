"""Calibrated formats the kernels' argument specs use (tests, lowering, benchmarks).

INTB tables here are synthetic: widths 2, 6, 3, 5, 4, 4, 7, 1 (4 bits per channel on average)
repeated over the channels and rolled per (layer, head), so every row differs. Naming a
format registers nothing: a spec's `config()` calls `ensure_registered` with its formats,
and `unregister_synthetic` takes them out of the registry again (the test suite does so after
every module, so the process-wide registry holds only what a test registers itself).
"""

from __future__ import annotations

import numpy as np

_PATTERN = (2, 6, 3, 5, 4, 4, 7, 1)
#: loops-abs-v2442's per-loop schedule (4 loops): K INT2 in every loop, each absolute; V INT2 /
#: INT4 / INT4 / INT2 with loops 1-2 absolute and loop 3 a delta.
V2442 = dict(
    k_base_format="int2", k_residual_format="int2", k_absolute=(1, 2, 3),
    v_base_format="int2", v_residual_format=("int4", "int4", "int2"), v_absolute=(1, 2),
)  # fmt: skip
_CODECS: dict = {}  # name -> the codec to register on demand


def _row(head_dim: int, shift: int) -> list[int]:
    return np.roll(np.resize(np.array(_PATTERN), head_dim), shift).tolist()


def _remember(codec) -> str:
    _CODECS.setdefault(codec.name, codec)
    return codec.name


def intb_format(heads: int, head_dim: int) -> str:
    """The name of a synthetic INTB format of one [heads, head_dim] table (FORMAT.md 2b)."""
    return intb_table_format([_row(head_dim, h) for h in range(heads)])


def intb_table_format(table) -> str:
    """The name of the INTB format of bit table `table` ([H][D], FORMAT.md 2b), registered on
    demand as the synthetic ones are."""
    from kvq_jax.codecs.formats.intb import IntBCodec

    return _remember(IntBCodec(table))


def intb_layer_tables_format(tables) -> str:
    """The name of the per-layer INTB format of `tables` ([N][H][D], one row width)."""
    from kvq_jax.codecs.formats.intb import IntBLayersCodec

    return _remember(IntBLayersCodec(tables))


def intb_layers_format(heads: int, head_dim: int, layers: int = 3) -> str:
    """The name of a synthetic INTB format with one table per model layer (layer l, head h
    rolled by 3 l + h)."""
    tables = [[_row(head_dim, 3 * layer + h) for h in range(heads)] for layer in range(layers)]
    return intb_layer_tables_format(tables)


def heavy_format(base: str, heavy_group: int, heads: int | None = None,
                 head_dim: int | None = None, *, query_heads: int = 3,
                 layers: int | None = None) -> str:  # fmt: skip
    """The name of a heavy-row format (FORMAT.md 5a) over format `base` (registered, or a
    synthetic one of this module) with heavy groups of `heavy_group` tokens; with `heads` and
    `head_dim`, keys' format holding a seeded random bfloat16 mean-query table [heads,
    query_heads, head_dim] (one per layer [layers, ...] with `layers`), else the values'
    (rows handed over from the keys)."""
    import ml_dtypes

    from kvq_jax.codecs.formats.heavy_rows import HeavyCodec
    from kvq_jax.codecs.registry import get_codec

    tables = None
    if heads is not None:
        shape = (
            (heads, query_heads, head_dim)
            if layers is None
            else (layers, heads, query_heads, head_dim)
        )
        rng = np.random.default_rng(heavy_group + head_dim)
        tables = rng.standard_normal(shape).astype(ml_dtypes.bfloat16)
    return _remember(HeavyCodec(_CODECS.get(base) or get_codec(base), heavy_group, tables))


def heavy_rope_formats(heads: int, head_dim: int) -> tuple[str, str]:
    """(keys, values): the best served policy's formats (intb-prerope-hint4-heavy) with
    synthetic tables: heavy rows of 64 tokens over INTB keys with one mean-query table per KV
    head, and the same rows over HINT4 values. Its keys are stored before RoPE, which changes
    no byte of a page (RoPE is the reader's: decode attention and prefill)."""
    keys = heavy_format(intb_format(heads, head_dim), 64, heads, head_dim, query_heads=1)
    return keys, heavy_format("hint4", 64)


def synthetic_codec(name: str):
    """The codec of a synthetic format of this module (registered or not), else None."""
    return _CODECS.get(name)


def ensure_registered(*formats) -> None:
    """Register each synthetic format among `formats` (names or tuples of names) that the
    JAX registry lacks, a heavy-row format's synthetic base first; other names pass through
    untouched."""
    from kvq_jax.codecs.registry import CODECS, register_codec

    for fmt in formats:
        for name in (fmt,) if isinstance(fmt, str) else fmt:
            codec = _CODECS.get(name)
            base = getattr(codec, "base_codec", None)
            for c in (base, codec):
                if c is not None and c.name in _CODECS and c.name not in CODECS:
                    register_codec(c)


def unregister_synthetic() -> None:
    """Take every synthetic format of this module out of the JAX registry."""
    from kvq_jax.codecs.registry import CODECS, unregister_codec

    for name in _CODECS:
        if name in CODECS:
            unregister_codec(name)
