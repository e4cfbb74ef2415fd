"""The GPU check's runner and merger: kernel tests and the three kernel benchmarks on a CUDA
GPU, one JSON of results. Run through `bench/gpu_check.sh` (which installs the CUDA jax build
first); on its own:

    python bench/gpu_check.py [--out gpu_check.json] [--skip-tests] [--skip-bench]
                              [--test-timeout S] [--bench-timeout S] [--pytest-args "..."]
    python bench/gpu_check.py --install-line     # the pip line gpu_check.sh runs

Steps (each a subprocess with a timeout; a failing step is recorded, the others still run):
  tests                python -m pytest tests/kernels --run-gpu -m "not cuda_compile"
                       (JUnit XML -> counts)
  page_pack            bench/page_pack.py --quick --tokens 8192
  page_reconstruct     bench/page_reconstruct.py --quick (2 x 1024 tokens)
  paged_attention      bench/paged_attention_kernel.py --quick --batch 1 8 --context 4096
                       --formats int4 nvfp4 --loops 0 3 --check
Budget: the whole check fits in 10 minutes on one H100/H200 (default timeouts 420 s for the
tests, 150 s per benchmark, after the install). Exit status 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The CUDA 13 jax build matching the project's jax pin (pyproject: jax>=0.10,<0.11).
INSTALL_LINE = 'pip install "jax[cuda13]==0.10.2"'

BENCHES = {
    "page_pack": ["bench/page_pack.py", "--quick", "--tokens", "8192"],
    "page_reconstruct": ["bench/page_reconstruct.py", "--quick"],
    "paged_attention": [
        "bench/paged_attention_kernel.py", "--quick", "--batch", "1", "8", "--context", "4096",
        "--formats", "int4", "nvfp4", "--loops", "0", "3", "--check",
    ],
}  # fmt: skip
TAIL = 4000


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check.json", help="the merged JSON (default %(default)s)")
    p.add_argument("--install-line", action="store_true", help="print the install line, exit")
    p.add_argument("--skip-tests", action="store_true", help="no pytest step")
    p.add_argument("--skip-bench", action="store_true", help="no benchmark steps")
    p.add_argument("--test-timeout", type=float, default=420.0, help="seconds (pytest)")
    p.add_argument("--bench-timeout", type=float, default=150.0, help="seconds per benchmark")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments (one string)")
    args = p.parse_args(argv)
    if args.test_timeout <= 0 or args.bench_timeout <= 0:
        p.error("timeouts must be positive")
    return args


def pytest_command(args, junit: str) -> list[str]:
    return [
        sys.executable, "-m", "pytest", "tests/kernels", "--run-gpu", "-q",
        "-m", "not cuda_compile",  # the deviceless compile sweep is CI's, not the GPU's
        "-p", "no:cacheprovider", f"--junitxml={junit}", *shlex.split(args.pytest_args),
    ]  # fmt: skip


def bench_command(name: str, out_json: str) -> list[str]:
    return [sys.executable, *BENCHES[name], "--json", out_json]


def parse_junit(text: str) -> dict:
    """Counts of a pytest JUnit XML report: tests, failures, errors, skipped, passed, and
    the ids of the failed / errored tests."""
    root = ET.fromstring(text)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = dict(tests=0, failures=0, errors=0, skipped=0)
    failed = []
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed"] = failed
    return counts


def run_step(name: str, command: list[str], timeout: float) -> dict:
    """Run one step; never raises: rc (None on timeout), seconds, the output's tail."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
        out += f"\n[timed out after {timeout:.0f} s]"
    return dict(
        name=name,
        command=shlex.join(command),
        rc=rc,
        ok=rc == 0,
        seconds=round(time.perf_counter() - t0, 1),
        output_tail=out[-TAIL:],
    )


def merge(steps: list[dict], *, pytest_counts: dict | None, benches: dict, env: dict) -> dict:
    """The one JSON of the check: environment, every step, pytest counts, benchmark rows."""
    return dict(
        kind="kvq-gpu-check",
        install_line=INSTALL_LINE,
        env=env,
        ok=bool(steps) and all(s["ok"] for s in steps),
        steps=steps,
        pytest=pytest_counts,
        bench=benches,
    )


def write_json(path: str, result: dict) -> None:
    pathlib.Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")


def environment() -> dict:
    env = dict(python=platform.python_version(), host=platform.node())
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        env["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        env["nvidia_smi"] = None
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.__version__, jax.devices())"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    env["jax"] = (probe.stdout or probe.stderr).strip()[-500:]
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.install_line:
        print(INSTALL_LINE)
        return 0
    steps, counts, benches = [], None, {}
    with tempfile.TemporaryDirectory(prefix="kvq-gpu-check-") as tmp:
        if not args.skip_tests:
            junit = os.path.join(tmp, "junit.xml")
            steps.append(run_step("tests", pytest_command(args, junit), args.test_timeout))
            if os.path.exists(junit):
                counts = parse_junit(pathlib.Path(junit).read_text())
        if not args.skip_bench:
            for name in BENCHES:
                out = os.path.join(tmp, f"{name}.json")
                steps.append(run_step(name, bench_command(name, out), args.bench_timeout))
                if os.path.exists(out):
                    benches[name] = json.loads(pathlib.Path(out).read_text())
        result = merge(steps, pytest_counts=counts, benches=benches, env=environment())
    write_json(args.out, result)
    for s in steps:
        print(f"{s['name']:18} {'ok' if s['ok'] else 'FAILED':7} rc={s['rc']} {s['seconds']} s")
    print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
