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
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from kvq_jax.core.calibration import (
    KeyTables,
    intb_bit_table,
    mean_query_table,
    save_key_tables,
)
from kvq_jax.report.capture import load_capture


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
