"""One decode step of a serving engine over the append-time quantized paged cache.

    python bench/paged.py [--quick] [--json PATH] [--context N] [--batch B] [--loops L]

Ouro-1.4B shapes: B = 8 sequences, context 4096, H = 16 KV heads, D = 128, Hq = 16 query
heads (Ouro has no GQA: Hq = H, group 1), page size 16, bf16. The physical pages of the B
sequences are a random permutation of the pool (P = B * context / 16 pages), so the block
tables are not contiguous.

Setup (not timed): every loop l of each sequence gets `context - 1` tokens through ONE
`append` call per loop (the prefill path: B x 255 pages quantized at once, loop l > 0 as
residual deltas against loop l - 1), so the last page of each sequence holds 15 staged rows.
Loop l's KV is loop l - 1's plus noise of 0.3 x its scale (successive loops are correlated).

Timed, per format (median of N jitted runs, each blocked until ready):
  append        one decode token per sequence (B x [1, H, D]) into loop `loop`: it fills the
                partial page, which is quantized (loop 0: pack_kv; loop l: the residual against
                the reconstructed loop l - 1 page). The cache is donated (append's default) and
                each run appends to the previous run's result (a serving engine's in-place
                update; the block table has spare pages for the timed tokens).
  attention     `paged_decode_attention` over the `context` tokens of loop `loop` (the cache
                right after the timed token was appended; q [B, Hq, D] bf16). This is the
                REFERENCE path: it reconstructs every page (through the residual chain for
                loop > 0) with XLA, then attends; no fused kernel.
  bf16 paged    the unquantized baseline in the same process: bf16 pages [P, 16, H, D] gathered
                through the same block tables, then `dense_decode_attention` (same math).

KV bytes read per step (what a fused kernel must read; the reference path reads as much, plus
what it materializes): quantized = B x pages x (K + V packed bytes of a page: codes, scales,
zero points, NVFP4 page global scale) + the B staging pages (bf16, K and V) + sink rows
(none here, sink = 0) + for loop l > 0 the l residual planes of those pages ("+resid" column);
bf16 = 2 bytes x B x context x H x D x 2 (K and V). The error column is the max |out - ref| /
max |ref| of the attention output against the bf16 baseline on the same (unquantized) KV.
"""

from __future__ import annotations

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing

import kvq_jax
from kvq_jax.cache.paged_attention import dense_decode_attention, paged_decode_attention
from kvq_jax.cache.paged_cache import PagedCacheConfig, append, check_append, init_cache

HEADS, HEAD_DIM, Q_HEADS, PAGE = 16, 128, 16, 16
FORMATS = {
    # name: (K base/residual format, V base/residual format, K group, V group)
    "int4 (K tok G16, V ch G64)": ("int4", "int4", 16, 64),
    "nvfp4": ("nvfp4", "nvfp4", None, None),
}
COLUMNS = (
    ("format", "format", None),
    ("loop", "loop", None),
    ("op", "op", None),
    ("ms", "ms/step", ".3f"),
    ("x_bf16", "x bf16", ".2f"),
    ("kv_read_mb", "KV read MB", ".3f"),
    ("resid_mb", "+resid MB", ".3f"),
    ("bytes_ratio", "bytes/bf16", ".4f"),
    ("rel_err", "rel err", ".2e"),
)


def _loop_data(key, loops, shape):
    """[loops, *shape] bf16 K or V: loop l = loop l - 1 + 0.3 * noise."""
    x = jax.random.normal(key, (loops, *shape), jnp.float32)
    x = jnp.cumsum(x * jnp.float32([1.0] + [0.3] * (loops - 1)).reshape(-1, 1, 1, 1, 1), axis=0)
    return x.astype(jnp.bfloat16)


def _packed_page_bytes(packed) -> int:
    """Bytes of one page of a packed store (batch shape (..., P))."""
    return packed.storage_bytes // int(np.prod(packed.batch_shape))


def _make_step(loop):
    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, k, v, block_tables, seq_ids):
        return append(cache, k, v, block_tables=block_tables, seq_ids=seq_ids, loop=loop)

    return step


