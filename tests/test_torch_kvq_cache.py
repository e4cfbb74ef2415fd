"""KVQCache, kvq's transformers Cache: `model.generate` and a manual forward loop on a tiny
random Llama (2 layers, 2 KV heads of head_dim 64, fixed seed). Checked against independent
references: the K/V every `update` returns against the public codec (`pack_kv` + `unpack_kv`
of each complete block's raw rows, the open block and the call's own tokens raw), the packed
bytes against `pack_kv` and against `allocate_kv_cache` + `reshape_and_cache` fed the same
tokens in another layout, generation against transformers' DynamicCache, storage against the
formats' accounting; bad input refused by argument; a planted defect caught."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvq_torch_bridge as kt  # noqa: E402
from kvq_jax.core.registry import layout  # noqa: E402
from kvq_torch_bridge.serving import (  # noqa: E402
    KVQCache,
    allocate_kv_cache,
    kv_cache,
    reshape_and_cache,
)

H, D, BS = 2, 64, 64
#: the public codec's arguments of each policy's pages (pack_kv's default axes per kind)
CODEC_ARGS = {
    "int4-g64": dict(format="int4", group_size=64),
    "nvfp4": dict(format="nvfp4"),
    "fp8": dict(format="fp8_e4m3"),
}
#: bytes per element of K and V pages, from the format definitions (FORMAT.md): INT4 nibble
#: + FP16 minimum and scale per 64; NVFP4 nibble + E4M3 scale per 16 (+ an FP32 global scale
#: per page and kind); FP8 one byte + an FP32 scale per row of D
BYTES_PER_ELEMENT = {"int4-g64": 0.5 + 4 / 64, "nvfp4": 0.5 + 1 / 16, "fp8": 1 + 4 / D}
PAGE_EXTRA = {"int4-g64": 0, "nvfp4": 2 * 4, "fp8": 0}


def tiny_config(**overrides):
    kwargs = dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=H, head_dim=D,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)  # fmt: skip
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(tiny_config()).eval()
    return m.to(torch.bfloat16)


def prompt(batch=2, length=70, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (batch, length), generator=g)


def generate(model, ids, cache, steps=24, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values= (renamed `cache`)
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                              min_new_tokens=steps, do_sample=False, past_key_values=cache,
                              **kwargs)  # fmt: skip


# -- (a) raw rows: the same tokens as transformers' DynamicCache ------------------------------


def test_generate_raw_matches_dynamic_cache(model):
    ids = prompt()
    ref = generate(model, ids, transformers.DynamicCache(config=model.config))
    cache = KVQCache(model.config, policy="bfloat16")
    out = generate(model, ids, cache)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == ids.shape[1] + 24 - 1
    assert kt.KVQCache is KVQCache  # exported from the package root too


# -- (b) what update returns and the bytes it stores, against the public codec ----------------


def reference_kv(raw: torch.Tensor, start: int, kind: str, policy: str, stored_new: bool,
                 memo: dict | None = None):  # fmt: skip
    """raw [B, L, H, D] (every token so far, the call's own from `start`) -> [B, L, H, D]:
    complete blocks through pack_kv + unpack_kv, the open block raw, and the call's tokens
    raw (unless `stored_new`). `memo` keeps the decoded blocks between calls (time)."""
    memo = {} if memo is None else memo
    b, length = raw.shape[:2]
    out = raw.clone()
    upto = length if stored_new else start
    for s in range(b):
        for j in range(length // BS):
            if (s, j) not in memo:
                block = raw[s, j * BS : (j + 1) * BS]
                memo[s, j] = kt.unpack_kv(kt.pack_kv(block, kind=kind, **CODEC_ARGS[policy]))
            lo, hi = j * BS, min((j + 1) * BS, upto)
            if hi > lo:
                out[s, lo:hi] = memo[s, j][: hi - lo]
    return out


#: token counts of successive update calls: a prefill that ends mid-block, decode steps that
#: complete it, a chunk that opens and completes a block in one call, more decode steps
CALLS = [70, *[1] * 60, 130, *[1] * 5]


def drive(cache: KVQCache, calls=CALLS, batch=2, seed=3, dtype=torch.bfloat16):
    """Feed random K/V to layer 0 call by call; yield (raw K, raw V, start, returned K, V)."""
    g = torch.Generator().manual_seed(seed)
    raw_k = torch.zeros((batch, 0, H, D), dtype=dtype)
    raw_v = torch.zeros_like(raw_k)
    for t in calls:
        k = torch.randn(batch, H, t, D, generator=g).to(dtype)
        v = torch.randn(batch, H, t, D, generator=g).to(dtype)
        start = raw_k.shape[1]
        got_k, got_v = cache.update(k, v, 0)
        raw_k = torch.cat([raw_k, k.transpose(1, 2)], dim=1)
        raw_v = torch.cat([raw_v, v.transpose(1, 2)], dim=1)
        yield raw_k, raw_v, start, got_k.transpose(1, 2), got_v.transpose(1, 2)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def check_pages(cache: KVQCache, raw_k, raw_v, policy: str) -> None:
    """Every complete block's packed arrays equal pack_kv of its raw rows."""
    layer = cache.layers[0]
    table = layer.block_table()
    for kind, raw, pages in (("key", raw_k, layer.serving.k_pages),
                             ("value", raw_v, layer.serving.v_pages)):  # fmt: skip
        for s in range(raw.shape[0]):
            for j in range(raw.shape[1] // BS):
                block = raw[s, j * BS : (j + 1) * BS]
                want = kt.pack_kv(block, kind=kind, **CODEC_ARGS[policy])
                for name, arr in want.arrays.items():
                    got = pages.arrays[name][table[s, j]]
                    assert torch.equal(as_bytes(got), as_bytes(arr)), (kind, s, j, name)


@pytest.mark.parametrize("policy", list(CODEC_ARGS))
@pytest.mark.parametrize("raw_new_tokens", [True, False])
def test_update_returns_the_codecs_kv(policy, raw_new_tokens):
    cache = KVQCache(tiny_config(), policy=policy, raw_new_tokens=raw_new_tokens)
    memo = {"key": {}, "value": {}}
    for i, (raw_k, raw_v, start, got_k, got_v) in enumerate(drive(cache)):
        assert got_k.dtype == torch.bfloat16 and got_k.shape == raw_k.shape
        for kind, raw, got in (("key", raw_k, got_k), ("value", raw_v, got_v)):
            want = reference_kv(raw, start, kind, policy, not raw_new_tokens, memo[kind])
            assert torch.equal(got, want), (policy, kind, i)
    check_pages(cache, raw_k, raw_v, policy)


@pytest.mark.parametrize("policy", list(CODEC_ARGS))
def test_bytes_equal_the_serving_cache_fed_the_same_tokens(policy):
    """One allocate_kv_cache, all tokens of each sequence in one reshape_and_cache call, blocks
    numbered per sequence: the same page bytes as KVQCache's call-by-call writes."""
    cache = KVQCache(tiny_config(), policy=policy)
    *_, (raw_k, raw_v, _, _, _) = drive(cache)
    b, n = raw_k.shape[:2]
    per = -(-n // BS)
    other = allocate_kv_cache("kvq:" + policy, b * per, BS, H, D, max_num_seqs=b)
    for s in range(b):
        slots = s * per * BS + torch.arange(n)
        reshape_and_cache(raw_k[s], raw_v[s], other, slots)
    layer = cache.layers[0]
    table = layer.block_table()
    for name in ("k_pages", "v_pages"):
        for arr_name, arr in getattr(other, name).arrays.items():
            mine = getattr(layer.serving, name).arrays[arr_name]
            for s in range(b):
                for j in range(n // BS):
                    assert torch.equal(as_bytes(mine[table[s, j]]), as_bytes(arr[s * per + j]))
    # the open block's rows: raw in both
    full = n // BS
    rows = layer.serving.block_stage[table[:, full]]
    want = other.block_stage[torch.arange(b) * per + full]
    assert torch.equal(layer.serving.k_stage[rows, : n % BS], other.k_stage[want, : n % BS])
    assert torch.equal(layer.serving.v_stage[rows, : n % BS], other.v_stage[want, : n % BS])
    assert torch.equal(layer.serving.stage_count[rows], other.stage_count[want])


def test_keep_decoded_gives_identical_kv():
    a = KVQCache(tiny_config(), policy="int4-g64")
    b = KVQCache(tiny_config(), policy="int4-g64", keep_decoded=True)
    for (_, _, _, ka, va), (_, _, _, kb, vb) in zip(drive(a), drive(b), strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert b.memory()["decoded"] > 0 and a.memory()["decoded"] == 0


def test_window_policy_keeps_sink_rows_raw():
    cache = KVQCache(tiny_config(), policy="int4-g64+win", raw_new_tokens=False)
    *_, (raw_k, _, _, got_k, _) = drive(cache, calls=[130, 1])
    want = reference_kv(raw_k, 0, "key", "int4-g64", stored_new=True)
    want[:, :4] = raw_k[:, :4]  # Window.sink = 4 rows raw, as kvq's paged cache
    assert torch.equal(got_k, want)
    assert not torch.equal(got_k[:, 4:64], raw_k[:, 4:64])


def test_pool_grows_and_batch_select_keeps_sequences():
    cache = KVQCache(tiny_config(), policy="nvfp4")
    *_, (_, _, _, got_k, _) = drive(cache, calls=[100, 1, 1], batch=3)
    layer = cache.layers[0]
    assert layer.blocks_per_seq >= 2
    cache.batch_select_indices(torch.tensor([2, 0]))
    k, _ = cache.update(torch.zeros(2, H, 0, D, dtype=torch.bfloat16),
                        torch.zeros(2, H, 0, D, dtype=torch.bfloat16), 0)  # fmt: skip
    assert torch.equal(k.transpose(1, 2), got_k[[2, 0]])


# -- (c) a manual forward loop ----------------------------------------------------------------


@torch.no_grad()
def manual_loop(model, ids, cache, steps):
    """Prefill, then one greedy token per forward; returns (tokens [B, steps], logits)."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    tokens, logits = [], [out.logits[:, -1]]
    for _ in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.cat(tokens, 1), torch.stack(logits, 1).float()


def test_manual_forward_loop(model):
    ids = prompt(length=60)
    steps = 8
    ref_tokens, ref_logits = manual_loop(model, ids, transformers.DynamicCache(), steps)
    raw_tokens, raw_logits = manual_loop(model, ids, KVQCache(model.config, "bfloat16"), steps)
    assert torch.equal(raw_tokens, ref_tokens)
    torch.testing.assert_close(raw_logits, ref_logits, rtol=0, atol=0.05)
    cache = KVQCache(model.config, policy="int4-g64")
    tokens, logits = manual_loop(model, ids, cache, steps)  # crosses the block at 64 tokens
    assert cache.get_seq_length() == 60 + steps
    assert torch.isfinite(logits).all()
    # the manual loop and generate drive the cache the same way: the same greedy tokens
    gen = generate(model, ids, KVQCache(model.config, policy="int4-g64"), steps=steps)
    assert torch.equal(gen[:, 60:], tokens)
    # quantized: near the raw logits, not equal (blocks of 64 tokens are stored in INT4)
    err = (logits[:, 5:] - ref_logits[:, 5:]).abs().max()
    assert 0 < err < 1.0


# -- (d) bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(policy="int5"), "policy 'int5' is not"),
        (dict(policy="intb-smollm2"), r"does not fit policy 'intb-smollm2': .*key table is for"),
        (dict(policy="loops-abs-v2442"), "policy 'loops-abs-v2442' cannot be served"),
        (dict(policy="fp8_e5m2"), "policy 'fp8_e5m2' cannot be served"),
        (dict(policy="int4-g64", block_size=32), "block_size 32"),
        (dict(policy="int4-g64", block_size=0), "block_size must be"),
        (dict(policy="int4-g64", max_cache_len=-1), "max_cache_len"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVQCache(tiny_config(), **kwargs)


def test_config_mismatch_raises_value_error():
    with pytest.raises(ValueError, match=r"config\.head_dim"):
        KVQCache(tiny_config(head_dim=0), policy="nvfp4")
    sliding = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=32)
    with pytest.raises(ValueError, match="config"):
        KVQCache(sliding, policy="int4-g64")
    with pytest.raises(TypeError, match="config"):
        KVQCache({"num_hidden_layers": 2}, policy="int4-g64")
    with pytest.raises(TypeError, match="policy"):
        KVQCache(tiny_config(), policy=4)
    cache = KVQCache(tiny_config(), policy="int4-g64")
    k = torch.randn(2, H, 5, D, dtype=torch.bfloat16)
    cache.update(k, k, 0)
    before = {n: t.clone() for n, t in cache.layers[0].serving.tensors().items()}
    bad = torch.randn(2, H + 1, 1, D, dtype=torch.bfloat16)  # KV heads of another config
    with pytest.raises(ValueError, match="key_states"):
        cache.update(bad, bad, 0)
    other_batch = torch.randn(3, H, 1, D, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="key_states has batch 3"):
        cache.update(other_batch, other_batch, 0)
    with pytest.raises(ValueError, match="layer_idx"):
        cache.update(k, k, -1)
    assert cache.get_seq_length() == 5
    after = cache.layers[0].serving.tensors()
    assert all(torch.equal(before[n], after[n]) for n in before)  # unchanged


# -- (e) memory -------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(CODEC_ARGS))
def test_bytes_per_token_are_the_formats_accounting(policy):
    config = tiny_config()
    cache = KVQCache(config, policy=policy)
    *_, (raw_k, _, _, _, _) = drive(cache, calls=[200])
    for i in range(1, config.num_hidden_layers):  # fill the other layer too
        cache.update(raw_k.transpose(1, 2), raw_k.transpose(1, 2), i)
    layers = config.num_hidden_layers
    by_definition = layers * (2 * H * D * BYTES_PER_ELEMENT[policy] + PAGE_EXTRA[policy] / BS)
    from_layouts = 0.0
    for kind in ("key", "value"):
        args = CODEC_ARGS[policy]
        fmt = layout(args["format"])
        axis, group = fmt.resolve((BS, H, D), kind, None, args.get("group_size"))
        from_layouts += layers * fmt.storage_bytes((BS, H, D), axis, group) / BS
    assert cache.kv_bytes_per_token() == pytest.approx(by_definition, rel=1e-12)
    assert cache.kv_bytes_per_token() == pytest.approx(from_layouts, rel=1e-12)
    mem = cache.memory()
    b, n = raw_k.shape[:2]
    assert mem["pages"] == pytest.approx(b * (n // BS) * BS * from_layouts, rel=1e-12)
    # staging: (batch + 1) raw blocks per layer and kind, O(batch x block), not O(tokens)
    assert mem["staging"] == layers * 2 * (b + 1) * BS * H * D * 2
    assert cache.kv_bytes_per_token() < 0.6 * layers * 2 * H * D * 2  # vs bf16 rows


def test_raw_bytes_per_token():
    cache = KVQCache(tiny_config(), policy="bfloat16")
    list(drive(cache, calls=[3]))
    assert cache.kv_bytes_per_token() == 1 * 2 * H * D * 2  # one layer written so far


# -- a planted defect is caught ---------------------------------------------------------------


def test_planted_defect_is_caught(monkeypatch):
    """Break the staging flush (a completed staged block is never packed): the returned K/V
    stop matching the codec reference."""
    monkeypatch.setattr(kv_cache, "_pack_staged", lambda *a, **k: None)
    cache = KVQCache(tiny_config(), policy="int4-g64", raw_new_tokens=False)
    with pytest.raises(AssertionError):
        for raw_k, _, start, got_k, _ in drive(cache, calls=[70, *[1] * 60]):
            want = reference_kv(raw_k, start, "key", "int4-g64", stored_new=True)
            assert torch.equal(got_k, want)


def test_beam_search_reorders_sequences(model):
    """generate(num_beams=3) reorders the cache's sequences (reorder_cache) every step: raw
    rows give DynamicCache's beams; int4-g64 runs through block completion."""
    ids = prompt(batch=1, length=62)
    ref = generate(model, ids, transformers.DynamicCache(config=model.config), steps=6,
                   num_beams=3)  # fmt: skip
    out = generate(model, ids, KVQCache(model.config, "bfloat16", max_cache_len=128), steps=6,
                   num_beams=3)  # fmt: skip
    assert torch.equal(out, ref)
    cache = KVQCache(model.config, "int4-g64")
    out = generate(model, ids, cache, steps=6, num_beams=3)
    assert out.shape == ref.shape and cache.layers[0].num_seqs == 3


def test_imports_transformers_on_first_use_and_no_jax():
    code = (
        "import sys, kvq_torch_bridge\n"
        "assert 'transformers' not in sys.modules\n"
        "from kvq_torch_bridge.serving import KVQCache\n"
        "assert kvq_torch_bridge.KVQCache is KVQCache and 'transformers' in sys.modules\n"
        "assert 'jax' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_calibrated_policy_takes_each_layers_table():
    """ "intb-hint4-smollm2" on a config of SmolLM2's shape: layer i's cache holds keys in the
    INTB format of SmolLM2's table of layer i."""
    from transformers import LlamaConfig

    from kvq_jax.core.calibration import get_key_tables
    from kvq_torch_bridge import KVQCache

    config = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, hidden_size=576, vocab_size=64)  # fmt: skip
    cache = KVQCache(config, policy="intb-hint4-smollm2")
    states = torch.randn(1, 3, 70, 64).to(torch.bfloat16)
    for layer in (2, 15):
        cache.update(states, states, layer)
        fmt = cache.layers[layer].serving.policy.base_format
        assert fmt == kt.IntBCodec(get_key_tables("smollm2").table(layer)).name


@pytest.mark.parametrize("name", ["intb-hint4-heavy-smollm2", "intb-prerope-hint4-heavy-smollm2"])
def test_heavy_row_policy_takes_its_layers_tables(name):
    """A heavy-row policy on a config of SmolLM2's shape (tokens returned as stored): layer
    7's complete block comes back as the public functions give it with layer 7's tables
    (keys INTB of that layer's bit table with the row its mean-query table chooses from the
    keys as written stored INT8, values HINT4 with the same rows; the prerope policy's keys
    stored with RoPE taken off at positions 0..63 and put back); the open block raw."""
    from transformers import LlamaConfig

    from kvq_jax.core.calibration import get_key_tables
    from kvq_jax.core.policies import POLICIES
    from kvq_jax.core.rope import rope_tables
    from kvq_torch_bridge import KVQCache
    from kvq_torch_bridge.codecs.rope import apply_rope, invert_rope

    config = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, hidden_size=576, vocab_size=64)  # fmt: skip
    cache = KVQCache(config, policy=name, raw_new_tokens=False)
    gen = torch.Generator().manual_seed(7)
    k = (torch.randn(1, 3, 70, 64, generator=gen) * torch.linspace(0.2, 3, 64)).to(torch.bfloat16)
    v = torch.randn(1, 3, 70, 64, generator=gen).to(torch.bfloat16)
    got_k, got_v = cache.update(k, v, 7)
    policy = POLICIES[name]
    tables = get_key_tables(policy.key_tables)
    queries = tables.heavy_table(name, 7)
    mq = torch.from_numpy(queries.view("int16")).view(torch.bfloat16)
    kb, vb = (x[0, :, :BS].transpose(0, 1) for x in (k, v))  # [64, H, D]
    rows = kt.select_heavy(kb, mq, group_size=64)
    intb = kt.IntBCodec(tables.table(7)).name
    turn = tuple(torch.from_numpy(a) for a in rope_tables(BS, 64, tables.rope_theta or 1.0))
    stored = invert_rope(kb, *turn).to(torch.bfloat16) if policy.pre_rope else kb
    want_k = kt.unpack_heavy(kt.pack_heavy(stored, rows, kind="key", format=intb))
    if policy.pre_rope:
        want_k = apply_rope(want_k, *turn).to(torch.bfloat16)
    want_v = kt.unpack_heavy(kt.pack_heavy(vb, rows, kind="value", format="hint4"))
    assert torch.equal(got_k[0, :, :BS].transpose(0, 1), want_k)
    assert torch.equal(got_v[0, :, :BS].transpose(0, 1), want_v)
    assert torch.equal(got_k[0, :, BS:], k[0, :, BS:])  # the open block: raw
    assert not torch.equal(got_k[0, :, :BS], k[0, :, :BS])  # quantized indeed
