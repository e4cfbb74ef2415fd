"""Attention over a `ServingKVCache` as vLLM's attention backends call it: decode by block
tables and sequence lengths, chunked prefill by `cu_seqlens`. The reference path (blocks read
with `kv_cache.read_blocks`: packed blocks decoded, open blocks from their staging rows, then
float32 attention), not a kernel; GQA (query head i reads KV head i // (Hq // H)).
"""

from __future__ import annotations

import math

import torch

from kvq_torch_bridge.serving.kv_cache import (
    ServingKVCache,
    _check_cache,
    _check_tokens,
    host_checks,
    read_blocks,
)

__all__ = ["paged_attention_decode", "paged_attention_prefill"]


def _check_tables(cache: ServingKVCache, block_tables, seq_lens, batch: int):
    for name, x in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32 / int64 torch.Tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")  # fmt: skip
        if x.device != cache.device:
            raise ValueError(f"{name} is on {x.device}, the cache on {cache.device}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [{batch}, max_blocks], got "
                         f"{tuple(block_tables.shape)}")  # fmt: skip
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [{batch}], got {tuple(seq_lens.shape)}")
    if host_checks(seq_lens) and batch:  # host memory: checked without a sync
        cap = block_tables.shape[1] * cache.block_size
        if bool(((seq_lens < 1) | (seq_lens > cap)).any()):
            raise ValueError(f"seq_lens must lie in [1, {cap}] (max_blocks x block_size), got "
                             f"{seq_lens.tolist()}")  # fmt: skip
        used = (seq_lens + cache.block_size - 1) // cache.block_size
        live = torch.arange(block_tables.shape[1])[None, :] < used[:, None]
        bad = live & ((block_tables < 0) | (block_tables >= cache.num_blocks))
        if bool(bad.any()):
            raise ValueError(f"block_tables points outside the {cache.num_blocks} blocks: "
                             f"{int(block_tables[bad][0])}")  # fmt: skip


def _check_query(name, q, cache: ServingKVCache, ndim_tokens: int = 1) -> int:
    if not isinstance(q, torch.Tensor) or not q.is_floating_point():
        raise TypeError(f"{name} must be a floating torch.Tensor")
    if q.ndim != 3 or q.shape[2] != cache.head_size or q.shape[1] % cache.num_kv_heads:
        raise ValueError(f"{name} must be [tokens, num_heads, {cache.head_size}] with num_heads "
                         f"a multiple of {cache.num_kv_heads}, got {tuple(q.shape)}")  # fmt: skip
    if q.device != cache.device:
        raise ValueError(f"{name} is on {q.device}, the cache on {cache.device}")
    return q.shape[1]


