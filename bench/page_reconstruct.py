"""Page reconstruction bandwidth: loop l of every page of an Ouro-like paged cache, per backend.

    python bench/page_reconstruct.py [--quick] [--repeats N] [--json PATH]
                                     [--batch B] [--context T] [--backends xla,pallas]
                                     [--formats int4,nvfp4,mixed,heavy-rope]

Ouro-1.4B shapes (arg_specs.BENCH_SPECS): H = 16 KV heads, D = 128, bf16, page size 16 or
64, a pool of B x T / page_size physical pages (default B = 8 sequences x T = 4096 tokens;
--quick: 2 x 1024), num_loops = 4. Formats: int4 (K tokens G = page_size up to 64, V
channels G 64), nvfp4 (G 16), mixed (K int4 base + nvfp4 residuals, V nvfp4 base + int4
residuals), heavy-rope (the best served policy's pages, intb-prerope-hint4-heavy: heavy rows
over INTB keys and HINT4 values, every loop stored whole, page size 64 only; its keys are
stored before RoPE, which reconstruction returns as stored). Reconstructed: loop 0 (base
plane only) and loop 3 (base + 3 residual planes; heavy-rope: loop 3's own plane),
K and V of every page of the pool in a random order (page ids int32 [P], a permutation), in
one jitted call per backend: `decode_pages(..., backend=b)` for K and V.

The packed planes hold random bytes of the right types (random codes, finite FP16 / E4M3
metadata, positive global scales): bandwidth does not depend on the values, and building
the pool through `append` would take minutes on a CPU.

Effective bandwidth = (packed bytes read: base page + loop residual pages, codes and every
scale, + bf16 bytes written) / median time. The XLA path materializes every intermediate
loop, so it moves more than this; the Pallas kernel reads each plane once and writes only
the result. On a GPU the last column is the share of the peak HBM bandwidth (H200 4.8 TB/s,
H100 SXM 3.35 TB/s, RTX 5090 1.79 TB/s); on CPU only the XLA path runs ("pallas" needs a
CUDA GPU; interpret mode is not benchmarked). The copy row is a jitted bf16 copy of one
output-sized array (read + write), the practical ceiling of the device.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing

from kvq_jax.core.registry import layout
from kvq_jax.kernel_checks.arg_specs import page_reconstruct as arg_specs
from kvq_jax.kernels import backend as kernel_backend
from kvq_jax.kernels.page_reconstruct import config_support, decode_pages

COLUMNS = (
    ("format", "format", None),
    ("page", "page", "d"),
    ("loop", "loop", "d"),
    ("backend", "backend", None),
    ("pages", "pages", "d"),
    ("mb", "MB moved", ".1f"),
    ("ms", "ms", ".3f"),
    ("gbps", "GB/s", ".2f"),
    ("peak_pct", "% peak", ".1f"),
)


def _draw(key, shape, dtype):
    """Random values of one packed field: codes any byte, metadata finite."""
    if dtype == jnp.uint8:
        return jax.random.bits(key, shape, jnp.uint8)
    if dtype == jnp.float8_e4m3fn:  # E4M3 codes / block scales: finite, within [-448, 448]
        return jax.random.uniform(key, shape, jnp.float32, -448, 448).astype(dtype)
    if dtype == jnp.float32:  # NVFP4 global scales, FP8 row scales: positive
        return jax.random.uniform(key, shape, jnp.float32, 0.5, 100.0)
    return (0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)  # f16 meta, bf16


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "chunk_bytes"))
def _random_array(key, shape, dtype, chunk_bytes):
    if len(shape) < 2:
        return _draw(key, shape, dtype)
    # slabs over the leading axes merged until a slab's temporaries (float32 / uint32: 4 bytes
    # per element) fit chunk_bytes: a plane [1, P, ...] (one loop) is cut along P, not drawn
    # whole
    split = 1
    while split < len(shape) - 1 and int(np.prod(shape[split:])) * 4 > chunk_bytes:
        split += 1
    lead, rest = int(np.prod(shape[:split])), shape[split:]
    row_bytes = int(np.prod(rest)) * 4
    keys = jax.random.split(key, lead)
    batch = max(1, min(lead, chunk_bytes // max(row_bytes, 1)))
    out = lax.map(lambda k: _draw(k, rest, dtype), keys, batch_size=batch)
    return out.reshape(shape)


def random_leaf(key, leaf, *, chunk_bytes: int = 1 << 26):
    """Random contents of one packed array (shape and dtype of `leaf`): codes any byte,
    metadata finite. Drawn in slabs of the leading axis of about `chunk_bytes` of
    temporaries each, so a multi-GB pool needs its own size and no more (one jitted call)."""
    return _random_array(key, tuple(leaf.shape), jnp.dtype(leaf.dtype), chunk_bytes)


def random_plane(key, packed):
    """Random contents of a stored plane: each field drawn in its format's dtype, then held
    as the cache holds it (E4M3 fields as uint8 bits)."""
    shapes = layout(packed.format).array_shapes(packed.shape, packed.axis, packed.group_size)
    arrays = {}
    for i, (name, leaf) in enumerate(packed.arrays.items()):
        value = random_leaf(
            jax.random.fold_in(key, i), jax.ShapeDtypeStruct(leaf.shape, shapes[name][1])
        )
        arrays[name] = lax.bitcast_convert_type(value, leaf.dtype)
    return dataclasses.replace(packed, **arrays)


def random_cache(spec: arg_specs.ReconstructSpec, seed: int = 0):
    abstract = spec.abstract_cache()
    key = jax.random.key(seed)
    filled = {
        f: random_plane(jax.random.fold_in(key, i), getattr(abstract, f))
        for i, f in enumerate(("k_base", "v_base", "k_delta", "v_delta"))
        if getattr(abstract, f) is not None
    }
    empty = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
    return dataclasses.replace(empty, **filled)


def main(argv=None) -> int:
    parser = _timing.bench_parser(__doc__)
    parser.add_argument("--batch", type=int, default=None, help="sequences (default 8)")
    parser.add_argument("--context", type=int, default=None, help="tokens (default 4096)")
    parser.add_argument("--backends", default=None, help="comma list (default: available)")
    parser.add_argument(
        "--formats",
        default=",".join(arg_specs.BENCH_FORMATS),
        help="comma list of arg_specs.BENCH_FORMATS names (default: all)",
    )
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    if unknown := sorted(set(formats) - set(arg_specs.BENCH_FORMATS)):
        parser.error(f"--formats: unknown {unknown}; choose from {list(arg_specs.BENCH_FORMATS)}")
    batch = args.batch or (2 if args.quick else 8)
    context = args.context or (1024 if args.quick else 4096)
    warmup, repeats = _timing.repeat_counts(args, quick=(1, 3), full=(3, 20))
    on_gpu = kernel_backend.pallas_device_support() is None
    backends = (
        args.backends.split(",") if args.backends else (["xla", "pallas"] if on_gpu else ["xla"])
    )
    peak = _timing.peak_bandwidth() if on_gpu else None
    header = _timing.device_header()
    print(header)
    print(f"B = {batch} sequences x {context} tokens, H 16, D 128, bf16; backends {backends}")

    rows = []
    chosen = [(n, spec) for n in arg_specs.BENCH_FORMATS if n in formats
              for spec in arg_specs.bench_specs(n)]  # fmt: skip
    for name, spec in chosen:
        spec = dataclasses.replace(spec, num_pages=batch * context // spec.page_size)
        cache = random_cache(spec)
        rng = np.random.default_rng(0)
        pages = jnp.asarray(rng.permutation(spec.num_pages).astype(np.int32))
        nbytes = sum(spec.bytes_moved(kind, spec.num_pages) for kind in arg_specs.KINDS)
        results = {}
        for backend in backends:
            if backend != "xla" and any(config_support(spec.config(), k) for k in arg_specs.KINDS):
                continue

            @jax.jit
            def both(cache, pages, backend=backend, loop=spec.loop):
                return tuple(
                    decode_pages(cache, kind, pages, loop=loop, backend=backend)
                    for kind in arg_specs.KINDS
                )

            t = _timing.median_time(
                both, cache, pages, warmup=warmup, repeats=repeats, budget_s=5.0
            )
            results[backend] = both(cache, pages)
            gbps = _timing.gbps(nbytes, t.median_s)
            rows.append(
                dict(
                    format=name,
                    page=spec.page_size,
                    loop=spec.loop,
                    backend=backend,
                    pages=spec.num_pages,
                    mb=nbytes / 1e6,
                    ms=t.median_ms,
                    gbps=gbps,
                    peak_pct=None if peak is None else 100 * gbps * 1e9 / peak,
                )
            )
            print(f"  {name:10s} page {spec.page_size:3d} loop {spec.loop}  {backend:7s} "
                  f"{t.median_ms:9.3f} ms  {gbps:8.2f} GB/s", flush=True)  # fmt: skip
        if len(results) > 1:  # the backends agree (NaN-free random data: bytes)
            ref = jax.tree.leaves(results.pop("xla"))
            for backend, out in results.items():
                for a, b in zip(jax.tree.leaves(out), ref, strict=True):
                    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
                    if not np.array_equal(a32, b32, equal_nan=True):
                        raise RuntimeError(f"{backend} differs from xla on {spec.name}")

    out_elems = batch * context * 16 * 128
    x = jnp.ones((2 * out_elems,), jnp.bfloat16)  # K and V outputs
    fn, fargs = _timing.copy_baseline(x)
    t = _timing.median_time(fn, *fargs, warmup=warmup, repeats=repeats, budget_s=5.0)
    copy_bytes = 2 * x.nbytes
    gbps = _timing.gbps(copy_bytes, t.median_s)
    rows.append(
        dict(
            format="copy",
            backend="xla",
            mb=copy_bytes / 1e6,
            ms=t.median_ms,
            gbps=gbps,
            peak_pct=None if peak is None else 100 * gbps * 1e9 / peak,
        )
    )
    _timing.report(args, header, rows, COLUMNS, batch=batch, context=context)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
