"""Public API: `paged_decode_attention(..., backend=)` and `config_support`.

Semantics and argument checks are those of `kvq_jax.paged_attention.paged_decode_attention`
(the XLA reference): q [B, Hq, D] (one decode token per sequence; Hq a multiple of the H KV
heads), a `PagedKVCache`, block_tables int32 [max_seqs, max_pages_per_seq], seq_lens int32
[B] (each in [1, stored length of its sequence in `loop`], not checked), seq_ids int32 [B]
(default 0..B-1), loop static. Returns float32 [B, Hq, D].

backend: "xla" (reference), "pallas" (Triton kernel, CUDA GPU >= sm80), "pallas_interpret"
(the kernel body in Pallas' interpreter, any device), "auto" ("pallas" where the device and
the configuration allow, else "xla"). num_splits (static): splits of each sequence's pages
(the kernel's split-K over the context; default `default_num_splits`); ignored by "xla".
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from kvq_jax.kernels import backend as _backend
from kvq_jax.kernels.paged_attention import pallas_triton, xla
from kvq_jax.paged_attention import check_decode_args

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


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def config_support(q, cache, block_tables, *, loop: int = 0, num_splits=None) -> str | None:
    """None when the kernel takes this call's configuration, else why not (naming the
    argument). Reads shapes and static metadata only (ShapeDtypeStructs will do)."""
    del block_tables, loop
    config = cache.config
    d, ps = config.head_dim, config.page_size
    if d not in HEAD_DIMS:
        return f"cache.config.head_dim = {d} is not supported (kernel takes {HEAD_DIMS})"
    if ps not in PAGE_SIZES:
        return f"cache.config.page_size = {ps} is not supported (kernel takes {PAGE_SIZES})"
    group = np.shape(q)[1] // config.num_heads
    if group > MAX_GROUP:
        return f"q: {group} query heads per KV head exceed the kernel's {MAX_GROUP}"
    for kind in ("key", "value"):
        for level in ("base", "residual"):
            spec = config.spec(kind, level)
            g, axis = spec["group_size"], spec["axis"]
            length = ps if axis == "tokens" else d
            if not _is_pow2(g) or length % g:
                return (
                    f"cache.config: {kind} {level} {spec['format']} group size {g} along "
                    f"{axis} must be a power of two dividing {length} (Triton tile shapes)"
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


def choose_backend(q, cache, block_tables, *, loop: int, backend: str, num_splits=None) -> str:
    """The implementation a call runs: "xla", "pallas" or "pallas_interpret" (raises for a
    bad num_splits or backend, and for an explicit pallas backend the call cannot take)."""
    _check_num_splits(num_splits)
    support = config_support(q, cache, block_tables, loop=loop, num_splits=num_splits)
    return _backend.resolve_backend(backend, support)


@functools.partial(jax.jit, static_argnames=("loop", "num_splits", "interpret"))
def _kernel(q, cache, block_tables, seq_lens, seq_ids, *, loop, num_splits, interpret):
    return pallas_triton.paged_decode_attention(
        q, cache, block_tables, seq_lens, seq_ids, loop=loop, num_splits=num_splits,
        interpret=interpret,
    )  # fmt: skip


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
):
    """Decode attention over loop `loop` of the quantized paged cache (see the module doc).

    Raises TypeError/ValueError naming the argument for bad arguments (every backend), and
    ValueError for backend="pallas"/"pallas_interpret" with a configuration the kernel does
    not take (`config_support`) or, for "pallas", a device without the Triton kernels.
    Checks and dispatch happen in Python (shapes only; traceable under an outer jit); the
    chosen path runs jitted ("xla": `kvq_jax.paged_attention.paged_decode_attention` with
    backend="xla", whatever num_splits says).
    """
    check_decode_args(q, cache, block_tables, seq_lens, loop=loop, seq_ids=seq_ids)
    chosen = choose_backend(q, cache, block_tables, loop=loop, backend=backend,
                            num_splits=num_splits)  # fmt: skip
    if chosen == "xla":
        return xla.paged_decode_attention_jit(
            q, cache, block_tables, seq_lens, loop=loop, seq_ids=seq_ids, backend="xla"
        )
    b = np.shape(q)[0]
    if seq_ids is None:
        seq_ids = jax.numpy.arange(b, dtype=jax.numpy.int32)
    max_pages = np.shape(block_tables)[1]
    if num_splits is None:
        num_splits = default_num_splits(b, cache.config.num_heads, max_pages)
    return _kernel(
        q,
        cache,
        block_tables,
        seq_lens,
        seq_ids,
        loop=int(loop),
        num_splits=int(min(num_splits, max_pages)),
        interpret=chosen == "pallas_interpret",
    )
