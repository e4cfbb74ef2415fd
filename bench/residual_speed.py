"""Loop-stack throughput: `encode_loops` and `decode_loop` for an Ouro-like 4-loop stack.

    python bench/residual_speed.py [--quick] [--json PATH] [--repeats N]

Input: bf16 [L=4, T=2048, H=16, D=128], a KV-like loop 0 and each later loop the previous plus
a perturbation (so residuals are small, as in a looped LM). For each policy (base format +
residual format) and kind: `encode_loops` (the whole stack, one jitted call, dense loops as a
`lax.scan`) and `decode_loop(loop=3)` (the last loop, rebuilt through every residual) are
timed as the median of N runs after a warm-up, and `decode_loop(loop=0)` (the base alone)
beside it: "x loop 0" is the loop-3 decode time over the loop-0 one (issue 15's goal: <= 2.5).
GB/s counts the bf16 bytes of the stack for encode and of the one reconstructed loop for
decode; "x copy" divides by a jitted copy of the same bytes in the same process. The
reconstruction error of every loop is printed as well.
"""

from __future__ import annotations

import functools
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing

import kvq_jax

SHAPE = (4, 2048, 16, 128)
POLICIES = (("int4", "int4"), ("int4", "nvfp4"), ("nvfp4", "nvfp4"), ("fp8_e4m3", "fp8_e4m3"))
COLUMNS = (
    ("policy", "base+residual", None),
    ("kind", "kind", None),
    ("op", "op", None),
    ("ms", "ms", ".3f"),
    ("gbps", "GB/s", ".2f"),
    ("x_copy", "x copy", ".2f"),
    ("x_loop0", "x loop 0", ".2f"),
    ("bits_per_element", "bits/elem", ".4f"),
    ("errors", "rel L2 per loop", None),
)


def loop_stack(shape=SHAPE, step: float = 0.25, seed: int = 0) -> jax.Array:
    """[L, T, H, D] bf16: loop 0 with per-channel offsets, then small random steps."""
    key0, key1, key2 = jax.random.split(jax.random.key(seed), 3)
    _, t, h, d = shape
    base = jax.random.normal(key0, (t, h, d)) + 2.0 * jax.random.normal(key1, (1, h, d))
    steps = step * jax.random.normal(key2, (shape[0] - 1, t, h, d))
    loops = jnp.concatenate([base[None], base[None] + jnp.cumsum(steps, axis=0)])
    return loops.astype(jnp.bfloat16)


def relative_errors(recon, loops) -> str:
    r, x = np.asarray(recon, np.float32), np.asarray(loops, np.float32)
    errs = [np.linalg.norm(r[i] - x[i]) / np.linalg.norm(x[i]) for i in range(len(x))]
    return " ".join(f"{100 * e:.2f}%" for e in errs)


def bench(*, warmup: int, repeats: int) -> list[dict]:
    loops = loop_stack()
    stack_bytes = loops.size * loops.dtype.itemsize
    loop_bytes = stack_bytes // loops.shape[0]
    copy_stack = _timing.median_time(
        *_flatten(_timing.copy_baseline(loops)), warmup=warmup, repeats=repeats
    )
    copy_loop = _timing.median_time(
        *_flatten(_timing.copy_baseline(loops[0])), warmup=warmup, repeats=repeats
    )
    rows = [
        {
            "policy": "(copy)",
            "op": "stack",
            "ms": copy_stack.median_ms,
            "gbps": _timing.gbps(stack_bytes, copy_stack.median_s),
            "x_copy": 1.0,
        },
        {
            "policy": "(copy)",
            "op": "one loop",
            "ms": copy_loop.median_ms,
            "gbps": _timing.gbps(loop_bytes, copy_loop.median_s),
            "x_copy": 1.0,
        },
    ]
    last = loops.shape[0] - 1
    for base_format, residual_format in POLICIES:
        for kind in ("key", "value"):
            encode = functools.partial(
                kvq_jax.encode_loops,
                kind=kind,
                base_format=base_format,
                residual_format=residual_format,
            )
            decode = functools.partial(kvq_jax.decode_loop, loop=last)
            code = jax.block_until_ready(encode(loops))
            errors = relative_errors(kvq_jax.decode_loops(code), loops)
            enc = _timing.median_time(encode, loops, warmup=warmup, repeats=repeats)
            dec = _timing.median_time(decode, code, warmup=warmup, repeats=repeats)
            dec0 = _timing.median_time(
                functools.partial(kvq_jax.decode_loop, loop=0),
                code,
                warmup=warmup,
                repeats=repeats,
            )
            common = {
                "policy": f"{base_format}+{residual_format}",
                "kind": kind,
                "bits_per_element": code.bits_per_element,
            }
            rows.append(
                {
                    **common,
                    "op": "encode_loops",
                    "ms": enc.median_ms,
                    "gbps": _timing.gbps(stack_bytes, enc.median_s),
                    "x_copy": enc.median_s / copy_stack.median_s,
                    "errors": errors,
                }
            )
            rows.append(
                {
                    **common,
                    "op": "decode_loop(0)",
                    "ms": dec0.median_ms,
                    "gbps": _timing.gbps(loop_bytes, dec0.median_s),
                    "x_copy": dec0.median_s / copy_loop.median_s,
                }
            )
            rows.append(
                {
                    **common,
                    "op": f"decode_loop({last})",
                    "ms": dec.median_ms,
                    "gbps": _timing.gbps(loop_bytes, dec.median_s),
                    "x_copy": dec.median_s / copy_loop.median_s,
                    "x_loop0": dec.median_s / dec0.median_s,
                }
            )
    return rows


def _flatten(fn_and_args):
    fn, args = fn_and_args
    return (fn, *args)


def main(argv=None) -> int:
    args = _timing.bench_parser(__doc__).parse_args(argv)
    warmup, repeats = _timing.repeat_counts(args, quick=(1, 3), full=(2, 10))
    header = _timing.device_header()
    print(header)
    print(
        f"loop stack bf16 {list(SHAPE)} ({math.prod(SHAPE) * 2 / 2**20:.0f} MiB); median of "
        f"{repeats} runs after {warmup} warm-up"
    )
    rows = bench(warmup=warmup, repeats=repeats)
    _timing.report(args, header, rows, COLUMNS, warmup=warmup, repeats=repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
