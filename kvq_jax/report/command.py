"""`kvq report` on a capture: arguments, loading and subsets, evaluation, output files.

Errors in the input (missing or malformed file, unknown policy, bad subset) print one line
`kvq report: error: ...` on stderr and return exit code 2.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from kvq_jax.core.checks import check_output_folders
from kvq_jax.core.policies import DEFAULT_REPORT, POLICIES

REPORT_DESCRIPTION = (
    "Compare KV storage policies (bits/element, K/V reconstruction error, attention-output "
    "error, base and residual errors) on captured real K/V/Q: by default the embedded "
    "SmolLM2-135M capture, or --kv FILE. With --model NAME, run the model-level evaluation "
    "instead (kvq_torch_bridge.model_eval; see `kvq report --model NAME --help`)."
)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by the capture report and the --model report."""
    parser.add_argument(
        "--policies",
        default=None,
        metavar="A,B,...",
        help="comma-separated policy names, or all (every policy; one the paged cache and "
        "the engine do not serve is marked, with the reason); default: "
        f"{', '.join(DEFAULT_REPORT)}; all names: {', '.join(POLICIES)}",
    )
    parser.add_argument(
        "--tables",
        default=None,
        metavar="TABLES.npz",
        help="key tables from kvq calibrate for the intb-* policies (instead of the shipped "
        "ones their names give)",
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="also write every number")
    parser.add_argument(
        "--plot", default=None, metavar="FILE.png", help="error vs bits/element (needs [plot])"
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="evaluate inside a model (e.g. smollm2) instead of on a capture",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every option of `kvq report` on a capture."""
    parser.add_argument(
        "--kv",
        default=None,
        metavar="FILE",
        help="a capture .npz (k, v [windows, loops, layers, tokens, heads, dim], optional q, "
        "dtype, meta; see kvq_jax/report/capture.py); default: the embedded capture",
    )
    add_common_arguments(parser)
    parser.add_argument(
        "--layers", default=None, metavar="I,J", help="evaluate only these layer indices"
    )
    parser.add_argument(
        "--windows", default=None, metavar="I,J", help="evaluate only these window indices"
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no progress bar (default: on a TTY only)"
    )


def parse_indices(text: str | None, size: int, what: str) -> list[int] | None:
    """'0,2' -> [0, 2], checked against `size` (ValueError otherwise); None -> None."""
    if text is None:
        return None
    try:
        indices = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--{what}: expected comma-separated integers, got {text!r}") from None
    bad = [i for i in indices if not 0 <= i < size]
    if not indices or bad:
        raise ValueError(
            f"--{what}: indices must be in [0, {size}), got {text!r} (the capture has {size})"
        )
    return list(dict.fromkeys(indices))


def _error(message: str) -> int:
    print(f"kvq report: error: {message}", file=sys.stderr)
    return 2


def run(args) -> int:
    """The capture report; returns the exit code."""
    from kvq_jax.core.calibration import apply_key_tables
    from kvq_jax.core.policies import parse_policies
    from kvq_jax.report import capture as cap

    try:
        policies = apply_key_tables(parse_policies(args.policies), args.tables)
    except (ValueError, FileNotFoundError) as e:
        return _error(str(e))
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _error("--plot needs matplotlib: pip install -e '.[plot]'")
    try:
        check_output_folders(json=args.json, plot=args.plot)
    except ValueError as e:
        return _error(str(e))
    source = "embedded capture" if args.kv is None else str(args.kv)
    try:
        capture = cap.load_capture(args.kv)
        windows = parse_indices(args.windows, capture.num_windows, "windows")
        layers = parse_indices(args.layers, capture.num_layers, "layers")
    except FileNotFoundError as e:
        hint = " (the embedded capture is missing from this install)" if args.kv is None else ""
        return _error(f"{e}{hint}")
    except (ValueError, TypeError, OSError) as e:
        return _error(str(e))
    capture = cap.select(capture, windows=windows, layers=layers)
    from kvq_jax.report.key_tables import layer_policies

    kept = []
    for policy in policies:  # per-layer key tables fit only their model's captures
        if policy.key_tables is not None:
            try:
                layer_policies(policy, capture.meta, capture.k.shape)
            except ValueError as e:
                if args.policies not in (None, "all"):
                    return _error(str(e))
                print(f"kvq report: skipping {policy.name}: {e}", file=sys.stderr)
                continue
        kept.append(policy)
    policies = kept

    from kvq_jax.report import render
    from kvq_jax.report.evaluate import evaluate

    info = render.capture_info(capture, source, windows=windows, layers=layers)
    print(render.describe(info))
    start = time.perf_counter()
    results = evaluate(capture, policies, show_progress=False if args.no_progress else None)
    seconds = time.perf_counter() - start
    print(f"kvq report: {len(policies)} policies in {seconds:.1f} s", file=sys.stderr)
    print("errors: relative L2 in percent\n")
    not_served = render.not_served(policies, capture.num_loops)
    print(render.format_table(results, not_served))
    print()
    print(render.LEGEND)
    if not_served:
        print(render.format_not_served(not_served, capture.num_loops))
    if args.json is not None:
        info["seconds"] = seconds
        info["not_served"] = not_served
        pathlib.Path(args.json).write_text(render.to_json(results, info) + "\n")
        print(f"wrote {args.json}")
    if args.plot is not None:
        from kvq_jax.report.plot import write_plot

        write_plot(results, args.plot, title=render.describe(info))
        print(f"wrote {args.plot}")
    return 0
