"""`kvq loops`: what a looped (Ouro) model does with its loops, on a text.

Teacher forced over the text's token ids, cut into consecutive windows of the model's context
(`max_position_embeddings` tokens; each window starts a fresh context, its first token is not
predicted): per loop l, the mean next-token NLL (nats/token) of loop l's logits, and the
histogram of exit loops under Ouro's exit rule at the model's threshold (the first loop whose
cumulative exit probability from the gate reaches the threshold; `kvq_jax.models.ouro`).

    stats = loop_statistics(model.params, model.config, ids)
    stats["nll_per_loop"]          # [N] floats, nats/token, loop 1 first
    stats["exit_loop_histogram"]   # [N] ints: tokens exiting at each loop (sum: stats["tokens"])

`run(args)` is the command: errors print one line `kvq loops: error: ...` and return 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import numpy as np

from kvq_jax.core.checks import check_output_folders

DESCRIPTION = (
    "Per-loop next-token NLL of a looped (Ouro) model over a text (teacher forced, windows of "
    "the model's context) and the histogram of exit loops at the model's early-exit threshold."
)
#: The text a checkpoint directory may ship for `kvq loops` (its held-out split).
DEFAULT_TEXT = "heldout.txt"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of `kvq loops`."""
    parser.add_argument("--model", required=True,
                        help="an Ouro checkpoint: 'looped-tiny', a HF directory, or "
                             "random:ouro-tiny")  # fmt: skip
    parser.add_argument("--text", default=None, metavar="FILE",
                        help=f"UTF-8 text (default: the checkpoint's {DEFAULT_TEXT}, "
                             "e.g. looped-tiny's held-out split)")  # fmt: skip
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="early-exit threshold in (0, 1] (default: the checkpoint's)",
    )
    parser.add_argument("--window", type=int, default=None,
                        help="tokens per window (default: the model's "
                             "max_position_embeddings)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="use only the text's first N token ids")  # fmt: skip
    parser.add_argument("--batch", type=int, default=8, help="windows per forward")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))


@functools.cache
def _window_stats():
    """The jitted (params, config, tokens [B, W], threshold) -> nll [N, B, W-1] f32 of each
    loop, exit_loop [B, W-1] int32, exit probabilities [B, W-1, N] f32 (the positions that
    predict a next token). Built on first use: `kvq` parses its arguments without JAX."""
    import jax
    import jax.numpy as jnp

    from kvq_jax.models import ouro

    @functools.partial(jax.jit, static_argnames="config")
    def stats(params, config, tokens, threshold):
        loop_logits, gate_logits = ouro.loop_outputs(params, config, tokens)
        logp = jax.nn.log_softmax(loop_logits[:, :, :-1].astype(jnp.float32), axis=-1)
        target = jnp.broadcast_to(tokens[None, :, 1:, None], (*logp.shape[:3], 1))
        nll = -jnp.take_along_axis(logp, target, axis=-1)[..., 0]
        probs = ouro.exit_probabilities(gate_logits)
        exit_loop = ouro.exit_loops(probs, threshold)
        return nll, exit_loop[:, :-1], probs[:, :-1]

    return stats


