"""The paged cache's state: `PagedKVCache` (a pytree of device arrays) and `init_cache`.

Layout (P physical pages of `page_size` tokens, L loops, S sequence slots, H heads, D dims):

    k_base, v_base:    PackedKV, batch shape (P,): loop 0 of every physical page, packed as
                       `pack_paged` packs it, 1-byte float fields (E4M3 block scales, FP8
                       codes) held as their uint8 bits (`rest_dtype`; `codec_view` reads
                       them back): XLA:CPU widens any update of a float8 array, a pass over the
                       whole pool, where an update of uint8 bits writes only its pages.
    k_delta, v_delta:  PackedKV, batch shape (L - 1, P) (None for L == 1): plane l - 1 holds
                       loop l of every physical page as a residual delta against the
                       *reconstructed* loop l - 1 of the same physical page (the payload of
                       `encode_residual(page_l, recon_{l-1})`), or, for a loop the config
                       stores absolute, the page itself packed on its own. When the later
                       loops differ in format: a tuple of planes, one per run of loops of one
                       format (`PagedCacheConfig.delta_runs`), each batch (len(run), P).
    k_stage, v_stage:  [L, S, page_size, H, D] raw rows of each sequence's current partial page
                       (rows past the fill are zero).
    k_sink, v_sink:    [L, S, sink, H, D] raw copies of each sequence's first `sink` tokens.
    seq_lens:          int32 [L, S] tokens written per loop and sequence.
    depth:             uint8 [P, page_size] (adaptive-exit caches, else None): per row of a
                       quantized page, the last loop with its own K/V (L - 1 unless the token
                       exited early); reconstruction skips the deltas of later loops.
    stage_exited:      bool [L, S, page_size] (adaptive-exit caches, else None): staged rows
                       whose token had exited before that loop.
    layer:             int32 [] (caches of a format with one table per model layer,
                       `PagedCacheConfig.layered`, else None): the model layer whose table the
                       pages use (`at_layer`); the engine's layer scan sets it, traced, so one
                       compiled step serves every layer.

Base and deltas are two containers (not one (L, P) stack) because loop 0 and the deltas may use
different formats, whose packed arrays differ. All loops share one block table: a sequence's
logical page i is physical page `block_tables[seq, i]` in every loop plane. Every leaf is its
own buffer, so a cache can be donated to a jitted update (`kvq_jax.cache.paged_cache`).

`sequence_rows` is the XLA building block of every read: the rows a sequence attends in one
loop, from its decoded pages, its staging page and its sink rows. `rope_keys` turns the keys
of a pre-RoPE cache (`PagedCacheConfig.rope_theta`) between the stored and the served space
(`key_rope`: their tables).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvq_jax.codecs.packed import PackedKV
from kvq_jax.codecs.registry import get_codec
from kvq_jax.codecs.rope import apply_rope, invert_rope, rope_at
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.codec_base import layer_arg
from kvq_jax.core.containers import CACHE_FIELDS, PagedCacheBase, plane_fields, rest_dtype
from kvq_jax.core.registry import layout
from kvq_jax.core.rope import tables_at

__all__ = [
    "PagedCacheConfig",
    "PagedKVCache",
    "at_layer",
    "check_cache",
    "codec_view",
    "head_shardings",
    "init_cache",
    "key_rope",
    "planes",
    "rope_keys",
]


class PagedKVCache(PagedCacheBase):
    """The cache state, jax arrays (see the module doc for the fields); `config` is static."""


jax.tree_util.register_dataclass(
    PagedKVCache, data_fields=list(CACHE_FIELDS), meta_fields=["config"]
)


def check_cache(cache) -> PagedCacheConfig:
    """`cache` is a PagedKVCache; returns its config."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    return cache.config


def planes(cache: PagedKVCache, kind: str) -> tuple[PackedKV, PackedKV | tuple | None]:
    """(base, delta) packed planes of K ("key") or V ("value"), as stored (`codec_view` gives the
    format's dtypes); delta is a tuple of runs when the later loops differ in format."""
    if kind == "key":
        return cache.k_base, cache.k_delta
    return cache.v_base, cache.v_delta


def _bitcast(a, dtype):
    return a if a.dtype == dtype else lax.bitcast_convert_type(a, dtype)


def codec_view(packed: PackedKV) -> PackedKV:
    """A stored plane (or pages taken from one) with its format's dtypes, as `unpack_kv` and
    `pack_kv` see it (same bytes)."""
    shapes = layout(packed.format).array_shapes(packed.shape, packed.axis, packed.group_size)
    fields = {n: _bitcast(a, shapes[n][1]) for n, a in packed.arrays.items()}
    return dataclasses.replace(packed, **fields)


