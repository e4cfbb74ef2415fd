"""The CPU-side parts of the GPU check (bench/gpu_check.sh, bench/gpu_check.py): argument
parsing, the commands it runs (nothing installed, kvq from the tree), the preflight verdict,
JUnit parsing, the compass and the JSON; no GPU, no step actually run except trivial ones.
The whole `--dry-run` runs in `.ci/run` on the device machine's stack (Python 3.12, jax 0.11.2).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = _load()


def test_parse_args_defaults_and_options():
    a = gc.parse_args([])
    assert (a.out, a.dry_run, a.skip_tests, a.skip_bench, a.skip_resources) == (
        "gpu_check.json", False, False, False, False,
    )  # fmt: skip
    # the GPU budget: <= 8 minutes with the default timeouts, every step at its limit
    steps = gc.PREFLIGHT_TIMEOUT + a.test_timeout + 3 * a.bench_timeout + a.resources_timeout
    assert steps <= 8 * 60
    a = gc.parse_args(["--out", "x.json", "--dry-run", "--skip-bench", "--test-timeout", "60",
                       "--pytest-args", "-k reconstruct -x"])  # fmt: skip
    assert a.out == "x.json" and a.dry_run and a.skip_bench and a.test_timeout == 60.0
    assert gc.pytest_command(a, "j.xml")[-3:] == ["-k", "reconstruct", "-x"]
    with pytest.raises(SystemExit):
        gc.parse_args(["--bench-timeout", "0"])
    with pytest.raises(SystemExit):
        gc.parse_args(["--no-such-option"])


def test_script_installs_and_fetches_nothing():
    script = (BENCH / "gpu_check.sh").read_text()
    code = [ln for ln in script.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    fetch = re.compile(r"\b(pip|pip3|install|curl|wget|uv)\b")
    assert not any(fetch.search(ln) for ln in code), code
    assert any("PYTHONPATH" in ln for ln in code)
    assert "bench/gpu_check.py --out" in script
    assert "install" not in gc.__doc__.split("Steps")[1].lower()


def test_step_environment_runs_kvq_from_the_tree(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    gpu = gc.step_env(dry_run=False)
    assert gpu["PYTHONPATH"].split(":") == [str(gc.ROOT), "/elsewhere"]
    assert "JAX_PLATFORMS" not in gpu  # the GPU, not the CPU
    assert gc.step_env(dry_run=True)["JAX_PLATFORMS"] == "cpu"


def test_commands_name_the_kernel_tests_benchmarks_and_resources():
    cmd = gc.pytest_command(gc.parse_args([]), "j.xml")
    assert cmd[1:5] == ["-m", "pytest", "tests/kernels", "--run-gpu"]
    assert cmd[cmd.index("-m", 2) + 1] == "not cuda_compile"
    dry = gc.pytest_command(gc.parse_args(["--dry-run"]), "j.xml")
    assert "--collect-only" in dry and "--run-gpu" not in dry
    assert set(gc.BENCHES) == set(gc.DRY_BENCHES) == {
        "page_pack", "page_reconstruct", "paged_attention", "paged_attention_best",
    }  # fmt: skip
    for name in gc.BENCHES:
        for dry_run in (False, True):
            cmd = gc.bench_command(name, "o.json", dry_run)
            assert (BENCH.parent / cmd[1]).is_file() and "--quick" in cmd
            assert cmd[-2:] == ["--json", "o.json"]
    attn = gc.bench_command("paged_attention", "o.json")
    ctx = attn[attn.index("--context") + 1 : attn.index("--formats")]
    assert "32768" in ctx and attn[attn.index("--loops") + 1 : attn.index("--check")] == ["0", "3"]
    best = gc.bench_command("paged_attention_best", "o.json")
    assert best[best.index("--formats") + 1 : best.index("--loops")] == ["int4", "heavy-rope"]
    res = gc.resources_command("r.json")
    assert (BENCH.parent / res[1]).is_file() and res[res.index("--targets") + 1] == "sm_90a"


def test_collected_count():
    assert gc.collected("a\nb\n176 tests collected in 3.1s\n") == 176
    assert gc.collected("1 test collected in 0.1s") == 1
    assert gc.collected("no tests ran") is None


def _pre(info: dict, ok=True) -> dict:
    return dict(name="preflight", ok=ok, rc=0 if ok else 1, output_tail="x\n" + json.dumps(info))


def test_preflight_verdicts():
    gpu = dict(jax="0.11.2", devices=["gpu:NVIDIA H200"])
    cpu = dict(jax="0.11.2", devices=["cpu:cpu"])
    assert gc.check_preflight(_pre(gpu), dry_run=False)["ok"]
    assert gc.check_preflight(_pre(cpu), dry_run=True)["ok"]
    assert not gc.check_preflight(_pre(cpu), dry_run=False)["ok"]  # no GPU
    assert not gc.check_preflight(_pre(gpu), dry_run=True)["ok"]  # dry run on a GPU
    old = gc.check_preflight(_pre(dict(gpu, jax="0.9.1")), dry_run=False)
    assert not old["ok"] and "outside the tested" in old["output_tail"]
    assert not gc.check_preflight(_pre(gpu, ok=False), dry_run=False)["ok"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest"
errors="1" failures="1" skipped="2" tests="7"><testcase classname="tests.kernels.t" name="a"/>
<testcase classname="tests.kernels.t" name="b"><failure message="x"/></testcase>
<testcase classname="tests.kernels.t" name="c"><error message="y"/></testcase>
</testsuite></testsuites>"""


