"""Independent references for the paged cache: the unfused composition of the public codec
functions, one page and one sequence at a time (eager Python loops, no vmap, no shared code
with the paths under test), and float64 NumPy attention."""

from __future__ import annotations

import jax
import numpy as np

from kvq_jax.codecs.api import unpack_kv
from kvq_jax.codecs.cache_state import codec_view
from kvq_jax.codecs.residual import KVResidual, decode_residual
from kvq_jax.core.rope import rope_tables


def reference_pages(cache, kind: str, loop: int, pages) -> np.ndarray:
    """Loop `loop` of physical `pages` [N], page by page with the public codec functions:
    `unpack_kv` of the page in the first loop read (0, or the last loop at or before `loop`
    that the config stores absolute), then per later loop `unpack_kv` of its page when stored
    absolute, else `decode_residual` of its delta; [N, page_size, H, D]."""
    absolute = cache.config.absolute_loops(kind)
    start = max((a for a in absolute if a <= loop), default=0)
    out = []
    for page in np.asarray(pages).tolist():
        recon = None
        for i in range(start, loop + 1):
            plane, level = cache.loop_plane(kind, i)
            at = (page,) if level is None else (level, page)
            payload = jax.tree.map(lambda a, at=at: a[at], codec_view(plane))
            if recon is None or i in absolute:
                recon = unpack_kv(payload, layer=cache.layer)
            else:
                recon = decode_residual(KVResidual(payload=payload, shape=recon.shape), recon)
        out.append(np.asarray(recon))
    ps, h, d = cache.config.page_shape
    return np.stack(out) if out else np.zeros((0, ps, h, d), np.dtype(cache.config.dtype))


def reference_sequence(cache, kind: str, loop: int, table_row, slot: int, length: int):
    """The rows a sequence attends in `loop`: [length, H, D] in the cache dtype. Complete pages
    (`reference_pages`; keys stored before RoPE with RoPE put back, `numpy_rope`), then the
    staging rows of the partial page, the raw sink rows over the first `sink` positions."""
    config = cache.config
    ps = config.page_size
    stored = int(np.asarray(cache.seq_lens)[loop, slot])
    prefix = "k" if kind == "key" else "v"
    full = stored // ps
    pages = reference_pages(cache, kind, loop, np.asarray(table_row)[:full]).reshape(
        full * ps, *config.page_shape[1:]
    )
    if kind == "key" and config.rope_theta is not None:
        pages = numpy_rope(pages, config.rope_theta)
    rows = [pages]
    rows.append(np.asarray(getattr(cache, f"{prefix}_stage"))[loop, slot, : stored - full * ps])
    out = np.concatenate(rows)
    n_sink = min(config.sink, stored)
    out[:n_sink] = np.asarray(getattr(cache, f"{prefix}_sink"))[loop, slot, :n_sink]
    return out[:length]


def numpy_rope(rows, theta: float) -> np.ndarray:
    """FORMAT.md 5b's apply_rope of rows [T, H, D] at positions 0..T-1 in NumPy: binary64
    x * cos + rotate_half(x) * sin of the float32 rows and the float32 tables (`rope_tables`),
    rounded to float32, then to the rows' dtype."""
    t, _, d = rows.shape
    cos, sin = (a.astype(np.float64) for a in rope_tables(t, d, theta))
    x = np.asarray(rows).astype(np.float32).astype(np.float64)
    half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return (x * cos + half * sin).astype(np.float32).astype(rows.dtype)


def numpy_decode_attention(q, ks, vs) -> np.ndarray:
    """softmax(q k^T / sqrt(D)) v per sequence in float64 (GQA), as float32 [B, Hq, D]; ks, vs
    are lists of [T_b, H, D] arrays."""
    q = np.asarray(q, np.float64)
    b, hq, d = q.shape
    out = np.empty((b, hq, d))
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
        g = hq // k.shape[1]
        kh, vh = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [T, Hq, D]
        s = np.einsum("hd,thd->ht", q[i], kh) / np.sqrt(d)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[i] = np.einsum("ht,thd->hd", p / p.sum(axis=1, keepdims=True), vh)
    return out.astype(np.float32)


def reference_attention(q, cache, block_tables, seq_lens, *, loop: int, seq_ids=None):
    """Paged decode attention from `reference_sequence` and `numpy_decode_attention`."""
    tables, lens = np.asarray(block_tables), np.asarray(seq_lens)
    ids = np.arange(len(lens)) if seq_ids is None else np.asarray(seq_ids)
    ks, vs = [], []
    for slot, length in zip(ids.tolist(), lens.tolist(), strict=True):
        row = tables[slot]
        ks.append(reference_sequence(cache, "key", loop, row, slot, length))
        vs.append(reference_sequence(cache, "value", loop, row, slot, length))
    return numpy_decode_attention(q, ks, vs)
