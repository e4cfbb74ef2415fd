"""Torch serving cache (`kvq_torch_bridge.serving`) speed: a decode step's write and paged
attention per kv_cache_dtype, beside vLLM's raw bfloat16 layout.

    python bench/torch_serving.py [--batches 1 8 32] [--contexts 1024 4096]
        [--dtypes bfloat16 int4-g64 nvfp4 kvq:fp8] [--rounds 5] [--quick] [--json PATH]

One layer of Ouro-1.4B's shape (16 KV heads, 16 query heads, head size 128; block size 64;
flags). For every (B, T) the caches of every kv_cache_dtype hold the same random bf16 K/V,
written with `reshape_and_cache` in chunks (whole blocks, as a prefill writes them): each of
B sequences holds T context tokens in T / 64 complete blocks plus an open block of 32 tokens
(staged raw in the quantized caches), its blocks scattered over the cache by a seeded random
permutation, as a long-running server's block tables are. Timed, eager (no torch.compile):

- "write ms": one decode step's `reshape_and_cache` of B new tokens, one per sequence, at
  offset 32 of its open (staged) block: the write every decode step of every layer does. (A
  step that completes a block also packs it: 1 step in 64; the prefill write packs.)
- "prefill ms": `reshape_and_cache` of one whole 64-token block per sequence (B x 64 tokens,
  into a spare block each): a quantized cache packs the B blocks straight from the tokens.
- "decode ms": `paged_attention_decode` of B queries (bf16 [B, 16, 128]), each over its
  sequence's T + 33 tokens (block tables int32 [B, T / 64 + 1], seq_lens int32) after the
  write: the reference path (`read_blocks` decodes every packed block with the Torch codec,
  float32 attention), which is what runs on the CPU.
- "ms (min)": the median over the rounds (the fastest round in brackets).
- "x bf16": the median time over the bfloat16 cache's at the same (B, T) (2.0: twice as slow).
- "KV B/token": the format's bytes per token of K and V (one block's pages, or raw rows, over
  the block size; `page_storage_bytes`) and its ratio to bf16's. JSON only: "alloc_mib",
  every tensor the cache owns (`ServingKVCache.storage_bytes`: pages, staging, scratch), and
  "fill_s", the seconds its fill's `reshape_and_cache` calls took.
- "rel err": ||out - out_bf16|| / ||out_bf16|| of the decode output against the bfloat16
  cache's on the same K/V and query (a check that the quantized cache was read, not a
  quality number: random Gaussian K/V).

All caches are built first; then `_timing.interleaved_times` runs the warm-up calls and
`--rounds` rounds, each round timing every case once (so a change of load on the machine hits
all alike), and reports the median. Every call is complete when it returns (eager CPU).
`--table JSON` reprints a saved run's table. Threads: `--threads` (default
$OMP_NUM_THREADS, else 2). Decode cases of more than `--max-tokens` B x T tokens are skipped
(listed in the output and the JSON): the reference read materializes the whole context in
float32 several times over (B = 32 x T = 4096, NVFP4: about 9 GB of temporaries per call,
about a minute on 2 shared cores).

A quantized cache's decode-step write packs min(B, max_num_seqs) blocks of K and of V on
every call, into the scratch page when no block completes (`_write_staged` keeps its shapes
static so that CUDA never syncs the host): its cost is that of packing B blocks, not of
writing B rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # _timing imports jax; nothing here runs on it

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing

from kvq_torch_bridge.cache.paged import page_storage_bytes
from kvq_torch_bridge.serving import (
    allocate_kv_cache,
    paged_attention_decode,
    reshape_and_cache,
)

DTYPES = ("bfloat16", "int4-g64", "nvfp4", "kvq:fp8")
BASELINE = "bfloat16"
OPS = ("write", "prefill", "decode")


@dataclasses.dataclass
class Case:
    """One cache at one (B, T), with the tensors of its timed calls."""

    kv_cache_dtype: str
    batch: int
    context: int
    cache: object
    step: tuple  # (key, value, slots) of a decode step's write
    prefill: tuple  # (key, value, slots) of one whole block per sequence
    decode: tuple  # (query, block_tables, seq_lens)
    fill_s: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.kv_cache_dtype} B={self.batch} T={self.context}"


def kv_bytes_per_token(cache) -> float:
    """Bytes of K and V one token costs in the cache's blocks (the format's accounting)."""
    if cache.quantized:
        page = page_storage_bytes(cache.k_pages) + page_storage_bytes(cache.v_pages)
    else:
        page = 2 * cache.key_cache[0].numel() * cache.key_cache.element_size()
    return page / cache.block_size


def build_cases(dtypes, batch: int, context: int, args, seed: int) -> list[Case]:
    """Caches of every dtype at (batch, context), filled with the same random bf16 K/V."""
    bs, h, d = args.block_size, args.kv_heads, args.head_size
    if context % bs:
        raise SystemExit(f"--contexts: {context} is not a multiple of --block-size {bs}")
    open_fill = bs // 2  # tokens in each sequence's open block before the step
    ctx_blocks = context // bs
    per_seq = ctx_blocks + 2  # context blocks, the open block, a spare block for prefill
    num_blocks = batch * per_seq
    g = torch.Generator().manual_seed(seed)
    tables = torch.randperm(num_blocks, generator=g).reshape(batch, per_seq)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    def slots_of(blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return (blocks[..., None] * bs + offsets).reshape(-1)

    cases = [
        Case(dt, batch, context,
             allocate_kv_cache(dt, num_blocks, bs, h, d, max_num_seqs=batch), (), (), ())
        for dt in dtypes
    ]  # fmt: skip
    full = torch.arange(bs)
    per_call = max(1, args.fill_chunk // (batch * bs))  # blocks per sequence per fill call
    chunks = [(tables[:, j : j + per_call], full) for j in range(0, ctx_blocks, per_call)]
    chunks.append((tables[:, ctx_blocks : ctx_blocks + 1], torch.arange(open_fill)))
    for blocks, offsets in chunks:
        slots = slots_of(blocks, offsets)
        k, v = rand(slots.numel(), h, d), rand(slots.numel(), h, d)
        for case in cases:
            t0 = time.perf_counter()
            reshape_and_cache(k, v, case.cache, slots)
            case.fill_s += time.perf_counter() - t0
    step_slots = tables[:, ctx_blocks] * bs + open_fill
    step = (rand(batch, h, d), rand(batch, h, d), step_slots)
    pre_slots = slots_of(tables[:, ctx_blocks + 1 : ctx_blocks + 2], full)
    prefill = (rand(pre_slots.numel(), h, d), rand(pre_slots.numel(), h, d), pre_slots)
    query = rand(batch, args.q_heads, d)
    block_tables = tables[:, : ctx_blocks + 1].to(torch.int32).contiguous()
    seq_lens = torch.full((batch,), context + open_fill + 1, dtype=torch.int32)
    for case in cases:
        case.step, case.prefill, case.decode = step, prefill, (query, block_tables, seq_lens)
    return cases


def timed_functions(cases: list[Case], outputs: dict) -> dict:
    """{(case name, op): zero-argument call}; decode calls keep their latest output."""
    fns = {}
    for case in cases:
        c = case.cache

        def decode(case=case, c=c):
            query, block_tables, seq_lens = case.decode
            outputs[case.name] = paged_attention_decode(query, c, block_tables, seq_lens)

        fns[(case.name, "write")] = lambda case=case, c=c: reshape_and_cache(
            case.step[0], case.step[1], c, case.step[2]
        )
        fns[(case.name, "prefill")] = lambda case=case, c=c: reshape_and_cache(
            case.prefill[0], case.prefill[1], c, case.prefill[2]
        )
        fns[(case.name, "decode")] = decode
    return fns


def rows_of(cases: list[Case], times: dict, outputs: dict) -> list[dict]:
    base = {(c.batch, c.context): c for c in cases if c.kv_cache_dtype == BASELINE}
    rows = []
    for case in cases:
        ref = base.get((case.batch, case.context))
        row = dict(
            kv_cache_dtype=case.kv_cache_dtype,
            batch=case.batch,
            context=case.context,
            attended=int(case.decode[2][0]),
            kv_bytes_per_token=kv_bytes_per_token(case.cache),
            alloc_mib=case.cache.storage_bytes() / 2**20,
            fill_s=case.fill_s,
        )
        for op in OPS:
            t = times[(case.name, op)]
            row[f"{op}_ms"] = t.median_ms
            row[f"{op}_min_ms"] = t.min_s * 1e3
            row[f"{op}_times_ms"] = [s * 1e3 for s in t.times_s]
            row[f"{op}_x_bf16"] = (
                None if ref is None else t.median_s / times[(ref.name, op)].median_s
            )
        row["bytes_x_bf16"] = (
            None if ref is None else row["kv_bytes_per_token"] / kv_bytes_per_token(ref.cache)
        )
        row["rel_err"] = None
        if ref is not None:
            out, want = outputs[case.name], outputs[ref.name]
            row["rel_err"] = float(torch.linalg.vector_norm(out - want)
                                   / torch.linalg.vector_norm(want))  # fmt: skip
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table: medians (and the fastest round) in ms, ratios of medians."""

    def x(v):
        return "" if v is None else f"{v:.2f}x"

    def ms(r, op):
        digits = 1 if r[f"{op}_ms"] >= 100 else 2
        return f"{r[f'{op}_ms']:.{digits}f} ({r[f'{op}_min_ms']:.{digits}f})"

    lines = [
        "| kv_cache_dtype | B | T | KV B/token | write ms (min) | x bf16 | prefill ms (min) | "
        "x bf16 | decode ms (min) | x bf16 | rel err |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        err = "" if r["rel_err"] is None else f"{r['rel_err']:.4f}"
        lines.append(
            f"| {r['kv_cache_dtype']} | {r['batch']} | {r['context']} | "
            f"{r['kv_bytes_per_token']:.0f} ({x(r['bytes_x_bf16'])}) | "
            f"{ms(r, 'write')} | {x(r['write_x_bf16'])} | "
            f"{ms(r, 'prefill')} | {x(r['prefill_x_bf16'])} | "
            f"{ms(r, 'decode')} | {x(r['decode_x_bf16'])} | {err} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls of each case")
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=32768,
        help="skip (B, T) with B x T above this (decode temporaries: see the docstring)",
    )
    parser.add_argument(
        "--fill-chunk", type=int, default=4096, help="tokens per reshape_and_cache fill call"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="tiny setting (smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument(
        "--table", metavar="JSON", help="print the markdown table of a saved --json run, exit"
    )
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        print(saved["header"])
        print(markdown(saved["rows"]))
        return
    if args.quick:
        args.batches, args.contexts, args.rounds, args.warmup = [1, 2], [128], 2, 1
    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS") or 0) or 2
    torch.set_num_threads(threads)
    dtypes = list(dict.fromkeys([BASELINE, *args.dtypes]))  # the baseline always, first

    shapes = [(b, t) for b in args.batches for t in args.contexts]
    skipped = [(b, t) for b, t in shapes if b * t > args.max_tokens]
    header = (
        f"{_timing.device_header()}, torch {torch.__version__} ({threads} threads, eager) | "
        f"one layer: {args.kv_heads} KV heads, {args.q_heads} query heads, head size "
        f"{args.head_size}, block size {args.block_size}, bf16 K/V"
    )
    print(header, flush=True)
    cases = []
    for i, (b, t) in enumerate(shapes):
        if (b, t) in skipped:
            continue
        t0 = time.perf_counter()
        built = build_cases(dtypes, b, t, args, seed=i)
        fills = ", ".join(f"{c.kv_cache_dtype} {c.fill_s:.1f} s" for c in built)
        print(f"built B={b} T={t} in {time.perf_counter() - t0:.1f} s (fill: {fills})",
              flush=True)  # fmt: skip
        cases += built
    for b, t in skipped:
        print(f"skipped B={b} T={t}: B x T = {b * t} > --max-tokens {args.max_tokens}")
    outputs: dict = {}
    t0 = time.perf_counter()
    times = _timing.interleaved_times(
        timed_functions(cases, outputs), warmup=args.warmup, repeats=args.rounds
    )
    print(f"timed {args.rounds} rounds in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = rows_of(cases, times, outputs)
    print()
    print(markdown(rows))
    if args.json:
        _timing.write_json(
            args.json,
            header,
            rows,
            args=vars(args),
            threads=threads,
            torch=torch.__version__,
            skipped=[dict(batch=b, context=t) for b, t in skipped],
        )
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
