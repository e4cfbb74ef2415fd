"""`kvq generate`: generate text with the engine under a KV storage policy and measure it.

Prints the text, the prefill and decode rates and the stored KV bytes per token (the pages:
packed base and residual planes over every layer and loop) with the ratio to the same K/V in
bfloat16. Timing: the prefill programs the prompt needs and the decode program are compiled
first, ahead of time (`compile_s`), then the request runs once, measured; prefill tokens/s
counts prompt tokens, decode tokens/s the tokens of decode steps (the first new token comes
from the prefill); `loops_per_token` is the mean number of loops a decode step ran (fewer
than the model's when exits skip loops). `--model random:ouro-1.4b` (or `random:ouro-tiny`)
runs seeded random weights of that shape; a model without a tokenizer takes `--prompt-ids`,
or by default `--prompt-len` seeded random ids. Errors (unknown model or policy, prompt too long,
exhausted pool) print one line and exit with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from kvq_jax.core.checks import check_output_folders

DESCRIPTION = (
    "Generate with kvq_jax.engine (per-layer quantized paged KV caches, jitted prefill and "
    "decode) under a storage policy; print the text, prefill/decode tokens/s and the KV bytes "
    "per token with the ratio to bf16."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="'smollm2', a HF directory, a .gguf, or random:ouro-1.4b / "
                             "random:ouro-tiny (seeded random weights)")  # fmt: skip
    parser.add_argument("--policy", default="int4-g64+win", help="a kvq report policy name")
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    text.add_argument("--prompt-ids", help="prompt token ids, comma separated")
    parser.add_argument("--prompt-len", type=int, default=16,
                        help="a model without a tokenizer and no --prompt-ids: this many "
                             "seeded random prompt ids")  # fmt: skip
    parser.add_argument("--loop-kv", default="all", choices=("all", "last", "mean"),
                        help="what later tokens attend across loops: every loop's K/V (all), "
                             "one shared plane of the last loop's or the mean K/V")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--loops",
        type=int,
        default=None,
        help="loops (default: the checkpoint's; on a plain model, > 1 is an emulation)",
    )
    parser.add_argument("--exit-threshold", type=float, default=None,
                        help="Ouro: the early-exit threshold (default: the checkpoint's; "
                             "< 1 exits early and skips the loops after)")  # fmt: skip
    parser.add_argument("--compare", default=None, help="also run this policy (e.g. bf16)")
    parser.add_argument("--tables", default=None, metavar="TABLES.npz",
                        help="key tables from kvq calibrate for an intb-* policy (instead of "
                             "the shipped ones its name gives)")  # fmt: skip
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results here")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="model compute and cache dtype (auto: float32 on the CPU, "
                             "whose XLA has no fast bfloat16 products; bfloat16 on "
                             "accelerators)")  # fmt: skip
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--num-pages", type=int, default=None,
                        help="pool pages (default: max-pages-per-seq)")  # fmt: skip
    parser.add_argument("--max-pages-per-seq", type=int, default=None,
                        help="default: enough for prompt + max-new-tokens")  # fmt: skip
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", help="cache ops backend (auto, xla, ...)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="no ahead-of-time compile: the measured run compiles")  # fmt: skip


class _Error(Exception):
    pass


def resolve_dtype(name: str) -> str:
    """`--dtype` as the model runs it: "auto" is float32 on the CPU backend (XLA:CPU widens
    bfloat16 products: SmolLM2 decodes about 3x slower in bfloat16 there) and bfloat16 on
    accelerators; an explicit dtype as given."""
    if name != "auto":
        return name
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def _prompt_ids(args, model) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            bad = args.prompt_ids
            raise _Error(f"--prompt-ids must be comma-separated ints, got {bad!r}") from None
    if args.prompt is None:
        if model.tokenizer is not None:
            raise _Error("pass --prompt TEXT or --prompt-ids IDS")
        if args.prompt_len < 1:
            raise _Error("--prompt-len must be >= 1")
        rng = np.random.default_rng(args.seed)
        return rng.integers(1, model.config.vocab_size, args.prompt_len).tolist()
    if model.tokenizer is None:
        raise _Error("the model has no tokenizer: pass --prompt-ids")
    return list(model.tokenizer.encode(args.prompt))


def _decode_text(model, tokens) -> str:
    if model.tokenizer is None:
        return " ".join(str(t) for t in tokens)
    return model.tokenizer.decode(tokens, skip_special_tokens=True)


def _run_policy(model, policy, prompt, args, *, forced=None, keep_logits=False,
                skip_exited=None) -> dict:  # fmt: skip
    from kvq_jax.engine import Engine

    ps = args.page_size
    need = -(-(len(prompt) + args.max_new_tokens) // ps)
    per_seq = args.max_pages_per_seq or need
    engine = Engine(
        model, policy, num_pages=args.num_pages or per_seq, page_size=ps, max_seqs=1,
        max_pages_per_seq=per_seq, loops=args.loops, prefill_chunk=args.prefill_chunk,
        backend=args.backend, loop_kv=args.loop_kv, skip_exited=skip_exited,
    )  # fmt: skip
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, seed=args.seed, keep_logits=keep_logits)  # fmt: skip
    if forced is not None:
        options.update(max_new_tokens=len(forced), forced_tokens=forced)
    engine.make_request(prompt, **options)  # validate before any compilation
    compile_s = None
    if not args.no_warmup:
        compile_s = engine.compile_steps(len(prompt))
    request = engine.add_request(prompt, **options)
    engine.run()
    st = engine.stats
    kv, bf16 = engine.kv_bytes_per_token(), engine.bf16_bytes_per_token()
    return {
        "policy": engine.policy.name,
        "tokens": request.tokens,
        "text": _decode_text(model, request.tokens),
        "finish_reason": request.finish_reason,
        "exit_loops": request.exit_loops,
        "prefill_tokens": st["prefill_tokens"],
        "prefill_s": st["prefill_s"],
        "prefill_tokens_per_s": st["prefill_tokens"] / max(st["prefill_s"], 1e-9),
        "decode_tokens": st["decode_tokens"],
        "decode_s": st["decode_s"],
        "decode_tokens_per_s": st["decode_tokens"] / max(st["decode_s"], 1e-9),
        "compile_s": compile_s,
        "loop_kv": engine.loop_kv,
        "every_loop_reason": engine.every_loop_reason,
        "loops_per_token": st["decode_loops"] / st["decode_steps"] if st["decode_steps"] else None,
        "kv_bytes_per_token": kv,
        "bf16_bytes_per_token": bf16,
        "ratio_to_bf16": kv / bf16,
        "raw_rows_per_sequence": engine.raw_rows_per_sequence(),
        "calibration_bytes": engine.calibration_bytes(),
        "loops": engine.config.num_loops,
        "logits": np.stack(request.logits) if keep_logits else None,
    }


def compare(run: dict, base: dict, forced: dict) -> dict:
    """`run` against the `base` policy: greedy token agreement (over the shorter output) and
    the teacher-forced mean KL(base || run) per token (nats), where `forced` is `run`'s policy
    fed `base`'s tokens (both with logits)."""
    n = min(len(run["tokens"]), len(base["tokens"]))
    agree = sum(a == b for a, b in zip(run["tokens"][:n], base["tokens"][:n], strict=True))
    p = _log_softmax(base["logits"])
    q = _log_softmax(forced["logits"])
    kl = float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))
    return {"against": base["policy"], "token_agreement": agree / max(n, 1),
            "teacher_forced_kl": kl, "tokens_compared": n}  # fmt: skip


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _print_run(run: dict) -> None:
    print(f"[{run['policy']}] {run['text']}")
    c = run["compile_s"]
    if c is not None:
        print(f"  compile: prefill {c['prefill']:.1f} s ({len(c['prefill_shapes'])} shape(s)), "
              f"decode {c['decode']:.1f} s")  # fmt: skip
    print(
        f"  prefill: {run['prefill_tokens']} tokens in {run['prefill_s']:.3f} s = "
        f"{run['prefill_tokens_per_s']:.1f} tokens/s; decode: {run['decode_tokens']} tokens in "
        f"{run['decode_s']:.3f} s = {run['decode_tokens_per_s']:.1f} tokens/s "
        f"({run['finish_reason']})"
        + ("" if run["loops_per_token"] is None else
           f"; {run['loops_per_token']:.2f} loops/token")
        + ("" if run["every_loop_reason"] is None else
           f" (every loop runs: {run['every_loop_reason']})")
    )  # fmt: skip
    print(
        f"  KV bytes/token: {run['kv_bytes_per_token']:.1f} (bf16: "
        f"{run['bf16_bytes_per_token']}, ratio {run['ratio_to_bf16']:.3f}); plus "
        f"{run['raw_rows_per_sequence']} raw rows per sequence, layer and loop (staging page + "
        f"sink); loop_kv {run['loop_kv']}"
        + (f"; calibration tables {run['calibration_bytes']} B per model"
           if run["calibration_bytes"] else "")
    )  # fmt: skip
    c = run.get("compare")
    if c:
        print(
            f"  vs {c['against']}"
            + (" (both run every loop)" if c["every_loop"] else "")
            + f": greedy tokens agree {c['token_agreement']:.1%} of "
            f"{c['tokens_compared']}; teacher-forced KL on its continuation "
            f"{c['teacher_forced_kl']:.3g} nats/token"
        )


