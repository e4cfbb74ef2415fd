"""Decode attention over a `PagedKVCache`: the reference (not a kernel).

`paged_decode_attention` reconstructs every sequence's K and V (`paged_cache.reconstruct`,
masked to the static block-table length) and runs `dense_decode_attention` on them, so it
equals dense attention on the reconstructed KV by construction. The fused kernel that
dequantizes pages in registers (`kvq_jax.kernels.paged_attention`, backend="pallas") is held
to this path; `paged_decode_attention(..., backend=)` dispatches to it ("auto": on a CUDA GPU
for configurations it takes; on a CPU "auto" is this reference path, unchanged).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvq_jax.paged_cache import (
    PagedKVCache,
    _check_block_tables,
    _check_cache,
    _check_int32,
    _check_loop,
    reconstruct,
)


def _check_q(q, num_heads: int, head_dim: int) -> tuple[int, int]:
    shape = np.shape(q)
    if len(shape) != 3:
        raise ValueError(f"q must have rank 3 [B, Hq, D], got shape {shape}")
    b, hq, d = shape
    if d != head_dim:
        raise ValueError(f"q has D = {d} but the KV has D = {head_dim}")
    if hq < 1 or hq % num_heads:
        raise ValueError(f"q heads Hq = {hq} must be a positive multiple of KV heads {num_heads}")
    return b, hq


@jax.jit
def dense_decode_attention(q, k, v, seq_lens) -> jnp.ndarray:
    """One query token per sequence over unquantized KV.

    Args:
      q: [B, Hq, D]; Hq a multiple of H (GQA: query head i reads KV head i // (Hq // H)).
      k, v: [B, T, H, D].
      seq_lens: int32 [B], 1 <= seq_lens <= T; tokens >= seq_len are masked out.

    Returns softmax(q k^T / sqrt(D)) v as float32 [B, Hq, D], computed in float32 at HIGHEST
    precision (a sequence with seq_len 0 gives NaN).
    """
    k, v = jnp.asarray(k), jnp.asarray(v)
    if k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"k, v must both be [B, T, H, D], got {k.shape} and {v.shape}")
    b, t, h, d = k.shape
    bq, hq = _check_q(q, h, d)
    if bq != b:
        raise ValueError(f"q has B = {bq} but k, v have B = {b}")
    _check_int32(seq_lens, "seq_lens", 1)
    if np.shape(seq_lens)[0] != b:
        raise ValueError(f"seq_lens has {np.shape(seq_lens)[0]} entries, expected B = {b}")
    g = hq // h
    hi = jax.lax.Precision.HIGHEST
    qf = jnp.asarray(q, jnp.float32).reshape(b, h, g, d)
    scores = jnp.einsum("bhgd,bthd->bhgt", qf, k.astype(jnp.float32), precision=hi)
    scores = scores * jnp.float32(1.0 / math.sqrt(d))
    mask = jnp.arange(t)[None, :] < jnp.asarray(seq_lens)[:, None]  # [B, T]
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgt,bthd->bhgd", probs, v.astype(jnp.float32), precision=hi)
    return out.reshape(b, hq, d)


def _check_batch(config, seq_lens, seq_ids) -> int:
    """seq_lens int32 [B] and seq_ids (None: slots 0..B-1, B <= max_seqs; else int32 [B]);
    returns B."""
    _check_int32(seq_lens, "seq_lens", 1)
    b = np.shape(seq_lens)[0]
    if seq_ids is None:
        if b > config.max_seqs:
            raise ValueError(f"B = {b} exceeds max_seqs = {config.max_seqs}; pass seq_ids")
        return b
    _check_int32(seq_ids, "seq_ids", 1)
    if np.shape(seq_ids)[0] != b:
        raise ValueError(f"seq_ids has {np.shape(seq_ids)[0]} entries but seq_lens has {b}")
    return b


def gather_batch(
    cache: PagedKVCache, block_tables, seq_lens, *, loop: int, seq_ids=None, backend="auto"
):
    """Reconstructed K, V of a batch: [B, max_pages_per_seq * page_size, H, D] each, rows
    >= seq_lens[b] zero (the inputs `paged_decode_attention` attends over). `backend` picks the
    page reconstruction (`paged_cache.decode_pages`); the reference attention passes "xla"."""
    config = _check_cache(cache)
    loop = _check_loop(config, loop)
    max_pages = _check_block_tables(config, block_tables)
    b = _check_batch(config, seq_lens, seq_ids)
    if seq_ids is None:
        seq_ids = jnp.arange(b, dtype=jnp.int32)
    seq_ids, tables = jnp.asarray(seq_ids), jnp.asarray(block_tables)

    def one(seq, length):
        row = tables.at[seq].get(mode="fill", fill_value=-1)
        return reconstruct(
            cache,
            seq_id=seq,
            length=length,
            table_row=row,
            loop=loop,
            max_pages=max_pages,
            backend=backend,
        )

    return jax.vmap(one)(seq_ids, jnp.asarray(seq_lens))


def check_decode_args(q, cache: PagedKVCache, block_tables, seq_lens, *, loop: int, seq_ids=None):
    """Trace-time checks of a `paged_decode_attention` call (shared by every backend);
    returns the cache config. Raises TypeError/ValueError naming the argument."""
    config = _check_cache(cache)
    _check_q(q, config.num_heads, config.head_dim)
    if np.shape(q)[0] != np.shape(seq_lens)[0]:
        raise ValueError(f"q has B = {np.shape(q)[0]} but seq_lens has {np.shape(seq_lens)[0]}")
    _check_loop(config, loop)
    _check_block_tables(config, block_tables)
    _check_batch(config, seq_lens, seq_ids)
    return config


def xla_paged_decode_attention(q, cache, block_tables, seq_lens, *, loop: int, seq_ids=None):
    """The XLA reference path (traceable, not jitted): `gather_batch`, then
    `dense_decode_attention`."""
    k, v = gather_batch(cache, block_tables, seq_lens, loop=loop, seq_ids=seq_ids, backend="xla")
    return dense_decode_attention(q, k, v, seq_lens)


@functools.partial(jax.jit, static_argnames=("loop", "backend"))
def paged_decode_attention(
    q, cache: PagedKVCache, block_tables, seq_lens, *, loop: int, seq_ids=None, backend="auto"
) -> jnp.ndarray:
    """Decode attention of q [B, Hq, D] (one token per sequence) over loop `loop` of the
    paged cache; float32 [B, Hq, D].

    block_tables: int32 [max_seqs, max_pages_per_seq], the table `append` uses; seq_ids:
    int32 [B] sequence slots (default 0..B-1); seq_lens: int32 [B] tokens attended, each in
    [1, cache.seq_lens[loop, seq]] (not checked: no host sync). backend (static): "xla" is the
    reference path: it reconstructs KV padded to max_pages_per_seq * page_size rows
    (`gather_batch`), then `dense_decode_attention`. "pallas" / "pallas_interpret" run the
    fused kernel of `kvq_jax.kernels.paged_attention` (dequantizes pages in registers; equal
    to the reference to float32 round-off); "auto" (default) takes the kernel on a CUDA GPU
    for configurations it supports, else the reference (always the reference on CPU).
    """
    check_decode_args(q, cache, block_tables, seq_lens, loop=loop, seq_ids=seq_ids)
    if backend != "xla":
        from kvq_jax.kernels.paged_attention import api  # here: the kernels import this module

        if api.choose_backend(q, cache, block_tables, loop=loop, backend=backend) != "xla":
            return api.paged_decode_attention(
                q, cache, block_tables, seq_lens, loop=loop, seq_ids=seq_ids, backend=backend
            )
    return xla_paged_decode_attention(q, cache, block_tables, seq_lens, loop=loop, seq_ids=seq_ids)
