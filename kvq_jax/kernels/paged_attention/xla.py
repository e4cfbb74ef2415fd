"""The XLA path of quantized paged decode attention, block of pages by block of pages.

`paged_decode_attention` never materializes a sequence's reconstructed K/V: it runs an online
softmax (running max, running sum, rescaled float32 accumulator) over
  - the sink rows (raw, positions 0 .. sink - 1),
  - the staging page (raw rows of the partial page, positions from (stored // ps) * ps),
  - the quantized pages, `block_pages` at a time: each block is decoded through the residual
    chain up to `loop` (`page_reconstruct.xla.decode_pages`, adaptive-exit depth map
    included), attended, and dropped before the next (a `lax.fori_loop` that stops after the
    last block any sequence attends),
with every row masked to the positions the reference reads it at: so peak memory is one block
of pages, whatever the context. The rows and masks are those of
`cache_state.read_batch` (`paged_decode_attention_reference`: reconstruct every page, then
dense attention), which it equals to float32 round-off.

Values stored in a Hadamard-rotated format in every loop the chain reads (HINT4 / HINT2,
FORMAT.md 2c) are attended in the rotated space: the quantized rows are decoded without their
inverse rotation (`decode_pages(rotated=True)`), the raw sink and staging rows are attended
as they are, in one update, and their part of the output (sum of p v, [B, H, G, D]) is
rotated (`OnlineSoftmax.update(value_map=rotate)`), and the output is un-rotated once per
query head. The rotation is linear, so this is the same attention up to rounding, without a
butterfly per value row; the reference rounds each decoded row to the cache dtype first, so
for a bfloat16 or float16 cache the two differ by that rounding (float32 caches: float32
round-off).

Keys stored before RoPE (`PagedCacheConfig.rope_theta`) get RoPE back block by block, at
their positions, in float32 arithmetic rounded to the cache dtype (`apply_rope_halves`, as the
attention kernel turns them): within 2 ulps of the reference's binary64 rotation
(`cache_state.rope_keys`), and the scores are taken on the two halves (XLA:CPU evaluates a
concatenation element by element).

Heavy rows in K and V (FORMAT.md 5a) are attended as stored: each page's payload rows and its
heavy rows, each masked and turned at its own per-head position, not put back in order (a
softmax is the same in any order of its rows): no payload spread, no scatter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvq_jax.codecs import cache_state
from kvq_jax.codecs.attention import OnlineSoftmax, attend, default_block_pages
from kvq_jax.codecs.formats.hadamard import rotate, unrotate
from kvq_jax.codecs.formats.heavy_rows import payload_positions
from kvq_jax.codecs.rope import apply_rope_halves
from kvq_jax.kernels.page_reconstruct import xla as page_xla


def paged_decode_attention_reference(q, cache, block_tables, seq_lens, seq_ids, *, loop: int):
    """Reconstruct every attended page (`cache_state.read_batch` with the XLA page decoder),
    then dense float32 attention at HIGHEST precision (`kvq_jax.codecs.attention.attend`).

    Same arguments and result as `paged_decode_attention`; peak memory grows with the context
    (the whole reconstructed K and V of every sequence). Kept as the reference the blockwise
    path is tested against.
    """

    def decode(kind, pages):
        chain = cache.loop_chain(kind, loop)
        return page_xla.decode_pages(chain, pages, depth=cache.depth, layer=cache.layer)

    rows = cache_state.table_rows(block_tables, seq_ids)
    k, v = cache_state.read_batch(cache, rows, seq_lens, seq_ids, loop=loop, decode=decode)
    return attend(q, k, v, seq_lens)


def paged_decode_attention(
    q, cache, block_tables, seq_lens, seq_ids, *, loop: int, block_pages: int | None = None,
    return_lse: bool = False,
):  # fmt: skip
    """Validated arguments (seq_ids an int32 [B] array) -> float32 [B, Hq, D] (traceable).

    q [B, Hq, D]; block_tables int32 [max_seqs, M]; seq_lens int32 [B] (rows attended, each
    <= the stored length of its slot in `loop`; 0: no row, the output is 0); block_pages
    (static): quantized pages decoded per step (None: `default_block_pages`); return_lse:
    also return the scores' log-sum-exp float32 [B, Hq] (-inf for no row), to merge with
    other keys. See the module doc.
    """
    config = cache.config
    ps, sink = config.page_size, config.sink
    b, hq, d = q.shape
    h = config.num_heads
    block_pages = default_block_pages(ps) if block_pages is None else int(block_pages)
    if block_pages < 1:
        raise ValueError(f"block_pages must be >= 1, got {block_pages}")

    rows = cache_state.table_rows(block_tables, seq_ids)  # [B, M]
    m_pages = rows.shape[1]
    block_pages = min(block_pages, m_pages)  # a short table: one block, no padded pages
    n_blocks = -(-m_pages // block_pages)
    pad = n_blocks * block_pages - m_pages
    rows = jnp.pad(rows, ((0, 0), (0, pad)), constant_values=-1)
    page_ids = jnp.clip(rows, 0, config.num_pages - 1)

    length = jnp.asarray(seq_lens, jnp.int32)  # [B]
    stored = cache.seq_lens[loop][seq_ids]  # [B]
    n_sink = min(sink, m_pages * ps)
    full_end = (stored // ps) * ps  # rows below come from complete (quantized) pages
    stage_start = full_end  # the partial page, if any, is staged
    limit = jnp.minimum(length, full_end)  # quantized rows attended: [n_sink, limit)

    by_row = page_xla.costly_chain(cache.loop_chain("key", loop))
    soft = OnlineSoftmax(jnp.asarray(q, jnp.float32).reshape(b, h, hq // h, d), keys_by_row=by_row)
    state = soft.init()
    rotated = page_xla.rotated_chain(cache.loop_chain("value", loop))

    def raw_rows(stage_or_sink):
        return stage_or_sink[loop][seq_ids]  # [B, n, H, D]

    # The raw rows (the staging page's, and the sink's before them) in one update; their
    # values attended as they are, their part of the output rotated (rotated values).
    stage_pos = stage_start[:, None] + jnp.arange(ps)[None, :]
    raw_valid = ((stage_pos >= n_sink) & (stage_pos < length[:, None])
                 & (stage_start < m_pages * ps)[:, None])  # fmt: skip
    raw_k, raw_v = raw_rows(cache.k_stage), raw_rows(cache.v_stage)
    if n_sink:
        sink_pos = jnp.arange(n_sink)[None, :]
        sink_valid = sink_pos < jnp.minimum(length, stored)[:, None]
        raw_valid = jnp.concatenate([sink_valid, raw_valid], 1)
        raw_k = jnp.concatenate([raw_rows(cache.k_sink)[:, :n_sink], raw_k], axis=1)
        raw_v = jnp.concatenate([raw_rows(cache.v_sink)[:, :n_sink], raw_v], axis=1)
    state = soft.update(state, raw_k, raw_v, raw_valid, rotate if rotated else None)

    block_tokens = block_pages * ps
    # pre-RoPE keys: the tables of every position, constants of the program (static positions)
    rope = cache_state.key_rope(config, np.arange(n_blocks * block_tokens))

    def decode(kind, pages):
        chain = cache.loop_chain(kind, loop)
        out = page_xla.decode_pages(chain, pages, depth=cache.depth, layer=cache.layer,
                                    rotated=rotated and kind == "value")  # fmt: skip
        return out.reshape(b, block_tokens, h, d)

    def body(j, state):
        pages = _block_pages(page_ids, j, block_pages)
        pos = j * block_tokens + jnp.arange(block_tokens)[None, :]
        valid = (pos >= n_sink) & (pos < limit[:, None])
        keys = decode("key", pages)
        if rope is not None:  # keys stored before RoPE: put back at their positions
            block = [lax.dynamic_slice_in_dim(a, j * block_tokens, block_tokens) for a in rope]
            keys = tuple(a.astype(config.dtype) for a in apply_rope_halves(keys, *block))
        return soft.update(state, keys, decode("value", pages), valid)

    step = body
    group = page_xla.heavy_chain(cache.loop_chain("key", loop))
    if group is not None and page_xla.heavy_chain(cache.loop_chain("value", loop)) == group:
        step = _heavy_body(cache, loop, soft, page_ids, limit, rope, group=group,
                           n_blocks=n_blocks, block_pages=block_pages, n_sink=n_sink,
                           rotated=rotated)  # fmt: skip

    # Blocks past every sequence's last quantized row are never decoded.
    needed = jnp.minimum((jnp.max(limit) + block_tokens - 1) // block_tokens, n_blocks)
    state = jax.lax.fori_loop(0, needed, step, state)
    out = soft.finish(state)  # [B, H, G, D]
    out = (unrotate(out) if rotated else out).reshape(b, hq, d)
    if not return_lse:
        return out
    lse = soft.lse(state).reshape(b, hq)
    return jnp.where(jnp.isfinite(lse)[..., None], out, 0.0), lse


def _block_pages(page_ids, j, block_pages: int):
    """int32 [B * block_pages]: the physical pages of block j of every sequence's table
    `page_ids` [B, M], sequence by sequence."""
    return lax.dynamic_slice_in_dim(page_ids, j * block_pages, block_pages, axis=1).reshape(-1)


def _heavy_body(cache, loop, soft, page_ids, limit, rope, *, group, n_blocks, block_pages,
                n_sink, rotated):  # fmt: skip
    """The loop body of `paged_decode_attention` over heavy rows in K and V (the same rows,
    FORMAT.md 5a): each page's payload rows and heavy rows attended as stored
    (`decode_heavy_parts`), each row masked (and, for keys stored before RoPE, turned) at its
    own per-head position, not put back in order (a softmax over rows is the same in any
    order): no payload spread, no scatter of the heavy rows. rope: `key_rope`'s tables of
    every position (None: keys stored after RoPE)."""
    config = cache.config
    ps, b = config.page_size, page_ids.shape[0]
    block_tokens = block_pages * ps
    key_chain, value_chain = (cache.loop_chain(kind, loop) for kind in ("key", "value"))
    n_payload = block_pages * (ps - ps // group)  # payload rows of a block of pages
    if rope is not None:
        # A payload row's position is its place without the heavy row of its group (static,
        # `fixed`) or one more: its tables are one of two constants', chosen per head.
        in_page = np.arange(ps).reshape(ps // group, group)[:, : group - 1].reshape(-1)
        fixed = (np.arange(n_blocks * block_pages)[:, None] * ps + in_page).reshape(-1)
        tables = [cache_state.key_rope(config, fixed + i) for i in (0, 1)]

    def keys(k, pos, j, payload: bool):
        """Key rows [B, n, H, D] at positions pos [B, n, H]: as they are, or (keys before
        RoPE) RoPE's two halves, for scores taken on the halves."""
        if rope is None:
            return k.astype(config.dtype)
        if payload:  # [1, n, 1, D / 2] tables of the fixed place and of one more
            here, after = ([lax.dynamic_slice_in_dim(a, j * n_payload, n_payload)[None]
                            for a in t] for t in tables)  # fmt: skip
            start = lax.dynamic_slice_in_dim(jnp.asarray(fixed, jnp.int32), j * n_payload,
                                             n_payload)  # fmt: skip
            moved = (pos > start[None, :, None])[..., None]
            turn = [jnp.where(moved, a1, a0) for a0, a1 in zip(here, after, strict=True)]
        else:  # a few rows per page: their tables gathered
            turn = [a[:, 0][pos] for a in rope]
        return tuple(a.astype(config.dtype) for a in apply_rope_halves(k, *turn))

    def body(j, state):
        pages = _block_pages(page_ids, j, block_pages)
        kp, kh, rows = page_xla.decode_heavy_parts(key_chain, pages, layer=cache.layer)
        vp, vh, _ = page_xla.decode_heavy_parts(value_chain, pages, rotated=rotated)
        # each page's first position, [B * block_pages, 1, 1]
        first = j * block_tokens + jnp.tile(jnp.arange(block_pages) * ps, b)[:, None, None]
        payload = jax.vmap(payload_positions, (0, None, None))(rows, group, ps) + first
        heavy = jnp.arange(rows.shape[1])[None, :, None] * group + rows + first
        rows_k, rows_v, masks = [], [], []
        for k, v, pos, is_payload in ((kp, vp, payload, True), (kh, vh, heavy, False)):
            k, v, pos = (a.reshape(b, -1, *a.shape[2:]) for a in (k, v, pos))  # [B, n, ...]
            k = keys(k, pos, j, is_payload)
            rows_k.append(k if isinstance(k, tuple) else (k,))
            rows_v.append(v if rotated else v.astype(config.dtype))
            masks.append((pos >= n_sink) & (pos < limit[:, None, None]))  # [B, n, H]
        # one update over the payload and heavy rows (a second costs XLA:CPU more than the
        # concatenation)
        k = tuple(jnp.concatenate(parts, axis=1) for parts in zip(*rows_k, strict=True))
        k = k if len(k) > 1 else k[0]
        return soft.update(state, k, *(jnp.concatenate(a, axis=1) for a in (rows_v, masks)))

    return body


__all__ = ["paged_decode_attention", "paged_decode_attention_reference"]
