"""Disaggregated prefill and decode on a real model: the JAX engine alone, JAX prefill -> Torch
decode, and Torch prefill -> JAX decode (`kvq_torch_bridge.bridge.handoff`), greedy, on text
windows of the packaged corpora; prints whether each handoff gives the engine's tokens, where
they first differ (and the engine's top-1 margin there), the shared buffers, and the time of
each side.

    python bench/handoff.py --model smollm2 --policies int4-g64,nvfp4,kvq:fp8,bf16 \\
        --windows 2 --prompt-tokens 200 --new-tokens 32 --json /tmp/handoff.json

Both stacks load the same weights in float32 (SmolLM2: the packaged GGUF, dequantized by kvq
and by transformers): any token difference is the two implementations' arithmetic, not the
cache (the cache bytes are shared, not copied).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--policies", default="int4-g64,nvfp4,kvq:fp8,bf16")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--text", default=None,
                        help="text file for the prompts (default: Python's own difflib.py "
                        "source, always installed)")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from kvq_jax.engine import Engine
    from kvq_jax.models.loading import load_model
    from kvq_torch_bridge.bridge import handoff
    from kvq_torch_bridge.model_eval.loading import load_model as load_torch
    from kvq_torch_bridge.model_eval.text import text_windows

    t0 = time.perf_counter()
    model = load_model(args.model, "float32", tokenizer=False)
    torch_model = load_torch(args.model, dtype="float32")
    load_s = time.perf_counter() - t0
    import difflib

    text = args.text or difflib.__file__
    windows = text_windows(torch_model.tokenizer, args.windows, args.prompt_tokens, text)
    pages_per_seq = -(-(args.prompt_tokens + args.new_tokens) // args.page_size)

    def engine(policy):
        return Engine(model, policy.removeprefix("kvq:"), page_size=args.page_size,
                      num_pages=2 * pages_per_seq + 2, max_seqs=2,
                      max_pages_per_seq=pages_per_seq)  # fmt: skip

    rows = []
    for policy in args.policies.split(","):
        for w, window in enumerate(windows):
            prompt = window.ids.tolist()
            opts = dict(max_new_tokens=args.new_tokens, stop_ids=())
            t = time.perf_counter()
            (alone,) = engine(policy).generate([prompt], keep_logits=True, **opts)
            jax_s = time.perf_counter() - t
            eng = engine(policy)
            t = time.perf_counter()
            to_torch, view = handoff.jax_prefill_torch_decode(eng, torch_model.model, prompt,
                                                              **opts)  # fmt: skip
            to_torch_s = time.perf_counter() - t
            shared = len(view.shared_pointers)
            same_ptr = all(a == b for a, b in view.shared_pointers.values())
            view.close()
            eng = engine(policy)
            t = time.perf_counter()
            request, pointers = handoff.torch_prefill_jax_decode(eng, torch_model.model, prompt,
                                                                 **opts)  # fmt: skip
            eng.run()
            to_jax_s = time.perf_counter() - t
            same_ptr &= all(a == b for a, b in pointers.values())
            row = {"policy": policy, "window": w, "source": window.source,
                   "jax_alone_s": jax_s, "jax_to_torch_s": to_torch_s,
                   "torch_to_jax_s": to_jax_s, "shared_tensors": shared,
                   "pointers_equal": same_ptr}  # fmt: skip
            for name, tokens in (("jax_to_torch", to_torch), ("torch_to_jax", request.tokens)):
                d = first_difference(alone.tokens, tokens)
                row[f"{name}_equal"] = d is None
                row[f"{name}_first_difference"] = d
                if d is not None and d < len(alone.logits):
                    top2 = np.sort(alone.logits[d])[-2:]
                    row[f"{name}_margin_at_difference"] = float(top2[1] - top2[0])
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"model": args.model, "load_s": load_s, "args": vars(args), "rows": rows}
    print("\n| policy | window | JAX -> Torch tokens | Torch -> JAX tokens | shared tensors |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        cells = []
        for name in ("jax_to_torch", "torch_to_jax"):
            d = r[f"{name}_first_difference"]
            cells.append("equal" if d is None else f"differ from token {d}")
        print(f"| {r['policy']} | {r['window']} | {cells[0]} | {cells[1]} | "
              f"{r['shared_tensors']} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
