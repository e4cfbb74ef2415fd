"""Decode attention over a torch `PagedKVCache` (mirrors kvq_jax.cache.paged_attention): the
reference, not a kernel.

`paged_decode_attention` reconstructs every sequence's K and V (`paged_cache.reconstruct`,
vectorized over the batch, masked to the block-table length) and runs `dense_decode_attention`
on them, so it equals dense attention on the reconstructed KV by construction. The products
are float32 multiplies and sums (no matmul), so the result does not depend on Torch's TF32
settings; it matches kvq_jax's (HIGHEST precision) to float32 round-off, not bit for bit.
"""

from __future__ import annotations

import math

import torch

from kvq_jax.core import checks
from kvq_torch_bridge.cache.paged_cache import PagedKVCache, _check_cache, _index_tensor, batch_rows
from kvq_torch_bridge.codecs._dtypes import meta

__all__ = ["dense_decode_attention", "paged_decode_attention"]


@torch.no_grad()
def dense_decode_attention(q, k, v, seq_lens) -> torch.Tensor:
    """One query token per sequence over unquantized KV (kvq_jax's `dense_decode_attention`).

    Args:
      q: torch [B, Hq, D]; Hq a multiple of H (GQA: query head i reads KV head i // (Hq // H)).
      k, v: torch [B, T, H, D] on q's device.
      seq_lens: int32 [B], 1 <= seq_lens <= T; tokens >= seq_len are masked out.

    Returns softmax(q k^T / sqrt(D)) v as float32 [B, Hq, D], computed in float32 (a sequence
    with seq_len 0 gives NaN).
    """
    q, k, v = torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v)
    checks.check_dense_attention_args(meta(q), meta(k), meta(v), meta(seq_lens))
    return _attend(q, k, v, seq_lens)


def _attend(q, k, v, seq_lens) -> torch.Tensor:
    """`dense_decode_attention` without the argument checks."""
    q = torch.as_tensor(q)
    b, t, h, d = k.shape
    hq = q.shape[1]
    device = k.device
    g = hq // h
    qf = q.to(device=device, dtype=torch.float32).reshape(b, h, g, 1, d)
    kf = k.to(torch.float32).permute(0, 2, 1, 3)[:, :, None]  # [B, H, 1, T, D]
    vf = v.to(torch.float32).permute(0, 2, 1, 3)[:, :, None]
    scores = (qf * kf).sum(dim=-1)  # [B, H, G, T]
    scores = scores * torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32, device=device)
    lens = _index_tensor(seq_lens, device).to(torch.int64)
    mask = torch.arange(t, device=device)[None, :] < lens[:, None]  # [B, T]
    scores = torch.where(mask[:, None, None, :], scores, -torch.inf)
    probs = torch.softmax(scores, dim=-1)
    out = (probs[..., None] * vf).sum(dim=-2)  # [B, H, G, D]
    return out.reshape(b, hq, d)


@torch.no_grad()
def paged_decode_attention(
    q, cache: PagedKVCache, block_tables, seq_lens, *, loop: int, seq_ids=None
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] (one token per sequence) over loop `loop` of the paged
    cache; float32 [B, Hq, D] (kvq_jax's `paged_decode_attention`, see it for the arguments).
    seq_lens are not checked against the cache (no host sync). Reference path: `gather_batch`
    then `dense_decode_attention`."""
    config = _check_cache(cache)
    b = checks.check_decode_args(config, meta(q), meta(block_tables), meta(seq_lens), loop,
                                 meta(seq_ids))  # fmt: skip
    k, v = batch_rows(cache, block_tables, seq_lens, seq_ids, b, loop)
    return _attend(q, k, v, seq_lens)
