"""Argument specs of quantized paged decode attention, shared by the tests and the benchmark.

A `PagedAttentionSpec` is one static configuration (shapes, formats, loop, sink, dtype).
`make_inputs(spec)` builds a real cache through `init_cache` / `append` (every loop of every
sequence, in the looped-LM order) plus queries, block tables and lengths: sequences of
different lengths, a partial (staged) last page for most of them, an attended length shorter
than the stored one for one of them, and non-contiguous physical pages. `random_inputs(spec)`
fills the packed planes with random bytes of sane values instead (fast, for large benchmark
caches; same array shapes). `input_shapes(spec)` gives the ShapeDtypeStructs alone (for
lowering tests).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvq_jax.cache.paged_cache import PagedCacheConfig, append, init_cache
from kvq_jax.codecs.cache_state import at_layer, codec_view
from kvq_jax.kernel_checks.arg_specs.formats import (
    V2442,
    ensure_registered,
    heavy_format,
    heavy_rope_formats,
    intb_format,
    intb_layers_format,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedAttentionSpec:
    """One configuration of `paged_decode_attention`.

    context: the longest attended sequence (tokens); the others are shorter (`lengths`).
    num_loops: loops held by the cache; loop: the loop attended (static).
    dtype: the cache dtype name ("float32", "bfloat16", "float16"); q is float32.
    """

    name: str
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    context: int
    num_loops: int = 1
    loop: int = 0
    k_base_format: str = "int4"
    k_residual_format: str | tuple[str, ...] = "int4"  # a tuple: one format per later loop
    v_base_format: str = "int4"
    v_residual_format: str | tuple[str, ...] = "int4"
    k_group_size: int | None = None
    v_group_size: int | None = None
    sink: int = 0
    dtype: str = "float32"
    ragged: bool = True
    k_absolute: tuple[int, ...] = ()  # later loops stored absolute
    v_absolute: tuple[int, ...] = ()
    layer: int | None = None  # the model layer a format with per-layer tables is read as
    rope_theta: float | None = None  # keys stored before RoPE (FORMAT.md 5b)
    adaptive_exit: bool = False  # a depth map: each row keeps its exit loop

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def max_pages(self) -> int:
        """Block-table width: the context's pages plus one spare (a staged page may need it)."""
        return -(-self.context // self.page_size) + 1

    def lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(attended seq_lens [B], stored lengths [B]), int32.

        Sequence 0 attends `context` tokens; sequence b > 0 attends fewer (not multiples of
        the page size in general); the last sequence (B > 1) stores 3 more tokens than it
        attends (a prefix read). Not ragged: every sequence stores and attends `context`.
        """
        if not self.ragged:
            full = np.full(self.batch, self.context, np.int32)
            return full, full.copy()
        b = np.arange(self.batch)
        attended = self.context - (b * (self.context // 3 + 5)) % max(self.context - 1, 1)
        attended = np.maximum(attended, 1).astype(np.int32)
        stored = attended.copy()
        if self.batch > 1:
            stored[-1] += 3
        return attended, stored

    def config(self) -> PagedCacheConfig:
        _, stored = self.lengths()
        pages = int(np.sum(-(-stored // self.page_size)))
        ensure_registered(
            self.k_base_format, self.k_residual_format, self.v_base_format, self.v_residual_format
        )
        return PagedCacheConfig(
            num_pages=pages + 2,  # two physical pages no sequence uses
            page_size=self.page_size,
            num_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=jnp.dtype(self.dtype),
            num_loops=self.num_loops,
            k_base_format=self.k_base_format,
            k_residual_format=self.k_residual_format,
            v_base_format=self.v_base_format,
            v_residual_format=self.v_residual_format,
            k_group_size=self.k_group_size,
            v_group_size=self.v_group_size,
            sink=self.sink,
            max_seqs=self.batch,
            k_absolute=self.k_absolute,
            v_absolute=self.v_absolute,
            rope_theta=self.rope_theta,
            adaptive_exit=self.adaptive_exit,
        )


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Arguments of one call: q [B, Hq, D] f32, the cache, block tables, seq_lens, seq_ids."""

    q: Any
    cache: Any
    block_tables: Any
    seq_lens: Any
    seq_ids: Any

    def args(self):
        return self.q, self.cache, self.block_tables, self.seq_lens


def _spec(name, batch, hq, h, d, ps, ctx, **kw) -> PagedAttentionSpec:
    return PagedAttentionSpec(
        name=name, batch=batch, q_heads=hq, kv_heads=h, head_dim=d, page_size=ps, context=ctx, **kw
    )


#: Small configurations the tests run in interpret mode (each a case of the test matrix).
# fmt: off
SPECS: tuple[PagedAttentionSpec, ...] = (
    # INT4 (K token groups 16, V channel groups 64), no GQA, one loop, float32.
    _spec("int4-g1-p16-d64", 2, 2, 2, 64, 16, 45),
    # GQA 4 (broadcast path), 3 loops attending the last (residual chain), sink rows, bf16.
    _spec("int4-gqa4-p16-d64-loop2-sink3-bf16", 3, 8, 2, 64, 16, 61, num_loops=3, loop=2,
          sink=3, dtype="bfloat16"),
    # GQA 8 (dot path, padded to 16 rows), NVFP4 base and residual, 32-token pages, D 128.
    _spec("nvfp4-gqa8-p32-d128-loop1-bf16", 2, 8, 1, 128, 32, 75, num_loops=2, loop=1,
          k_base_format="nvfp4", k_residual_format="nvfp4", v_base_format="nvfp4",
          v_residual_format="nvfp4", dtype="bfloat16"),
    # Mixed formats (FP8 K residual, NVFP4 V base), 64-token pages, K groups of 32, sink 5, f16.
    _spec("mixed-fp8-nvfp4-p64-d64-loop1-sink5-f16", 2, 2, 1, 64, 64, 150, num_loops=2, loop=1,
          k_residual_format="fp8_e4m3", v_base_format="nvfp4", k_group_size=32, sink=5,
          dtype="float16"),
    # Values in HINT4 with HINT2 deltas (attended in the rotated space: staging and sink rows
    # rotated, the output un-rotated), GQA 3 (SmolLM2's), sink 3; float32, where attending in
    # the rotated space agrees with the reference to float32 round-off (a bfloat16 cache
    # rounds each un-rotated row first, FORMAT.md 2c).
    _spec("hint4-gqa3-p16-d64-loop1-sink3", 2, 6, 2, 64, 16, 70, num_loops=2, loop=1,
          v_base_format="hint4", v_residual_format="hint2", sink=3),
    # Keys in INTB with one bit table per model layer (read as layer 2), INT4 deltas; values
    # HINT4 (intb-hint4's formats), GQA 3, 2 loops.
    _spec("intb-layers-hint4-gqa3-p16-d64-loop1-l2", 2, 6, 2, 64, 16, 50, num_loops=2, loop=1,
          k_base_format=intb_layers_format(2, 64), k_residual_format="int4", k_group_size=16,
          v_base_format="hint4", v_residual_format="hint4", layer=2),
    # loops-abs-v2442's schedule, GQA 2, attending loop 3 (chain: V loop 2 + a delta).
    _spec("abs-v2442-gqa2-p16-d64-loop3-bf16", 2, 4, 2, 64, 16, 50, num_loops=4, loop=3,
          dtype="bfloat16", **V2442),
    # The best policy's shape (intb-prerope-hint4-heavy): heavy rows over INTB keys (rows
    # chosen with a mean-query table) and HINT4 values (their heavy rows attended plain, in
    # the second accumulator), two heavy groups per page, keys stored before RoPE (RoPE back
    # in the kernel), sink rows, GQA 3; float32 (rotated values, as the hint4 spec above).
    _spec("heavy-intb-hint4-rope-gqa3-p32-d64-sink3", 2, 6, 2, 64, 32, 90, sink=3,
          k_base_format=heavy_format(intb_format(2, 64), 16, 2, 64),
          k_residual_format=heavy_format(intb_format(2, 64), 16, 2, 64),
          v_base_format=heavy_format("hint4", 16), v_residual_format=heavy_format("hint4", 16),
          dtype="float32", rope_theta=10000.0),
    # Keys before RoPE over an INT4 chain (loop 1 a delta), GQA 8 (the dot path on the
    # halves), D 128, bf16, sink 2; heavy INT4 / INT2 pages on 64-token groups, bf16 (in
    # interpret mode XLA dropped the tiles' bfloat16 rounding here: `_exact.round_to`).
    _spec("rope-int4-gqa8-p16-d128-loop1-sink2-bf16", 2, 8, 1, 128, 16, 60, num_loops=2,
          loop=1, dtype="bfloat16", rope_theta=10000.0, sink=2),
    _spec("heavy-int4-int2-p64-d64-bf16", 2, 2, 2, 64, 64, 150, dtype="bfloat16",
          k_base_format=heavy_format("int4", 64, 2, 64),
          k_residual_format=heavy_format("int4", 64, 2, 64),
          v_base_format=heavy_format("int2", 64), v_residual_format=heavy_format("int2", 64)),
)
# fmt: on


def ouro_spec(
    batch: int, context: int, fmt: str = "int4", *, loop: int = 0, page_size: int = 16
) -> PagedAttentionSpec:
    """Ouro-1.4B decode shapes: Hq = H = 16, D = 128, bf16, 4 loops (attending `loop`).

    int4: K token groups of page_size (G = 16 at page 16: 6 bits; 32 at page 32: 5 bits),
    V channel groups of 64 (4.5 bits); nvfp4: 4.5 bits everywhere; "heavy-rope": the best
    served policy's formats (`_ouro_heavy_rope`; 64-token pages whatever `page_size`).
    """
    if fmt == "heavy-rope":
        return _ouro_heavy_rope(batch, context, loop)
    groups = dict(k_group_size=min(page_size, 64), v_group_size=64) if fmt == "int4" else {}
    return _spec(
        f"ouro-{fmt}-b{batch}-ctx{context}-p{page_size}-loop{loop}",
        batch, 16, 16, 128, page_size, context, num_loops=4, loop=loop,
        k_base_format=fmt, k_residual_format=fmt, v_base_format=fmt, v_residual_format=fmt,
        dtype="bfloat16", ragged=False, **groups,
    )  # fmt: skip


def _ouro_heavy_rope(batch: int, context: int, loop: int) -> PagedAttentionSpec:
    """The best served policy's formats (intb-prerope-hint4-heavy: heavy64 rows over INTB keys
    with a mean-query table and over HINT4 values, keys stored before RoPE) at Ouro-1.4B's
    decode shapes, every loop stored whole (heavy formats have no deltas), 64-token pages."""
    keys, values = heavy_rope_formats(16, 128)
    later = (1, 2, 3)
    return _spec(
        f"ouro-heavy-rope-b{batch}-ctx{context}-p64-loop{loop}", batch, 16, 16, 128, 64,
        context, num_loops=4, loop=loop, k_base_format=keys, k_residual_format=keys,
        v_base_format=values, v_residual_format=values, k_absolute=later, v_absolute=later,
        dtype="bfloat16", ragged=False, rope_theta=1000000.0,
    )  # fmt: skip


#: Shapes the Triton lowering test covers beyond SPECS (production sizes, never executed).
# fmt: off
LOWERING_SPECS: tuple[PagedAttentionSpec, ...] = (
    ouro_spec(8, 4096, "int4", loop=3, page_size=16),
    ouro_spec(8, 4096, "nvfp4", loop=0, page_size=32),
    _spec("fp8-gqa4-p16-d128", 4, 32, 8, 128, 16, 1024, v_base_format="fp8_e4m3",
          k_base_format="fp8_e4m3", dtype="bfloat16"),
    _spec("int4-gqa16-p64-d64-sink4", 2, 32, 2, 64, 64, 2048, num_loops=2, loop=1, sink=4,
          dtype="bfloat16"),
    _spec("ouro-intb-layers-hint4-b8-ctx4096-p64-loop0-l1", 8, 16, 16, 128, 64, 4096,
          num_loops=4, k_base_format=intb_layers_format(16, 128), v_base_format="hint4",
          v_residual_format="hint4", dtype="bfloat16", ragged=False, layer=1),
    _spec("ouro-hint4-b8-ctx4096-p64-loop3", 8, 16, 16, 128, 64, 4096, num_loops=4, loop=3,
          v_base_format="hint4", v_residual_format="hint4", dtype="bfloat16", ragged=False),
    _spec("ouro-abs-v2442-b8-ctx4096-p64-loop3", 8, 16, 16, 128, 64, 4096, num_loops=4, loop=3,
          dtype="bfloat16", ragged=False, **V2442),
    _spec("ouro-abs-v2442-b8-ctx4096-p16-loop1", 8, 16, 16, 128, 16, 4096, num_loops=4, loop=1,
          dtype="bfloat16", ragged=False, **V2442),
    # Ouro with adaptive exits (the depth map; chains from loop 0 through absolute loops)
    _spec("ouro-abs-v2442-exits-b8-ctx4096-p64-loop3", 8, 16, 16, 128, 64, 4096, num_loops=4,
          loop=3, dtype="bfloat16", ragged=False, adaptive_exit=True, **V2442),
    # intb-prerope-hint4-heavy-smollm2's shapes (SmolLM2: 3 KV heads of 64, GQA 3, 64-token
    # pages, heavy64, per-layer tables of 30 layers), and Ouro-1.4B's head shapes.
    _spec("smollm2-heavy-intb-hint4-rope-b8-ctx4096-p64-l7", 8, 9, 3, 64, 64, 4096,
          dtype="float32", ragged=False, layer=7, rope_theta=100000.0,
          k_base_format=heavy_format(intb_layers_format(3, 64, 30), 64, 3, 64, layers=30),
          k_residual_format=heavy_format(intb_layers_format(3, 64, 30), 64, 3, 64, layers=30),
          v_base_format=heavy_format("hint4", 64), v_residual_format=heavy_format("hint4", 64)),
    _spec("ouro-heavy-intb-hint4-rope-b8-ctx4096-p64", 8, 16, 16, 128, 64, 4096,
          dtype="bfloat16", ragged=False, rope_theta=1000000.0,
          k_base_format=heavy_format(intb_format(16, 128), 64, 16, 128, query_heads=1),
          k_residual_format=heavy_format(intb_format(16, 128), 64, 16, 128, query_heads=1),
          v_base_format=heavy_format("hint4", 64), v_residual_format=heavy_format("hint4", 64)),
)
# fmt: on


#: Every spec the kernel is lowered for in the tests (all supported: `api.config_support`).
SUPPORTED_SPECS: tuple[PagedAttentionSpec, ...] = SPECS + LOWERING_SPECS


def make_block_tables(spec: PagedAttentionSpec, seed: int = 0) -> np.ndarray:
    """The block tables `make_inputs` / `random_inputs` build for `seed`."""
    return _tables(spec, spec.lengths()[1], spec.config().num_pages, np.random.default_rng(seed))


def _tables(spec: PagedAttentionSpec, stored: np.ndarray, num_pages: int, rng) -> np.ndarray:
    """Block tables [B, max_pages]: a random permutation of physical pages 1.. (page 0 and
    the last page unused), -1 past each sequence's pages."""
    ps = spec.page_size
    perm = 1 + rng.permutation(num_pages - 2)
    tables = np.full((spec.batch, spec.max_pages), -1, np.int32)
    used = 0
    for s, n in enumerate(stored):
        k = -(-int(n) // ps)
        tables[s, :k] = perm[used : used + k]
        used += k
    return tables


def _loop_data(rng, spec: PagedAttentionSpec, tokens: int, scale: float):
    """[L, B, tokens, H, D]: loop l = loop l - 1 + 0.3 * noise (correlated loops)."""
    shape = (spec.num_loops, spec.batch, tokens, spec.kv_heads, spec.head_dim)
    steps = rng.standard_normal(shape) * np.array([1.0] + [0.3] * (spec.num_loops - 1)).reshape(
        -1, 1, 1, 1, 1
    )
    return (scale * np.cumsum(steps, axis=0)).astype(jnp.dtype(spec.dtype))


def _empty(config, layer):
    """`init_cache(config)`, read and written as model `layer` (None: as it comes)."""
    cache = init_cache(config)
    return cache if layer is None else at_layer(cache, layer)


def _fill(config, layer, k, v, block_tables, stored):
    """Append token t of every loop (0, 1, ...) for t = 0 .. T-1 (the looped-LM decode
    order) to the sequences whose stored length exceeds t; one jitted program (a fori_loop
    over t; the other sequences get an out-of-range slot, whose writes `append` drops)."""
    num_loops, b, t = k.shape[:3]
    slots = jnp.arange(b, dtype=jnp.int32)

    def step(i, cache):
        ids = jnp.where(i < stored, slots, jnp.int32(config.max_seqs))
        for loop in range(num_loops):
            kt = lax.dynamic_slice_in_dim(k[loop], i, 1, axis=1)
            vt = lax.dynamic_slice_in_dim(v[loop], i, 1, axis=1)
            cache = append(cache, kt, vt, block_tables=block_tables, seq_ids=ids, loop=loop)
        return cache

    return lax.fori_loop(0, t, step, _empty(config, layer))


def make_inputs(spec: PagedAttentionSpec, seed: int = 0) -> Inputs:
    """A cache filled through `append` (token by token, loops 0, 1, ... per token), and
    queries q ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    config = spec.config()
    attended, stored = spec.lengths()
    tables = _tables(spec, stored, config.num_pages, rng)
    t = int(stored.max())
    k = _loop_data(rng, spec, t, 1.0)
    v = _loop_data(rng, spec, t, 2.0)
    block_tables = jnp.asarray(tables)
    args = (jnp.asarray(k), jnp.asarray(v), block_tables, jnp.asarray(stored))
    # One program, compiled without backend optimization (a third of the compile time; the
    # cache bytes need not match anything but themselves: kernel and reference read them).
    fill = jax.jit(functools.partial(_fill, config, spec.layer)).lower(*args)
    cache = fill.compile(compiler_options={"xla_backend_optimization_level": 0})(*args)
    q = rng.standard_normal((spec.batch, spec.q_heads, spec.head_dim)).astype(np.float32)
    return Inputs(
        q=jnp.asarray(q),
        cache=cache,
        block_tables=block_tables,
        seq_lens=jnp.asarray(attended),
        seq_ids=jnp.arange(spec.batch, dtype=jnp.int32),
    )


def _random_leaf(key, name: str, shape, dtype, page_size: int = 0):
    dtype = jnp.dtype(dtype)
    if name == "heavy_rows":  # [..., P, n, H]: a row of each heavy group of page_size / n
        return jax.random.randint(key, shape, 0, page_size // shape[-2], jnp.int32).astype(dtype)
    name = name.removeprefix("heavy_")  # heavy rows' INT8 codes, minimum, scale: as INT4's
    if name == "codes" and dtype == jnp.uint8:
        return jax.random.randint(key, shape, 0, 256, jnp.int32).astype(jnp.uint8)
    if name == "codes":  # fp8 codes
        return (jax.random.normal(key, shape) * 64).astype(dtype)
    if name == "minimum":
        return (jax.random.normal(key, shape) - 1.0).astype(dtype)
    if name in ("scale", "block_scale"):
        return jax.random.uniform(key, shape, jnp.float32, 0.05, 0.2).astype(dtype)
    if name == "global_scale":
        return jax.random.uniform(key, shape, jnp.float32, 50.0, 100.0).astype(dtype)
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)  # staging / sink rows


def random_inputs(spec: PagedAttentionSpec, seed: int = 0) -> Inputs:
    """Same shapes as `make_inputs`, but every packed array, staging and sink row holds
    random (finite, decodable) values and seq_lens are set directly: builds a 32k-token cache
    in seconds. Attention over it is well defined (the kernel and the reference must agree),
    only the values carry no meaning."""
    rng = np.random.default_rng(seed)
    config = spec.config()
    attended, stored = spec.lengths()
    tables = _tables(spec, stored, config.num_pages, rng)
    cache = _empty(config, spec.layer)
    key = jax.random.key(seed)

    def fill(plane, packed):
        if packed is None:
            return None
        if isinstance(packed, tuple):  # per-loop runs of later loops
            return tuple(fill(16 * plane + r + 1, run) for r, run in enumerate(packed))
        arrays = {}
        for i, (name, a) in enumerate(codec_view(packed).arrays.items()):
            sub = jax.random.fold_in(key, 16 * plane + i)
            leaf = _random_leaf(sub, name, a.shape, a.dtype, spec.page_size)
            stored = packed.arrays[name].dtype  # E4M3 fields are stored as uint8 bits
            arrays[name] = leaf if leaf.dtype == stored else lax.bitcast_convert_type(leaf, stored)
        return dataclasses.replace(packed, **arrays)

    rows = {}
    for i, name in enumerate(("k_stage", "v_stage", "k_sink", "v_sink")):
        a = getattr(cache, name)
        rows[name] = _random_leaf(jax.random.fold_in(key, 1000 + i), name, a.shape, a.dtype)
    lens = np.zeros((spec.num_loops, spec.batch), np.int32) + stored[None]
    cache = dataclasses.replace(
        cache,
        k_base=fill(0, cache.k_base),
        v_base=fill(1, cache.v_base),
        k_delta=fill(2, cache.k_delta),
        v_delta=fill(3, cache.v_delta),
        seq_lens=jnp.asarray(lens),
        **rows,
    )
    q = rng.standard_normal((spec.batch, spec.q_heads, spec.head_dim)).astype(np.float32)
    return Inputs(
        q=jnp.asarray(q),
        cache=cache,
        block_tables=jnp.asarray(tables),
        seq_lens=jnp.asarray(attended),
        seq_ids=jnp.arange(spec.batch, dtype=jnp.int32),
    )


def input_shapes(spec: PagedAttentionSpec) -> Inputs:
    """ShapeDtypeStructs of every argument (no data: for tracing and lowering)."""
    config = spec.config()
    b = spec.batch
    sds = jax.ShapeDtypeStruct
    return Inputs(
        q=sds((b, spec.q_heads, spec.head_dim), jnp.float32),
        cache=jax.eval_shape(lambda: _empty(config, spec.layer)),
        block_tables=sds((b, spec.max_pages), jnp.int32),
        seq_lens=sds((b,), jnp.int32),
        seq_ids=sds((b,), jnp.int32),
    )
