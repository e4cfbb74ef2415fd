"""The model runner: the engine's jitted prefill and decode steps over its layer-group stores.

`prefill_step(params, stores, scratch, tokens, start, tables, seq_ids, scratch_tables,
*, spec)` and `decode_step(params, stores, tokens, positions, tables, active, *, spec)` are
the public steps (the engine and `bench/engine_decode.py` call them); `stores` (and
`scratch`) are donated and returned updated. `spec` is the static `StepSpec`.

Compiled by scan: within a loop, each layer group (`kvq_jax.engine.stores`) runs as one
`lax.scan` over its layers, the layer's parameters indexed from the stacked pytree and its
cache addressed by the traced layer index (folded block tables and slots). A program holds
one layer body per (loop, group): 4 for a 4-loop model with one policy for every layer,
whatever the number of layers. Loops stay unrolled: loop 0 writes a cache's base plane and
loop l > 0 its residual plane l - 1 against loop l - 1, different formats and code.

Loop-KV sharing (`spec.loop_kv`, docs/GUIDE.md "Loop-KV sharing"):

* "all": the stores hold every loop (plane l: loop l). Prefill and decode append the token's
  loop-l K/V at loop l, and loop l attends to loop l of every token.
* "last" / "mean": the stores hold one plane per layer, the *shared* K/V of each token: its
  last loop's K/V, or the float32 mean over its loops rounded to the compute dtype, stored in
  the policy's format. Prefill: loop l of a prompt chunk attends to the prompt's earlier
  chunks at loop l, from `scratch` (per-loop stores of the prompt being prefilled, every
  loop) and to the chunk itself raw; the chunk's per-loop K/V go to `scratch`, its shared K/V
  to the stores. Decode: loop l of a token attends to the shared plane of the earlier tokens
  and to its own loop-l K/V (raw, merged by log-sum-exp); after its last loop its shared row
  is appended.

Exits that skip loops (`spec.skip_exited`, Ouro with early_exit_threshold < 1): after each
loop the decode step knows which rows have exited (their cumulative exit probability reached
the threshold). A loop in which every active row has exited runs no layer (`lax.cond`) but
the appends that keep the cache consistent: with loop_kv "all" each layer appends the rows'
K/V of their exit loop, flagged `exited` (an adaptive-exit cache records them); a row that
exited while others still loop keeps its hidden state and its exit loop's K/V the same way.
Later tokens attend to an exited token's K/V of loop min(l, exit loop) (for "mean": the mean
over loops counts the exit loop's K/V for each skipped loop). Prefill runs every loop.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kvq_jax.codecs.attention import merge_attention, merge_partials
from kvq_jax.engine.stores import fold_tables, layer_ids
from kvq_jax.models import architecture, ouro
from kvq_jax.models.config import ModelConfig

__all__ = [
    "LOOP_KV",
    "StepSpec",
    "decode_step",
    "prefill_attention",
    "prefill_step",
    "scan_layer_groups",
]

#: What a later token attends at loop l: "all" (loop l of every token), "last" (each earlier
#: token's last loop), "mean" (each earlier token's mean over loops).
LOOP_KV = ("all", "last", "mean")

_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static description of a step (hashable): the model `config` (num_loops as run),
    `groups` (layers per store, summing to config.num_layers), the allocator's `num_pages` and
    `max_seqs`, the cache `backend`, `skip_exited` (decode skips loops once every active row
    has exited; with loop_kv "all" it needs adaptive-exit stores), `loop_kv` ("all", "last",
    "mean"), and the prefill scratch pool's `scratch_pages` / `scratch_seqs` (shared loop_kv
    only)."""

    config: ModelConfig
    groups: tuple[int, ...]
    num_pages: int
    max_seqs: int
    backend: str = "auto"
    skip_exited: bool = False
    loop_kv: str = "all"
    scratch_pages: int = 0
    scratch_seqs: int = 0

    def __post_init__(self):
        if self.loop_kv not in LOOP_KV:
            raise ValueError(f"loop_kv must be one of {LOOP_KV}, got {self.loop_kv!r}")
        if sum(self.groups) != self.config.num_layers:
            raise ValueError(
                f"StepSpec.groups {self.groups} must sum to the {self.config.num_layers} layers"
            )


