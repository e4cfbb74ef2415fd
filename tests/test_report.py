"""`kvq report`: its numbers against an independent numpy computation, storage accounting,
argument and file errors, the JSON and PNG outputs, and the default run on the embedded
capture."""

from __future__ import annotations

import json
import pathlib
import re
import sys
import types

import jax
import ml_dtypes
import numpy as np
import pytest

import kvq_jax
from kvq_jax.cli import commands as cli
from kvq_jax.core.policies import (
    DEFAULT_REPORT,
    POLICIES,
    ServingSupport,
    parse_policies,
    serving_support,
)
from kvq_jax.report import capture as cap
from kvq_jax.report.evaluate import evaluate, policy_sums, stacks

#: Policies checked against numpy: INT4 with a window (partial token groups), NVFP4 without
#: (its per-tensor scale must stay per (window, layer) under vmap), FlashLoop's legacy profile
#: (INT2 keys, INT4/INT2 values: formats per kind and per loop).
CHECKED = "int4-g32+win,nvfp4,flashloop-legacy"
#: The fixture has the embedded capture's shape (SmolLM2: 3 KV heads, 9 query heads, dim 64),
#: so the programs compiled for it serve the default run too (compilation dominates).
W, L, N, T, H, D, HQ = 2, 4, 3, 128, 3, 64, 9


def _fixture_capture() -> cap.Capture:
    rng = np.random.default_rng(7)

    def stack(heads, offset):
        base = rng.standard_normal((W, 1, N, T, heads, D)) + offset * rng.standard_normal(
            (1, 1, N, 1, heads, D)
        )
        drift = np.cumsum(0.3 * rng.standard_normal((W, L, N, T, heads, D)), axis=1)
        drift[:, 0] = 0
        return (base + drift).astype(ml_dtypes.bfloat16)

    meta = {"model": "fixture", "loops_emulated": True}
    return cap.make_capture(stack(H, 2.0), stack(H, 0.0), stack(HQ, 1.0), meta=meta)


@pytest.fixture(scope="module")
def fixture_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kv") / "fixture.npz"
    cap.save_capture(path, _fixture_capture())
    return path


@pytest.fixture(scope="module")
def results(fixture_file):
    capture = cap.load_capture(fixture_file)
    return capture, evaluate(capture, parse_policies("bf16," + CHECKED), show_progress=False)


# --- the independent computation -------------------------------------------------------------


def _f64(x):
    return np.asarray(x).astype(np.float64)


def _rel(err_sq, ref_sq):
    return np.sqrt(np.sum(err_sq) / np.sum(ref_sq))