def windows(ids: np.ndarray, window: int) -> list[np.ndarray]:
    """Consecutive windows [<= window] of the ids [n] (the last one shorter; one of a single
    token is dropped: it predicts nothing)."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    ids = np.asarray(ids)
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) > 1]


def loop_statistics(
    params: dict, config, ids, *, window: int | None = None, threshold: float | None = None,
    batch: int = 8,
) -> dict:  # fmt: skip
    """Per-loop NLL and exit histogram of an Ouro model over token ids [n] (int).

    window: tokens per window (default config.max_position_embeddings); threshold: the exit
    threshold (default config.early_exit_threshold). Returns a JSON-ready dict: tokens (the
    positions scored, n minus one per window), window, threshold, loops, nll_per_loop [N]
    (nats/token), exit_loop_histogram [N] (counts, loop 1 first), exit_fraction [N],
    mean_exit_probability [N] (the gate's exit distribution averaged over tokens),
    nll_at_exit (NLL of each token's exit loop: the model's returned logits),
    mean_exit_loop (1-based).
    """
    if config.arch != "ouro":
        raise ValueError(f"model must be an Ouro (looped) model, got arch {config.arch!r}")
    window = config.max_position_embeddings if window is None else int(window)
    threshold = config.early_exit_threshold if threshold is None else float(threshold)
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 1 or len(ids) < 2:
        raise ValueError(f"ids must be 1-D with at least 2 tokens, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        raise ValueError(
            f"ids must lie in [0, {config.vocab_size}), got [{ids.min()}, {ids.max()}]"
        )
    n = config.num_loops
    nll_sum = np.zeros(n, np.float64)
    hist = np.zeros(n, np.int64)
    exit_nll, prob_sum, count = 0.0, np.zeros(n, np.float64), 0
    groups: dict[int, list[np.ndarray]] = {}
    for w in windows(ids, window):
        groups.setdefault(len(w), []).append(w)
    for _, ws in sorted(groups.items()):
        for i in range(0, len(ws), batch):
            chunk = np.stack(ws[i : i + batch]).astype(np.int32)
            nll, exit_loop, probs = _window_stats()(params, config, chunk, np.float32(threshold))
            nll = np.asarray(nll, np.float64)
            exit_loop = np.asarray(exit_loop)
            nll_sum += nll.sum(axis=(1, 2))
            hist += np.bincount(exit_loop.ravel(), minlength=n)[:n]
            exit_nll += np.take_along_axis(nll, exit_loop[None], axis=0).sum()
            prob_sum += np.asarray(probs, np.float64).sum(axis=(0, 1))
            count += exit_loop.size
    return {
        "tokens": int(count),
        "window": window,
        "threshold": threshold,
        "loops": n,
        "nll_per_loop": (nll_sum / count).tolist(),
        "exit_loop_histogram": hist.tolist(),
        "exit_fraction": (hist / count).tolist(),
        "mean_exit_probability": (prob_sum / count).tolist(),
        "nll_at_exit": exit_nll / count,
        "mean_exit_loop": float((hist * np.arange(1, n + 1)).sum() / count),
    }


def run(args) -> int:
    """`kvq loops`: print the table, write --json; 2 on an input error."""
    from kvq_jax.models import load_model

    try:
        if args.window is not None and args.window < 2:
            raise ValueError("--window must be >= 2")
        check_output_folders(json=args.json)
        try:
            model = load_model(args.model, args.dtype)
        except (ImportError, OSError) as e:
            raise ValueError(str(e)) from None
        if model.config.arch != "ouro":
            raise ValueError(f"--model must be an Ouro (looped) model, got {model.config.arch}")
        if model.tokenizer is None:
            raise ValueError(f"--model {args.model!r} has no tokenizer.json: no text to score")
        text_path = args.text
        if text_path is None:
            text_path = pathlib.Path(model.source["path"]) / DEFAULT_TEXT
            if not text_path.is_file():
                raise ValueError(f"--text is required: {args.model!r} ships no {DEFAULT_TEXT}")
        try:
            text = pathlib.Path(text_path).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--text {text_path}: {e.strerror or e}") from None
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        if args.max_tokens is not None:
            if args.max_tokens < 2:
                raise ValueError("--max-tokens must be >= 2")
            ids = ids[: args.max_tokens]
        stats = loop_statistics(model.params, model.config, ids, window=args.window,
                                threshold=args.threshold, batch=args.batch)  # fmt: skip
    except ValueError as e:
        print(f"kvq loops: error: {e}", file=sys.stderr)
        return 2
    result = {"model": args.model, "text": str(text_path), "dtype": args.dtype, **stats}
    print(format_table(result))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def format_table(result: dict) -> str:
    """The per-loop table of a `loop_statistics` result (plus model / text keys)."""
    lines = [
        f"kvq loops: {result.get('model', '?')} on {result.get('text', '?')}: "
        f"{result['tokens']} tokens, windows of {result['window']}, threshold "
        f"{result['threshold']:g}",
        "loop  NLL (nats/token)  exit tokens  exit share  mean p(exit)",
    ]
    for i in range(result["loops"]):
        lines.append(
            f"{i + 1:>4}  {result['nll_per_loop'][i]:>16.4f}  "
            f"{result['exit_loop_histogram'][i]:>11}  {result['exit_fraction'][i]:>10.1%}  "
            f"{result['mean_exit_probability'][i]:>12.3f}"
        )
    lines.append(
        f"NLL at exit {result['nll_at_exit']:.4f}; mean exit loop {result['mean_exit_loop']:.2f}"
    )
    return "\n".join(lines)
