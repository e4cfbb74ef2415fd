"""Argument specs of page pack, shared by the tests and the benchmark.

A `PagePackSpec` is one configuration (format, kind, page shape, dtype, group size, axis);
`spec.kwargs` are the `pack_paged` keyword arguments, `spec.shape(P)` the pages' shape.

  SPECS        every supported configuration the tests lower for CUDA and compare on a GPU:
               each format variant x page size 16 / 32 / 64 x head dim 64 / 128, the input
               dtype cycling through bf16 / fp16 / fp32.
  SMALL_SPECS  one configuration per format variant (each dtype at least once), small
               enough for interpret mode on a CPU.
  BENCH_SPECS  Ouro-like pages for the benchmark: page 16 / 32 / 64, H 16, D 128, bf16.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import ml_dtypes
import numpy as np

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

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16 if self.dtype == "bfloat16" else self.dtype)

    @property
    def kwargs(self) -> dict:
        """The `pack_paged` keyword arguments (backend excluded)."""
        return dict(kind=self.kind, format=self.format, group_size=self.group_size, axis=self.axis)

    def shape(self, num_pages: int) -> tuple[int, int, int, int]:
        return (num_pages, self.page_size, self.num_heads, self.head_dim)

    def shape_dtype_struct(self, num_pages: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape(num_pages), self.np_dtype)

    @property
    def name(self) -> str:
        group = "" if self.group_size is None else f"-g{self.group_size}"
        axis = "" if self.axis is None else f"-{self.axis}"
        return (
            f"{self.format}-{self.kind}{group}{axis}-ps{self.page_size}-h{self.num_heads}"
            f"-d{self.head_dim}-{self.dtype}"
        )


def _specs() -> tuple[PagePackSpec, ...]:
    dtypes = itertools.cycle(DTYPES)
    return tuple(
        PagePackSpec(fmt, kind, ps, 2, d, next(dtypes), group, axis)
        for (fmt, kind, group, axis), ps, d in itertools.product(VARIANTS, PAGE_SIZES, HEAD_DIMS)
    )


SPECS = _specs()

SMALL_SPECS = tuple(
    PagePackSpec(fmt, kind, 16, 2, 64, dtype, group, axis)
    for (fmt, kind, group, axis), dtype in zip(VARIANTS, itertools.cycle(DTYPES), strict=False)
)

BENCH_SPECS = tuple(
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
)
