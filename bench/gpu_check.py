"""The GPU check's runner: kernel tests, the three kernel benchmarks and the kernels' compiled
resources on a CUDA GPU, one JSON and one table. Run through `bench/gpu_check.sh`, which runs
kvq from the working tree and installs and fetches nothing (the lent machine has no package
index); on its own:

    python bench/gpu_check.py [--out gpu_check.json] [--dry-run] [--skip-tests] [--skip-bench]
                              [--skip-resources] [--test-timeout S] [--bench-timeout S]
                              [--pytest-args "..."]

Steps (each a subprocess with a timeout; a failing step is recorded, the others still run):
  preflight         kvq imports from the tree; jax / jaxlib / torch / triton versions; jax in
                    the tested range (TESTED_JAX); a GPU present (with --dry-run: the CPU)
  tests             python -m pytest tests/kernels --run-gpu -m "not cuda_compile" (JUnit)
  page_pack         bench/page_pack.py --quick --tokens 32768 (and a copy of the same bytes)
  page_reconstruct  bench/page_reconstruct.py --quick (8 x 4096 tokens, and the copy row)
  paged_attention   bench/paged_attention_kernel.py --quick --batch 1 8 --context 4096 32768
                    --loops 0 3 --check (against bf16 paged attention of the same shapes)
  paged_attention_best  the same at B 8, 32k tokens, loop 0 for int4 and "heavy-rope" (the
                    best served policy's formats at Ouro's shapes: heavy rows over INTB keys
                    and HINT4 values, keys before RoPE; its time over int4's)
  kernel_resources  bench/kernel_resources.py --targets sm_90a --filter d128: registers, spills,
                    shared memory of the kernels compiled for the H100/H200 architecture (the
                    ptxas of the machine's CUDA wheels when the pinned one is not there)
The compass (`compass` in the JSON, printed as one table): page pack and page reconstruction
GB/s over the copy's GB/s, decode attention at the longest context over bf16 attention (loop 0
and loop 3), and the worst registers / spills / shared memory per kernel.

--dry-run does every step on the CPU at the smallest settings, with the tests collected but not
run: proof that the script starts on a stack before a GPU minute is spent (CI runs it on the
device machine's Python 3.12 / jax 0.11.2). Budget: <= 9 minutes on one H100/H200 with every
step at its default timeout (preflight 60 s, tests 180 s, 55 s per benchmark, 75 s for the
resources). Exit status 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: jax versions the project tests (pyproject: jax>=0.10,<0.13); preflight fails outside.
TESTED_JAX = ((0, 10), (0, 11), (0, 12))

BENCHES = {
    "page_pack": ["bench/page_pack.py", "--quick", "--tokens", "32768"],
    "page_reconstruct": ["bench/page_reconstruct.py", "--quick"],
    "paged_attention": [
        "bench/paged_attention_kernel.py", "--quick", "--batch", "1", "8",
        "--context", "4096", "32768", "--formats", "int4", "nvfp4", "--loops", "0", "3",
        "--check",
    ],
    "paged_attention_best": [
        "bench/paged_attention_kernel.py", "--quick", "--batch", "8", "--context", "32768",
        "--formats", "int4", "heavy-rope", "--loops", "0", "--check",
    ],
}  # fmt: skip
#: the same benchmarks at the smallest settings, for --dry-run on a CPU: one case each where a
#: case is a compile of minutes' share of CI (the plumbing is what a dry run checks; the
#: cases' arithmetic is tested in tests/kernels)
DRY_BENCHES = {
    "page_pack": ["bench/page_pack.py", "--quick", "--tokens", "256"],
    "page_reconstruct": [
        "bench/page_reconstruct.py", "--quick", "--batch", "1", "--context", "256",
        "--formats", "mixed",
    ],
    "paged_attention": [
        "bench/paged_attention_kernel.py", "--quick", "--batch", "1", "--context", "256",
        "--formats", "nvfp4", "--loops", "3", "--check",
    ],
    "paged_attention_best": [
        "bench/paged_attention_kernel.py", "--quick", "--batch", "1", "--context", "256",
        "--formats", "heavy-rope", "--loops", "0", "--check",
    ],
}  # fmt: skip
RESOURCES = ["bench/kernel_resources.py", "--targets", "sm_90a", "--filter", "d128"]
DRY_RESOURCES = ["bench/kernel_resources.py", "--targets", "sm_90a", "--filter", "^nvfp4-key.*d128"]
TAIL = 4000
PREFLIGHT_TIMEOUT = 60.0

PREFLIGHT = r"""
import importlib, json, sys
report = {}
for name in ("jax", "jaxlib", "torch", "triton", "numpy"):
    try:
        report[name] = importlib.import_module(name).__version__
    except Exception as e:
        report[name] = None
