"""Page pack (kernel 1 of issue 6): effective bandwidth of packing full KV pages, per backend.

    python bench/page_pack.py [--quick] [--tokens N] [--interpret] [--json PATH]

Ouro-like pages (`kvq_jax.kernel_checks.arg_specs.page_pack.BENCH_SPECS`): page size 16 / 32 / 64,
H = 16 KV heads, D = 128, bf16; formats INT4 K (token groups, gcd(64, page)), INT4 V
(channel groups of 64), NVFP4 K / V and FP8 E4M3. One call packs `--tokens` tokens of one
of K / V (default 32768 = 8 sequences x 4096, the prefill of the paged benchmark; P = tokens /
page pages), through `pack_paged(backend=...)`:

  xla               every device (on a CPU it is the only real number)
  pallas            the Triton kernel, on a CUDA GPU (compute capability >= 8.0)
  pallas_interpret  with --interpret only: the kernel body in Pallas' interpreter, on 8
                    pages, labelled as such (it measures the interpreter, not the kernel)

Effective bandwidth = (bytes read + bytes written) / median time: the bf16 pages once plus
every packed array (codes, scales, NVFP4 page global scales); NVFP4's second read of each
page (from L2) is not counted. On a GPU whose peak memory bandwidth is known (H200 4.8 TB/s,
H100 SXM 3.35 TB/s, RTX 5090 1.79 TB/s) the "% peak" column divides by it; elsewhere GB/s
only. "vs xla" is the XLA time over this backend's time for the same case. The last row
copies the bf16 pages of one call (read + write, `_timing.copy_baseline`): the bandwidth a
memory-bound pack is measured against.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing

import kvq_jax
from kvq_jax.kernel_checks.arg_specs import page_pack as arg_specs
from kvq_jax.kernels.backend import pallas_device_support
from kvq_jax.kernels.page_pack import api, pack_paged

INTERPRET_PAGES = 8
COLUMNS = (
    ("case", "case", None),
    ("page", "page", "d"),
    ("backend", "backend", None),
    ("pages", "P", "d"),
    ("mb", "MB r+w", ".2f"),
    ("ms", "ms", ".3f"),
    ("gbps", "GB/s", ".1f"),
    ("peak_pct", "% peak", ".1f"),
    ("vs_xla", "vs xla", ".2f"),
)


def _case(spec: arg_specs.PagePackSpec) -> str:
    axis = {"key": "tok", "value": "ch"}[spec.kind] if spec.format != "fp8_e4m3" else "row"
    return f"{spec.format} {spec.kind[0].upper()} ({axis})"


def bench(args, warmup: int, repeats: int) -> list[dict]:
    backends = ["xla"]
    if pallas_device_support() is None:
        backends.append("pallas")
    if args.interpret:
        backends.append("pallas_interpret")
    peak = _timing.peak_bandwidth()
    rows = []
    key = jax.random.key(0)
    for spec in arg_specs.BENCH_SPECS:
        if args.tokens % spec.page_size:
            raise SystemExit(f"--tokens must be a multiple of {spec.page_size}")
        xla_s = None
        for backend in backends:
            heavy = spec.heavy_group is not None
            if backend != "xla" and api.config_support(spec.shape(1), spec.np_dtype,
                                                       **spec.kwargs, rows=heavy):  # fmt: skip
                continue
            num_pages = INTERPRET_PAGES if backend == "pallas_interpret" else (
                args.tokens // spec.page_size
            )  # fmt: skip
            pages = jax.random.normal(key, spec.shape(num_pages), jnp.float32).astype(spec.np_dtype)
            heavy_rows = spec.heavy_rows(num_pages)  # heavy-row values: the keys' rows
            read, written = api.storage_bytes(pages.shape, pages.dtype, heavy_rows, **spec.kwargs)

            def run(x, backend=backend, spec=spec, heavy_rows=heavy_rows):
                return pack_paged(x, **spec.kwargs, backend=backend, rows=heavy_rows)

            t = _timing.median_time(run, pages, warmup=warmup, repeats=repeats, budget_s=3.0)
            if backend == "xla":
                xla_s = t.median_s
            label = backend + (" (interpreter)" if backend == "pallas_interpret" else "")
            bw = _timing.gbps(read + written, t.median_s)
            rows.append(
                dict(
                    case=_case(spec),
                    page=spec.page_size,
                    backend=label,
                    pages=num_pages,
                    mb=(read + written) / 1e6,
                    ms=t.median_ms,
                    gbps=bw,
                    peak_pct=None if peak is None else 100 * bw * 1e9 / peak,
                    vs_xla=(
                        xla_s / t.median_s if xla_s and backend != "pallas_interpret" else None
                    ),
                )
            )
            del pages
            print(f"  {rows[-1]['case']} page {spec.page_size} {label}: {t.median_ms:.3f} ms",
                  flush=True)  # fmt: skip
    rows.append(copy_row(args.tokens, warmup, repeats, peak))
    return rows


def copy_row(tokens: int, warmup: int, repeats: int, peak: float | None) -> dict:
    """A device-to-device copy of the bf16 pages one call packs (read + write): the bandwidth
    a memory-bound pack is measured against."""
    x = jnp.ones((tokens, 16, 128), jnp.bfloat16)
    fn, fargs = _timing.copy_baseline(x)
    t = _timing.median_time(fn, *fargs, warmup=warmup, repeats=repeats, budget_s=3.0)
    bw = _timing.gbps(2 * x.nbytes, t.median_s)
    print(f"  copy of the bf16 pages: {t.median_ms:.3f} ms", flush=True)
    return dict(
        case="copy (bf16 pages)",
        page=None,
        backend="xla",
        pages=None,
        mb=2 * x.nbytes / 1e6,
        ms=t.median_ms,
        gbps=bw,
        peak_pct=None if peak is None else 100 * bw * 1e9 / peak,
        vs_xla=None,
    )


def main(argv=None) -> int:
    parser = _timing.bench_parser(__doc__)
    parser.add_argument("--tokens", type=int, default=32768, help="tokens packed per call")
    parser.add_argument(
        "--interpret", action="store_true", help="also time the kernel in interpret mode"
    )
    args = parser.parse_args(argv)
    warmup, repeats = _timing.repeat_counts(args, quick=(1, 5), full=(2, 20))
    header = _timing.device_header()
    print(header)
    peak = _timing.peak_bandwidth()
    print(
        f"kvq {kvq_jax.__version__}; pack_paged, {args.tokens} tokens per call, H=16 D=128 "
        f"bf16; median of <= {repeats} runs (3 s budget) after {warmup} warm-up; "
        + (f"peak {peak / 1e12:.2f} TB/s" if peak else "peak bandwidth unknown: GB/s only")
    )
    rows = bench(args, warmup, repeats)
    options = {k: v for k, v in vars(args).items() if k != "repeats"}
    _timing.report(args, header, rows, COLUMNS, warmup=warmup, repeats=repeats, **options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