def _attention(q, k, v):
    """Causal GQA attention in float64: q [T, Hq, D], k, v [T, H, D] -> [T, Hq, D]."""
    t, hq, d = q.shape
    k = np.repeat(k, hq // k.shape[1], axis=1)  # query head j reads KV head j // group
    v = np.repeat(v, hq // v.shape[1], axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v)


def _numpy_report(capture, policy):
    """Every number of one policy row, from per-stack codec calls and numpy float64."""
    window = policy.window
    head, mid, _ = window.split_sizes(T) if window else (0, T, 0)
    rows = slice(head, head + mid)
    out = {}
    recon = {}
    codes = {}
    for c, kind in (("k", "key"), ("v", "value")):
        x = getattr(capture, c)
        hat = np.empty_like(x)
        storage = 0
        codes[c] = []
        pay_err = np.zeros(L)
        pay_ref = np.zeros(L)
        for w in range(W):
            for n in range(N):
                code = kvq_jax.encode_loops(x[w, :, n], **policy.loop_kwargs(kind, L))
                codes[c].append(code)  # in the report's stack order: w * N + n
                storage += code.storage_bytes
                hat[w, :, n] = np.asarray(kvq_jax.decode_loops(code))
                ref0 = _f64(x[w, 0, n, rows])
                pay_err[0] += np.sum((_f64(hat[w, 0, n, rows]) - ref0) ** 2)
                pay_ref[0] += np.sum(ref0**2)
                for i, residual in enumerate(code.residuals):
                    delta = (
                        x[w, i + 1, n, rows].astype(np.float32)
                        - hat[w, i, n, rows].astype(np.float32)
                    ).astype(ml_dtypes.bfloat16)
                    got = _f64(kvq_jax.unpack_kv(residual.payload))
                    pay_err[i + 1] += np.sum((got - _f64(delta)) ** 2)
                    pay_ref[i + 1] += np.sum(_f64(delta) ** 2)
        err = (_f64(hat) - _f64(x)) ** 2
        out[f"{c}_bits_per_element"] = 8 * storage / x.size
        out[f"{c}_rel_l2"] = _rel(err, _f64(x) ** 2)
        out[f"{c}_loop_rel_l2"] = [_rel(err[:, i], _f64(x[:, i]) ** 2) for i in range(L)]
        out[f"{c}_base_rel_l2"] = np.sqrt(pay_err[0] / pay_ref[0])
        out[f"{c}_residual_rel_l2"] = list(np.sqrt(pay_err[1:] / pay_ref[1:]))
        recon[c] = hat
    err_sq = np.zeros((N, HQ))
    ref_sq = np.zeros((N, HQ))
    for w in range(W):
        for i in range(L):
            for n in range(N):
                q = _f64(capture.q[w, i, n])
                ref = _attention(q, _f64(capture.k[w, i, n]), _f64(capture.v[w, i, n]))
                got = _attention(q, _f64(recon["k"][w, i, n]), _f64(recon["v"][w, i, n]))
                err_sq[n] += np.sum((got - ref) ** 2, axis=(0, 2))
                ref_sq[n] += np.sum(ref**2, axis=(0, 2))
    per_layer_head = np.sqrt(err_sq / ref_sq)
    out["attention_layer_head"] = per_layer_head
    out["attention_mean"] = per_layer_head.mean()
    out["attention_max"] = per_layer_head.max()
    # decode-like: the last 64 queries, each with its own window rows raw (explicit loops)
    sink, recent = (window.sink, window.recent) if window else (0, 0)
    err_sq = np.zeros((N, HQ))
    ref_sq = np.zeros((N, HQ))
    for w in range(W):
        for i in range(L):
            for n in range(N):
                q = _f64(capture.q[w, i, n])
                k, v = _f64(capture.k[w, i, n]), _f64(capture.v[w, i, n])
                ref = _attention(q, k, v)
                k_hat, v_hat = _f64(recon["k"][w, i, n]), _f64(recon["v"][w, i, n])
                for t in range(T - 64, T):
                    raw = [s < sink or t - s < recent for s in range(t + 1)]
                    ks = np.stack([k[s] if raw[s] else k_hat[s] for s in range(t + 1)])
                    vs = np.stack([v[s] if raw[s] else v_hat[s] for s in range(t + 1)])
                    got = _attention(q[: t + 1], ks, vs)[t]  # the last query attends all
                    err_sq[n] += np.sum((got - ref[t]) ** 2, axis=1)
                    ref_sq[n] += np.sum(ref[t] ** 2, axis=1)
    per_layer_head = np.sqrt(err_sq / ref_sq)
    out["attention_decode_layer_head"] = per_layer_head
    out["attention_decode_mean"] = per_layer_head.mean()
    out["attention_decode_max"] = per_layer_head.max()
    return out, codes


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[] if n == "nvfp4" else [pytest.mark.slow]) for n in CHECKED.split(",")],
)
def test_numbers_equal_an_independent_numpy_computation(results, name):
    capture, rows = results
    row = next(r for r in rows if r.name == name)
    expected, codes = _numpy_report(capture, POLICIES[name])
    # the report's batched (vmapped) codes are the per-stack codes, bit for bit
    k_code, v_code, *_ = policy_sums(stacks(capture.k), stacks(capture.v), policy=POLICIES[name])
    for batched, singles in ((k_code, codes["k"]), (v_code, codes["v"])):
        stacked = jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]), *singles)
        for got, want in zip(jax.tree.leaves(batched), jax.tree.leaves(stacked), strict=True):
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    for key, value in expected.items():
        got = getattr(row, key)
        # K/V sums are float32 partial sums pooled in float64; attention runs in float32.
        rtol = 2e-3 if key.startswith("attention") else 1e-5
        np.testing.assert_allclose(got, value, rtol=rtol, err_msg=key)
    assert row.bits_per_element == pytest.approx(
        (expected["k_bits_per_element"] + expected["v_bits_per_element"]) / 2, abs=0
    )
    assert row.k_storage_bytes * 8 == pytest.approx(row.k_bits_per_element * row.num_elements)
    assert 0 < row.attention_mean <= row.attention_max < 0.5
    assert row.attention_decode_queries == 64
    assert 0 < row.attention_decode_mean <= row.attention_decode_max < 0.5


