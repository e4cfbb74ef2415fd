"""The engine against the eager page-by-page reference (tests/engine_reference.py): quantized
decode over 16 steps, exits that skip loops, loop-KV sharing, each with planted defects.

The prompt is fed one token per prefill call, as the reference does; tiny float32 models
(tests/tiny_models.py).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from engine_reference import reference_decode
from tiny_models import prompt_of, tiny_model

from kvq_jax.engine import Engine

# -- decode against the page-by-page reference (tests/engine_reference.py) ---------------------

#: engine vs the eager page-by-page reference, float32 tiny models: most tokens agree to float32
#: round-off (measured 2e-6 - 5e-6: float32 attention vs float64), bounded by REFERENCE_TYPICAL
#: on the median token; a few tokens jump to 1e-4 - 2.4e-3 where the round-off rounds one
#: float16 scale of a quantized group to the neighbouring value (every code equal; measured
#: on 3-loop Ouro with exits and on +win last), which later layers carry: REFERENCE_TOL
#: bounds those. A wrong residual chain (the planted loop-0 defect) is off by ~4.
REFERENCE_TOL = 1e-2
REFERENCE_TYPICAL = 1e-4


def _against_reference(model, policy, *, prompt_len=20, page_size=16, loops=None,
                       reference_skip=None, engine_scratch=False, **kw):  # fmt: skip
    """17 new tokens (16 decode steps; the prompt fed one token per prefill call, as the
    reference does): the engine's tokens, logits and exit loops equal the reference's.
    engine_scratch: the reference's prompt scratch (shared loop_kv) in the engine's
    configurations (heavy rows), not its own derivation."""
    engine = Engine(model, policy, num_pages=8, page_size=page_size, max_seqs=2,
                    max_pages_per_seq=4, prefill_chunk=1, loops=loops, **kw)  # fmt: skip
    prompt = prompt_of(prompt_len, seed=4)
    request = engine.add_request(prompt, max_new_tokens=17, keep_logits=True)
    engine.run()
    _, logits, exits = reference_decode(
        model, prompt, 17, cache_config=engine.cache_configs, loops=loops,
        skip=engine.skip_exited if reference_skip is None else reference_skip,
        forced=request.tokens, loop_kv=engine.loop_kv,
        scratch_config=engine.scratch_configs if engine_scratch else None,
    )  # fmt: skip
    err = np.abs(np.stack(request.logits) - logits).max(axis=-1)  # per token
    assert err.max() < REFERENCE_TOL and np.median(err) < REFERENCE_TYPICAL, err
    assert request.tokens == [int(t) for t in logits.argmax(-1)]
    assert request.exit_loops == exits
    return engine, request


@pytest.mark.parametrize(
    "arch,policy,page_size",
    [
        ("llama", "int4-g16+win", 16),
        ("ouro", "int4-g16", 16),
        pytest.param("ouro", "mixed+win", 64, marks=pytest.mark.slow),
    ],
)
def test_quantized_decode_matches_the_reference(tiny_llama, tiny_ouro, arch, policy, page_size):
    """>= 16 decode steps through complete pages (loop 0 packed, loop 1 a residual delta),
    the partial page and the sink rows, against the public codec functions page by page."""
    model = tiny_llama if arch == "llama" else tiny_ouro
    prompt_len = 20 if page_size == 16 else 70
    _against_reference(model, policy, prompt_len=prompt_len, page_size=page_size)


@pytest.mark.parametrize(
    "policy", ["loops-abs-v2442", pytest.param("flashloop-legacy+win", marks=pytest.mark.slow)]
)
def test_per_loop_policies_match_the_reference(policy):
    """4-loop Ouro with per-loop formats (values 2/4/4/2 bits) and absolute loops (keys in
    every later loop, values in loops 1-2): 16 decode steps against the page-by-page chain
    (each loop's format, `absolute=True` where the policy says)."""
    model = tiny_model("ouro", seed=5, loops=4)
    engine, _ = _against_reference(model, _groups_of_16(policy))
    assert engine.cache_config.per_loop("value")


def _groups_of_16(name: str):
    """Policy `name` with groups of 16 tokens (16-token pages: complete pages in decode)."""
    from kvq_jax.core.policies import POLICIES

    return dataclasses.replace(POLICIES[name], name=f"{name}-g16", group_size=16)


#: Per-layer INTB key tables of two layers, rows of different widths per layer (2 x 64
#: channels: layer 0 two heads of 256 / 256 bits, layer 1 384 / 384).
TWO_WIDTHS = {0: ((2, 6) * 32, (4,) * 64), 1: ((6,) * 64, (5, 7) * 32)}


def _intb_policy(monkeypatch, tables, *, heavy: bool, rope_theta=None):
    """(policy, mean-query tables or None): INTB keys with per-layer `tables` (served as the
    tiny models' key tables; groups of 16) and HINT4 values; heavy: heavy rows (FORMAT.md 5a:
    one INT8 row per 16 tokens and KV head) chosen with random mean-query tables; with
    `rope_theta`, keys stored before RoPE (FORMAT.md 5b)."""
    import ml_dtypes

    from kvq_jax.core import calibration
    from kvq_jax.core.policies import Policy

    queries = None
    if heavy:
        rng = np.random.default_rng(9)
        queries = {i: rng.standard_normal((2, 2, 64)).astype(ml_dtypes.bfloat16) for i in tables}
    key_tables = calibration.KeyTables(("tiny",), tables, 16, "test", mean_query=queries,
                                       rope_theta=rope_theta)  # fmt: skip
    monkeypatch.setattr(calibration, "get_key_tables", lambda name: key_tables)
    policy = Policy("heavy-g16" if heavy else "intb-g16", "intb", "intb", group_size=16,
                    v_base_format="hint4", v_residual_format="hint4",
                    key_tables="tiny-heavy" if heavy else "tiny", heavy=16 if heavy else None,
                    pre_rope=rope_theta is not None)  # fmt: skip
    return policy, None if queries is None else np.stack([queries[i] for i in sorted(tables)])


def test_heavy_rows_match_the_reference(tiny_llama, monkeypatch):
    """Heavy-row pages through the engine (keys INTB with per-layer tables of one width, one
    layer group; values HINT4; the rows chosen from each key page with the layer's mean-query
    table): 16 decode steps against `select_heavy` / `pack_heavy` page by page."""
    from kvq_jax.core.registry import layout

    tables = {0: ((2, 6) * 32, (4,) * 64), 1: ((8, 1, 3) * 20 + (4, 4, 4, 4), (3, 5) * 32)}
    policy, queries = _intb_policy(monkeypatch, tables, heavy=True)
    engine, _ = _against_reference(tiny_llama, policy)
    assert engine.spec.groups == (2,)
    keys, values = (layout(engine.cache_config.loop_format(k, 0)) for k in ("key", "value"))
    assert keys.heavy_group == values.heavy_group == 16 and values.tables is None
    assert keys.tables.tobytes() == queries.tobytes() and keys.base.tables == (tables[0], tables[1])
    assert engine.calibration_bytes() == queries.nbytes + 2 * 2 * 64


def test_heavy_rows_in_every_loop_match_the_reference(monkeypatch):
    """2-loop Ouro, key tables of different widths (one format and layer group per layer):
    every loop stored whole with rows chosen from that loop's keys."""
    tables = TWO_WIDTHS
    policy, _ = _intb_policy(monkeypatch, tables, heavy=True)
    engine, _ = _against_reference(tiny_model("ouro", seed=5, loops=2), policy)
    assert engine.spec.groups == (1, 1)
    assert engine.cache_configs[0].k_absolute == engine.cache_configs[0].v_absolute == (1,)


@pytest.mark.slow  # CI time: the kernel-path test below runs these formats by default
def test_keys_before_rope_match_the_reference(monkeypatch):
    """Keys stored before RoPE (FORMAT.md 5b) with heavy rows, 2-loop Ouro: each key page packs
    `invert_rope` at its positions, rows chosen from the RoPE'd keys, and is attended with
    RoPE put back; 16 decode steps against the page-by-page reference. The comparison can
    fail: a reference that packs the keys as handed over (the planted defect) is off by far
    more than the tolerance."""
    tables = TWO_WIDTHS
    model = tiny_model("ouro", seed=5, loops=2)
    policy, _ = _intb_policy(monkeypatch, tables, heavy=True, rope_theta=model.config.rope_theta)
    engine, request = _against_reference(model, policy)
    assert {c.rope_theta for c in engine.cache_configs} == {model.config.rope_theta}
    # planted defect: the reference stores the keys as handed over (no RoPE taken off)
    configs = tuple(dataclasses.replace(c, rope_theta=None) for c in engine.cache_configs)
    _, logits, _ = reference_decode(model, prompt_of(20, seed=4), 17, cache_config=configs,
                                    forced=request.tokens)  # fmt: skip
    assert np.abs(np.stack(request.logits) - logits).max() > 10 * REFERENCE_TOL


def _through_the_kernels(monkeypatch, model, policy) -> dict:
    """`_against_reference` with backend "auto" resolved as on a GPU (each op's kernel where
    its `config_support` takes the cache, here in interpret mode; the XLA path elsewhere);
    returns the keyword arguments of each kernel call per op ({"attention", "pack",
    "reconstruct"})."""
    from kvq_jax.kernels import backend
    from kvq_jax.kernels.page_pack import api as pack_api
    from kvq_jax.kernels.page_reconstruct import api as reconstruct_api
    from kvq_jax.kernels.paged_attention import api as attention_api

    real_resolve = backend.resolve_backend
    calls = {"attention": [], "pack": [], "reconstruct": []}

    def as_on_a_gpu(name, support=None, *, device=None):
        if name == "auto":
            name = "pallas_interpret" if support is None else "xla"
        return real_resolve(name, support, device=device)

    def counted(op, real):
        def call(*args, **kwargs):
            calls[op].append(kwargs)
            return real(*args, **kwargs)

        return call

    for op, module, name in (
        ("attention", attention_api.pallas_triton, "paged_decode_attention"),
        ("pack", pack_api.pallas_triton, "pack_paged"),
        ("reconstruct", reconstruct_api.pallas_triton, "decode_pages"),
    ):
        monkeypatch.setattr(module, name, counted(op, getattr(module, name)))
    monkeypatch.setattr(backend, "resolve_backend", as_on_a_gpu)
    monkeypatch.setattr(reconstruct_api, "resolve_backend", as_on_a_gpu)
    jax.clear_caches()  # no program traced with another resolution
    try:
        _against_reference(model, policy, backend="auto")
    finally:
        jax.clear_caches()
    return calls


def test_the_best_policy_through_the_kernels_matches_the_reference(monkeypatch):
    """The served best policy's formats (heavy rows over INTB keys and HINT4 values, keys
    stored before RoPE) on 2-loop Ouro through the kernels (`_through_the_kernels`: every page
    packs in the kernel with the rows the keys chose, decode attention runs in it): 16 decode
    steps against the page-by-page reference."""
    tables = TWO_WIDTHS
    model = tiny_model("ouro", seed=5, loops=2)
    policy, _ = _intb_policy(monkeypatch, tables, heavy=True, rope_theta=model.config.rope_theta)
    calls = _through_the_kernels(monkeypatch, model, policy)
    assert calls["attention"] and all(c["interpret"] for c in calls["attention"])
    assert {c["kind"] for c in calls["pack"]} == {"key", "value"}
    assert all(c["format"].startswith("heavy") and c["rows"] is not None for c in calls["pack"])


def test_intb_keys_through_the_kernels_match_the_reference(monkeypatch):
    """INTB keys with per-layer tables of two widths (W = 32 and 48 bytes, one format per
    layer; loop 1 an INTB delta) and HINT4 values on 2-loop Ouro through the kernels: the key
    pages pack in the kernel (each layer's stream maps), reconstruct in it for loop 1's deltas
    and are attended in it; 16 decode steps against the page-by-page reference."""
    tables = TWO_WIDTHS
    policy, _ = _intb_policy(monkeypatch, tables, heavy=False)
    calls = _through_the_kernels(monkeypatch, tiny_model("ouro", seed=5, loops=2), policy)
    packed = {c["format"] for c in calls["pack"] if c["kind"] == "key"}
    assert len(packed) == 2 and all(f.startswith("intb") for f in packed)
    assert calls["attention"] and calls["reconstruct"]


def test_int2_and_hint_values_through_the_kernels_match_the_reference(monkeypatch):
    """INT2 keys (loop 1 an INT2 delta) and HINT2 values (loop 1 a HINT4 delta) on 2-loop Ouro
    through the kernels: every page packs in the kernel (four INT2 codes per byte; HINT rows
    rotated in registers), loop 0 reconstructs in it for loop 1's deltas (HINT2 un-rotated in
    registers), decode attention reads the values in the rotated space; 16 decode steps
    against the page-by-page reference."""
    policy = dataclasses.replace(_groups_of_16("int4-hint4"), name="int2-hint2-hint4-g16",
                                 base_format="int2", residual_format="int2",
                                 v_base_format="hint2", v_residual_format="hint4")  # fmt: skip
    calls = _through_the_kernels(monkeypatch, tiny_model("ouro", seed=6, loops=2), policy)
    assert all(c["interpret"] for op in calls for c in calls[op])
    assert calls["attention"]
    assert {c["format"] for c in calls["pack"]} == {"int2", "hint2", "hint4"}
    assert {"int2", "hint2"} <= {step[0] for c in calls["reconstruct"] for step in c["steps"]}


def test_exits_across_absolute_loops_match_the_reference():
    """3-loop Ouro at threshold 0.5 with loops 1-2 stored absolute: a token that exited before
    an absolute loop is read as its exit loop there (the adaptive-exit cache's depth map)."""
    engine, request = _against_reference(_gated_ouro(), _groups_of_16("loops-abs-v2442"))
    assert engine.cache_config.adaptive_exit and engine.cache_config.k_absolute == (1, 2)
    assert len(set(request.exit_loops[1:])) > 1


def test_heavy_rows_with_exits_run_every_loop(monkeypatch):
    """3-loop Ouro at threshold 0.5 with heavy-row pages in every loop: the cache of exits that
    skip loops does not take them, so by default (skip_exited=None) every loop runs and each
    token keeps its exit loop's logits, as the reference that runs every loop; asking to skip
    is refused naming skip_exited; a policy without heavy rows still skips."""
    tables = TWO_WIDTHS
    policy, _ = _intb_policy(monkeypatch, tables, heavy=True)
    model = _gated_ouro()
    engine, request = _against_reference(model, policy)
    assert not engine.skip_exited and not engine.cache_config.adaptive_exit
    assert len(set(request.exit_loops[1:])) > 1  # the tokens exit at different loops ...
    assert engine.stats["decode_loops"] == 3 * engine.stats["decode_steps"]  # ... none skipped
    with pytest.raises(ValueError, match="skip_exited: policy 'heavy-g16' stores heavy rows"):
        Engine(model, policy, num_pages=8, page_size=16, max_seqs=2, max_pages_per_seq=4,
               skip_exited=True)  # fmt: skip
    assert Engine(model, _groups_of_16("int4-g16"), num_pages=8, page_size=16, max_seqs=2,
                  max_pages_per_seq=4).skip_exited  # fmt: skip


def test_exits_through_the_kernels_match_the_reference(monkeypatch):
    """The same through the kernels (`_through_the_kernels`): page packing, page
    reconstruction (the previous loop of each delta, each row kept at its exit loop by the
    depth map) and decode attention (the depth map, absolute loops mid-chain) in the kernel."""
    calls = _through_the_kernels(monkeypatch, _gated_ouro(), _groups_of_16("loops-abs-v2442"))
    assert calls["attention"] and calls["pack"]
    assert calls["reconstruct"] and all(c["depth"] is not None for c in calls["reconstruct"])


@pytest.mark.slow
def test_reference_comparison_catches_a_planted_defect(tiny_ouro, monkeypatch):
    """Decode attention that reads loop 0 in every loop (the residual chain ignored)."""
    from kvq_jax.engine import stores

    real = stores.paged_attention.paged_decode_attention

    def loop_zero(*args, loop, **kwargs):
        return real(*args, loop=0, **kwargs)

    jax.clear_caches()  # the jitted steps were traced with the real function
    monkeypatch.setattr(stores.paged_attention, "paged_decode_attention", loop_zero)
    try:
        with pytest.raises(AssertionError):
            _against_reference(tiny_ouro, "int4-g16")
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def _gated_ouro():
    """Tiny 3-loop Ouro whose exit gate fires early for most tokens at threshold 0.5."""
    model = tiny_model("ouro", seed=3, loops=3, threshold=0.5)
    gate = model.params["early_exit_gate"]
    params = dict(model.params, early_exit_gate=dict(gate, weight=3 * gate["weight"]))
    return dataclasses.replace(model, params=params)


@pytest.mark.parametrize("policy", [pytest.param("bf16", marks=pytest.mark.slow), "int4-g16"])
def test_exits_skip_loops(policy):
    """Ouro at threshold 0.5: decode stops looping once the token has exited; later tokens
    attend an exited token's exit-loop K/V (the adaptive-exit cache for int4), as the
    reference's skipping semantics say; fewer loops run than 3 per step."""
    engine, request = _against_reference(_gated_ouro(), policy)
    assert engine.skip_exited and (engine.cache_config is None or engine.cache_config.adaptive_exit)
    assert len(set(request.exit_loops[1:])) > 1  # decode tokens exit at different loops
    steps, loops = engine.stats["decode_steps"], engine.stats["decode_loops"]
    assert steps == 16 and loops < 3 * steps


def test_skipping_reference_catches_an_engine_that_runs_every_loop():
    """The planted defect: an engine that runs every loop after the exit (skip_exited=False)
    differs from the skipping reference."""
    with pytest.raises(AssertionError):
        _against_reference(_gated_ouro(), "bf16", skip_exited=False, reference_skip=True)


@pytest.mark.parametrize(
    "policy,loop_kv",
    [
        ("bf16", "last"),
        pytest.param("bf16", "mean", marks=pytest.mark.slow),
        pytest.param("int4-g16+win", "last", marks=pytest.mark.slow),
        ("int4-g16+win", "mean"),
    ],
)
def test_loop_kv_sharing_matches_the_reference(policy, loop_kv):
    """3-loop Ouro with one shared K/V plane per layer: the prompt attends per loop, a decode
    token's loop l attends to the earlier tokens' shared rows (last loop, or the mean over
    loops, stored in the policy's format) and to its own loop-l K/V."""
    model = tiny_model("ouro", seed=3, loops=3)
    engine, _ = _against_reference(model, policy, loop_kv=loop_kv)
    assert engine.stored_loops == 1 and engine.spec.loop_kv == loop_kv


def test_heavy_rows_with_a_shared_loop_plane_match_the_reference(monkeypatch):
    """Heavy-row pages (keys INTB, values HINT4) with one shared K/V plane per layer on a gated
    3-loop Ouro: the prompt's scratch keeps every loop whole, the shared rows (each token's
    last loop) are packed with their own heavy rows, and the exits skip loops (one plane: no
    per-loop exit record)."""
    tables = TWO_WIDTHS
    policy, _ = _intb_policy(monkeypatch, tables, heavy=True)
    engine, _ = _against_reference(_gated_ouro(), policy, loop_kv="last", engine_scratch=True)
    assert engine.stored_loops == 1 and engine.skip_exited
    assert engine.stats["decode_loops"] < 3 * engine.stats["decode_steps"]
    for config in engine.scratch_configs:  # every later loop stored whole, in both kinds
        assert config.k_absolute == config.v_absolute == (1, 2) and config.num_loops == 3


def test_loop_kv_sharing_with_exits_that_skip_loops():
    engine, _ = _against_reference(_gated_ouro(), "int4-g16", loop_kv="mean")
    assert engine.stats["decode_loops"] < 3 * engine.stats["decode_steps"]
    assert not engine.cache_config.adaptive_exit  # one plane: no per-loop exit record


def test_loop_kv_reference_catches_a_planted_defect(monkeypatch):
    """Shared decode attention that drops the token's own K/V (the log-sum-exp merge)."""
    from kvq_jax.engine import runner

    jax.clear_caches()
    monkeypatch.setattr(runner, "merge_attention", lambda out, lse, q, k, v: out)
    try:
        with pytest.raises(AssertionError):
            _against_reference(tiny_model("ouro", seed=3, loops=3), "bf16", loop_kv="last")
    finally:
        monkeypatch.undo()
        jax.clear_caches()


def test_loop_kv_sharing_keeps_one_plane_and_frees_the_prompts_planes():
    """Chunked prefill (3 and 4 chunks) keeps the prompt's per-loop planes in the scratch pool,
    which is empty again after the prefill; the pool holds 1 plane per layer: 1/3 of the
    bytes of loop_kv="all" at 3 loops."""
    model = tiny_model("ouro", seed=3, loops=3)
    kw = dict(num_pages=8, page_size=16, max_seqs=2, max_pages_per_seq=4, prefill_chunk=8)
    every = Engine(model, "int4-g16", **kw)
    engine = Engine(model, "int4-g16", loop_kv="mean", **kw)
    assert engine.kv_bytes_per_token() == pytest.approx(every.kv_bytes_per_token() / 3)
    scratch = engine.prefill_allocator
    free = scratch.num_free_pages
    a = engine.submit(prompt_of(24, seed=4), max_new_tokens=8)
    b = engine.submit(prompt_of(32, seed=5), max_new_tokens=6)
    while engine.waiting or engine.running:
        engine.step()
        assert scratch.num_free_pages == free and not scratch.live_slots
    assert a.done and b.done and len(a.tokens) == 8 and len(b.tokens) == 6
    assert engine.allocator.num_free_pages == 8 and scratch.num_free_pages == free
    assert engine.scratch_bytes() > 0 and every.scratch_bytes() == 0


def test_exits_in_a_batch_equal_each_alone():
    """Two sequences decoding together, exiting at different loops in the same step: each
    gets the tokens it gets alone (the exited row keeps its state while the other loops)."""
    model = _gated_ouro()
    engine = Engine(model, "int4-g16", num_pages=8, page_size=16, max_seqs=2,
                    max_pages_per_seq=4, prefill_chunk=8)  # fmt: skip
    prompts = [prompt_of(24, seed=4), prompt_of(16, seed=5)]  # chunks of 8 only
    alone = []
    for prompt in prompts:
        alone.append(engine.add_request(prompt, max_new_tokens=10, stop_ids=[]))
        engine.run()
    together = engine.generate(prompts, max_new_tokens=10, stop_ids=[])
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert [r.exit_loops for r in together] == [r.exit_loops for r in alone]
    mixed = [
        a != b for a, b in zip(together[0].exit_loops[1:], together[1].exit_loops[1:], strict=True)
    ]
    assert any(mixed)  # some step had one row exit before the other
