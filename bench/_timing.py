"""Timing helpers shared by the kvq benchmarks.

    t = median_time(fn, x, warmup=3, repeats=20)     # seconds, results blocked on
    t = median_time(fn, x, repeats=20, budget_s=2.0) # ... at most ~2 s of timed calls
    ts = interleaved_times({"a": f, "b": g})          # rounds of a, b: steadier ratios
    copy = copy_baseline(x)                          # a jitted copy XLA cannot elide
    print_table(rows, COLUMNS)

Every timed call is followed by `jax.block_until_ready` on its result, so asynchronous
dispatch never hides device time. Times are wall-clock (`time.perf_counter`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvq_jax.cli import plugins

# JAX's plugin traceback (the CUDA plugin on a machine without a GPU) as kvq's one line, as
# `kvq` does: every benchmark that times imports this module before its first device use.
plugins.install()


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of `repeats` timed calls (after the warm-up calls)."""

    median_s: float
    min_s: float
    times_s: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3


def median_time(
    fn: Callable,
    *args,
    warmup: int = 3,
    repeats: int = 20,
    budget_s: float | None = None,
    **kwargs,
) -> Timing:
    """Time `fn(*args, **kwargs)`: `warmup` untimed calls (compilation happens there), then
    `repeats` timed calls, each blocked until its result is ready.

    budget_s: stop early once the timed calls have taken `budget_s` seconds in all, after at
    least min(3, repeats) of them (slow cases get fewer runs, fast ones all `repeats`).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(max(warmup, 1)):  # at least one: never time the compilation
        jax.block_until_ready(fn(*args, **kwargs))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        times.append(time.perf_counter() - start)
        if budget_s is not None and len(times) >= min(3, repeats) and sum(times) >= budget_s:
            break
    return Timing(statistics.median(times), min(times), tuple(times))


def interleaved_times(fns: dict[str, Callable], *, warmup: int = 3, repeats: int = 20):
    """{name: Timing} of several zero-argument functions timed in rounds (each round calls
    every function once, in order): a load that changes during the run hits them alike, so
    their ratios are steadier than those of one `median_time` after another."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for fn in fns.values():
        for _ in range(max(warmup, 1)):
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {n: Timing(statistics.median(t), min(t), tuple(t)) for n, t in times.items()}


def copy_baseline(x: jax.Array) -> tuple[Callable, tuple]:
    """A jitted function and its arguments that read all of `x` and write a same-sized copy.

    `x * one` with `one` a runtime scalar, so XLA cannot fold it: `x * 1`, `x + 0` and
    `jnp.copy(x)` are simplified to the identity, which (jax 0.10, XLA:CPU) still compiles to a
    `copy` instruction, but an identity may also be forwarded as the input buffer by jax or
    aliased by XLA and then costs nothing. Checked here: the compiled program multiplies, and
    the result is a fresh buffer equal to `x`.
    """
    one = jnp.ones((), x.dtype)
    fn = jax.jit(lambda a, s: a * s)
    compiled = fn.lower(x, one).compile().as_text()
    if "multiply" not in compiled:
        raise RuntimeError("copy baseline was optimized away:\n" + compiled)
    out = jax.block_until_ready(fn(x, one))
    if out.shape != x.shape or out.dtype != x.dtype:
        raise RuntimeError("copy baseline changed shape or dtype")
    if out.unsafe_buffer_pointer() == x.unsafe_buffer_pointer():
        raise RuntimeError("copy baseline returned its input buffer")
    if not bool(jnp.array_equal(out, x)):
        raise RuntimeError("copy baseline does not reproduce its input")
    return fn, (x, one)


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def device_header() -> str:
    """One line naming the device, platform and software the numbers come from."""
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "?")
    cpu = platform.processor() or platform.machine()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"device: {dev.platform}:{dev.id} {kind} ({len(jax.devices())} visible) | "
        f"host: {cpu}, {cores} cores | jax {jax.__version__}, numpy {np.__version__}"
    )


def format_cell(value: Any, fmt: str | None) -> str:
    if fmt is None or value is None or isinstance(value, str):
        return "" if value is None else str(value)
    return format(value, fmt)


def print_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str | None]]) -> None:
    """Print `rows` (dicts) as an aligned text table.

    columns: (key, header, format spec or None); numbers are right-aligned.
    """
    cells = [[format_cell(row.get(key), spec) for key, _, spec in columns] for row in rows]
    headers = [header for _, header, _ in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    numeric = [spec is not None for _, _, spec in columns]

    def line(values):
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print(line(c))


def write_json(path: str, header: str, rows: Sequence[dict], **extra) -> None:
    """Write {"header": ..., "rows": [...], **extra} to `path`."""
    with open(path, "w") as f:
        json.dump({"header": header, **extra, "rows": list(rows)}, f, indent=2)
        f.write("\n")


#: Peak DRAM bandwidth (bytes/s) by a substring of jax's device_kind (checked in order; the
#: H100 entries are the SXM part only: the PCIe card has 2.0 TB/s).
PEAK_BANDWIDTH = (
    ("H200", 4.8e12),
    ("H100 80GB HBM3", 3.35e12),  # H100 SXM
    ("H100 SXM", 3.35e12),
    ("RTX 5090", 1.79e12),
)


def peak_bandwidth(device=None) -> float | None:
    """Peak memory bandwidth in bytes/s of a known GPU, else None."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "gpu":
        return None
    kind = getattr(device, "device_kind", "")
    return next((bw for name, bw in PEAK_BANDWIDTH if name in kind), None)


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The options every kvq benchmark takes: --quick, --repeats N, --json PATH."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    return parser


def repeat_counts(args, *, quick: tuple[int, int], full: tuple[int, int]) -> tuple[int, int]:
    """(warmup, repeats) for --quick or a full run; --repeats overrides the repeats."""
    warmup, repeats = quick if args.quick else full
    return warmup, repeats if args.repeats is None else args.repeats


def report(args, header: str, rows: Sequence[dict], columns, **extra) -> None:
    """Print the table and, with --json, write the rows too."""
    print()
    print_table(rows, columns)
    if args.json:
        write_json(args.json, header, rows, **extra)
        print(f"\nwrote {args.json}")
