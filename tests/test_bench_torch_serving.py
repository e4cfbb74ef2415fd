"""Smoke run of bench/torch_serving.py --quick: every (dtype, B, T) row is in its JSON with
positive times, and the cache accounting holds (speed itself is never asserted)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench" / "torch_serving.py"


def test_torch_serving_bench_quick(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| kv_cache_dtype |" in proc.stdout  # the markdown table
    result = json.loads(out.read_text())
    assert result["header"] and result["skipped"] == []
    rows = {(r["kv_cache_dtype"], r["batch"], r["context"]): r for r in result["rows"]}
    dtypes = ("bfloat16", "int4-g64", "nvfp4", "kvq:fp8")
    want = {(d, b, 128) for d in dtypes for b in (1, 2)}
    assert set(rows) == want and len(result["rows"]) == len(want)
    for key, r in rows.items():
        for op in ("write", "prefill", "decode"):
            assert r[f"{op}_ms"] > 0 and len(r[f"{op}_times_ms"]) == 2, (key, op)
            assert r[f"{op}_x_bf16"] > 0, (key, op)
        assert r["attended"] == 128 + 33  # T context tokens + 32 staged + the step's token
    for b in (1, 2):
        raw = rows[("bfloat16", b, 128)]
        assert raw["kv_bytes_per_token"] == 2 * 16 * 128 * 2  # K and V, bf16
        assert raw["rel_err"] == 0.0 and raw["decode_x_bf16"] == 1.0
        for d in ("int4-g64", "nvfp4"):  # 4.5 bits per element
            assert rows[(d, b, 128)]["kv_bytes_per_token"] < raw["kv_bytes_per_token"] / 3
        fp8 = rows[("kvq:fp8", b, 128)]["kv_bytes_per_token"]
        assert raw["kv_bytes_per_token"] / 2 < fp8 < raw["kv_bytes_per_token"] / 1.8
        # the quantized caches were read: close to the bf16 cache's output, not equal to it
        for d in dtypes[1:]:
            assert 0 < rows[(d, b, 128)]["rel_err"] < 0.3, (d, b)