def test_reference_row_is_exact_and_16_bits(results):
    _, rows = results
    bf16 = rows[0]
    assert bf16.name == "bf16" and bf16.bits_per_element == 16.0
    assert bf16.k_rel_l2 == bf16.v_rel_l2 == bf16.attention_max == 0.0
    assert len(bf16.k_loop_rel_l2) == L and len(bf16.v_residual_rel_l2) == L - 1


# --- policies and arguments ------------------------------------------------------------------


def test_policy_parsing():
    assert [p.name for p in parse_policies(None)] == list(DEFAULT_REPORT)
    assert [p.name for p in parse_policies("all")] == list(POLICIES)
    assert [p.name for p in parse_policies(" nvfp4 ,fp8+win,nvfp4")] == ["nvfp4", "fp8+win"]
    with pytest.raises(ValueError, match=r"unknown \['int3'\].*known: bf16"):
        parse_policies("nvfp4,int3")
    with pytest.raises(ValueError, match="empty"):
        parse_policies(" , ")
    with pytest.raises(ValueError, match="unquantized"):
        POLICIES["bf16"].loop_kwargs("key")


def _run(argv, capsys):
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_unknown_policy_exits_2(fixture_file, capsys):
    rc, _, err = _run(["report", "--kv", str(fixture_file), "--policies", "int4,fp8"], capsys)
    assert rc == 2 and "unknown ['int4']" in err and "Traceback" not in err


def _bad_files(tmp_path):
    bf = ml_dtypes.bfloat16
    good = np.zeros((1, 2, 1, 8, 2, 16), bf)
    files = {"missing": (tmp_path / "nope.npz", "does not exist")}
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file at all")
    files["garbage"] = (garbage, "not a readable kv capture")
    npy = tmp_path / "k.npy"
    np.save(npy, np.zeros((1, 2, 1, 8, 2, 16), np.float32))
    files["npy"] = (npy, "not an .npz archive")
    rank = tmp_path / "rank.npz"
    np.savez(rank, k=np.zeros((8, 2, 16), np.float32), v=np.zeros((8, 2, 16), np.float32))
    files["rank"] = (rank, "must be \\[loops, layers, tokens, heads, dim\\]")
    for name, q, match in (
        ("q_heads", np.zeros((1, 2, 1, 8, 3, 16), bf), "multiple of KV heads"),
        ("q_tokens", np.zeros((1, 2, 1, 9, 4, 16), bf), "must match k"),
    ):
        path = tmp_path / f"{name}.npz"
        np.savez(
            path,
            k=good.view(np.uint16),
            v=good.view(np.uint16),
            q=q.view(np.uint16),
            dtype=np.array("bfloat16"),
        )
        files[name] = (path, match)
    no_v = tmp_path / "no_v.npz"
    np.savez(no_v, k=np.zeros((1, 1, 8, 2, 16), np.float32))
    files["no_v"] = (no_v, "missing array")
    return files


def test_kv_file_errors_exit_2(tmp_path, capsys):
    for name, (path, match) in _bad_files(tmp_path).items():
        rc, _, err = _run(["report", "--kv", str(path)], capsys)
        assert rc == 2, name
        assert err.startswith("kvq report: error:") and "Traceback" not in err, (name, err)
        assert re.search(match, err), (name, err)
        with pytest.raises((ValueError, TypeError, FileNotFoundError)):
            cap.load_capture(path)


