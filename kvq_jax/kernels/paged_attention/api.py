"""`paged_decode_attention`: the only place that validates a decode-attention call over the
paged cache and picks its implementation.

q [B, Hq, D] (one decode token per sequence; Hq a multiple of the H KV heads), a
`PagedKVCache`, block_tables int32 [max_seqs, max_pages_per_seq], seq_lens int32 [B] (each in
[1, stored length of its sequence in `loop`], not checked: no host sync), seq_ids int32 [B]
(default 0..B-1), loop static. Returns float32 [B, Hq, D].

backend: "xla" (the reference, `xla.py`), "pallas" (the Triton kernel, `pallas_triton.py`,
CUDA GPU >= sm80), "pallas_interpret" (the kernel body in Pallas' interpreter, any device),
"auto" ("pallas" where the device and the configuration allow, else "xla"). num_splits
(static): splits of each sequence's pages (the kernel's split-K over the context; default
`default_num_splits`); launch: the kernel's `kvq_jax.kernels.launch.Launch` (None: the rule of
`kvq_jax.kernels.launch.paged_attention`); both ignored by "xla". block_pages (static): pages
the XLA path decodes and attends per step (None:
`kvq_jax.codecs.attention.default_block_pages`); ignored by the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvq_jax.codecs.cache_state import check_cache
from kvq_jax.core import checks
from kvq_jax.kernels import backend as _backend
from kvq_jax.kernels import launch as _launch
from kvq_jax.kernels._tile_decode import rotated_format, tile_support
from kvq_jax.kernels.paged_attention import pallas_triton, xla

#: Head dims and page sizes the kernel takes (powers of two: Triton block shapes; D >= 32
#: keeps every uint8 tile's last axis even, see `pallas_triton.WIDE_INDEX_BYTES`).
HEAD_DIMS = (32, 64, 128, 256)
PAGE_SIZES = (16, 32, 64, 128)
#: Largest query group (Hq / H) of one program.
MAX_GROUP = 64
#: Programs (B x H x splits) the default split count aims for (~ 2 waves of a 132-SM GPU).
TARGET_PROGRAMS = 256
#: Fewest pages a default split gets.
MIN_PAGES_PER_SPLIT = 8


def config_support(q, cache, block_tables, *, loop: int = 0, num_splits=None,
                   return_lse: bool = False) -> str | None:  # fmt: skip
    """None when the kernel takes this call's configuration, else why not (naming the
    argument). Reads shapes and static metadata only (ShapeDtypeStructs will do).

    Formats: INT4, INT2, INTB (one table or one per layer), NVFP4, FP8 E4M3 in any loop
    (per-loop formats, absolute loops; adaptive exits: the depth map), values in HINT4 / HINT2 when
    every plane the attended loop's value chain reads is rotated (attended in the rotated space,
    as the XLA path does), and heavy rows (FORMAT.md 5a) over INT4 / INT2 / INTB (keys and
    values) or HINT4 / HINT2 (values) with a power-of-two heavy group and the payload on token
    groups of one heavy group (G - 1 rows, the default) or of one row, or on channel groups.
    Keys stored before RoPE (`rope_theta`) get RoPE back in the kernel."""
    del block_tables
    config = cache.config
    if return_lse:
        return "return_lse: the kernel returns the output only (the XLA path returns both)"
    d, ps = config.head_dim, config.page_size
    if d not in HEAD_DIMS:
        return f"cache.config.head_dim = {d} is not supported (kernel takes {HEAD_DIMS})"
    if ps not in PAGE_SIZES:
        return f"cache.config.page_size = {ps} is not supported (kernel takes {PAGE_SIZES})"
    group = np.shape(q)[1] // config.num_heads
    if group > MAX_GROUP:
        return f"q: {group} query heads per KV head exceed the kernel's {MAX_GROUP}"
    for kind in ("key", "value"):
        for i in range(config.num_loops):
            args = config.loop_pack_args(kind, i)
            fmt, g, axis = args["format"], args["group_size"], args["axis"]
            why = tile_support(fmt, axis, g, ps, d)
            if why:
                return f"cache.config: {kind} loop {i} {why}"
            if kind == "key" and rotated_format(fmt):
                return (
                    f"cache.config: key loop {i} format {fmt!r}: the kernel attends only "
                    "values in the rotated space (XLA path)"
                )
    if checks.is_int(loop) and 0 <= loop < config.num_loops:
        chain = {
            rotated_format(config.loop_format("value", i)) for i in config.chain("value", loop)
        }
        if len(chain) > 1:
            return (
                f"cache.config: loop {loop}'s values mix Hadamard-rotated and plain formats "
                "(XLA path)"
            )
    del num_splits
    return None


def default_num_splits(batch: int, kv_heads: int, max_pages: int) -> int:
    """Splits of each sequence: enough programs to fill the GPU (`TARGET_PROGRAMS`), at least
    `MIN_PAGES_PER_SPLIT` pages per split (one split for short contexts or large batches)."""
    want = max(1, TARGET_PROGRAMS // max(1, batch * kv_heads))
    return max(1, min(want, max_pages // MIN_PAGES_PER_SPLIT))


def _check_num_splits(num_splits) -> None:
    if num_splits is None:
        return
    if isinstance(num_splits, bool) or not isinstance(num_splits, int | np.integer):
        raise TypeError(f"num_splits must be a static int or None, got {num_splits!r}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def choose_backend(q, cache, block_tables, *, loop: int, backend: str, num_splits=None,
                   return_lse: bool = False) -> str:  # fmt: skip
    """The implementation a (validated) call runs: "xla", "pallas" or "pallas_interpret";
    raises for a bad num_splits or backend, and for an explicit pallas backend the
    configuration or the device cannot take."""
    _check_num_splits(num_splits)
    support = config_support(q, cache, block_tables, loop=loop, num_splits=num_splits,
                             return_lse=return_lse)  # fmt: skip
    return _backend.resolve_backend(backend, support)


def paged_decode_attention(
    q,
    cache,
    block_tables,
    seq_lens,
    *,
    loop: int,
    seq_ids=None,
    backend: str = "auto",
    num_splits: int | None = None,
    launch=None,
    block_pages: int | None = None,
    return_lse: bool = False,
):
    """Decode attention of q [B, Hq, D] (one token per sequence) over loop `loop` of the
    quantized paged cache; float32 [B, Hq, D] (see the module doc for the arguments). With
    return_lse (static; XLA path): (output, log-sum-exp of the scores float32 [B, Hq]), -inf
    and output 0 for a sequence with seq_lens 0, so that other keys can be merged in
    (`kvq_jax.codecs.attention.merge_attention`).

    Raises TypeError/ValueError naming the argument for bad arguments (every backend), and
    ValueError for backend="pallas"/"pallas_interpret" with a configuration the kernel does
    not take (`config_support`) or, for "pallas", a device without the Triton kernels. The
    XLA path equals dense attention on the reconstructed KV (`paged_cache.gather_batch`) to
    float32 round-off (blockwise online softmax), and so does the kernel.
    """
    check_cache(cache)  # before jit flattens it: a clear error for a non-cache
    return _paged_decode_attention(
        q, cache, block_tables, seq_lens, loop=loop, seq_ids=seq_ids, backend=backend,
        num_splits=num_splits, launch=_launch.check_launch(launch),
        block_pages=_check_block_pages(block_pages), return_lse=_check_bool(return_lse),
    )  # fmt: skip


def _check_bool(value):
    if not isinstance(value, bool):
        raise TypeError(f"return_lse must be a bool, got {value!r}")
    return value


def _check_block_pages(block_pages):
    if block_pages is None:
        return None
    if isinstance(block_pages, bool) or not isinstance(block_pages, int | np.integer):
        raise TypeError(f"block_pages must be a static int or None, got {block_pages!r}")
    if block_pages < 1:
        raise ValueError(f"block_pages must be >= 1, got {block_pages}")
    return int(block_pages)


@functools.partial(
    jax.jit,
    static_argnames=("loop", "backend", "num_splits", "launch", "block_pages", "return_lse"),
)
def _paged_decode_attention(q, cache, block_tables, seq_lens, *, loop, seq_ids, backend,
                            num_splits, launch, block_pages, return_lse):  # fmt: skip
    """The jitted body of `paged_decode_attention`."""
    config = check_cache(cache)
    b = checks.check_decode_args(config, q, block_tables, seq_lens, loop, seq_ids)
    impl = choose_backend(q, cache, block_tables, loop=loop, backend=backend,
                          num_splits=num_splits, return_lse=return_lse)  # fmt: skip
    seq_ids = jnp.arange(b, dtype=jnp.int32) if seq_ids is None else jnp.asarray(seq_ids)
    if impl == "xla":
        return xla.paged_decode_attention(
            q, cache, block_tables, seq_lens, seq_ids, loop=loop, block_pages=block_pages,
            return_lse=return_lse,
        )  # fmt: skip
    max_pages = np.shape(block_tables)[1]
    if num_splits is None:
        num_splits = default_num_splits(b, config.num_heads, max_pages)
    return pallas_triton.paged_decode_attention(
        q,
        cache,
        block_tables,
        seq_lens,
        seq_ids,
        loop=int(loop),
        num_splits=int(min(num_splits, max_pages)),
        interpret=impl == "pallas_interpret",
        launch=launch,
    )
