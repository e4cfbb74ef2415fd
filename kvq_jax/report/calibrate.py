"""Calibrate INTB key tables (FORMAT.md section 2b) from a capture, one per captured layer.

    python -m kvq_jax.report.calibrate CAPTURE.npz OUT.npz --models NAME[,NAME...]
        [--mean-bits 4] [--group-size 64] [--mean-query] [--pre-rope THETA] [--source TEXT]

CAPTURE: a `kvq report --kv` capture with queries (its meta lists the model layer of each
captured layer in "layers"); loop 0 of every window is used. Calibrate on other text than the
report evaluates on. `--mean-query` also stores each layer's heavy-row selection table (the
mean query per query head, FORMAT.md 5a); `--pre-rope THETA` calibrates for keys stored
before RoPE (THETA: the model's rope_theta). OUT is read by
`kvq_jax.core.calibration.load_key_tables`; the shipped `kvq_jax/data/intb_smollm2.npz`
and `intb_smollm2_heavy.npz` were made this way (see their `source`).

`kvq calibrate --model NAME|DIR|FILE.gguf --text FILE ... --out TABLES.npz` does it all in one
command: it runs the model (JAX, `kvq_jax.models.capture.attention_inputs_per_layer`) on
windows of the given text, captures every layer's loop-0 keys and queries, and writes the
tables; `--tables TABLES.npz` on `kvq generate` and `kvq report` puts a key-tables policy on
them (`kvq_jax.core.calibration.with_key_tables`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

from kvq_jax.core.calibration import (
    KeyTables,
    intb_bit_table,
    mean_query_table,
    save_key_tables,
)
from kvq_jax.core.checks import check_output_folders
from kvq_jax.report.capture import load_capture, make_capture, save_capture


def calibrate(
    capture, *, models, mean_bits=4.0, group_size=64, source="", mean_query=False, rope_theta=None
) -> KeyTables:
    """KeyTables from a capture's loop 0 (keys and queries of every window)."""
    if capture.q is None:
        raise ValueError("the capture has no queries (q): the tables weight keys by them")
    layers = capture.meta.get("layers")
    if not isinstance(layers, list) or len(layers) != capture.num_layers:
        raise ValueError(
            f"the capture's meta must list its model layers ('layers'), got {layers!r}"
        )
    k = np.asarray(capture.k[:, 0], np.float32)  # [W, N, T, H, D]
    q = np.asarray(capture.q[:, 0], np.float32)
    theta = None if rope_theta is None else float(rope_theta)
    if theta is not None and not theta > 0:
        raise ValueError(f"rope_theta must be positive, got {rope_theta!r}")
    tables = {
        int(layer): intb_bit_table(
            k[:, n], q[:, n], mean_bits=mean_bits, group_size=group_size, rope_theta=theta
        )
        for n, layer in enumerate(layers)
    }
    queries = None
    if mean_query:
        heads = k.shape[-2]
        queries = {int(layer): mean_query_table(q[:, n], heads) for n, layer in enumerate(layers)}
    return KeyTables(
        models=tuple(models),
        tables=tables,
        group_size=group_size,
        source=source,
        mean_query=queries,
        rope_theta=theta,
    )


