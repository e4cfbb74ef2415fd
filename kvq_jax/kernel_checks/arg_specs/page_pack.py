"""Argument specs of page pack, shared by the tests and the benchmark.

A `PagePackSpec` is one configuration (format, kind, page shape, dtype, group size, axis);
`spec.kwargs` are the `pack_paged` keyword arguments, `spec.shape(P)` the pages' shape.

  SPECS        every supported configuration the tests lower for CUDA and compare on a GPU:
               each format variant x page size 16 / 32 / 64 x head dim 64 / 128, the input
               dtype cycling through bf16 / fp16 / fp32; then HEAVY_SPECS.
  HEAVY_SPECS  heavy rows (FORMAT.md 5a; the rows handed in, `heavy_rows`): values in the
               best policy's heavy64-hint4 at 64-token pages and heavy16-int2 (several heavy
               groups per page, four codes per byte), both head dims; keys over INTB (W = 30,
               64-token pages; HEAVY_INT4_KEYS: over INT4, two heavy groups per page),
               payload token groups of G - 1 rows.
  INTB_SPECS   INTB keys: one bit table and one per layer, rows of W bytes not a power of two.
  SMALL_SPECS  one configuration per format variant (each dtype at least once), small
               enough for interpret mode on a CPU.
  BENCH_SPECS  Ouro-like pages for the benchmark: page 16 / 32 / 64, H 16, D 128, bf16 (and
               heavy64-hint4 values at page 64).
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kvq_jax.kernel_checks.arg_specs.formats import (
    ensure_registered,
    heavy_format,
    intb_layer_tables_format,
    intb_table_format,
)

DTYPES = ("bfloat16", "float16", "float32")
PAGE_SIZES = (16, 32, 64)
HEAD_DIMS = (64, 128)

#: (format, kind, group_size, axis): the format variants the kernel is held to. INT4 keys use
#: token groups (default gcd(64, page_size), and a smaller one), values channel groups (the
#: default 64 and 16); a key packed on the channel axis checks that the axis, not the kind,
#: decides the layout. INT2 / HINT2 (INT4's kernel with 3 levels and four codes per byte) as
#: the served policies store them: INT2 keys, HINT2 values.
VARIANTS = (
    ("int4", "key", None, None),
    ("int4", "key", 8, None),
    ("int4", "value", None, None),
    ("int4", "value", 16, None),
    ("int4", "key", 32, "channels"),
    ("hint4", "value", None, None),
    ("nvfp4", "key", None, None),
    ("nvfp4", "value", None, None),
    ("fp8_e4m3", "key", None, None),
    ("fp8_e4m3", "value", None, None),
    ("int2", "key", None, None),
    ("hint2", "value", None, None),
)


@dataclasses.dataclass(frozen=True)
class PagePackSpec:
    """One page-pack configuration. `group_size` / `axis` None take the `pack_paged`
    defaults."""

    format: str
    kind: str
    page_size: int
    num_heads: int
    head_dim: int
    dtype: str
    group_size: int | None = None
    axis: str | None = None
    layer: int | None = None  # the model layer a per-layer INTB format packs with

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16 if self.dtype == "bfloat16" else self.dtype)

    @property
    def kwargs(self) -> dict:
        """The `pack_paged` keyword arguments (backend, rows and layer excluded); registers the
        spec's synthetic format (INTB tables, heavy rows) on demand."""
        ensure_registered(self.format)
        return dict(kind=self.kind, format=self.format, group_size=self.group_size, axis=self.axis)

    def resolved(self) -> tuple[str, int]:
        """(axis, group_size) as `pack_paged` resolves them (the format registered first)."""
        from kvq_jax.core.cache_config import resolve_paged

        ensure_registered(self.format)
        return resolve_paged(self.format, self.kind, self.shape(1)[1:], self.axis,
                             self.group_size)  # fmt: skip

    def shape(self, num_pages: int) -> tuple[int, int, int, int]:
        return (num_pages, self.page_size, self.num_heads, self.head_dim)

    def shape_dtype_struct(self, num_pages: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape(num_pages), self.np_dtype)

    @property
    def heavy_group(self) -> int | None:
        """G of a heavy-row format (its rows are handed in), else None."""
        from kvq_jax.kernels._tile_decode import heavy_layout

        ensure_registered(self.format)
        layout = heavy_layout(self.format)
        return None if layout is None else layout.heavy_group

    def rows_struct(self, num_pages: int) -> jax.ShapeDtypeStruct | None:
        """The heavy rows' uint8 [P, page_size / G, H] (None for other formats)."""
        if self.heavy_group is None:
            return None
        shape = (num_pages, self.page_size // self.heavy_group, self.num_heads)
        return jax.ShapeDtypeStruct(shape, jnp.uint8)

    def heavy_rows(self, num_pages: int, seed: int = 0):
        """Seeded heavy rows for `num_pages` pages (None for other formats): random rows, and
        in the first pages a group's first row, its last row and an index past the group
        (clamped to the last row, FORMAT.md 5a)."""
        struct = self.rows_struct(num_pages)
        if struct is None:
            return None
        rows = np.random.default_rng(seed).integers(0, self.heavy_group, struct.shape)
        rows[0, 0, 0], rows[min(1, num_pages - 1), -1, -1] = self.heavy_group - 1, 0
        rows[min(2, num_pages - 1), 0, -1] = 255
        return jnp.asarray(rows.astype(np.uint8))

    @property
    def name(self) -> str:
        group = "" if self.group_size is None else f"-g{self.group_size}"
        axis = "" if self.axis is None else f"-{self.axis}"
        return (
            f"{self.format}-{self.kind}{group}{axis}-ps{self.page_size}-h{self.num_heads}"
            f"-d{self.head_dim}-{self.dtype}"
            + ("" if self.layer is None else f"-layer{self.layer}")
        )


def _specs() -> tuple[PagePackSpec, ...]:
    dtypes = itertools.cycle(DTYPES)
    return tuple(
        PagePackSpec(fmt, kind, ps, 2, d, next(dtypes), group, axis)
        for (fmt, kind, group, axis), ps, d in itertools.product(VARIANTS, PAGE_SIZES, HEAD_DIMS)
    )


def _table(head_dim: int, heads: int = 2) -> list[list[int]]:
    """An INTB bit table of 3.75 bits per channel on average (the served heavy policies'
    width: W = 30 bytes at D = 64, 60 at D = 128, not powers of two), rolled per head."""
    row = [4, 4, 4, 3] * (head_dim // 4)
    return [row[h:] + row[:h] for h in range(heads)]


HEAVY_SPECS = (
    PagePackSpec(heavy_format("hint4", 64), "value", 64, 2, 64, "bfloat16"),
    PagePackSpec(heavy_format("hint4", 64), "value", 64, 2, 128, "float32"),
    PagePackSpec(heavy_format("int2", 16), "value", 32, 2, 64, "float16"),
    PagePackSpec(heavy_format("int2", 16), "value", 64, 2, 128, "bfloat16"),
    PagePackSpec(heavy_format(intb_table_format(_table(64)), 64), "key", 64, 2, 64, "bfloat16"),
)
#: Heavy-row keys over INT4 (two heavy groups per page): lowered and checked in interpret mode,
#: not in SPECS (the CI compile subsets: the heavy INTB keys compile the same kernel branch).
HEAVY_INT4_KEYS = PagePackSpec(heavy_format("int4", 16), "key", 32, 2, 64, "float32")


#: INTB keys (FORMAT.md 2b) on token groups: one table (W = 60 bytes) and one table per layer
#: (read as layer 1; W = 30), rows of W bytes not a power of two.
INTB_SPECS = (
    PagePackSpec(intb_table_format(_table(128)), "key", 64, 2, 128, "float32"),
    PagePackSpec(
        intb_layer_tables_format([_table(64), _table(64, 3)[1:]]), "key", 32, 2, 64, "float16",
        16, layer=1,
    ),
)  # fmt: skip

SPECS = _specs() + HEAVY_SPECS + INTB_SPECS

SMALL_SPECS = tuple(
    PagePackSpec(fmt, kind, 16, 2, 64, dtype, group, axis)
    for (fmt, kind, group, axis), dtype in zip(VARIANTS, itertools.cycle(DTYPES), strict=False)
)

BENCH_SPECS = (
    *(
        PagePackSpec(fmt, kind, ps, 16, 128, "bfloat16", group)
        for ps in PAGE_SIZES
        for fmt, kind, group in (
            ("int4", "key", None),
            ("int4", "value", None),
            ("hint4", "value", None),
            ("nvfp4", "key", None),
            ("nvfp4", "value", None),
            ("fp8_e4m3", "key", None),
            ("int2", "key", None),
            ("hint2", "value", None),
        )
    ),
    PagePackSpec(heavy_format("hint4", 64), "value", 64, 16, 128, "bfloat16"),
)