import jax, kvq_jax
report["kvq_jax"] = kvq_jax.__file__
report["devices"] = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
print(json.dumps(report))
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check.json", help="the merged JSON (default %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="every step on the CPU, smallest sizes")
    p.add_argument("--skip-tests", action="store_true", help="no pytest step")
    p.add_argument("--skip-bench", action="store_true", help="no benchmark steps")
    p.add_argument("--skip-resources", action="store_true", help="no kernel_resources step")
    p.add_argument("--test-timeout", type=float, default=180.0, help="seconds (pytest)")
    p.add_argument("--bench-timeout", type=float, default=55.0, help="seconds per benchmark")
    p.add_argument("--resources-timeout", type=float, default=75.0, help="seconds")
    p.add_argument("--pytest-args", default="", help="extra pytest arguments (one string)")
    args = p.parse_args(argv)
    if min(args.test_timeout, args.bench_timeout, args.resources_timeout) <= 0:
        p.error("timeouts must be positive")
    return args


def step_env(dry_run: bool) -> dict:
    """The steps' environment: kvq from this tree first on PYTHONPATH; the CPU for --dry-run,
    else whatever jax finds (JAX_PLATFORMS unset)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("JAX_PLATFORMS", None)
    return env


def pytest_command(args, junit: str) -> list[str]:
    mode = ["--collect-only"] if args.dry_run else ["--run-gpu"]
    return [
        sys.executable, "-m", "pytest", "tests/kernels", *mode, "-q",
        "-m", "not cuda_compile",  # the deviceless compile sweep is CI's and the resources step's
        "-p", "no:cacheprovider", f"--junitxml={junit}", *shlex.split(args.pytest_args),
    ]  # fmt: skip


def bench_command(name: str, out_json: str, dry_run: bool = False) -> list[str]:
    return [sys.executable, *(DRY_BENCHES if dry_run else BENCHES)[name], "--json", out_json]


def resources_command(out_json: str, dry_run: bool = False) -> list[str]:
    return [sys.executable, *(DRY_RESOURCES if dry_run else RESOURCES), "--json", out_json]


def resources_ptxas() -> dict:
    """Environment for the resources step: the pinned ptxas when installed, else the ptxas of
    the machine's CUDA wheels (KVQ_PTXAS, an explicit choice, recorded in the JSON)."""
    sys.path.insert(0, str(ROOT))
    from kvq_jax.kernel_checks import cuda_compile as cc

    if os.environ.get("KVQ_PTXAS") or cc.availability() is None:
        return {}
    root = cc._nvcc_package_root()
    return {} if root is None else {"KVQ_PTXAS": str(root / "bin" / "ptxas")}


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


def collected(output: str) -> int | None:
    """The number of tests `pytest --collect-only -q` reports ("N tests collected")."""
    found = re.findall(r"(\d+) tests? collected", output)
    return int(found[-1]) if found else None


