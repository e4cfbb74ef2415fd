"""A real 4-loop K/V capture from looped-tiny, its loop-to-loop deltas, and residual vs absolute
loops at equal bits (issue 25, "Use it").

    python bench/looped_kv.py [--model looped-tiny] [--windows 8 --tokens 256]
        [--out /tmp/looped_tiny_kv.npz] [--policies int4-g64,nvfp4,fp8,flashloop-kivi]
        [--compare kvq_jax/data/real_kv.npz] [--json PATH]

1. Capture: the model's post-RoPE K, V and Q of every layer in every loop
   (`kvq_jax.report.calibrate.capture_from_model`, i.e. `attention_inputs_per_layer`: a
   cache-free JAX forward, float32), on `--windows` windows of `--tokens` tokens spread evenly
   over the text (default: the checkpoint's held-out split, Hamlet for looped-tiny), rounded
   to bfloat16 and written in the `kvq report --kv` format
   ([windows, loops, layers, tokens, heads, dim]).
2. Deltas: per captured layer and later loop l, ||X_l - X_(l-1)|| / ||X_l|| for K and V
   (`delta_ratios`: float32, pooled over windows, tokens, heads and dim), for this capture and
   for `--compare` (default: the embedded SmolLM2 capture, whose loops are emulated).
3. Residual vs absolute: each `--policies` policy (later loops stored as deltas against the
   reconstructed previous loop) beside its absolute twin (`absolute_twin`: the same formats,
   every later loop of K and V packed on its own; the same bits), evaluated by `kvq report`'s
   own code (`kvq_jax.report.evaluate`) on both captures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import ml_dtypes
import numpy as np

from kvq_jax.core.policies import POLICIES, Policy
from kvq_jax.report.capture import EMBEDDED_PATH, Capture, load_capture, save_capture

DEFAULT_POLICIES = "int4-g64,nvfp4,fp8,flashloop-kivi"


def capture(model, ids: np.ndarray, *, meta=None, dtype="bfloat16", batch=4) -> Capture:
    """Every layer's post-RoPE K/V/Q in every loop of the model on windows ids [W, T], in
    `dtype` (the forward runs in the model's own dtype)."""
    from kvq_jax.report.calibrate import capture_from_model

    cap = capture_from_model(model, ids, batch=batch, loops=model.config.num_loops, meta=meta)
    cast = np.dtype(getattr(ml_dtypes, dtype, dtype))
    k, v, q = (x.astype(cast) for x in (cap.k, cap.v, cap.q))
    return Capture(k=k, v=v, q=q, meta={**cap.meta, "dtype": dtype})


def delta_ratios(x: np.ndarray) -> np.ndarray:
    """[layers, loops - 1]: ||X_l - X_(l-1)|| / ||X_l|| of x [windows, loops, layers, ...] for
    l = 1 .. loops - 1, in float32, pooled over every axis but loop and layer."""
    x = np.asarray(x, np.float32)
    axes = tuple(i for i in range(x.ndim) if i not in (1, 2))
    diff = np.sqrt(np.sum(np.square(x[:, 1:] - x[:, :-1]), axis=axes))
    norm = np.sqrt(np.sum(np.square(x[:, 1:]), axis=axes))
    return (diff / norm).T


def absolute_twin(policy: Policy, num_loops: int) -> Policy:
    """The policy with every later loop of K and V stored absolute (same formats and bits)."""
    later = tuple(range(1, num_loops))
    return dataclasses.replace(policy, name=f"{policy.name}-abs", absolute=later, v_absolute=later)


def delta_table(name: str, cap: Capture) -> tuple[str, list[dict]]:
    layers = cap.meta.get("layers") or list(range(cap.num_layers))
    rows, lines = [], [f"{name}: ||X_l - X_(l-1)|| / ||X_l||"]
    head = "".join(f"{'l=' + str(i):>8}" for i in range(1, cap.num_loops))
    lines.append(f"{'layer':>6} {'':1}{head}")
    for kind, x in (("K", cap.k), ("V", cap.v)):
        for layer, r in zip(layers, delta_ratios(x), strict=True):
            rows.append({"capture": name, "kind": kind, "layer": layer, "ratios": r.tolist()})
            lines.append(f"{layer:>6} {kind}" + "".join(f"{v:8.3f}" for v in r))
    return "\n".join(lines), rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="looped-tiny")
    ap.add_argument("--text", default=None, help="UTF-8 text (default: the checkpoint's "
                    "heldout.txt)")  # fmt: skip
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/looped_tiny_kv.npz"))
    ap.add_argument("--compare", type=pathlib.Path, default=EMBEDDED_PATH)
    ap.add_argument("--policies", default=DEFAULT_POLICIES,
                    help="comma-separated; each beside its absolute twin ('' to skip)")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from kvq_jax.models import load_model
    from kvq_jax.report.calibrate import token_windows

    t0 = time.perf_counter()
    model = load_model(args.model, "float32")
    text = args.text or str(pathlib.Path(str(model.source.get("path", ""))) / "heldout.txt")
    ids, where = token_windows(model.tokenizer, [text], args.windows, args.tokens)
    meta = {
        "model": args.model,
        "architecture": model.config.arch,
        "num_model_layers": model.config.num_layers,
        "emulated": False,
        "loop_input": "the final RMSNorm output of the previous loop (the trained recurrence)",
        "text": [{"file": pathlib.Path(f).name, "first_token": int(a)} for f, a in where],
        "tokens": args.tokens,
        "compute_dtype": "float32",
        "post_rope": True,
        "arrays": "k, v, q: [windows, loops, layers, tokens, heads, dim]",
        "generator": "bench/looped_kv.py",
    }
    cap = capture(model, ids, meta=meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_capture(args.out, cap)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB): k {cap.k.shape} "
          f"q {cap.q.shape} {cap.dtype}, {time.perf_counter() - t0:.0f} s")  # fmt: skip

    out = {"args": {k: str(v) for k, v in vars(args).items()}, "deltas": [], "policies": []}
    captures = [(args.model, cap), (args.compare.name, load_capture(args.compare))]
    for name, c in captures:
        table, rows = delta_table(name, c)
        out["deltas"] += rows
        print("\n" + table)

    names = [p for p in args.policies.split(",") if p]
    if names:
        from kvq_jax.report.evaluate import evaluate
        from kvq_jax.report.render import format_table

        for name, c in captures:
            policies = [POLICIES["bf16"]]
            for p in names:
                policies += [POLICIES[p], absolute_twin(POLICIES[p], c.num_loops)]
            results = evaluate(c, policies, show_progress=False)
            print(f"\n{name}: residual (policy) vs absolute (policy-abs) later loops")
            print(format_table(results))
            out["policies"] += [{"capture": name, **r.to_dict()} for r in results]
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\n{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