def test_parse_junit():
    c = gc.parse_junit(JUNIT)
    assert (c["tests"], c["failures"], c["errors"], c["skipped"], c["passed"]) == (7, 1, 1, 2, 3)
    assert c["failed"] == ["tests.kernels.t::b", "tests.kernels.t::c"]


BENCHES = {
    "page_pack": {"rows": [
        dict(case="int4 K (tok)", page=16, backend="pallas", gbps=1500.0),
        dict(case="int4 K (tok)", page=16, backend="pallas_interpret (interpreter)", gbps=0.1),
        dict(case="copy (bf16 pages)", page=None, backend="xla", gbps=3000.0),
    ]},
    "page_reconstruct": {"rows": [
        dict(format="int4", page=16, loop=3, backend="pallas", gbps=2000.0),
        dict(format="copy", backend="xla", gbps=4000.0),
    ]},
    "paged_attention": {"rows": [
        dict(kind="bf16", loop="-", batch=1, context=32768, impl="x", ms=2.0, speedup=1.0),
        dict(kind="int4", loop=0, batch=1, context=4096, impl="pallas", ms=0.2, speedup=2.0),
        dict(kind="int4", loop=3, batch=1, context=32768, impl="pallas", ms=0.8, speedup=2.5),
    ]},
}  # fmt: skip
RESOURCES = [
    dict(kernel="page_pack", status="ok", registers=54, spill_stores=0, smem=512),
    dict(kernel="page_pack", status="spills", registers=255, spill_stores=4, smem=4096),
]


def test_compass_ratios_against_independent_arithmetic():
    rows = gc.compass(BENCHES, RESOURCES)
    pack = [r for r in rows if r["measure"] == "page_pack"]
    assert len(pack) == 1 and pack[0]["ratio"] == pytest.approx(1500 / 3000)  # no interpreter
    (rec,) = [r for r in rows if r["measure"] == "page_reconstruct"]
    assert rec["ratio"] == pytest.approx(0.5) and rec["unit"] == "GB/s"
    (attn,) = [r for r in rows if r["measure"] == "paged_attention"]  # the longest context only
    assert "loop 3" in attn["case"] and attn["ratio"] == 2.5
    res = {r["measure"]: r for r in rows if r["measure"].startswith("max")}
    assert (res["max registers"]["value"], res["max spills"]["value"]) == (255, 4)
    assert "2 configs, 1 not ok" in res["max smem"]["case"]
    no_copy = {"page_pack": {"rows": BENCHES["page_pack"]["rows"][:1]}}
    assert gc.compass(no_copy, None)[0]["ratio"] is None
    table = gc.compass_table(rows)
    assert table.count("\n") == len(rows) + 1 and "| 0.50 |" in table


def test_run_step_merge_and_write_json(tmp_path):
    ok = gc.run_step("py", [sys.executable, "-c", "print('hi')"], timeout=60)
    bad = gc.run_step("fail", [sys.executable, "-c", "raise SystemExit(3)"], timeout=60)
    slow = gc.run_step("slow", [sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.5)
    missing = gc.run_step("missing", ["/no/such/python"], timeout=5)
    assert ok["ok"] and ok["rc"] == 0 and "hi" in ok["output_tail"]
    assert not bad["ok"] and bad["rc"] == 3
    assert slow["rc"] is None and not slow["ok"] and "timed out" in slow["output_tail"]
    assert not missing["ok"] and missing["rc"] is None
    result = gc.merge([ok], pytest_counts=gc.parse_junit(JUNIT), benches=BENCHES,
                      resources=RESOURCES, env={}, dry_run=True)  # fmt: skip
    assert result["ok"] and result["dry_run"] and result["compass"]
    assert not gc.merge([ok, bad], pytest_counts=None, benches={}, resources=None, env={})["ok"]
    path = tmp_path / "check.json"
    gc.write_json(str(path), result)
    back = json.loads(path.read_text())
    assert back["bench"] == BENCHES and back["steps"][0]["name"] == "py"
    assert back["pytest"]["failed"] == ["tests.kernels.t::b", "tests.kernels.t::c"]
