"""Captures for issue-16 research (uses the repo's capture hook read-only).

python capture.py --model smollm2 --out cap_smol_main.npz --windows 4 --tokens 512 \
    --layers 2,6,10,15,19,23,28 --loops 4 [--text FILE]
Saves k, v, q as float32 [W, L, N, T, H, D] plus meta (JSON) and token ids.
"""
import argparse
import json
import os
import sys
import time

sys.path[:0] = ["/tmp/research16/site", "/work/main"]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import numpy as np
import torch

torch.set_num_threads(1)
from kvq_jax.core.policies import POLICIES
from kvq_torch_bridge.model_eval.codecs import get_loop_coder
from kvq_torch_bridge.model_eval.hooks import KVQuantizer, quantized_attention
from kvq_torch_bridge.model_eval.loading import load_model
from kvq_torch_bridge.model_eval.looped import run_logits
from kvq_torch_bridge.model_eval.text import text_windows

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2")
ap.add_argument("--windows", type=int, default=4)
ap.add_argument("--tokens", type=int, default=512)
ap.add_argument("--layers", default="2,6,10,15,19,23,28")
ap.add_argument("--loops", type=int, default=4)
ap.add_argument("--text", default=None)
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--out", required=True)
a = ap.parse_args()
layers = [int(x) for x in a.layers.split(",")]
t0 = time.time()
loaded = load_model(a.model, dtype=a.dtype, loops=a.loops)
print("loaded", loaded.source, time.time() - t0, flush=True)
wins = text_windows(loaded.tokenizer, a.windows, a.tokens, a.text)
ids = torch.from_numpy(np.stack([w.ids for w in wins]))
qz = KVQuantizer(POLICIES["bf16"], get_loop_coder("torch"),
                 base_implementation=loaded.model.config._attn_implementation,
                 record=True, record_layers=layers)
with torch.no_grad(), quantized_attention(loaded.model, qz):
    if a.loops == 1:
        qz.set_loop(0)
        loaded.model(input_ids=ids)
    else:
        run_logits(loaded.model, ids, loops=loaded.loops, keep=1, on_loop=qz.set_loop)


def stack(name):
    x = torch.stack([torch.stack([qz.records[(l, lp)][name] for l in layers], 1)
                     for lp in range(loaded.loops)], 1)
    return x.to(torch.float32).numpy()


cfg = loaded.model.config
meta = dict(source=loaded.source, layers=layers, loops=loaded.loops, emulated=loaded.emulated,
            text=[w.meta() for w in wins], tokens=a.tokens,
            rope_theta=getattr(cfg, "rope_theta", None),
            rope_parameters=str(getattr(cfg, "rope_parameters", None)),
            head_dim=getattr(cfg, "head_dim", None),
            query_pre_attn_scalar=getattr(cfg, "query_pre_attn_scalar", None),
            layer_types=getattr(cfg, "layer_types", None),
            sliding_window=getattr(cfg, "sliding_window", None))
np.savez_compressed(a.out, k=stack("k_in"), v=stack("v_in"), q=stack("q"), ids=ids.numpy(),
                    meta=np.array(json.dumps(meta, default=str)))
print("wrote", a.out, stack("k_in").shape, stack("q").shape, time.time() - t0)
