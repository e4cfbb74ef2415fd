"""`ModelConfig`: the static description of a model (hashable, so it can be a jit static arg)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

#: Architectures this package implements.
ARCHS = ("llama", "ouro")
#: HF `architectures` / `model_type` values accepted for each architecture.
_HF_NAMES = {
    "llama": ({"LlamaForCausalLM"}, {"llama"}),
    "ouro": ({"OuroForCausalLM"}, {"ouro"}),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static model description (frozen and hashable: pass it as a static argument to jit).

    arch: "llama" or "ouro".
    vocab_size, hidden_size, intermediate_size: V, H, I.
    num_layers: decoder layers in the stack (per loop for Ouro).
    num_heads / num_kv_heads / head_dim: Hq, Hkv (GQA when Hkv < Hq), D.
    rope_theta: RoPE base (plain RoPE, HF "rotate_half" layout, no scaling).
    rms_norm_eps: epsilon of every RMSNorm.
    tie_word_embeddings: the LM head is the embedding matrix transposed.
    num_loops: times the layer stack runs per token (Ouro `total_ut_steps`; 1 for Llama,
      where more is an emulation: the final-normed state fed back).
    early_exit_threshold: Ouro's cumulative exit probability at which a token exits
      (1.0: no early exit, every token uses the last loop's logits).
    bos_token_id / eos_token_id: special ids (eos may be a tuple of ids), None when unknown.
    max_position_embeddings: the positions the model was trained for (informational).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_loops: int = 1
    early_exit_threshold: float = 1.0
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "num_loops",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0.0 < self.early_exit_threshold <= 1.0:
            raise ValueError(
                f"early_exit_threshold must be in (0, 1], got {self.early_exit_threshold}"
            )

    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_caches(self) -> int:
        """KV caches the model needs: one per (loop, layer), index loop * num_layers + layer."""
        return self.num_loops * self.num_layers

    @classmethod
    def from_hf_config(cls, hf: Mapping) -> ModelConfig:
        """The config of a Hugging Face `config.json` dict (Llama or Ouro).

        Raises ValueError for another architecture, or for a feature this package does not
        implement (rope scaling, attention/MLP biases, sliding-window attention, another
        activation than SiLU).
        """
        arch = _hf_arch(hf)
        where = f"config.json ({arch})"
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{where}: hidden_act {act!r} is not supported (SwiGLU with silu)")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{where}: {flag}=true is not supported")
        rope_theta = _hf_rope_theta(hf, where)
        if arch == "ouro":
            layer_types = hf.get("layer_types") or []
            if hf.get("use_sliding_window") or "sliding_attention" in layer_types:
                raise ValueError(f"{where}: sliding-window attention is not supported")
        missing = [
            key
            for key in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
            )
            if key not in hf
        ]
        if missing:
            raise ValueError(f"{where}: missing keys {missing}")
        num_heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
        threshold = hf.get("early_exit_threshold") if arch == "ouro" else None
        eos = hf.get("eos_token_id")
        return cls(
            arch=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            intermediate_size=int(hf["intermediate_size"]),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            num_loops=int(hf.get("total_ut_steps", 4)) if arch == "ouro" else 1,
            early_exit_threshold=1.0 if threshold is None else float(threshold),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        )


def _hf_arch(hf: Mapping) -> str:
    architectures = set(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    for arch, (classes, types) in _HF_NAMES.items():
        if architectures & classes or (not architectures and model_type in types):
            return arch
    raise ValueError(
        f"config.json: unsupported architecture (architectures={sorted(architectures)}, "
        f"model_type={model_type!r}); kvq_jax.models implements "
        f"{sorted(c for classes, _ in _HF_NAMES.values() for c in classes)}"
    )


def _hf_rope_theta(hf: Mapping, where: str) -> float:
    """rope_theta; refuses rope scaling (transformers 4 `rope_scaling`, 5 `rope_parameters`)."""
    theta = hf.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        rope = hf.get(key)
        if not rope:
            continue
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{where}: {key} of type {kind!r} is not supported (plain RoPE only)")
        theta = rope.get("rope_theta", theta)
    return 10000.0 if theta is None else float(theta)