def test_subset_and_output_errors_and_selection(fixture_file, tmp_path, capsys):
    rc, _, err = _run(["report", "--json", str(tmp_path / "no" / "r.json")], capsys)
    assert rc == 2 and f"--json: folder {tmp_path / 'no'} does not exist" in err
    rc, _, err = _run(["report", "--kv", str(fixture_file), "--layers", "0,5"], capsys)
    assert rc == 2 and "--layers: indices must be in [0, 3)" in err
    rc, _, err = _run(["report", "--kv", str(fixture_file), "--windows", "a"], capsys)
    assert rc == 2 and "comma-separated integers" in err
    capture = cap.load_capture(fixture_file)
    sub = cap.select(capture, windows=[1], layers=[1, 0])
    assert sub.k.shape == (1, L, 2, T, H, D) and sub.q.shape == (1, L, 2, T, HQ, D)
    np.testing.assert_array_equal(sub.v[0, :, 0], capture.v[1, :, 1])


# --- outputs ---------------------------------------------------------------------------------


def test_json_and_plot(results, fixture_file, tmp_path, capsys):
    _, rows = results
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["report", "--kv", str(fixture_file), "--policies", "bf16," + CHECKED]
    rc, out, _ = _run([*argv, "--json", str(out_json), "--plot", str(out_png)], capsys)
    assert rc == 0
    doc = json.loads(out_json.read_text())
    info = doc["capture"]
    assert info["meta"] == {"model": "fixture", "loops_emulated": True}
    assert (info["windows"], info["loops"], info["layers"], info["tokens"]) == (W, L, N, T)
    assert (info["kv_heads"], info["q_heads"], info["head_dim"]) == (H, HQ, D)
    assert info["dtype"] == "bfloat16" and info["source"] == str(fixture_file)
    assert [p["name"] for p in doc["policies"]] == ["bf16", *CHECKED.split(",")]
    for p, r in zip(doc["policies"], rows, strict=True):
        for key in ("bits_per_element", "k_rel_l2", "v_rel_l2", "attention_mean"):
            assert p[key] == getattr(r, key), key
        assert p["k_residual_rel_l2"] == r.k_residual_rel_l2
        assert len(p["attention_layer_head"]) == N and len(p["attention_layer_head"][0]) == HQ
    assert doc["policies"][1]["window"] == {"sink": 4, "recent": 16}
    # the printed table has the same numbers, in percent
    table = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    assert float(table["nvfp4"][1]) == pytest.approx(rows[2].bits_per_element, abs=1e-3)
    assert table["nvfp4"][2] == f"{100 * rows[2].k_rel_l2:.3f}%"
    assert table["bf16"][1:] == ["16.000"] + ["0.000%"] * 9
    assert table["nvfp4"][6] == f"{100 * rows[2].attention_decode_mean:.3f}%"
    assert doc["policies"][2]["attention_decode_mean"] == rows[2].attention_decode_mean
    legacy = doc["policies"][3]
    assert legacy["k_loop_formats"] == ["int2"] * 4
    assert legacy["v_loop_formats"] == ["int4", "int4", "int2", "int2"]

    pytest.importorskip("matplotlib")
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(out_png)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 600


def test_no_queries_leaves_attention_empty(tmp_path, capsys):
    capture = _fixture_capture()
    path = tmp_path / "noq.npz"
    cap.save_capture(path, cap.Capture(k=capture.k, v=capture.v, q=None, meta={}))
    rc, out, _ = _run(["report", "--kv", str(path), "--policies", "bf16,nvfp4"], capsys)
    assert rc == 0 and "no queries" in out
    nvfp4 = next(line.split() for line in out.splitlines() if line.startswith("nvfp4"))
    assert nvfp4[4:7] == ["-", "-", "-"]


# --- --model dispatch ------------------------------------------------------------------------


def test_model_dispatch(monkeypatch, capsys):
    seen = {}

    def add_model_arguments(parser):
        parser.add_argument("--model", required=True)
        parser.add_argument("--tokens", type=int, default=8)

    def run_model_report(args):
        seen.update(vars(args))
        return 0

    fake = types.ModuleType("kvq_torch_bridge.model_eval")
    fake.add_model_arguments, fake.run_model_report = add_model_arguments, run_model_report
    monkeypatch.setitem(sys.modules, "kvq_torch_bridge.model_eval", fake)
    assert cli.main(["report", "--model", "smollm2", "--tokens", "4", "--policies", "fp8"]) == 0
    assert seen["model"] == "smollm2" and seen["tokens"] == 4 and seen["policies"] == "fp8"

    monkeypatch.setitem(sys.modules, "kvq_torch_bridge.model_eval", None)
    rc, _, err = _run(["report", "--model=smollm2"], capsys)
    assert rc == 2 and "--model is unavailable" in err