def run(args) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvq_jax.engine import resolve_policy
    from kvq_jax.models import load_model

    dtype = resolve_dtype(args.dtype)
    try:
        from kvq_jax.core.calibration import apply_key_tables

        policies = [resolve_policy(args.policy)]
        if args.compare:
            policies.append(resolve_policy(args.compare))
        policies = apply_key_tables(policies, args.tables)
        for name in ("max_new_tokens", "page_size", "prefill_chunk"):
            if getattr(args, name) < 1:
                raise _Error(f"--{name.replace('_', '-')} must be >= 1")
        if args.loops is not None and args.loops < 1:
            raise _Error("--loops must be an int >= 1")
        check_output_folders(json=args.json)
        try:
            model = load_model(args.model, dtype)
        except (ImportError, OSError) as e:  # MissingPackages: one message, one command
            raise _Error(str(e)) from None
        if args.exit_threshold is not None:
            if model.config.arch != "ouro":
                raise _Error("--exit-threshold needs an Ouro model (an exit gate)")
            if not 0.0 < args.exit_threshold <= 1.0:
                raise _Error("--exit-threshold must be in (0, 1]")
            config = dataclasses.replace(model.config, early_exit_threshold=args.exit_threshold)
            model = dataclasses.replace(model, config=config)
        prompt = _prompt_ids(args, model)
        keep = args.compare is not None  # logits of the base run for the KL
        # Compared policies decode with the same loops: where one must run every loop, so do
        # all three runs (exits that skip loops change what later tokens attend to).
        from kvq_jax.engine.engine import loop_skipping

        why = [loop_skipping(model.config, p, args.loop_kv, loops=args.loops)[1] for p in policies]
        every = keep and any(w is not None for w in why)
        skip = [False if every and w is None else None for w in why]
        runs = [_run_policy(model, policies[0], prompt, args, skip_exited=skip[0])]
        if keep:
            base = _run_policy(model, policies[1], prompt, args, keep_logits=True,
                               skip_exited=skip[1])  # fmt: skip
            forced = _run_policy(model, policies[0], prompt, args, forced=base["tokens"],
                                 keep_logits=True, skip_exited=skip[0])  # fmt: skip
            runs[0]["compare"] = compare(runs[0], base, forced)
            runs[0]["compare"]["every_loop"] = every
            runs.append(base)
            for run, other, asked in ((runs[0], base, skip[0]), (base, runs[0], skip[1])):
                if asked is False:  # made to run every loop by the policy it is compared with
                    run["every_loop_reason"] = f"compared with {other['policy']}, which does"
        for r in runs:
            r.pop("logits")
    except (_Error, ValueError, FileNotFoundError) as e:
        print(f"kvq generate: error: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    loops = runs[0]["loops"]
    emulated = cfg.arch != "ouro" and loops > 1
    print(
        f"kvq generate: {args.model} ({cfg.arch}, {cfg.num_layers} layers x {loops} loop(s)"
        f"{' (emulated)' if emulated else ''}, {dtype}), {len(prompt)} prompt tokens"
    )
    for r in runs:
        _print_run(r)
    if args.json:
        report = {"model": args.model, "arch": cfg.arch, "dtype": dtype, "loops": loops,
                  "emulated": emulated, "prompt_tokens": len(prompt), "runs": runs}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
