"""looped-tiny (issue 25): the shipped checkpoint, the training objectives against numpy
references, `kvq loops` against an independent per-loop NLL, and one training run at a micro
size."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pathlib
import re
import sys

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from kvq_jax.cli import commands
from kvq_jax.models import load_hf_directory, load_model, ouro

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def _train_module():
    pytest.importorskip("optax")
    spec = importlib.util.spec_from_file_location("train_looped", BENCH / "train_looped.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks the module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train():
    return _train_module()


@pytest.fixture(scope="module")
def tiny():
    return load_model("looped-tiny", "float32")


# --- the shipped checkpoint -------------------------------------------------------------------


def test_checkpoint_loads_by_name_and_matches_its_card(tiny):
    folder = pathlib.Path(tiny.source["path"])
    card = (folder / "README.md").read_text()
    hf = json.loads((folder / "config.json").read_text())
    c = tiny.config
    assert c.arch == "ouro" and c.num_loops == hf["total_ut_steps"] == 4
    assert c.early_exit_threshold == hf["early_exit_threshold"] < 1.0
    assert f"{c.num_layers} layers run {c.num_loops} times" in card
    assert f"hidden {c.hidden_size}" in card and f"vocabulary {c.vocab_size}" in card
    assert f"context {c.max_position_embeddings} tokens" in card
    weights = folder / "model.safetensors"
    digest = re.search(r"sha256 of `model.safetensors`: `([0-9a-f]{64})`", card).group(1)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 20 * 2**20
    p = tiny.params
    assert p["embed_tokens"].shape == (c.vocab_size, c.hidden_size)
    assert p["layers"]["q_proj"].shape == (c.num_layers, c.hidden_size, c.num_heads * c.head_dim)
    assert p["early_exit_gate"]["weight"].shape == (c.hidden_size,)
    ids = tiny.tokenizer.encode("To be, or not to be", add_special_tokens=False)
    assert tiny.tokenizer.decode(ids) == "To be, or not to be"
    assert (folder / "heldout.txt").stat().st_size > 10_000


# --- the objectives against numpy -------------------------------------------------------------


def np_exit_probs(g: np.ndarray) -> np.ndarray:
    """p [..., N] float64 written out loop by loop."""
    lam = 1.0 / (1.0 + np.exp(-g.astype(np.float64)))
    n = g.shape[-1]
    p = np.zeros_like(lam)
    survive = np.ones(g.shape[:-1])
    for t in range(n):
        p[..., t] = survive * (lam[..., t] if t < n - 1 else 1.0)
        survive = survive * (1.0 - lam[..., t])
    return p


def np_stage1(ce: np.ndarray, g: np.ndarray, beta: float) -> float:
    """mean over tokens of sum_t p_t ce_t - beta * (-sum_t p_t log p_t); ce [N, B, T]."""
    p = np_exit_probs(g)
    expected = np.einsum("btn,nbt->bt", p, ce.astype(np.float64))
    entropy = -(p * np.log(p)).sum(-1)
    return float(np.mean(expected - beta * entropy))


def np_stage2(ce: np.ndarray, g: np.ndarray, k: float = 50.0, gamma: float = 0.005) -> float:
    ce = ce.astype(np.float64)
    total, count = 0.0, 0
    for t in range(ce.shape[0] - 1):
        w = 1.0 / (1.0 + np.exp(-k * (np.maximum(ce[t] - ce[t + 1], 0.0) - gamma)))
        lam = 1.0 / (1.0 + np.exp(-g[..., t].astype(np.float64)))
        total += float(np.sum(-(w * np.log(1.0 - lam) + (1.0 - w) * np.log(lam))))
        count += w.size
    return total / count


def _example(seed=0, n=4, b=2, t=5):
    rng = np.random.default_rng(seed)
    ce = rng.uniform(0.5, 6.0, (n, b, t)).astype(np.float32)
    g = rng.normal(0.0, 2.0, (b, t, n)).astype(np.float32)
    return ce, g


def test_stage1_objective_matches_numpy(train):
    ce, g = _example()
    for beta in (0.0, 0.1, 0.7):
        loss, _, entropy, mean_p = train.stage1_objective(ce, g, beta)
        assert float(loss) == pytest.approx(np_stage1(ce, g, beta), rel=1e-5, abs=1e-5)
        p = np_exit_probs(g)
        np.testing.assert_allclose(mean_p, p.mean((0, 1)), rtol=1e-5, atol=1e-6)
        assert float(entropy) == pytest.approx(-(p * np.log(p)).sum(-1).mean(), rel=1e-5)
    # the model's own exit rule gives the same distribution
    np.testing.assert_allclose(
        np.exp(train.log_exit_probabilities(g)), ouro.exit_probabilities(g), atol=1e-6
    )
    # the check has teeth: a flipped entropy sign, or a mean over loops, is caught
    assert abs(float(train.stage1_objective(ce, g, -0.1)[0]) - np_stage1(ce, g, 0.1)) > 1e-2
    assert abs(float(np.mean(ce)) - np_stage1(ce, g, 0.0)) > 1e-2


def test_stage2_objective_matches_numpy(train):
    ce, g = _example(1)
    ce[1] = ce[0] - 0.004  # an improvement under gamma: label "exit"
    assert float(train.stage2_objective(ce, g)) == pytest.approx(np_stage2(ce, g), rel=1e-5)


def test_per_loop_ce_matches_numpy(train):
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 3, (3, 2, 4, 7)).astype(np.float32)
    targets = rng.integers(0, 7, (2, 4))
    x = logits.astype(np.float64)
    lse = np.log(np.exp(x).sum(-1))
    want = lse - np.take_along_axis(x, targets[None, ..., None].repeat(3, 0), -1)[..., 0]
    np.testing.assert_allclose(train.per_loop_ce(logits, targets), want, rtol=1e-5, atol=1e-5)


# --- kvq loops ----------------------------------------------------------------------------------


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_kvq_loops_json_and_per_loop_nll(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Enter HAMLET.\n\nHam.\nWhat a piece of work is a man! how noble in reason!\n")
    out = tmp_path / "loops.json"
    window = 16
    rc = commands.main(["loops", "--model", "looped-tiny", "--text", str(text), "--json",
                        str(out), "--window", str(window)])  # fmt: skip
    assert rc == 0
    got = json.loads(out.read_text())
    for key in ("nll_per_loop", "exit_loop_histogram", "tokens", "threshold", "model"):
        assert key in got
    c = tiny.config
    assert got["threshold"] == c.early_exit_threshold and got["loops"] == c.num_loops
    ids = np.asarray(tiny.tokenizer.encode(text.read_text(), add_special_tokens=False))
    nll, exits = np.zeros(c.num_loops), np.zeros(c.num_loops, int)
    count = 0
    for i in range(0, len(ids), window):
        w = ids[i : i + window]
        if len(w) < 2:
            continue
        res = ouro.forward(tiny.params, c, w[None].astype(np.int32))
        logp = _log_softmax(np.asarray(res.loop_logits)[:, 0, :-1])  # [N, W-1, V]
        nll += -np.take_along_axis(logp, w[None, 1:, None].repeat(c.num_loops, 0), -1)[..., 0].sum(
            1
        )
        exits += np.bincount(np.asarray(res.exit_loop)[0, :-1], minlength=c.num_loops)
        count += len(w) - 1
    assert got["tokens"] == count == sum(got["exit_loop_histogram"])
    np.testing.assert_allclose(got["nll_per_loop"], nll / count, rtol=1e-4)
    assert got["exit_loop_histogram"] == exits.tolist()


def test_kvq_loops_errors(tmp_path, capsys):
    assert commands.main(["loops", "--model", "looped-tiny", "--text", str(tmp_path / "no")]) == 2
    assert "kvq loops: error: --text" in capsys.readouterr().err
    assert commands.main(["loops", "--model", "looped-tiny", "--window", "1"]) == 2
    assert "--window" in capsys.readouterr().err
    no = tmp_path / "no"  # checked before the run, not after it
    assert commands.main(["loops", "--model", "looped-tiny", "--json", str(no / "x.json")]) == 2
    assert f"kvq loops: error: --json: folder {no} does not exist" in capsys.readouterr().err


# --- training -----------------------------------------------------------------------------------


def test_one_training_step_of_each_stage(train):
    """One stage-I step moves every parameter group; one stage-II step moves the gate alone."""
    import jax
    import optax

    from kvq_jax.models import ModelConfig

    config = ModelConfig(arch="ouro", vocab_size=64, hidden_size=32, num_layers=1, num_heads=1,
                         num_kv_heads=1, head_dim=32, intermediate_size=64, rope_theta=1e4,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, num_loops=3,
                         early_exit_threshold=0.5, max_position_embeddings=8)  # fmt: skip
    params = train.init_params(config, seed=0)
    opt = train.make_optimizer(1e-2, warmup=1, steps=4, weight_decay=0.1)
    gate_opt = optax.adam(1e-2)
    stage1, stage2 = train.make_steps(config, opt, gate_opt, beta=0.1)
    batch = np.random.default_rng(0).integers(0, 64, (2, 9)).astype(np.int32)
    new, state, _ = stage1(params, opt.init(params), batch)  # warmup: the first lr is 0
    new, _, metrics = stage1(new, state, batch)
    assert np.isfinite(float(metrics["loss"])) and metrics["ce"].shape == (3,)
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), params, new)
    assert all(jax.tree.leaves(moved))
    after, _, metrics = stage2(new, gate_opt.init(new["early_exit_gate"]), batch)
    assert np.isfinite(float(metrics["gate_loss"]))
    for key in new:
        same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), new[key], after[key])
        assert all(jax.tree.leaves(same)) == (key != "early_exit_gate"), key


@pytest.mark.slow
def test_training_runs_at_a_micro_size(train, tmp_path):
    out = tmp_path / "micro"
    rc = train.main(["--micro", "--out", str(out), "--steps", "2", "--stage2-steps", "1",
                     "--vocab", "300", "--hidden", "32", "--layers", "1", "--heads", "1",
                     "--intermediate", "64", "--loops", "2", "--context", "16", "--batch", "2",
                     "--log-every", "1"])  # fmt: skip
    assert rc == 0
    config, _ = load_hf_directory(out, "float32")
    assert config.num_loops == 2 and config.num_layers == 1
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["stage"] for r in rows] == ["I", "I", "II"]
    assert all(np.isfinite(r.get("loss", r.get("gate_loss"))) for r in rows)
    metrics = json.loads((out / "metrics.json").read_text())
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert metrics["sha256"]["model.safetensors"] == digest
    assert len(metrics["heldout_eval"]["nll_per_loop"]) == 2