# --- the default run -------------------------------------------------------------------------


def test_not_served_rows_are_marked_with_the_reason(fixture_file, capsys, monkeypatch):
    """A policy `serving_support` refuses at the capture's 4 loops gets a '*' row and the
    reason under the table; a served one gets neither. (Every policy that runs on this
    fixture is served since issue 24, so the refusal is planted: heavy-row policies need
    SmolLM2's tables, which refuse the fixture's model.)"""
    from kvq_jax.report import render

    reason = "policy 'loops-abs-v2442' is not served by the paged cache and the engine: planted"

    def refuse(policy, *, num_loops=None):
        if policy.name == "loops-abs-v2442":
            return ServingSupport(False, reason)
        return serving_support(policy, num_loops=num_loops)

    monkeypatch.setattr(render, "serving_support", refuse)
    argv = ["report", "--kv", str(fixture_file), "--policies", "int4-g64,loops-abs-v2442"]
    argv += ["--layers", "0", "--windows", "0"]
    rc, out, err = _run(argv, capsys)
    assert rc == 0, err
    names = [line.split()[0] for line in out.splitlines() if line.startswith(("int4", "loops"))]
    assert names == ["int4-g64", "loops-abs-v2442*"]
    assert f"  {reason}" in out.splitlines()
    assert "*: not served at 4 loop(s)" in out
    monkeypatch.undo()
    rc, out, err = _run(argv, capsys)
    assert rc == 0 and "*" not in out, out


def test_header_names_the_selected_model_layers(capsys):
    """`--layers 2,1` on the embedded capture (model layers 2, 15, 28 of 30) names model layers
    28 and 15 in the header (a selection past the first indices once raised IndexError)."""
    argv = ["report", "--policies", "int4-g64", "--layers", "2,1", "--windows", "0"]
    rc, out, err = _run(argv, capsys)
    assert rc == 0, err
    assert "2 layers (28, 15 of 30)" in out.splitlines()[1], out


def _readme_report_output() -> str:
    """The `kvq report` output the README shows (its ```text block)."""
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    (block,) = re.findall(r"```text\n(.*?)```", readme, re.S)
    return block


@pytest.mark.skipif(
    not cap.EMBEDDED_PATH.exists(),
    reason=f"the embedded capture {cap.EMBEDDED_PATH.name} is not in this checkout yet",
)
def test_default_run_on_the_embedded_capture(capsys):
    """`kvq report` prints the served policies (DEFAULT_REPORT), exactly the output the
    README shows, and its int4-g64 row equals the independent numpy computation."""
    rc, out, err = _run(["report", "--no-progress"], capsys)
    assert rc == 0, err
    assert out == _readme_report_output()
    rows = {s[0]: s for s in (line.split() for line in out.splitlines()) if s and s[0] in POLICIES}
    assert list(rows) == list(DEFAULT_REPORT) and "*" not in out
    assert rows["bf16"][1:] == ["16.000"] + ["0.000%"] * 9
    capture = cap.load_capture()
    assert capture.k.shape == (W, L, N, T, H, D)  # the numpy reference's constants
    assert rows["int4-g64"][1] == "4.500"  # 4 bits + fp16 minimum and scale per 64
    assert float(rows["fp8"][1]) == pytest.approx(8 + 32 / D, abs=1e-3)
    expected, _ = _numpy_report(capture, POLICIES["int4-g64"])
    columns = ("k_rel_l2", "v_rel_l2", "attention_mean", "attention_max", "attention_decode_mean")
    for column, cell in zip(columns, rows["int4-g64"][2:7], strict=True):
        want = pytest.approx(100 * expected[column], rel=2e-3, abs=1.5e-3)
        assert float(cell.rstrip("%")) == want, column