def prefill_attention(store, q, k, v, tables, seq_ids, start, *, loop, backend):
    """Chunk attention: q [B, T, Hq, D] over the first start[b] rows of slots seq_ids in the
    store's `loop` (read block by block: `store.attend`, the chunk's T queries passed as T x G
    query heads of each KV head) and, causally, the chunk's own k, v [B, T, H, D] raw, merged
    by log-sum-exp. float32 [B, T, Hq, D]; peak memory one block of pages plus the chunk's
    T x T scores, whatever the context."""
    b, t, hq, d = q.shape
    h = k.shape[2]
    g = hq // h
    qf = q.astype(jnp.float32).reshape(b, t, h, g, d)
    heads = qf.transpose(0, 2, 1, 3, 4).reshape(b, h * t * g, d)  # KV head h: its T*G queries
    ctx_out, ctx_lse = store.attend(heads, tables, seq_ids, start, loop=loop, backend=backend,
                                    return_lse=True)  # fmt: skip
    scores = jnp.einsum("bthgd,bshd->bhtgs", qf, k.astype(jnp.float32), precision=_HI)
    scores = scores * jnp.float32(1.0 / math.sqrt(d))
    causal = jnp.tril(jnp.ones((t, t), bool))[None, None, :, None, :]
    scores = jnp.where(causal, scores, -jnp.inf)
    own_lse = jax.nn.logsumexp(scores, axis=-1)  # [B, H, T, G], finite (the diagonal)
    probs = jnp.exp(scores - own_lse[..., None])
    own = jnp.einsum("bhtgs,bshd->bhtgd", probs, v.astype(jnp.float32), precision=_HI)
    out = merge_partials(ctx_out.reshape(b, h, t, g, d), ctx_lse.reshape(b, h, t, g), own,
                         own_lse)  # fmt: skip
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d)


def scan_layer_groups(spec, params, stores, h, tables, body):
    """Run every layer group's layers in order, one `lax.scan` per group: body(layer_params,
    h, store, tables_g, j, index) -> (h, store, y), with tables_g the group's folded block
    tables, j the layer within the group (traced; `layer_ids(seq_ids, j, spec.max_seqs)`
    are its slots), index the model layer (traced) and the store read and written as that
    layer (`at_layer`: a format with one table per layer reads layer index's). Returns
    (h, stores, ys), ys the per-layer outputs stacked over all layers."""
    layer_params = architecture(spec.config).layer_params
    out, ys, first = [], [], 0
    for count, store in zip(spec.groups, stores, strict=True):
        tables_g = fold_tables(tables, count, spec.num_pages)

        def step(carry, j, first=first, tables_g=tables_g):
            h, store = carry
            index = first + j
            h, store, y = body(layer_params(params, index), h, store.at_layer(index), tables_g,
                               j, index)  # fmt: skip
            return (h, store), y

        (h, store), y = lax.scan(step, (h, store), jnp.arange(count, dtype=jnp.int32))
        out.append(store)
        ys.append(y)
        first += count
    ys = jax.tree.map(lambda *a: jnp.concatenate(a), *ys)
    return h, tuple(out), ys


def _head(params, config, h_last, *, last):
    """(logits [B, V] float32, exit gate logit [B] or None) of a loop's final-normed h [B,1,H];
    logits None for a non-final loop of a model that has no exit gate (Llama)."""
    if config.arch != "ouro":
        return (architecture(config).logits(params, h_last, config)[:, 0] if last else None), None
    return ouro.logits(params, h_last, config)[:, 0], ouro.exit_logit(params, h_last)[:, 0]


def _select(config, heads):
    """(logits [B, V], exit loop [B] int32) from the loops' (logits, gate) heads."""
    if config.arch != "ouro":
        logits = heads[-1][0]
        return logits, jnp.full(logits.shape[:1], len(heads) - 1, jnp.int32)
    stacked = jnp.stack([lg for lg, _ in heads])  # [N, B, V]
    probs = ouro.exit_probabilities(jnp.stack([g for _, g in heads], axis=-1))
    exit_loop = ouro.exit_loops(probs, config.early_exit_threshold)
    return jnp.take_along_axis(stacked, exit_loop[None, :, None], axis=0)[0], exit_loop


def _add_kv(spec, total, kv):
    """loop_kv "mean": the float32 running sum of the loops' K/V (total None: the first
    loop's); None for the other modes."""
    if spec.loop_kv != "mean":
        return None
    f32 = tuple(a.astype(jnp.float32) for a in kv)
    return f32 if total is None else tuple(a + b for a, b in zip(total, f32, strict=True))


def _shared_kv(spec, kv_sum, kv_last):
    """A token's shared K/V rows from the float32 sum over its loops or its last loop's."""
    if spec.loop_kv == "last":
        return kv_last
    n = jnp.float32(spec.config.num_loops)
    return tuple((a / n).astype(b.dtype) for a, b in zip(kv_sum, kv_last, strict=True))


