"""Pack / unpack throughput of every registered kvq format, jitted, for keys and values.

    python bench/codec_speed.py [--quick] [--json PATH] [--repeats N]

For each bf16 [T, H, D] shape, format in `kvq_jax.CODECS` and kind (key / value):
pack_kv and unpack_kv (to bf16) are timed after a warm-up, as the median of N runs, each
blocked until ready. GB/s counts the bf16 tensor: the input of pack, the output of unpack.
"x copy" is the time relative to a jitted copy of the same bf16 tensor (`x * one`, read once
and written once) timed in the same process: 2.0 means twice as long as the copy.
"""

from __future__ import annotations

import functools
import math
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing

import kvq_jax

SHAPES = ((2048, 16, 128), (32768, 8, 128))
KINDS = ("key", "value")
COLUMNS = (
    ("shape", "shape [T,H,D]", None),
    ("format", "format", None),
    ("kind", "kind", None),
    ("axis", "axis", None),
    ("op", "op", None),
    ("ms", "ms", ".3f"),
    ("gbps", "GB/s", ".2f"),
    ("x_copy", "x copy", ".2f"),
    ("bits_per_element", "bits/elem", ".6f"),
)


def _pack(values, *, kind, fmt):
    return kvq_jax.pack_kv(values, kind=kind, format=fmt)


def bench_shape(shape, *, warmup: int, repeats: int) -> list[dict]:
    x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    nbytes = math.prod(shape) * x.dtype.itemsize
    copy_fn, copy_args = _timing.copy_baseline(x)
    copy = _timing.median_time(copy_fn, *copy_args, warmup=warmup, repeats=repeats)
    label = "x".join(map(str, shape))
    rows = [
        {
            "shape": label,
            "format": "(copy)",
            "kind": "",
            "axis": "",
            "op": "x*one",
            "ms": copy.median_ms,
            "min_ms": copy.min_s * 1e3,
            "gbps": _timing.gbps(nbytes, copy.median_s),
            "x_copy": 1.0,
            "bits_per_element": 16.0,
        }
    ]
    for fmt in kvq_jax.CODECS:
        for kind in KINDS:
            pack = functools.partial(_pack, kind=kind, fmt=fmt)
            packed = jax.block_until_ready(pack(x))
            out = jax.block_until_ready(kvq_jax.unpack_kv(packed))
            assert out.shape == x.shape and out.dtype == x.dtype
            timings = {
                "pack": _timing.median_time(pack, x, warmup=warmup, repeats=repeats),
                "unpack": _timing.median_time(
                    kvq_jax.unpack_kv, packed, warmup=warmup, repeats=repeats
                ),
            }
            for op, t in timings.items():
                rows.append(
                    {
                        "shape": label,
                        "format": fmt,
                        "kind": kind,
                        "axis": packed.axis,
                        "op": op,
                        "ms": t.median_ms,
                        "min_ms": t.min_s * 1e3,
                        "gbps": _timing.gbps(nbytes, t.median_s),
                        "x_copy": t.median_s / copy.median_s,
                        "bits_per_element": packed.bits_per_element,
                        "storage_bytes": packed.storage_bytes,
                    }
                )
    return rows


def main(argv=None) -> int:
    args = _timing.bench_parser(__doc__).parse_args(argv)
    warmup, repeats = _timing.repeat_counts(args, quick=(1, 3), full=(3, 15))

    header = _timing.device_header()
    print(header)
    print(
        f"kvq {kvq_jax.__version__}; formats {', '.join(kvq_jax.CODECS)}; bf16 input; "
        f"median of {repeats} runs after {warmup} warm-up; GB/s = bf16 bytes (pack: input, "
        f"unpack: output) / median time; x copy = time / time of a jitted copy"
    )
    rows = []
    for shape in SHAPES:
        rows += bench_shape(shape, warmup=warmup, repeats=repeats)
    _timing.report(args, header, rows, COLUMNS, warmup=warmup, repeats=repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