def _scale(scale, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise ValueError(f"scale must be a positive float or None, got {scale!r}")
    return float(scale)


def _context(cache, block_tables) -> tuple[torch.Tensor, torch.Tensor]:
    tables = block_tables.to(torch.int64).clamp(0, cache.num_blocks)  # unused entries: any block
    return read_blocks(cache, tables)


@torch.no_grad()
def paged_attention_decode(query, cache: ServingKVCache, block_tables, seq_lens, *, scale=None):
    """One query token per sequence. query [num_seqs, num_heads, head_size]; block_tables
    int [num_seqs, max_blocks]; seq_lens int [num_seqs] (tokens in the cache, the new one
    included: it was written by `reshape_and_cache` first). Returns float32 [num_seqs,
    num_heads, head_size]: softmax(scale q k^T) v over each sequence's first seq_lens tokens
    (scale default 1 / sqrt(head_size))."""
    cache = _check_cache(cache)
    hq = _check_query("query", query, cache)
    b = query.shape[0]
    _check_tables(cache, block_tables, seq_lens, b)
    sc = _scale(scale, cache.head_size)
    k, v = _context(cache, block_tables)  # [B, T, H, D]
    h, d = cache.num_kv_heads, cache.head_size
    g = hq // h
    qf = query.float().reshape(b, h, g, d)
    scores = torch.einsum("bhgd,bthd->bhgt", qf, k.float()) * sc
    t = k.shape[1]
    mask = torch.arange(t, device=k.device)[None, :] < seq_lens.to(torch.int64)[:, None]
    scores = scores.masked_fill(~mask[:, None, None, :], -torch.inf)
    probs = torch.softmax(scores, dim=-1)
    # rows past a sequence's end may hold anything (an unused block: NaN from an empty NVFP4
    # page); a zero weight times NaN is NaN, so they are zeroed, not only weighted 0
    v = torch.where(mask[:, :, None, None], v.float(), 0.0)
    out = torch.einsum("bhgt,bthd->bhgd", probs, v)
    return out.reshape(b, hq, d)


@torch.no_grad()
def paged_attention_prefill(query, key, value, cache: ServingKVCache, cu_seqlens_q, block_tables,
                            seq_lens, *, scale=None):  # fmt: skip
    """Chunked prefill, causal. query [N, num_heads, head_size] and key / value [N,
    num_kv_heads, head_size]: the new tokens of every sequence, back to back
    (cu_seqlens_q int [num_seqs + 1], cu_seqlens_q[0] = 0, cu_seqlens_q[-1] = N); seq_lens
    [num_seqs]: each sequence's length with its new tokens; the first seq_lens - q_len tokens
    (the cached context) are read from the cache by block_tables, the new ones are `key` /
    `value` as given (raw). New token j of a sequence sits at position seq_len - q_len + j
    and attends to every earlier position and itself. Returns float32 [N, num_heads,
    head_size]."""
    cache = _check_cache(cache)
    hq = _check_query("query", query, cache)
    n = query.shape[0]
    _check_tokens("key", key, cache, n)
    _check_tokens("value", value, cache, n)
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.ndim != 1:
        raise TypeError("cu_seqlens_q must be an int torch.Tensor [num_seqs + 1]")
    b = cu_seqlens_q.shape[0] - 1
    _check_tables(cache, block_tables, seq_lens, b)
    cu = cu_seqlens_q.to(torch.int64)
    if host_checks(cu) and (int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] < cu[:-1]).any())):
        raise ValueError(f"cu_seqlens_q must rise from 0 to {n}, got {cu.tolist()}")
    sc = _scale(scale, cache.head_size)
    h, d = cache.num_kv_heads, cache.head_size
    g = hq // h
    lens = seq_lens.to(torch.int64)
    q_len = cu[1:] - cu[:-1]
    ctx_len = lens - q_len  # cached tokens before the new ones
    tok = torch.arange(n, device=query.device)
    seq = torch.searchsorted(cu[1:], tok, right=True)  # each new token's sequence
    pos = ctx_len[seq] + tok - cu[seq]  # its position
    k_ctx, v_ctx = _context(cache, block_tables)  # [B, T, H, D]
    t = k_ctx.shape[1]
    qf = query.float().reshape(n, h, g, d)
    s_ctx = torch.einsum("nhgd,nthd->nhgt", qf, k_ctx[seq].float()) * sc  # [N, H, G, T]
    m_ctx = torch.arange(t, device=query.device)[None, :] < ctx_len[seq][:, None]
    s_new = torch.einsum("nhgd,mhd->nhgm", qf, key.float()) * sc  # [N, H, G, N]
    m_new = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    s_ctx = s_ctx.masked_fill(~m_ctx[:, None, None, :], -torch.inf)
    s_new = s_new.masked_fill(~m_new[:, None, None, :], -torch.inf)
    scores = torch.cat([s_ctx, s_new], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    v_seq = torch.where(m_ctx[:, :, None, None], v_ctx[seq].float(), 0.0)  # see decode
    out = torch.einsum("nhgt,nthd->nhgd", probs[..., :t], v_seq)
    out = out + torch.einsum("nhgm,mhd->nhgd", probs[..., t:], value.float())
    return out.reshape(n, hq, d)