def empty_packed(config: PagedCacheConfig, pack_args: dict, batch: tuple[int, ...]) -> PackedKV:
    """Zero packed pages with leading axes `batch`, as `pack_kv(**pack_args)` packs a page and
    the cache stores it (`rest_dtype`)."""
    args = dict(pack_args)
    codec = get_codec(args.pop("format"))  # this stack must implement the format
    page = jax.ShapeDtypeStruct(config.page_shape, config.dtype)
    layer = 0 if codec.per_layer else None  # shapes are the same for every layer
    extra = layer_arg(codec, layer)
    if hasattr(codec, "heavy_group"):  # heavy rows (any: the shapes do not depend on them)
        extra["rows"] = jax.ShapeDtypeStruct((codec.num_groups(page.shape[0]), page.shape[1]),
                                             jnp.uint8)  # fmt: skip
        shapes = jax.eval_shape(lambda p, r: codec.pack(p, **args, **extra, rows=r), page,
                                extra.pop("rows"))  # fmt: skip
    else:
        shapes = jax.eval_shape(functools.partial(codec.pack, **args, **extra), page)
    return jax.tree.map(lambda s: jnp.zeros((*batch, *s.shape), rest_dtype(s.dtype)), shapes)


def init_cache(config: PagedCacheConfig) -> PagedKVCache:
    """An empty cache: zero pages, zero staging and sink rows, seq_lens 0 (one buffer per leaf).

    Raises ValueError for a format that kvq_jax's registry does not hold.
    """
    if not isinstance(config, PagedCacheConfig):
        raise TypeError(f"config must be a PagedCacheConfig, got {type(config).__name__}")
    c = config

    def rows(n):
        return jnp.zeros((c.num_loops, c.max_seqs, n, c.num_heads, c.head_dim), c.dtype)

    stored = {}
    for name, _, loops, args in c.plane_specs():
        batch = (c.num_pages,) if name.endswith("base") else (len(loops), c.num_pages)
        stored[name] = empty_packed(c, args, batch)

    return PagedKVCache(
        **plane_fields(stored),
        k_stage=rows(c.page_size),
        v_stage=rows(c.page_size),
        k_sink=rows(c.sink),
        v_sink=rows(c.sink),
        seq_lens=jnp.zeros((c.num_loops, c.max_seqs), jnp.int32),
        depth=jnp.zeros((c.num_pages, c.page_size), jnp.uint8) if c.adaptive_exit else None,
        stage_exited=jnp.zeros((c.num_loops, c.max_seqs, c.page_size), bool)
        if c.adaptive_exit
        else None,
        layer=jnp.zeros((), jnp.int32) if c.layered else None,
        config=c,
    )


def at_layer(cache: PagedKVCache, layer) -> PagedKVCache:
    """`cache` read and written as model layer `layer` (an int or a traced int32 scalar) of a
    format with one table per layer (`PagedCacheConfig.layered`); other caches unchanged."""
    if not check_cache(cache).layered:
        return cache
    return dataclasses.replace(cache, layer=jnp.asarray(layer, jnp.int32))


def head_shardings(cache: PagedKVCache, mesh, axis: str):
    """NamedShardings (a pytree like `cache`) that split every per-head array over the KV-head
    axis H along mesh axis `axis`: each packed field with a head axis ([..., T', H, D']), the
    staging and sink rows ([L, S, rows, H, D]); per-page NVFP4 global scales, seq_lens and the
    exit maps are replicated. H must be a multiple of the mesh axis size (ValueError)."""
    config = check_cache(cache)
    size = mesh.shape.get(axis)
    if size is None or config.num_heads % size:
        raise ValueError(
            f"mesh: axis {axis!r} of size {size} must divide the {config.num_heads} KV heads "
            f"(mesh axes {dict(mesh.shape)})"
        )

    def on_heads(a, head_axis):
        if a.ndim <= head_axis:
            return NamedSharding(mesh, P())
        return NamedSharding(mesh, P(*([None] * head_axis), axis))

    out = {}
    for name in CACHE_FIELDS:
        value = getattr(cache, name)
        if isinstance(value, PackedKV):  # fields [*batch, T', H, D'] (or [*batch] scalars)
            lead = len(value.batch_shape)
            out[name] = jax.tree.map(lambda a, lead=lead: on_heads(a, lead + 1), value)
        elif isinstance(value, tuple):  # runs of later loops, each batch (loops, P)
            out[name] = tuple(jax.tree.map(lambda a: on_heads(a, 3), v) for v in value)
        elif name.endswith(("_stage", "_sink")):
            out[name] = on_heads(value, 3)
        elif value is not None:
            out[name] = NamedSharding(mesh, P())
        else:
            out[name] = None
    return dataclasses.replace(cache, **out)


