"""The serving cache driven as a server drives it: decode-step cost against pool size, and the
throughput of swapping a sequence out to host memory / disk and back.

    python bench/cache_lifecycle.py [--quick] [--json PATH] [--pools 64,512,4096,8192]

Decode step (per pool size P, per cache format): B = 8 sequences of `--context` tokens
(H = 8 KV heads, D = 128, page 16, bf16, one loop) whose pages sit at random places of a
P-page pool. Timed, median of N runs, each blocked until ready:
  append     one token per sequence (`kvq_jax.cache.paged_cache.append`, donated: the cache is
             updated in place, each run appends to the previous run's result);
  attention  `paged_decode_attention` over the context (the XLA path on a CPU).
"bf16" is the unquantized baseline in the same process: a bf16 page pool updated in place by a
donated scatter (held as uint16 bits, as the cache holds E4M3 fields as uint8: XLA:CPU widens a
bf16 scatter to float32, copying the pool), attended by gathering its pages (the same math).
The append's time should not depend on P (flat from 64 to 8192 pages: "x_p64" is the ratio to
the 64-page pool).

Swap and save (per format): one sequence of `--swap-tokens` tokens in a 3-loop cache (every
loop plane, staging and sink rows), timed as
  swap out   `swap_out` (device -> host NumPy arrays),
  swap in    `swap_in` into other physical pages (host -> device, donated),
  save/load  `save_sequence` / `load_sequence` (safetensors, checksummed, page cache warm),
  copy       plain copies of the same bytes as one array: device -> a new host array (the
             reference of swap out and save) and host -> device (of swap in and load);
             "of copy" = copy time / op time (the four timed in interleaved rounds).
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing

from kvq_jax.cache.paged_attention import dense_decode_attention, paged_decode_attention
from kvq_jax.cache.paged_cache import PagedCacheConfig, append, init_cache, swap_in, swap_out
from kvq_jax.core.allocator import PageAllocator
from kvq_jax.core.offload import load_sequence, save_sequence

HEADS, HEAD_DIM, PAGE, BATCH = 8, 128, 16, 8
FORMATS = {"int4": ("int4", "int4"), "nvfp4": ("nvfp4", "nvfp4")}
STEP_COLUMNS = (
    ("format", "format", None),
    ("pool", "pool pages", "d"),
    ("pool_mb", "cache MB", ".1f"),
    ("append_ms", "append ms", ".3f"),
    ("x_p64", "x_p64", ".2f"),
    ("attention_ms", "attention ms", ".2f"),
    ("x_bf16", "attn x bf16", ".2f"),
)
SWAP_COLUMNS = (
    ("format", "format", None),
    ("op", "op", None),
    ("mb", "MB", ".2f"),
    ("ms", "ms", ".2f"),
    ("gbps", "GB/s", ".2f"),
    ("of_copy", "of copy", ".2f"),
)


def _config(fmt, pool, loops=1):
    kf, vf = FORMATS[fmt]
    return PagedCacheConfig(
        num_pages=pool, page_size=PAGE, num_heads=HEADS, head_dim=HEAD_DIM,
        dtype=jnp.bfloat16, num_loops=loops, k_base_format=kf, k_residual_format=kf,
        v_base_format=vf, v_residual_format=vf, max_seqs=BATCH, sink=4,
    )  # fmt: skip


def _tables(pool, pages_per_seq, rng):
    pages = rng.choice(pool, BATCH * pages_per_seq, replace=False).astype(np.int32)
    return pages.reshape(BATCH, pages_per_seq)


def _tokens(key, n):
    return jax.random.normal(key, (BATCH, n, HEADS, HEAD_DIM), jnp.bfloat16)


@jax.jit
def _bf16_attention(q, k_pages, v_pages, tables, lens):
    b, n = tables.shape
    shape = (b, n * PAGE, HEADS, HEAD_DIM)

    def rows(pages):  # the uint16 pool's pages of the batch, as bf16
        return jax.lax.bitcast_convert_type(pages[tables], jnp.bfloat16).reshape(shape)

    return dense_decode_attention(q, rows(k_pages), rows(v_pages), lens)


def _bf16_append(pool_k, pool_v, k, v, pages, rows):
    # The pools hold bf16 as uint16 bits: XLA:CPU widens a bf16 scatter (or a bitcast around
    # it) to a pass over the whole pool, as the cache's float8 planes would be.
    def put(pool, x):
        return pool.at[pages, rows].set(jax.lax.bitcast_convert_type(x[:, 0], jnp.uint16))

    return put(pool_k, k), put(pool_v, v)


_BF16_APPEND = jax.jit(_bf16_append, donate_argnums=(0, 1))


def bench_steps(args, warmup, repeats) -> list[dict]:
    ctx = args.context
    rng = np.random.default_rng(0)
    extra = -(-(warmup + repeats + 2) // PAGE)
    pages_per_seq = -(-ctx // PAGE) + extra
    keys = jax.random.split(jax.random.key(0), 4)
    prompt_k, prompt_v = _tokens(keys[0], ctx - 1), _tokens(keys[1], ctx - 1)
    tok = _tokens(keys[2], 1)
    q = jax.random.normal(keys[3], (BATCH, HEADS, HEAD_DIM), jnp.bfloat16)
    ids = jnp.arange(BATCH, dtype=jnp.int32)
    lens = jnp.full((BATCH,), ctx, jnp.int32)
    rows_out = []
    for pool in args.pools:
        tables = _tables(pool, pages_per_seq, rng)
        attn_tables = jnp.asarray(tables[:, : -(-ctx // PAGE)])
        # bf16 baseline: pool [P, page, H, D] in place, attention over gathered pages.
        pool_k = jnp.zeros((pool, PAGE, HEADS, HEAD_DIM), jnp.uint16)
        pool_v = jnp.zeros((pool, PAGE, HEADS, HEAD_DIM), jnp.uint16)
        pos = ctx - 1
        page_ids = jnp.asarray(tables[:, pos // PAGE])
        state = [pool_k, pool_v]

        def bf16_step(state=state, page_ids=page_ids, pos=pos):
            state[:] = _BF16_APPEND(*state, tok, tok, page_ids, pos % PAGE)
            return state[0]

        t_bf16_app = _timing.median_time(bf16_step, warmup=warmup, repeats=repeats)
        t_bf16_attn = _timing.median_time(
            _bf16_attention, q, *state, attn_tables, lens, warmup=warmup, repeats=repeats
        )
        rows_out.append(dict(format="bf16", pool=pool, pool_mb=2 * pool_k.nbytes / 1e6,
                             append_ms=t_bf16_app.median_ms,
                             attention_ms=t_bf16_attn.median_ms, x_bf16=1.0))  # fmt: skip
        del state[:], pool_k, pool_v
        for fmt in FORMATS:
            config = _config(fmt, pool)
            cache = init_cache(config)
            block_tables = jnp.asarray(tables)
            cache = append(cache, prompt_k, prompt_v, block_tables=block_tables, seq_ids=ids,
                           loop=0)  # fmt: skip
            cache_box = [cache]

            def step(box=cache_box, block_tables=block_tables):
                box[0] = append(box[0], tok, tok, block_tables=block_tables, seq_ids=ids, loop=0)
                return box[0]

            t_app = _timing.median_time(step, warmup=warmup, repeats=repeats)
            t_attn = _timing.median_time(
                paged_decode_attention, q, cache_box[0], attn_tables, lens, loop=0,
                warmup=warmup, repeats=repeats,
            )  # fmt: skip
            rows_out.append(dict(format=fmt, pool=pool, pool_mb=cache_box[0].storage_bytes / 1e6,
                                 append_ms=t_app.median_ms, attention_ms=t_attn.median_ms,
                                 x_bf16=t_attn.median_s / t_bf16_attn.median_s))  # fmt: skip
            del cache_box[:]
    first = {}
    for row in rows_out:
        first.setdefault(row["format"], row["append_ms"])
        row["x_p64"] = row["append_ms"] / first[row["format"]]
    return rows_out


def bench_swap(args, warmup, repeats) -> list[dict]:
    return [row for fmt in FORMATS for row in _swap_rows(fmt, args.swap_tokens, warmup, repeats)]


def _swap_rows(fmt, n, warmup, repeats) -> list[dict]:
    config = _config(fmt, pool=4 * (-(-n // PAGE)) + 4, loops=3)
    alloc = PageAllocator.for_config(config, -(-n // PAGE))
    slot = alloc.add_sequence(n)
    cache = init_cache(config)
    tables = jnp.asarray(alloc.block_tables())
    ids = jnp.asarray([slot], jnp.int32)
    for loop in range(3):
        x = jax.random.normal(jax.random.key(loop), (1, n, HEADS, HEAD_DIM), jnp.bfloat16)
        cache = append(cache, x, x, block_tables=tables, seq_ids=ids, loop=loop)
    pages = alloc.pages(slot)
    host = swap_out(cache, slot=slot, pages=pages)
    flat = jnp.zeros((host.nbytes,), jnp.uint8) + 1
    flat_host = np.ones(host.nbytes, np.uint8)
    other = alloc.add_sequence(n)
    box = [cache]

    def swap_back():
        box[0] = swap_in(box[0], host, slot=other, pages=alloc.pages(other))
        return box[0]

    timed = {
        # Plain copies of the same bytes: device -> a new host array, host -> device.
        "copy (device->host)": lambda: np.array(jax.device_get(flat), copy=True),
        # (XLA:CPU may alias an aligned host buffer instead of copying it: copy it first.)
        "copy (host->device)": lambda: jax.device_put(flat_host.copy()),
        "swap out": lambda: swap_out(box[0], slot=slot, pages=pages),
        "swap in": swap_back,
    }
    times = _timing.interleaved_times(timed, warmup=warmup, repeats=repeats)
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "seq.safetensors"
        times["save"] = _timing.median_time(
            lambda: save_sequence(path, host) or jnp.zeros(()), warmup=warmup, repeats=repeats
        )
        times["load"] = _timing.median_time(
            lambda: jnp.asarray(load_sequence(path, config).seq_lens),
            warmup=warmup, repeats=repeats,
        )  # fmt: skip
    out_s, in_s = times["copy (device->host)"].median_s, times["copy (host->device)"].median_s
    reference = {"swap in": in_s, "load": in_s, "copy (host->device)": in_s}
    return [
        dict(format=fmt, op=op, mb=host.nbytes / 1e6, ms=t.median_ms,
             gbps=_timing.gbps(host.nbytes, t.median_s),
             of_copy=reference.get(op, out_s) / t.median_s)
        for op, t in times.items()
    ]  # fmt: skip


def main(argv=None):
    parser = _timing.bench_parser(__doc__)
    parser.add_argument("--pools", default="64,512,4096,8192", help="pool sizes in pages")
    parser.add_argument("--context", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--swap-tokens", type=int, default=1024, help="tokens swapped")
    args = parser.parse_args(argv)
    args.pools = [int(p) for p in args.pools.split(",")]
    warmup, repeats = _timing.repeat_counts(args, quick=(1, 3), full=(3, 20))
    header = _timing.device_header()
    print(header)
    steps = bench_steps(args, warmup, repeats)
    swaps = bench_swap(args, warmup, repeats)
    print("\ndecode step: append one token per sequence, attention over the context")
    _timing.print_table(steps, STEP_COLUMNS)
    _timing.report(args, header, swaps, SWAP_COLUMNS, steps=steps)


if __name__ == "__main__":
    main()
