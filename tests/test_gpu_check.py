"""The CPU-side parts of the GPU check (bench/gpu_check.sh, bench/gpu_check.py): argument
parsing, the install line, the commands it runs, JUnit parsing, merging and JSON writing; no
GPU, nothing installed, no step actually run except a trivial one."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shlex
import sys

import pytest
from packaging.requirements import Requirement

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = _load()


def test_parse_args_defaults_and_options():
    a = gc.parse_args([])
    assert (a.out, a.skip_tests, a.skip_bench, a.install_line) == (
        "gpu_check.json", False, False, False,
    )  # fmt: skip
    a = gc.parse_args(["--out", "x.json", "--skip-bench", "--test-timeout", "60",
                       "--pytest-args", "-k reconstruct -x"])  # fmt: skip
    assert a.out == "x.json" and a.skip_bench and a.test_timeout == 60.0
    assert gc.pytest_command(a, "j.xml")[-3:] == ["-k", "reconstruct", "-x"]
    with pytest.raises(SystemExit):
        gc.parse_args(["--bench-timeout", "0"])
    with pytest.raises(SystemExit):
        gc.parse_args(["--no-such-option"])


def test_install_line_is_well_formed(capsys):
    words = shlex.split(gc.INSTALL_LINE)
    assert words[:2] == ["pip", "install"] and len(words) == 3
    req = Requirement(words[2])
    assert req.name == "jax" and req.extras == {"cuda13"}
    (version,) = [s.version for s in req.specifier if s.operator == "=="]
    assert version.startswith("0.10.")  # the project's jax pin: jax>=0.10,<0.11
    assert gc.main(["--install-line"]) == 0
    assert capsys.readouterr().out.strip() == gc.INSTALL_LINE
    script = (BENCH / "gpu_check.sh").read_text()
    assert "--install-line" in script and "bench/gpu_check.py --out" in script


def test_commands_name_the_kernel_tests_and_benchmarks():
    cmd = gc.pytest_command(gc.parse_args([]), "j.xml")
    assert cmd[1:5] == ["-m", "pytest", "tests/kernels", "--run-gpu"]
    assert cmd[cmd.index("-m", 2) + 1] == "not cuda_compile"
    assert set(gc.BENCHES) == {"page_pack", "page_reconstruct", "paged_attention"}
    for name in gc.BENCHES:
        cmd = gc.bench_command(name, "o.json")
        assert (BENCH.parent / cmd[1]).is_file() and "--quick" in cmd
        assert cmd[-2:] == ["--json", "o.json"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest"
errors="1" failures="1" skipped="2" tests="7"><testcase classname="tests.kernels.t" name="a"/>
<testcase classname="tests.kernels.t" name="b"><failure message="x"/></testcase>
<testcase classname="tests.kernels.t" name="c"><error message="y"/></testcase>
</testsuite></testsuites>"""


def test_parse_junit():
    c = gc.parse_junit(JUNIT)
    assert (c["tests"], c["failures"], c["errors"], c["skipped"], c["passed"]) == (7, 1, 1, 2, 3)
    assert c["failed"] == ["tests.kernels.t::b", "tests.kernels.t::c"]


def test_run_step_merge_and_write_json(tmp_path):
    ok = gc.run_step("py", [sys.executable, "-c", "print('hi')"], timeout=60)
    bad = gc.run_step("fail", [sys.executable, "-c", "raise SystemExit(3)"], timeout=60)
    slow = gc.run_step("slow", [sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.5)
    assert ok["ok"] and ok["rc"] == 0 and "hi" in ok["output_tail"]
    assert not bad["ok"] and bad["rc"] == 3
    assert slow["rc"] is None and not slow["ok"] and "timed out" in slow["output_tail"]
    benches = {"page_pack": {"header": "h", "rows": [{"ms": 1.0}]}}
    result = gc.merge([ok], pytest_counts=gc.parse_junit(JUNIT), benches=benches, env={})
    assert result["ok"] and result["install_line"] == gc.INSTALL_LINE
    assert not gc.merge([ok, bad], pytest_counts=None, benches={}, env={})["ok"]
    path = tmp_path / "check.json"
    gc.write_json(str(path), result)
    back = json.loads(path.read_text())
    assert back["bench"] == benches and back["steps"][0]["name"] == "py"
    assert back["pytest"]["failed"] == ["tests.kernels.t::b", "tests.kernels.t::c"]