def key_rope(config: PagedCacheConfig, positions):
    """(cos, sin) float32 for the keys of a cache storing them before RoPE
    (`config.rope_theta`), None for other caches. positions: int [...], a NumPy array when
    static (the tables are then computed here, in NumPy, and enter the program as constants
    [..., 1, D / 2]: no binary64 cosines on the device, and nothing to hoist out of a layer
    scan), else traced (`rope_at` on the device: [..., 1, D]). The same numbers either way
    (`kvq_jax.core.rope.tables_at`); `rope_keys` takes both widths."""
    if config.rope_theta is None:
        return None
    if isinstance(positions, np.ndarray):
        tables = tables_at(positions, config.head_dim, config.rope_theta, half=True)
        return tuple(jnp.asarray(a) for a in tables)
    return rope_at(positions, config.head_dim, config.rope_theta)


def rope_keys(config: PagedCacheConfig, rows, rope, *, invert: bool = False):
    """Key rows [..., T, H, D] of a pre-RoPE cache turned by `rope` = (cos, sin) broadcasting
    against them (`key_rope` of the rows' positions): RoPE applied (FORMAT.md 5b's
    arithmetic, `apply_rope`), or with invert=True taken off (`invert_rope`, what a page
    packs), in the cache dtype. Rows as they are when `rope` is None."""
    if rope is None:
        return rows
    turn = invert_rope if invert else apply_rope
    return turn(rows, *rope).astype(config.dtype)


def sequence_rows(config, decoded, stage, sink, stored, length):
    """The rows one sequence attends: [M * page_size, H, D] in the cache dtype.

    decoded: [M, page_size, H, D] its logical pages 0..M-1 decoded from the store; stage:
    [page_size, H, D] its staging page; sink: [sink, H, D] its raw sink rows; stored: its
    stored length in this loop (traced int); length: rows kept (traced int, <= stored).
    Page i is `decoded[i]` when complete ((i + 1) * page_size <= stored), `stage` when it is
    the partial page, zero otherwise; the first `sink` stored rows are the sink rows; rows
    >= length are zero.
    """
    ps = config.page_size
    m = decoded.shape[0]
    i = jnp.arange(m)
    full = ((i + 1) * ps <= stored)[:, None, None, None]
    partial = (i == stored // ps)[:, None, None, None]
    zero = jnp.zeros((), config.dtype)
    rows = jnp.where(full, decoded, jnp.where(partial, stage[None], zero))
    rows = rows.reshape(m * ps, config.num_heads, config.head_dim)
    pos = jnp.arange(m * ps)[:, None, None]
    if config.sink:
        n_sink = min(config.sink, rows.shape[0])
        head = jnp.where(pos[:n_sink] < stored, sink[:n_sink], rows[:n_sink])
        rows = rows.at[:n_sink].set(head)
    return jnp.where(pos < length, rows, zero)


def table_rows(block_tables, seq_ids):
    """The block-table rows of slots `seq_ids` [B]: int32 [B, max_pages_per_seq]; a slot outside
    the table reads a row of -1 (no page)."""
    return jnp.asarray(block_tables).at[jnp.asarray(seq_ids)].get(mode="fill", fill_value=-1)


def read_batch(cache: PagedKVCache, rows, seq_lens, seq_ids, *, loop: int, decode):
    """K, V rows of a batch of sequences in loop `loop`: [B, M * page_size, H, D] each, rows
    >= seq_lens[b] zero (validated arguments, traceable).

    rows: int32 [B, M] the sequences' block-table rows (`table_rows`; ids are clamped to
    [0, num_pages)); seq_lens: int32 [B]; seq_ids: int32 [B] their slots, whose staging, sink
    rows and stored length are read as XLA indexing reads them. decode(kind, page_ids [N]) ->
    [N, page_size, H, D] is the page decoder to use (the XLA reference or a kernel). Keys
    of a pre-RoPE cache come back with RoPE (`rope_keys`).
    """
    config = cache.config
    b, m = rows.shape
    seq_ids = jnp.asarray(seq_ids)
    page_ids = jnp.clip(rows, 0, config.num_pages - 1).reshape(-1)
    stored = cache.seq_lens[loop][seq_ids]
    one = jax.vmap(functools.partial(sequence_rows, config))
    out = []
    for kind, stage, sink in (
        ("key", cache.k_stage, cache.k_sink),
        ("value", cache.v_stage, cache.v_sink),
    ):
        pages = decode(kind, page_ids).reshape(b, m * config.page_size, *config.page_shape[1:])
        if kind == "key":  # stored before RoPE: turned at each row's position in its sequence
            pages = rope_keys(config, pages, key_rope(config, np.arange(m * config.page_size)))
        pages = pages.reshape(b, m, *config.page_shape)
        stage_rows, sink_rows = stage[loop][seq_ids], sink[loop][seq_ids]
        out.append(one(pages, stage_rows, sink_rows, stored, jnp.asarray(seq_lens)))
    return tuple(out)
