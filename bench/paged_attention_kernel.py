"""Quantized paged decode attention (the fused kernel) against bf16 paged decode attention.

    python bench/paged_attention_kernel.py [--quick] [--json PATH] [--batch 1 8 32]
        [--context 4096 16384 32768] [--formats int4 nvfp4] [--loops 0 3] [--page 16]
        [--backend auto|xla|pallas|pallas_interpret] [--num-splits N] [--check]

On a GPU (the numbers this benchmark exists for; H100/H200/SM120, ~10 min):

    python bench/paged_attention_kernel.py --batch 1 8 32 --context 4096 16384 32768 \\
        --formats int4 nvfp4 --loops 0 3 --page 16 --check --json paged_attention_gpu.json

Elsewhere (CPU) the default grid is B 1/4 x context 1024/2048 and "auto" runs the XLA reference
path (no kernel): numbers exist everywhere, but only the GPU run measures the kernel.

Ouro-1.4B decode shapes: Hq = H = 16, D = 128, bf16 cache, 4 loops, every sequence at the
full context; physical pages a random permutation of the pool. One decode step = one query
token per sequence attending over loop `loop` of the cache (loop 3: base + 3 residual planes,
the 4th loop). The quantized cache holds random packed bytes of sane values
(`arg_specs.random_inputs`: building a 32k x 32 cache through `append` would take minutes).

Rows (median of N jitted runs, each blocked until ready):
  bf16 paged    the unquantized baseline on bf16 pages of the same shapes and block tables:
                on a GPU `jax.experimental.pallas.ops.gpu.paged_attention` (Pallas Triton,
                pages [H, P, page, D]); elsewhere (or if it fails) the XLA gather +
                `dense_decode_attention` of bench/paged.py.
  kvq <fmt>     `kvq_jax.kernels.paged_attention.paged_decode_attention(backend=...)`: "auto"
                is the fused kernel on a CUDA GPU and the XLA reference (reconstruct, then
                attend) on a CPU.
Columns: ms/step; speedup = bf16 time / this time; KV bytes read per step (the kernel's
reads: packed K + V tiles of every base and residual plane up to `loop`, no staging pages
here since the context is a multiple of the page size; bf16: 2 x B x ctx x H x D x 2 bytes),
bytes/bf16; GB/s = KV bytes / time; with --check, max |out - XLA reference| on the same cache.
The 4.5-bit target: a memory-bound kernel approaches bf16_time / 3.5 at loop 0 (INT4 K with
page-16 token groups is 6 bits, NVFP4 4.5 bits + 4 bytes per page); loop 3 reads 4 planes.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing
from paged import _bf16_paged_attention

import kvq_jax
from kvq_jax.kernel_checks.arg_specs import paged_attention as arg_specs
from kvq_jax.kernels import backend as kernel_backend
from kvq_jax.kernels.paged_attention import api, pallas_triton

COLUMNS = (
    ("kind", "kv", None),
    ("loop", "loop", None),
    ("batch", "B", None),
    ("context", "ctx", None),
    ("impl", "impl", None),
    ("ms", "ms/step", ".3f"),
    ("speedup", "speedup", ".2f"),
    ("kv_mb", "KV MB", ".2f"),
    ("bytes_ratio", "bytes/bf16", ".3f"),
    ("gbps", "GB/s", ".1f"),
    ("max_diff", "max|diff|", ".1e"),
)


def _bf16_baseline(spec, tables, lens, q, on_gpu):
    """(fn, args, name) of bf16 paged attention over random bf16 pages."""
    h, d, ps = spec.kv_heads, spec.head_dim, spec.page_size
    pages = spec.context // ps
    num_pages = int(np.max(tables)) + 1
    keys = jax.random.split(jax.random.key(1), 2)
    tables = jnp.asarray(tables[:, :pages])
    if on_gpu:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

        k = jax.random.normal(keys[0], (h, num_pages, ps, d), jnp.bfloat16)
        v = jax.random.normal(keys[1], (h, num_pages, ps, d), jnp.bfloat16)
        qb = q.astype(jnp.bfloat16)
        k_splits = min(16, pages)
        try:
            args = (qb, k, v, tables, lens)
            fn = jax.jit(lambda *a: jax_paged.paged_attention(*a, k_splits=k_splits))
            jax.block_until_ready(fn(*args))
            return fn, args, "pallas gpu paged_attention"
        except Exception as e:  # shapes its kernel does not take: fall back to XLA
            print(f"note: jax paged_attention failed ({type(e).__name__}); XLA bf16 baseline")
            del k, v
    k = jax.random.normal(keys[0], (num_pages, ps, h, d), jnp.bfloat16)
    v = jax.random.normal(keys[1], (num_pages, ps, h, d), jnp.bfloat16)
    return _bf16_paged_attention, (q, k, v, tables, lens), "xla gather + dense"


def bench(args, warmup: int, repeats: int) -> list[dict]:
    on_gpu = kernel_backend.pallas_device_support() is None
    rows = []
    for batch in args.batch:
        for context in args.context:
            base = arg_specs.ouro_spec(batch, context, page_size=args.page)
            tables = arg_specs.make_block_tables(base)  # every format's cache uses them
            lens = jnp.full((batch,), context, jnp.int32)
            q = jax.random.normal(jax.random.key(2), (batch, base.q_heads, base.head_dim))
            fn, fargs, name = _bf16_baseline(base, tables, lens, q, on_gpu)
            t_bf16 = _timing.median_time(fn, *fargs, warmup=warmup, repeats=repeats)
            del fargs
            bf16_bytes = 2 * batch * context * base.kv_heads * base.head_dim * 2
            rows.append(
                dict(
                    kind="bf16",
                    loop="-",
                    batch=batch,
                    context=context,
                    impl=name,
                    ms=t_bf16.median_ms,
                    speedup=1.0,
                    kv_mb=bf16_bytes / 1e6,
                    bytes_ratio=1.0,
                    gbps=_timing.gbps(bf16_bytes, t_bf16.median_s),
                )
            )
            for fmt in args.formats:
                spec = arg_specs.ouro_spec(batch, context, fmt, page_size=args.page)
                inp = arg_specs.random_inputs(spec)
                chosen = api.choose_backend(
                    inp.q, inp.cache, inp.block_tables, loop=0, backend=args.backend
                )
                for loop in args.loops:

                    def step(q, cache, tables, lens, loop=loop):
                        return api.paged_decode_attention(
                            q, cache, tables, lens, loop=loop, backend=args.backend,
                            num_splits=args.num_splits,
                        )  # fmt: skip

                    t = _timing.median_time(step, *inp.args(), warmup=warmup, repeats=repeats)
                    kv = pallas_triton.kv_bytes_read(
                        inp.cache.config, np.full(batch, context), loop=loop
                    )
                    diff = None
                    if args.check:
                        out = step(*inp.args())
                        ref = api.paged_decode_attention(*inp.args(), loop=loop, backend="xla")
                        diff = float(jnp.max(jnp.abs(out - ref)))
                    rows.append(
                        dict(
                            kind=fmt,
                            loop=loop,
                            batch=batch,
                            context=context,
                            impl=chosen,
                            ms=t.median_ms,
                            speedup=t_bf16.median_s / t.median_s,
                            kv_mb=kv / 1e6,
                            bytes_ratio=kv / bf16_bytes,
                            gbps=_timing.gbps(kv, t.median_s),
                            max_diff=diff,
                        )
                    )
                del inp
    return rows


def main(argv=None) -> int:
    on_gpu = kernel_backend.pallas_device_support() is None
    parser = _timing.bench_parser(__doc__)
    batch, context = ((1, 8, 32), (4096, 16384, 32768)) if on_gpu else ((1, 4), (1024, 2048))
    parser.add_argument("--batch", type=int, nargs="+", default=list(batch))
    parser.add_argument("--context", type=int, nargs="+", default=list(context))
    parser.add_argument("--formats", nargs="+", default=["int4", "nvfp4"])
    parser.add_argument("--loops", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--num-splits", type=int, default=None)
    parser.add_argument("--check", action="store_true", help="max |diff| vs the XLA path")
    args = parser.parse_args(argv)
    for ctx in args.context:
        if ctx % args.page:
            raise SystemExit(f"--context {ctx} must be a multiple of --page {args.page}")
    warmup, repeats = _timing.repeat_counts(args, quick=(1, 3), full=(3, 20))

    header = _timing.device_header()
    print(header)
    print(
        f"kvq {kvq_jax.__version__}; Ouro shapes Hq=H=16 D=128 page={args.page} bf16 cache, "
        f"4 loops; backend={args.backend}; median of {repeats} runs after {warmup} warm-up; "
        f"speedup = bf16 paged attention time / kvq time"
    )
    rows = bench(args, warmup, repeats)
    _timing.report(
        args, header, rows, COLUMNS, **{**vars(args), "warmup": warmup, "repeats": repeats}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