def run_step(name: str, command: list[str], timeout: float, env: dict | None = None) -> dict:
    """Run one step; never raises: rc (None on timeout), seconds, the output's tail."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
            env=env,
        )  # fmt: skip
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
        out += f"\n[timed out after {timeout:.0f} s]"
    except OSError as e:
        rc, out = None, f"{type(e).__name__}: {e}"
    return dict(
        name=name,
        command=shlex.join(command),
        rc=rc,
        ok=rc == 0,
        seconds=round(time.perf_counter() - t0, 1),
        output_tail=out[-TAIL:],
    )


def check_preflight(step: dict, dry_run: bool) -> dict:
    """Parse the preflight step's JSON line; the step fails when jax is outside TESTED_JAX or
    the device is not what the mode needs (a GPU, or the CPU with --dry-run)."""
    lines = [ln for ln in step["output_tail"].splitlines() if ln.startswith("{")]
    if not step["ok"] or not lines:
        return step
    info = json.loads(lines[-1])
    step["info"] = info
    problems = []
    version = tuple(int(x) for x in (info.get("jax") or "0.0").split(".")[:2])
    if version not in TESTED_JAX:
        problems.append(f"jax {info.get('jax')} is outside the tested {TESTED_JAX}")
    platforms = {d.split(":")[0] for d in info.get("devices", [])}
    if dry_run and platforms != {"cpu"}:
        problems.append(f"--dry-run wants the CPU, found {sorted(platforms)}")
    if not dry_run and not platforms & {"gpu", "cuda"}:
        problems.append(f"no GPU: jax sees {info.get('devices')}")
    if problems:
        step["ok"] = False
        step["output_tail"] += "\n" + "; ".join(problems)
    return step


def _rows(bench: dict | None) -> list[dict]:
    return list((bench or {}).get("rows", []))


def compass(benches: dict, resources: list[dict] | None) -> list[dict]:
    """The measurements the project steers by, one row each: measure, case, value, unit, and
    the ratio to the baseline named in `vs` (copy GB/s, bf16 attention time)."""
    out = []
    for name, is_copy, case_of in (
        ("page_pack", lambda r: r.get("case", "").startswith("copy"),
         lambda r: f"{r['case']} page {r['page']} {r['backend']}"),
        ("page_reconstruct", lambda r: r.get("format") == "copy",
         lambda r: f"{r['format']} page {r['page']} loop {r['loop']} {r['backend']}"),
    ):  # fmt: skip
        rows = _rows(benches.get(name))
        copies = [r for r in rows if is_copy(r)]
        copy = copies[0]["gbps"] if copies else None
        for r in rows:
            if is_copy(r) or "interpret" in str(r.get("backend")):
                continue
            ratio = r["gbps"] / copy if copy else None
            out.append(dict(measure=name, case=case_of(r), value=r["gbps"], unit="GB/s",
                            vs="copy", ratio=ratio))  # fmt: skip
    for name in ("paged_attention", "paged_attention_best"):
        rows = _rows(benches.get(name))
        if not rows:
            continue
        longest = max(int(r["context"]) for r in rows)
        for r in rows:
            if int(r["context"]) != longest or r["kind"] == "bf16":
                continue
            case = f"{r['kind']} loop {r['loop']} B {r['batch']} ctx {r['context']} {r['impl']}"
            out.append(dict(measure=name, unit="ms", case=case, value=r["ms"], vs="bf16",
                            ratio=r.get("speedup")))  # fmt: skip
    by_kernel: dict[str, dict] = {}
    for r in resources or []:
        k = by_kernel.setdefault(r["kernel"], dict(registers=0, spills=0, smem=0, n=0, bad=0))
        k["n"] += 1
        k["bad"] += r.get("status") != "ok"
        k["registers"] = max(k["registers"], int(r.get("registers") or 0))
        k["spills"] = max(k["spills"], int(r.get("spill_stores") or 0))
        k["smem"] = max(k["smem"], int(r.get("smem") or 0))
    for kernel, k in by_kernel.items():
        case = f"{kernel} sm_90a ({k['n']} configs, {k['bad']} not ok)"
        for what, unit in (("registers", "regs"), ("spills", "bytes"), ("smem", "bytes")):
            out.append(dict(measure=f"max {what}", case=case, value=k[what], unit=unit,
                            vs=None, ratio=None))  # fmt: skip
    return out


def compass_table(rows: list[dict]) -> str:
    """The compass as a Markdown table."""
    lines = ["| measure | case | value | unit | vs | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        value = r["value"] if isinstance(r["value"], int) else f"{r['value']:.3f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"| {r['measure']} | {r['case']} | {value} | {r['unit']} | "
                     f"{r['vs'] or ''} | {ratio} |")  # fmt: skip
    return "\n".join(lines)


def merge(steps, *, pytest_counts, benches, resources, env, dry_run=False) -> dict:
    """The one JSON of the check: environment, every step, pytest counts, benchmark rows,
    kernel resources and the compass."""
    return dict(
        kind="kvq-gpu-check",
        dry_run=dry_run,
        env=env,
        ok=bool(steps) and all(s["ok"] for s in steps),
        steps=steps,
        pytest=pytest_counts,
        bench=benches,
        resources=resources,
        compass=compass(benches, resources),
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
    return env


def _load(path: str):
    return json.loads(pathlib.Path(path).read_text()) if os.path.exists(path) else None


def main(argv=None) -> int:
    args = parse_args(argv)
    env = step_env(args.dry_run)
    steps, counts, benches, resources = [], None, {}, None
    with tempfile.TemporaryDirectory(prefix="kvq-gpu-check-") as tmp:
        pre = run_step("preflight", [sys.executable, "-c", PREFLIGHT], PREFLIGHT_TIMEOUT, env)
        steps.append(check_preflight(pre, args.dry_run))
        if not args.skip_tests:
            junit = os.path.join(tmp, "junit.xml")
            steps.append(run_step("tests", pytest_command(args, junit), args.test_timeout, env))
            if os.path.exists(junit):
                counts = parse_junit(pathlib.Path(junit).read_text())
            if args.dry_run and counts is not None:
                counts["collected"] = collected(steps[-1]["output_tail"])
        if not args.skip_bench:
            for name in BENCHES:
                out = os.path.join(tmp, f"{name}.json")
                cmd = bench_command(name, out, args.dry_run)
                steps.append(run_step(name, cmd, args.bench_timeout, env))
                if (data := _load(out)) is not None:
                    benches[name] = data
        if not args.skip_resources:
            out = os.path.join(tmp, "resources.json")
            renv = {**env, "JAX_PLATFORMS": "cpu", **resources_ptxas()}
            step = run_step("kernel_resources", resources_command(out, args.dry_run),
                            args.resources_timeout, renv)  # fmt: skip
            step["ptxas"] = renv.get("KVQ_PTXAS", "pinned")
            steps.append(step)
            data = _load(out)
            resources = data.get("rows", data) if isinstance(data, dict) else data
        result = merge(steps, pytest_counts=counts, benches=benches, resources=resources,
                       env=environment(), dry_run=args.dry_run)  # fmt: skip
    write_json(args.out, result)
    for s in steps:
        print(f"{s['name']:18} {'ok' if s['ok'] else 'FAILED':7} rc={s['rc']} {s['seconds']} s")
    print()
    print(compass_table(result["compass"]))
    print(f"\nwrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