DESCRIPTION = (
    "Calibrate INTB key tables (and, with --mean-query, heavy-row tables) for a model from text: "
    "runs the model on windows of the text, captures every layer's keys and queries (loop 0) "
    "and writes TABLES.npz for `--tables` of kvq generate / kvq report."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of `kvq calibrate`."""
    parser.add_argument("--model", required=True,
                        help="smollm2, looped-tiny, a HF directory or a .gguf file")  # fmt: skip
    parser.add_argument("--text", required=True, nargs="+", metavar="FILE",
                        help="UTF-8 text file(s) to calibrate on (judge the tables on "
                             "another text)")  # fmt: skip
    parser.add_argument("--out", required=True, metavar="TABLES.npz")
    parser.add_argument("--windows", type=int, default=8, help="text windows (spread evenly)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per window")
    parser.add_argument("--batch", type=int, default=4, help="windows per forward")
    parser.add_argument("--mean-bits", type=float, default=4.0)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--mean-query", action="store_true",
                        help="also store heavy-row mean-query tables")  # fmt: skip
    parser.add_argument("--pre-rope", action="store_true",
                        help="tables for keys stored before RoPE (the model's base)")  # fmt: skip
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--names", default="", metavar="A,B",
                        help="more names the tables' model goes by (a capture's meta 'model'); "
                             "--model, its folder name and a GGUF's model name always")  # fmt: skip
    parser.add_argument("--save-capture", default=None, metavar="FILE.npz",
                        help="also write the capture (kvq report --kv format)")  # fmt: skip


def text_id_windows(tokenizer, files, windows: int, tokens: int) -> tuple[np.ndarray, list]:
    """`windows` windows of `tokens` ids [W, T] int32 spread evenly over the files' token ids
    (concatenated in order), and [(file, first id index)] of each."""
    ids, owners = [], []
    for f in files:
        text = pathlib.Path(f).read_text(encoding="utf-8", errors="replace")
        part = tokenizer.encode(text, add_special_tokens=False)
        ids.extend(part)
        owners.extend([str(f)] * len(part))
    if len(ids) < tokens:
        raise ValueError(f"--text: {len(ids)} tokens, fewer than --tokens {tokens}")
    span = len(ids) - tokens
    starts = [span * i // max(windows - 1, 1) for i in range(windows)]
    out = np.asarray([ids[a : a + tokens] for a in starts], np.int32)
    return out, [(owners[a], a) for a in starts]


def capture_from_model(model, ids: np.ndarray, *, batch: int = 4, loops: int = 1, meta=None):
    """A `Capture` ([W, loops, layers, T, H, D], every layer, float32) of the model's post-RoPE
    K, V and Q on token windows `ids` [W, T] (`attention_inputs_per_layer`, `batch` windows per
    forward)."""
    import jax.numpy as jnp

    from kvq_jax.models.capture import attention_inputs_per_layer

    parts = {"q": [], "k": [], "v": []}
    for a in range(0, len(ids), batch):
        tokens = jnp.asarray(ids[a : a + batch])
        q, k, v = attention_inputs_per_layer(model.params, model.config, tokens, loops=loops)
        for name, x in (("q", q), ("k", k), ("v", v)):  # [N, L, B, T, H, D] -> [B, N, L, ...]
            parts[name].append(np.moveaxis(np.asarray(x, np.float32), 2, 0))
    c = model.config
    meta = dict(meta or {}, layers=list(range(c.num_layers)), loops=loops)
    return make_capture(*(np.concatenate(parts[n]) for n in ("k", "v", "q")), meta=meta)


def run(args) -> int:
    """`kvq calibrate`: errors print one line `kvq calibrate: error: ...` and return 2."""
    t0 = time.perf_counter()
    try:
        from kvq_jax.models import load_model

        for n, name in ((args.windows, "--windows"), (args.tokens, "--tokens"),
                        (args.batch, "--batch")):  # fmt: skip
            if n < 1:
                raise ValueError(f"{name} must be >= 1, got {n}")
        for f in args.text:
            if not pathlib.Path(f).is_file():
                raise ValueError(f"--text: {f} is not a file")
        out = pathlib.Path(args.out)
        check_output_folders(out=out, save_capture=args.save_capture)
        model = load_model(args.model, args.dtype)
        if model.tokenizer is None:
            raise ValueError(f"--model {args.model}: the checkpoint has no tokenizer")
        ids, where = text_id_windows(model.tokenizer, args.text, args.windows, args.tokens)
        names = [args.model, pathlib.Path(args.model).name, *args.names.split(",")]
        path = pathlib.Path(str(model.source.get("path", "")))
        if path.suffix == ".gguf":  # "SmolLM2-135M-Instruct.Q4_1.gguf": a capture's model name
            names.append(path.name.split(".")[0])
        names = [n for n in dict.fromkeys(names) if n]
        source = (f"kvq calibrate: {args.windows} windows x {args.tokens} tokens of "
                  f"{', '.join(pathlib.Path(f).name for f in args.text)}")  # fmt: skip
        capture = capture_from_model(model, ids, batch=args.batch,
                                     meta={"model": args.model, "text": where})  # fmt: skip
        tables = calibrate(
            capture, models=names, mean_bits=args.mean_bits, group_size=args.group_size,
            source=source, mean_query=args.mean_query,
            rope_theta=model.config.rope_theta if args.pre_rope else None,
        )  # fmt: skip
    except (ValueError, TypeError, OSError, ImportError) as e:
        print(f"kvq calibrate: error: {e}", file=sys.stderr)
        return 2
    save_key_tables(out, tables)
    if args.save_capture:
        save_capture(args.save_capture, capture)
    bits = np.mean([np.mean(t) for t in tables.tables.values()])
    print(json.dumps({"out": str(out), "model": args.model, "layers": len(tables.tables),
                      "mean_bits": round(float(bits), 4), "group_size": tables.group_size,
                      "mean_query": tables.mean_query is not None,
                      "rope_theta": tables.rope_theta, "source": source,
                      "seconds": round(time.perf_counter() - t0, 1)}))  # fmt: skip
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvq_jax.report.calibrate")
    parser.add_argument("capture")
    parser.add_argument("out")
    parser.add_argument("--models", required=True, help="model names the tables are for")
    parser.add_argument("--mean-bits", type=float, default=4.0)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--source", default="", help="what the capture holds (recorded)")
    parser.add_argument(
        "--mean-query", action="store_true", help="also store heavy-row mean-query tables"
    )
    parser.add_argument(
        "--pre-rope",
        type=float,
        default=None,
        metavar="THETA",
        help="tables for keys stored before RoPE with base THETA (the model's rope_theta)",
    )
    args = parser.parse_args(argv)
    try:
        capture = load_capture(args.capture)
        tables = calibrate(
            capture,
            models=[m for m in args.models.split(",") if m],
            mean_bits=args.mean_bits,
            group_size=args.group_size,
            source=args.source,
            mean_query=args.mean_query,
            rope_theta=args.pre_rope,
        )
    except (ValueError, TypeError, OSError) as e:
        print(f"calibrate: error: {e}", file=sys.stderr)
        return 2
    save_key_tables(args.out, tables)
    print(f"wrote {len(tables.tables)} layer tables to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
