"""Compile seconds of the engine's prefill and decode programs against loops x layers.

    python bench/engine_compile.py [--quick] [--json PATH] [--model random:ouro-1.4b]
        [--grid 1x6,4x6,4x24] [--policy int4-g64] [--loop-kv all] [--prefill-tokens 64]

For each LOOPSxLAYERS of the grid: the model cut to its first LAYERS decoder layers, run at
LOOPS loops, an engine of one sequence; `Engine.compile_steps` compiles (ahead of time, on
the CPU here) the prefill program of one chunk of `--prefill-tokens` tokens and the decode
program, and reports the seconds of each. The steps scan over the layers
(`kvq_jax.engine.runner`), so the time should not grow with LAYERS; loops are unrolled (one
layer body per loop).
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing
from engine_decode import truncated

from kvq_jax.engine import Engine
from kvq_jax.models import load_model

COLUMNS = (
    ("loops", "loops", "d"),
    ("layers", "layers", "d"),
    ("policy", "policy", None),
    ("loop_kv", "loop_kv", None),
    ("prefill_s", "prefill compile s", ".1f"),
    ("decode_s", "decode compile s", ".1f"),
)


def main(argv=None) -> int:
    parser = _timing.bench_parser(__doc__)
    parser.add_argument("--model", default="random:ouro-1.4b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--grid", default=None, help="LOOPSxLAYERS list (default 1x6,4x6,4x24)")
    parser.add_argument("--policy", default="int4-g64")
    parser.add_argument("--loop-kv", default="all")
    parser.add_argument("--prefill-tokens", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    args = parser.parse_args(argv)
    grid = args.grid or ("1x2,2x2" if args.quick else "1x6,4x6,4x24")
    full = load_model(args.model, args.dtype, tokenizer=False)
    rows = []
    for item in grid.split(","):
        loops, layers = (int(x) for x in item.split("x"))
        model = truncated(full, layers)
        pages = -(-(args.prefill_tokens + 1) // args.page_size)
        engine = Engine(model, args.policy, num_pages=pages, page_size=args.page_size,
                        max_seqs=1, max_pages_per_seq=pages, loops=loops,
                        prefill_chunk=args.prefill_tokens, loop_kv=args.loop_kv)  # fmt: skip
        got = engine.compile_steps(args.prefill_tokens)
        row = dict(loops=loops, layers=model.config.num_layers, policy=args.policy,
                   loop_kv=args.loop_kv, prefill_s=got["prefill"],
                   decode_s=got["decode"])  # fmt: skip
        print(f"  {loops} x {row['layers']}: prefill {row['prefill_s']:.1f} s, decode "
              f"{row['decode_s']:.1f} s", flush=True)  # fmt: skip
        rows.append(row)
    header = (
        f"Engine compile seconds ({args.model}, {args.dtype}, {args.prefill_tokens}-token chunk)"
    )
    print(header)
    _timing.report(args, header, rows, COLUMNS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