@jax.jit
def _bf16_paged_attention(q, k_pages, v_pages, block_tables, seq_lens):
    """Unquantized baseline: gather bf16 pages through the block table, then attend."""
    b, n = block_tables.shape
    shape = (b, n * k_pages.shape[1], *k_pages.shape[2:])
    k = k_pages[block_tables].reshape(shape)
    v = v_pages[block_tables].reshape(shape)
    return dense_decode_attention(q, k, v, seq_lens)


def bench(args, warmup: int, repeats: int) -> list[dict]:
    b, ctx, loops = args.batch, args.context, args.loops
    if ctx % PAGE:
        raise SystemExit(f"--context must be a multiple of {PAGE}")
    pages_per_seq = ctx // PAGE
    table_pages = pages_per_seq + -(-(warmup + repeats + 2) // PAGE)  # + the timed tokens
    num_pages = b * table_pages
    rng = np.random.default_rng(0)
    tables = rng.permutation(num_pages).astype(np.int32).reshape(b, table_pages)
    block_tables = jnp.asarray(tables)
    attn_tables = block_tables[:, :pages_per_seq]
    seq_ids = jnp.arange(b, dtype=jnp.int32)
    seq_lens = jnp.full((b,), ctx, jnp.int32)

    keys = jax.random.split(jax.random.key(0), 3)
    extra = warmup + repeats + 1  # tokens past the context: loops < l get them before loop l
    shape = (b, ctx + extra, HEADS, HEAD_DIM)
    k_all = _loop_data(keys[0], loops, shape)  # [L, B, ctx + extra, H, D] bf16
    v_all = _loop_data(keys[1], loops, shape)
    q = jax.random.normal(keys[2], (b, Q_HEADS, HEAD_DIM), jnp.bfloat16)

    def bf16_pool(x):  # [B, ctx, H, D] -> pages [P, 16, H, D] at the block-table positions
        pool = jnp.zeros((num_pages, PAGE, HEADS, HEAD_DIM), jnp.bfloat16)
        return pool.at[attn_tables.reshape(-1)].set(x.reshape(-1, PAGE, HEADS, HEAD_DIM))

    bf16_bytes = 2 * b * ctx * HEADS * HEAD_DIM * 2
    rows = []
    timed_loops = sorted({0, loops - 1})
    baseline = {}
    for loop in timed_loops:
        kp, vp = bf16_pool(k_all[loop, :, :ctx]), bf16_pool(v_all[loop, :, :ctx])
        ref = jax.block_until_ready(_bf16_paged_attention(q, kp, vp, attn_tables, seq_lens))
        t = _timing.median_time(
            _bf16_paged_attention, q, kp, vp, attn_tables, seq_lens,
            warmup=warmup, repeats=repeats,
        )  # fmt: skip
        baseline[loop] = (ref, t.median_s)
        rows.append(
            dict(format="bf16 (unquantized)", loop=loop, op="paged attention",
                 ms=t.median_ms, x_bf16=1.0, kv_read_mb=bf16_bytes / 1e6, resid_mb=0.0,
                 bytes_ratio=1.0, rel_err=0.0)
        )  # fmt: skip
        del kp, vp

    for name, (kf, vf, kg, vg) in FORMATS.items():
        config = PagedCacheConfig(
            num_pages=num_pages, page_size=PAGE, num_heads=HEADS, head_dim=HEAD_DIM,
            dtype=jnp.bfloat16, num_loops=loops, k_base_format=kf, k_residual_format=kf,
            v_base_format=vf, v_residual_format=vf, k_group_size=kg, v_group_size=vg,
            max_seqs=b,
        )  # fmt: skip
        cache = init_cache(config)
        for loop in range(loops):  # prefill: context - 1 tokens, one append call per loop
            cache = append(
                cache, k_all[loop, :, : ctx - 1], v_all[loop, :, : ctx - 1],
                block_tables=block_tables, seq_ids=seq_ids, loop=loop,
            )  # fmt: skip
        cache = jax.block_until_ready(cache)
        page_bytes = _packed_page_bytes(cache.k_base) + _packed_page_bytes(cache.v_base)
        delta_bytes = (
            _packed_page_bytes(cache.k_delta) + _packed_page_bytes(cache.v_delta)
            if loops > 1
            else 0
        )
        stage_bytes = 2 * b * PAGE * HEADS * HEAD_DIM * 2  # K and V staging pages, bf16
        sink_bytes = 2 * b * config.sink * HEADS * HEAD_DIM * 2
        for loop in timed_loops:
            # The decode token of this loop: position ctx - 1 (completes the last page). Loops
            # < loop first get positions ctx - 1 .. ctx + extra - 2, so every timed append of
            # loop `loop` takes its delta against complete pages (the looped-LM order).
            for lower in range(loop):
                if int(cache.seq_lens[lower, 0]) < ctx - 1 + extra:
                    sl = slice(ctx - 1, ctx - 1 + extra)
                    cache = append(
                        cache, k_all[lower, :, sl], v_all[lower, :, sl],
                        block_tables=block_tables, seq_ids=seq_ids, loop=lower,
                    )  # fmt: skip
            k_tok, v_tok = k_all[loop, :, ctx - 1 : ctx], v_all[loop, :, ctx - 1 : ctx]
            step = _make_step(loop)
            check_append(cache, k_tok, v_tok, block_tables=block_tables, seq_ids=seq_ids, loop=loop)
            # Attention input: the cache right after this token (computed before donation).
            after = jax.block_until_ready(
                append(cache, k_tok, v_tok, block_tables=block_tables, seq_ids=seq_ids,
                       loop=loop, donate=False)
            )  # fmt: skip
            out = paged_decode_attention(q, after, attn_tables, seq_lens, loop=loop)
            ref, ref_s = baseline[loop]
            rel_err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
            t_attn = _timing.median_time(
                paged_decode_attention, q, after, attn_tables, seq_lens, loop=loop,
                warmup=warmup, repeats=repeats,
            )  # fmt: skip
            del after
            # Chained donated appends from a copy (the prefilled cache is kept for later loops).
            state = [jax.tree.map(jnp.copy, cache)]

            def run_step(state=state, step=step, k_tok=k_tok, v_tok=v_tok):
                state[0] = step(state[0], k_tok, v_tok, block_tables, seq_ids)
                return state[0]

            t_app = _timing.median_time(run_step, warmup=warmup, repeats=repeats)
            del state
            resid = b * pages_per_seq * delta_bytes * loop
            quant_bytes = b * pages_per_seq * page_bytes + stage_bytes + sink_bytes + resid
            common = dict(format=name, loop=loop, resid_mb=resid / 1e6)
            rows.append(
                dict(common, op="append (1 tok/seq)", ms=t_app.median_ms,
                     x_bf16=t_app.median_s / ref_s, kv_read_mb=None, bytes_ratio=None)
            )  # fmt: skip
            rows.append(
                dict(common, op="paged attention", ms=t_attn.median_ms,
                     x_bf16=t_attn.median_s / ref_s, kv_read_mb=quant_bytes / 1e6,
                     bytes_ratio=quant_bytes / bf16_bytes, rel_err=rel_err)
            )  # fmt: skip
        del cache
    return rows


def main(argv=None) -> int:
    parser = _timing.bench_parser(__doc__)
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences")
    parser.add_argument("--loops", type=int, default=4, help="loops in the cache (times 0, L-1)")
    args = parser.parse_args(argv)
    warmup, repeats = _timing.repeat_counts(args, quick=(1, 5), full=(2, 15))

    header = _timing.device_header()
    print(header)
    print(
        f"kvq {kvq_jax.__version__}; B={args.batch} context={args.context} H={HEADS} "
        f"Hq={Q_HEADS} D={HEAD_DIM} page={PAGE} bf16, {args.loops}-loop cache; median of "
        f"{repeats} runs after {warmup} warm-up; x bf16 = time / bf16 paged attention time "
        f"(same loop); attention = reconstruct-then-attend reference path"
    )
    rows = bench(args, warmup, repeats)
    _timing.report(
        args,
        header,
        rows,
        COLUMNS,
        warmup=warmup,
        repeats=repeats,
        batch=args.batch,
        context=args.context,
        loops=args.loops,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
