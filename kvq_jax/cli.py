"""The `kvq` command line."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvq", description="4-bit KV-cache codecs for looped LMs."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="pack/unpack every format on a built-in tensor")
    demo.add_argument("--repeats", type=int, default=5, help="timed runs per format (median)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from kvq_jax import demo

        return demo.main(args)
    return 2  # unreachable: argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
