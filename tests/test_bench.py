"""Smoke runs of the benchmarks at tiny sizes: each runs end to end, writes its JSON, and every
row holds a positive time. (Speed itself is measured by the benchmarks, never asserted here.)"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"

# (script, tiny arguments, the row key holding milliseconds)
CASES = [
    ("paged.py", ["--batch", "1", "--context", "64", "--loops", "2"], "ms"),
    ("page_pack.py", ["--tokens", "256"], "ms"),
    ("codec_speed.py", ["--shapes", "128,2,64"], "ms"),
    ("page_reconstruct.py", ["--batch", "1", "--context", "256"], "ms"),
    ("cache_lifecycle.py", ["--pools", "64", "--context", "32", "--swap-tokens", "32"], "ms"),
    (
        "paged_attention_kernel.py",
        ["--batch", "1", "--context", "256", "--loops", "0", "1", "--formats", "int4"],
        "ms",
    ),
    (
        "engine_decode.py",
        [
            "--model",
            "random:ouro-tiny",
            "--layers",
            "1",
            "--context",
            "64",
            "--loops",
            "2",
            "--loop-kv",
            "all,last",
            "--policies",
            "int4-g64+win",
        ],
        "ms",
    ),
    ("engine_compile.py", ["--model", "random:ouro-tiny"], "decode_s"),
]


#: The smoke runs over a minute each on 2 CPU cores (compilation): --run-slow.
SLOW = {"paged.py", "page_reconstruct.py", "cache_lifecycle.py", "paged_attention_kernel.py",
        "engine_compile.py"}  # fmt: skip


@pytest.mark.parametrize(
    ("script", "args", "time_key"),
    [pytest.param(*c, id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW else []) for c in CASES],
)
def test_benchmark_runs(script, args, time_key, tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["header"] and result["rows"], result
    times = [row[time_key] for row in result["rows"]]
    assert all(t is not None and t > 0 for t in times), times
