"""Argument specs of `reconstruct_pages`, shared by the tests and the benchmark.

A `ReconstructSpec` names one cache configuration (formats of K and V base and residual
planes, page geometry, loops, dtype, group sizes) and the loop to reconstruct. It builds the
`PagedCacheConfig`, abstract arguments (for lowering without data) and packed byte counts.

Lists:
  FORMAT_PAIRS     every (base, residual) pair of int4 / nvfp4 / fp8_e4m3 (9)
  SUPPORTED_SPECS  every pair (as K or V) at every supported page geometry (page_size
                   16/32/64 x head_dim 64/128), loop = num_loops - 1, and `V2442` (per-loop
                   INT2 / INT4 planes, absolute loops) at two (and with adaptive exits at
                   one), INTB, heavy rows and HINT
                   values at one or two: the kernel builds for each (the GPU-lowering test)
  TEST_SPECS       small caches (tiny P and H) for interpret-mode tests: every format pair,
                   several group sizes, H in {1, 2, 3}, bf16 / fp16 / fp32, and
  PER_LOOP_SPECS   per-loop formats (INT2 included) and loops stored absolute,
  INTB_SPECS       INTB planes (one table, one per layer), and
  ROTATED_SPECS    HINT4 / HINT2 planes and heavy rows over HINT4, un-rotated in the tile
  BENCH_SPECS      Ouro-like pages: H 16, D 128, pages 16 / 64, int4 / nvfp4 / mixed, and
                   the best served policy's pages ("heavy-rope", 64 only)
  bench_specs      one format's BENCH_SPECS (the benchmark's --formats)
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp

from kvq_jax.cache.paged_cache import PagedCacheConfig, init_cache
from kvq_jax.codecs.cache_state import at_layer
from kvq_jax.codecs.registry import get_codec
from kvq_jax.kernel_checks.arg_specs.formats import (
    V2442,
    ensure_registered,
    heavy_format,
    heavy_rope_formats,
    intb_format,
    intb_layers_format,
    synthetic_codec,
)

FORMATS = ("int4", "nvfp4", "fp8_e4m3")
FORMAT_PAIRS = tuple(itertools.product(FORMATS, FORMATS))
KINDS = ("key", "value")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReconstructSpec:
    """One configuration of `reconstruct_pages` (see the module doc)."""

    k_base_format: str = "int4"
    k_residual_format: str | tuple[str, ...] = "int4"  # a tuple: one format per later loop
    v_base_format: str = "int4"
    v_residual_format: str | tuple[str, ...] = "int4"
    page_size: int = 16
    num_heads: int = 2
    head_dim: int = 64
    num_loops: int = 3
    loop: int = 2
    dtype: str = "bfloat16"
    k_group_size: int | None = None
    v_group_size: int | None = None
    num_pages: int = 4
    k_absolute: tuple[int, ...] = ()  # later loops stored absolute
    v_absolute: tuple[int, ...] = ()
    layer: int | None = None  # the model layer a format with per-layer tables is read as
    adaptive_exit: bool = False  # a depth map: each row keeps its exit loop

    @property
    def name(self) -> str:
        groups = ""
        if self.k_group_size or self.v_group_size:
            groups = f"-g{self.k_group_size or ''}/{self.v_group_size or ''}"
        for prefix, loops in (("Ka", self.k_absolute), ("Va", self.v_absolute)):
            if loops:
                groups += f"-{prefix}{''.join(map(str, loops))}"
        return (
            f"K{_short(self.k_base_format)}+{_short(self.k_residual_format)}"
            f"-V{_short(self.v_base_format)}+{_short(self.v_residual_format)}"
            f"-p{self.page_size}-h{self.num_heads}-d{self.head_dim}"
            f"-L{self.num_loops}l{self.loop}-{self.dtype}{groups}"
            + ("" if self.layer is None else f"-layer{self.layer}")
            + ("-exits" if self.adaptive_exit else "")
        )

    def config(self, *, max_seqs: int = 1) -> PagedCacheConfig:
        ensure_registered(
            self.k_base_format, self.k_residual_format, self.v_base_format, self.v_residual_format
        )
        return PagedCacheConfig(
            num_pages=self.num_pages,
            page_size=self.page_size,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            dtype=jnp.dtype(self.dtype),
            num_loops=self.num_loops,
            k_base_format=self.k_base_format,
            k_residual_format=self.k_residual_format,
            v_base_format=self.v_base_format,
            v_residual_format=self.v_residual_format,
            k_group_size=self.k_group_size,
            v_group_size=self.v_group_size,
            max_seqs=max_seqs,
            k_absolute=self.k_absolute,
            v_absolute=self.v_absolute,
            adaptive_exit=self.adaptive_exit,
        )

    def empty_cache(self, *, max_seqs: int = 1):
        """`init_cache` of the config, read and written as `layer` (when set)."""
        cache = init_cache(self.config(max_seqs=max_seqs))
        return cache if self.layer is None else at_layer(cache, self.layer)

    def abstract_cache(self):
        """The cache as a pytree of jax.ShapeDtypeStruct (no memory)."""
        return jax.eval_shape(self.empty_cache)

    def page_ids(self, n: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((n,), jnp.int32)

    def packed_page_bytes(self, kind: str, loop: int) -> int:
        """Bytes of one packed page of loop `loop` of `kind`."""
        spec = self.config().loop_pack_args(kind, loop)
        shape = (self.page_size, self.num_heads, self.head_dim)
        return get_codec(spec["format"]).storage_bytes(shape, spec["axis"], spec["group_size"])

    def bytes_moved(self, kind: str, num_pages: int) -> int:
        """Bytes a one-pass reconstruction of `num_pages` pages of loop `loop` reads and
        writes: the packed page of every loop on its chain (`PagedCacheConfig.chain`) and the
        output page."""
        config = self.config()
        read = sum(self.packed_page_bytes(kind, i) for i in config.chain(kind, self.loop))
        out = self.page_size * self.num_heads * self.head_dim * jnp.dtype(self.dtype).itemsize
        return num_pages * (read + out)


#: Short names of the built-in formats in spec names.
_SHORT = {
    "int4": "i4", "int2": "i2", "hint4": "hi4", "hint2": "hi2", "nvfp4": "nv", "fp8_e4m3": "f8",
}  # fmt: skip


def _short(fmt: str | tuple[str, ...]) -> str:
    if isinstance(fmt, tuple):
        return "/".join(map(_short, fmt))
    codec = synthetic_codec(fmt)
    if hasattr(codec, "heavy_group"):  # "heavy<G>-<base>[-<digest>]"
        return f"h{codec.heavy_group}{_short(codec.base_codec.name)}"
    if fmt.startswith("intb"):  # "intb-<digest>" / "intb-layers-<digest>"
        return "ib" + fmt.rsplit("-", 1)[-1][:4]
    return _SHORT[fmt]


def _pairs_as_specs(**geometry) -> list[ReconstructSpec]:
    """Every (base, residual) pair appears as K or V in ceil(9 / 2) specs."""
    pairs = list(FORMAT_PAIRS)
    pairs += pairs[: len(pairs) % 2]
    return [
        ReconstructSpec(
            k_base_format=k[0],
            k_residual_format=k[1],
            v_base_format=v[0],
            v_residual_format=v[1],
            **geometry,
        )
        for k, v in zip(pairs[0::2], pairs[1::2], strict=True)
    ]


SUPPORTED_SPECS = tuple(
    spec
    for page_size, head_dim in itertools.product((16, 32, 64), (64, 128))
    for spec in _pairs_as_specs(
        page_size=page_size, head_dim=head_dim, num_heads=4, num_loops=4, loop=3
    )
) + tuple(
    ReconstructSpec(
        page_size=page_size, head_dim=head_dim, num_heads=4, num_loops=4, loop=3, **V2442
    )
    for page_size, head_dim in ((16, 64), (64, 128))
) + (
    # adaptive exits: the chain from loop 0 through the absolute loops, rows kept at their
    # exit loop (the depth map)
    ReconstructSpec(page_size=64, head_dim=128, num_heads=4, num_loops=4, loop=3,
                    adaptive_exit=True, **V2442),
    ReconstructSpec(
        k_base_format=intb_layers_format(4, 128), k_residual_format="int2",
        v_base_format=intb_format(4, 128), v_residual_format="int4", page_size=64, num_heads=4,
        head_dim=128, num_loops=4, loop=3, layer=1,
    ),
    # heavy rows (FORMAT.md 5a): INTB keys with per-layer tables, INT4 values on channel groups
    ReconstructSpec(
        k_base_format=heavy_format(intb_layers_format(4, 128), 64, 4, 128, layers=3),
        k_residual_format="int4", v_base_format=heavy_format("int4", 64),
        v_residual_format="int4", v_group_size=32, page_size=64, num_heads=4, head_dim=128,
        num_loops=1, loop=0, layer=1,
    ),
    # Hadamard-rotated values un-rotated in the tile: int4-hint4's chain, and the best
    # policy's pages (heavy INTB keys, heavy rows over HINT4 values), at Ouro's pages
    ReconstructSpec(
        v_base_format="hint4", v_residual_format="hint2", page_size=64, num_heads=4,
        head_dim=128, num_loops=4, loop=3,
    ),
    ReconstructSpec(
        k_base_format=heavy_format(intb_layers_format(4, 128), 64, 4, 128, layers=3),
        k_residual_format="int4", v_base_format=heavy_format("hint4", 64),
        v_residual_format="int4", page_size=64, num_heads=4, head_dim=128, num_loops=1,
        loop=0, layer=1,
    ),
)  # fmt: skip

TEST_SPECS = (
    ReconstructSpec(
        k_base_format="int4",
        k_residual_format="int4",
        v_base_format="nvfp4",
        v_residual_format="nvfp4",
        page_size=16,
        num_heads=2,
        head_dim=64,
        num_loops=3,
        loop=2,
        dtype="bfloat16",
    ),
    ReconstructSpec(
        k_base_format="nvfp4",
        k_residual_format="int4",
        v_base_format="int4",
        v_residual_format="nvfp4",
        page_size=32,
        num_heads=1,
        head_dim=64,
        num_loops=2,
        loop=1,
        dtype="float16",
        v_group_size=32,
    ),
    ReconstructSpec(
        k_base_format="int4",
        k_residual_format="fp8_e4m3",
        v_base_format="fp8_e4m3",
        v_residual_format="int4",
        page_size=16,
        num_heads=3,
        head_dim=128,
        num_loops=2,
        loop=1,
        dtype="float32",
        k_group_size=4,
    ),
    ReconstructSpec(
        k_base_format="nvfp4",
        k_residual_format="fp8_e4m3",
        v_base_format="fp8_e4m3",
        v_residual_format="nvfp4",
        page_size=64,
        num_heads=2,
        head_dim=64,
        num_loops=2,
        loop=1,
        dtype="bfloat16",
    ),
    ReconstructSpec(
        k_base_format="fp8_e4m3",
        k_residual_format="fp8_e4m3",
        v_base_format="int4",
        v_residual_format="int4",
        page_size=16,
        num_heads=2,
        head_dim=64,
        num_loops=2,
        loop=1,
        dtype="bfloat16",
        v_group_size=16,
    ),
)

#: Per-loop formats and loops stored absolute (`V2442`), and chains of deltas in two formats
#: (keys after an INT4 base; values after an FP8 base, loop 2 absolute).
PER_LOOP_SPECS = (
    ReconstructSpec(
        page_size=16, num_heads=2, head_dim=64, num_loops=4, loop=3, dtype="bfloat16", **V2442
    ),
    ReconstructSpec(
        k_base_format="int4",
        k_residual_format=("int2", "nvfp4"),
        v_base_format="fp8_e4m3",
        v_residual_format=("int4", "int2"),
        page_size=32,
        num_heads=3,
        head_dim=128,
        num_loops=3,
        loop=2,
        dtype="float16",
        v_absolute=(2,),
        k_group_size=16,
    ),
)
TEST_SPECS += PER_LOOP_SPECS

#: Heavy-row pages (FORMAT.md 5a): keys choosing their rows (INT4 on token groups of G - 1;
#: INTB), values taking them (INT2 on channel groups of 16, INT4 of 64), two
#: heavy groups per page, a later loop stored absolute in its own heavy format.
HEAVY_SPECS = (
    ReconstructSpec(
        k_base_format=heavy_format("int4", 16, 2, 64),
        k_residual_format=heavy_format(intb_format(2, 64), 16, 2, 64),
        v_base_format=heavy_format("int2", 16), v_residual_format=heavy_format("int4", 16),
        v_group_size=16, page_size=32, num_heads=2, head_dim=64, num_loops=2, loop=1,
        dtype="bfloat16", k_absolute=(1,), v_absolute=(1,),
    ),
)  # fmt: skip
TEST_SPECS += HEAVY_SPECS

#: INTB planes: keys with one table per model layer (read as layer 2) and INT2 deltas, values
#: with one table, FP8 deltas.
INTB_SPECS = (
    ReconstructSpec(
        k_base_format=intb_layers_format(2, 64),
        k_residual_format="int2",
        v_base_format=intb_format(2, 64),
        v_residual_format="fp8_e4m3",
        page_size=32,
        num_heads=2,
        head_dim=64,
        num_loops=2,
        loop=1,
        dtype="bfloat16",
        k_group_size=16,
        v_group_size=32,
        layer=2,
    ),
)
TEST_SPECS += INTB_SPECS

#: Hadamard-rotated planes (FORMAT.md 2c), un-rotated in the tile: HINT2 keys with INT4 deltas
#: (a rotated base under plain deltas), HINT4 values with a HINT2 then an INT4 delta; heavy
#: rows over HINT4 values (the best policy's values) beside heavy INTB keys, loop 1 stored
#: absolute in the same formats.
ROTATED_SPECS = (
    ReconstructSpec(
        k_base_format="hint2", k_residual_format="int4", v_base_format="hint4",
        v_residual_format=("hint2", "int4"), page_size=16, num_heads=3, head_dim=64,
        num_loops=3, loop=2, dtype="float16", k_group_size=16,
    ),
    ReconstructSpec(
        k_base_format=heavy_format(intb_layers_format(2, 64), 16, 2, 64, layers=3),
        k_residual_format=heavy_format(intb_layers_format(2, 64), 16, 2, 64, layers=3),
        v_base_format=heavy_format("hint4", 16), v_residual_format=heavy_format("hint4", 16),
        page_size=32, num_heads=2, head_dim=64, num_loops=2, loop=1, dtype="bfloat16",
        k_absolute=(1,), v_absolute=(1,), layer=2,
    ),
)  # fmt: skip
TEST_SPECS += ROTATED_SPECS

_HEAVY_KEYS, _HEAVY_VALUES = heavy_rope_formats(16, 128)
BENCH_FORMATS = {
    # name: (K base, K residual, V base, V residual)
    "int4": ("int4", "int4", "int4", "int4"),
    "nvfp4": ("nvfp4", "nvfp4", "nvfp4", "nvfp4"),
    "mixed": ("int4", "nvfp4", "nvfp4", "int4"),
    # the best served policy (`heavy_rope_formats`): 64-token pages, every loop stored whole
    "heavy-rope": (_HEAVY_KEYS, _HEAVY_KEYS, _HEAVY_VALUES, _HEAVY_VALUES),
}
#: Formats with heavy rows: served at 64-token pages only, later loops stored whole.
_HEAVY_BENCH = {"heavy-rope"}

BENCH_SPECS = tuple(
    ReconstructSpec(
        k_base_format=f[0],
        k_residual_format=f[1],
        v_base_format=f[2],
        v_residual_format=f[3],
        page_size=page_size,
        num_heads=16,
        head_dim=128,
        num_loops=4,
        loop=loop,
        dtype="bfloat16",
        num_pages=4096 * 8 // page_size,  # 8 sequences x 4096 tokens
        k_absolute=(1, 2, 3) if name in _HEAVY_BENCH else (),
        v_absolute=(1, 2, 3) if name in _HEAVY_BENCH else (),
    )
    for name, f in BENCH_FORMATS.items()
    for page_size in ((64,) if name in _HEAVY_BENCH else (16, 64))
    for loop in (0, 3)
)


def bench_specs(name: str) -> tuple[ReconstructSpec, ...]:
    """The `BENCH_SPECS` of format `name` of `BENCH_FORMATS`, in their order."""
    k_base, k_residual = BENCH_FORMATS[name][:2]
    return tuple(
        s for s in BENCH_SPECS if (s.k_base_format, s.k_residual_format) == (k_base, k_residual)
    )