def _append_shared(spec, params, stores, tables, seq_ids, start, kv):
    """Append each layer's shared K/V rows kv ([layers, B, n, H, D] each) to the stores."""

    def body(layer, h, store, tables_g, j, index):
        ids = layer_ids(seq_ids, j, spec.max_seqs)
        store = store.append(kv[0][index], kv[1][index], tables_g, ids, start, loop=0,
                             backend=spec.backend)  # fmt: skip
        return h, store, None

    _, stores, _ = scan_layer_groups(spec, params, stores, jnp.zeros((), jnp.int32), tables, body)
    return stores


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("stores", "scratch"))
def prefill_step(params, stores, scratch, tokens, start, tables, seq_ids, scratch_tables,
                 scratch_ids=None, *, spec: StepSpec):  # fmt: skip
    """Prompt chunk tokens int32 [B, T] of slots seq_ids [B] (B requests, one chunk of T tokens
    each) at positions start[b] .. + T -> (logits [B, V] float32 of each row's last token,
    exit loops [B] int32, stores, scratch).

    Each loop and layer: the chunk's k, v are appended, then q attends (causally) to its
    sequence's earlier tokens of that loop as the store holds them, block by block
    (`prefill_attention`), and to the chunk's own k, v raw. Shared loop_kv: the earlier
    tokens' loop-l K/V are read from and the chunk's appended to `scratch` (slots scratch_ids
    int32 [B], default 0..B-1; tables `scratch_tables`), and the chunk's shared K/V go to
    `stores`; "all": scratch is None (scratch_tables and scratch_ids ignored)."""
    config, backend = spec.config, spec.backend
    shared = spec.loop_kv != "all"
    arch = architecture(config)
    t = tokens.shape[1]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    h = arch.embed(params, tokens)
    heads, kv_sum, kv = [], None, None
    per_loop = scratch if shared else stores
    loop_tables = scratch_tables if shared else tables
    if not shared:
        loop_ids = seq_ids
    elif scratch_ids is None:
        loop_ids = jnp.arange(seq_ids.shape[0], dtype=jnp.int32)
    else:
        loop_ids = jnp.asarray(scratch_ids, jnp.int32)
    loop_spec = (
        dataclasses.replace(spec, num_pages=spec.scratch_pages, max_seqs=spec.scratch_seqs)
        if shared
        else spec
    )
    for loop in range(config.num_loops):

        def body(layer, h, store, tables_g, j, index, loop=loop):
            ids = layer_ids(loop_ids, j, loop_spec.max_seqs)
            q, k, v = arch.attention_inputs(layer, h, positions, config)
            store = store.append(k, v, tables_g, ids, start, loop=loop, backend=backend)
            attn = prefill_attention(store, q, k, v, tables_g, ids, start, loop=loop,
                                     backend=backend)  # fmt: skip
            h = arch.attention_output(layer, h, attn.astype(h.dtype), config)
            return h, store, (k, v) if shared else None

        h, per_loop, kv = scan_layer_groups(loop_spec, params, per_loop, h, loop_tables, body)
        if shared:
            kv_sum = _add_kv(spec, kv_sum, kv)
        h = arch.final_norm(params, h, config)
        heads.append(_head(params, config, h[:, -1:], last=loop == config.num_loops - 1))
    if shared:
        scratch = per_loop
        stores = _append_shared(spec, params, stores, tables, seq_ids, start,
                                _shared_kv(spec, kv_sum, kv))  # fmt: skip
    else:
        stores = per_loop
    logits, exit_loop = _select(config, heads)
    return logits, exit_loop, stores, scratch


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("stores",))
def decode_step(params, stores, tokens, positions, tables, active, *, spec: StepSpec):
    """One token per slot (all max_seqs slots: tokens, positions int32 [S], active bool [S]
    marks the running ones) -> (logits [S, V] float32, exit loops [S] int32, loops run
    int32 (scalar), stores).

    Each loop and layer, loop_kv "all": the token's k, v are appended at its position, then
    its q attends to every stored token of its sequence in that loop, itself included;
    shared loop_kv: q attends to the shared plane of the earlier tokens and to its own k, v,
    and the token's shared row is appended after the last loop. With spec.skip_exited, see
    the module doc."""
    config, backend = spec.config, spec.backend
    shared = spec.loop_kv != "all"
    arch = architecture(config)
    n = config.num_loops
    s = tokens.shape[0]
    seq_ids = jnp.arange(s, dtype=jnp.int32)
    pos = positions[:, None]
    skip = spec.skip_exited

    def run_loop(loop, h, stores, exited, saved):
        """One loop; rows that exited (skip) keep h and use their saved K/V."""
        flags = exited[:, None] if (skip and loop and not shared) else None

        def body(layer, h, store, tables_g, j, index):
            ids = layer_ids(seq_ids, j, spec.max_seqs)
            q, k, v = arch.attention_inputs(layer, h, pos, config)
            if skip and loop:
                keep = exited[:, None, None, None]
                k = jnp.where(keep, saved[0][index], k)
                v = jnp.where(keep, saved[1][index], v)
            if shared:
                out, lse = store.attend(q[:, 0], tables_g, ids, positions, loop=0,
                                        backend=backend, return_lse=True)  # fmt: skip
                attn = merge_attention(out, lse, q[:, 0], k[:, 0], v[:, 0])
            else:
                store = store.append(k, v, tables_g, ids, positions, loop=loop,
                                     backend=backend, exited=flags)  # fmt: skip
                attn = store.attend(q[:, 0], tables_g, ids, positions + 1, loop=loop,
                                    backend=backend)  # fmt: skip
            new_h = arch.attention_output(layer, h, attn[:, None].astype(h.dtype), config)
            if skip:
                new_h = jnp.where(exited[:, None, None], h, new_h)
            return new_h, store, (k, v)

        h, stores, kv = scan_layer_groups(spec, params, stores, h, tables, body)
        return arch.final_norm(params, h, config), stores, kv

    def append_exited(loop, stores, saved):
        """A loop every active row has exited ("all"): the appends of their exit K/V."""
        flags = jnp.ones((s, 1), bool)

        def body(layer, h, store, tables_g, j, index):
            ids = layer_ids(seq_ids, j, spec.max_seqs)
            store = store.append(saved[0][index], saved[1][index], tables_g, ids, positions,
                                 loop=loop, backend=backend, exited=flags)  # fmt: skip
            return h, store, None

        _, stores, _ = scan_layer_groups(
            spec, params, stores, jnp.zeros((), jnp.int32), tables, body
        )
        return stores

    h = arch.embed(params, tokens[:, None])
    h, stores, saved = run_loop(0, h, stores, jnp.zeros((s,), bool), None)
    kv_sum = _add_kv(spec, None, saved)
    if not skip:
        heads = [_head(params, config, h, last=n == 1)]
        for loop in range(1, n):
            h, stores, saved = run_loop(loop, h, stores, jnp.zeros((s,), bool), saved)
            kv_sum = _add_kv(spec, kv_sum, saved)
            heads.append(_head(params, config, h, last=loop == n - 1))
        logits, exit_loop = _select(config, heads)
        loops_run = jnp.int32(n)
    else:
        # The exit rule of `ouro.exit_loops`, loop by loop: p_l = sigmoid(g_l) * stay_{l-1}
        # (the last loop takes the rest); a row exits at the first loop whose running sum of
        # p reaches the threshold.
        threshold = jnp.float32(config.early_exit_threshold)
        logits, gate = _head(params, config, h, last=False)
        lam = jax.nn.sigmoid(gate)
        cum, stay = lam, 1.0 - lam
        exited = (cum >= threshold) & (n > 1)
        exit_loop = jnp.zeros((s,), jnp.int32)
        loops_run = jnp.int32(1)
        for loop in range(1, n):
            last = loop == n - 1

            def run(args, loop=loop, last=last):
                h, stores, saved, kv_sum, logits, cum, stay, exit_loop, exited = args
                h, stores, kv = run_loop(loop, h, stores, exited, saved)
                lg, gate = _head(params, config, h, last=False)
                lam = jnp.float32(1.0) if last else jax.nn.sigmoid(gate)
                cum = cum + lam * stay
                now = ~exited & ((cum >= threshold) | last)
                logits = jnp.where(now[:, None], lg, logits)
                exit_loop = jnp.where(now, loop, exit_loop)
                return (h, stores, kv, _add_kv(spec, kv_sum, kv), logits, cum, stay * (1.0 - lam),
                        exit_loop, exited | now)  # fmt: skip

            def skip_loop(args, loop=loop):
                h, stores, saved, kv_sum, *rest = args
                if not shared:
                    stores = append_exited(loop, stores, saved)
                return (h, stores, saved, _add_kv(spec, kv_sum, saved), *rest)

            done = jnp.all(exited | ~active)
            loops_run = loops_run + jnp.where(done, 0, 1)
            args = (h, stores, saved, kv_sum, logits, cum, stay, exit_loop, exited)
            h, stores, saved, kv_sum, logits, cum, stay, exit_loop, exited = lax.cond(
                done, skip_loop, run, args
            )
    if shared:
        stores = _append_shared(spec, params, stores, tables, seq_ids, positions,
                                _shared_kv(spec, kv_sum, saved))  # fmt: skip
    return logits, exit_loop, loops_run, stores
