"""The model runner: the engine's jitted prefill and decode steps over its layer-group stores.

`prefill_step(params, stores, tokens, start, tables, seq_ids, *, spec)` and
`decode_step(params, stores, tokens, positions, tables, active, *, spec)` are the public steps
(the engine and `bench/engine_decode.py` call them); `stores` is donated and returned updated.
`spec` is the static `StepSpec` (model config, layer groups, pool shape, backend).

Compiled by scan: within a loop, each layer group (`kvq_jax.engine.stores`) runs as one
`lax.scan` over its layers, the layer's parameters indexed from the stacked pytree and its
cache addressed by the traced layer index (folded block tables and slots). A program holds
one layer body per (loop, group): 4 for a 4-loop model with one policy for every layer,
whatever the number of layers. Loops stay unrolled: loop 0 writes a cache's base plane and
loop l > 0 its residual plane l - 1 against loop l - 1, different formats and code.

Exits that skip loops (`spec.skip_exited`, Ouro with early_exit_threshold < 1, an
adaptive-exit cache): after each loop the decode step knows which rows have exited (their
cumulative exit probability reached the threshold). A loop in which every active row has
exited runs only the cache appends (`lax.cond`): each layer appends the rows' K/V of their
exit loop, flagged `exited`, so the cache records them as adaptive exits; a row that exited
while others still loop keeps its hidden state and appends its exit loop's K/V the same way.
Later tokens attend to an exited token's K/V of loop min(l, exit loop). Prefill runs every
loop for every prompt token.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from kvq_jax.engine.stores import fold_tables, layer_ids
from kvq_jax.models import architecture, ouro
from kvq_jax.models.config import ModelConfig

__all__ = ["StepSpec", "decode_step", "prefill_attention", "prefill_step"]

_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Static description of a step (hashable): the model `config` (num_loops as run),
    `groups` (layers per store, summing to config.num_layers), the allocator's `num_pages` and
    `max_seqs`, the cache `backend`, and `skip_exited` (decode skips loops once every active
    row has exited; needs adaptive-exit stores)."""

    config: ModelConfig
    groups: tuple[int, ...]
    num_pages: int
    max_seqs: int
    backend: str = "auto"
    skip_exited: bool = False

    def __post_init__(self):
        if sum(self.groups) != self.config.num_layers:
            raise ValueError(
                f"StepSpec.groups {self.groups} must sum to the {self.config.num_layers} layers"
            )


def prefill_attention(q, ctx_k, ctx_v, ctx_len, k, v):
    """Chunk attention: q [B,T,Hq,D] over the context rows ctx_k/ctx_v [B,C,H,D] (the first
    ctx_len[b] valid) and, causally, the chunk's own k, v [B,T,H,D]. float32 [B,T,Hq,D]."""
    b, t, hq, d = q.shape
    h = k.shape[2]
    c = ctx_k.shape[1]
    keys = jnp.concatenate([ctx_k.astype(jnp.float32), k.astype(jnp.float32)], axis=1)
    vals = jnp.concatenate([ctx_v.astype(jnp.float32), v.astype(jnp.float32)], axis=1)
    qf = q.astype(jnp.float32).reshape(b, t, h, hq // h, d)
    scores = jnp.einsum("bthgd,bshd->bhgts", qf, keys, precision=_HI)
    scores = scores * jnp.float32(1.0 / math.sqrt(d))
    ctx_mask = jnp.broadcast_to((jnp.arange(c)[None] < ctx_len[:, None])[:, None], (b, t, c))
    own = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool))[None], (b, t, t))
    mask = jnp.concatenate([ctx_mask, own], axis=-1)  # [B, T, C + T]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhgts,bshd->bthgd", probs, vals, precision=_HI)
    return out.reshape(b, t, hq, d)


def _layer(params, index):
    return jax.tree.map(lambda a: a[index], params["layers"])


def _scan_groups(spec, params, stores, h, tables, body):
    """Run every layer group's layers in order: body(layer_params, h, store, tables_g, j,
    index) -> (h, store, y) under one lax.scan per group. Returns (h, stores, ys) with ys the
    groups' stacked per-layer outputs concatenated over layers."""
    out, ys, first = [], [], 0
    for count, store in zip(spec.groups, stores, strict=True):
        tables_g = fold_tables(tables, count, spec.num_pages)

        def step(carry, j, first=first, tables_g=tables_g):
            h, store = carry
            h, store, y = body(_layer(params, first + j), h, store, tables_g, j, first + j)
            return (h, store), y

        (h, store), y = lax.scan(step, (h, store), jnp.arange(count, dtype=jnp.int32))
        out.append(store)
        ys.append(y)
        first += count
    ys = jax.tree.map(lambda *a: jnp.concatenate(a), *ys)
    return h, tuple(out), ys


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("stores",))
def prefill_step(params, stores, tokens, start, tables, seq_ids, *, spec: StepSpec):
    """Prompt chunk tokens int32 [B, T] of slots seq_ids [B] at positions start[b] .. + T ->
    (logits [B, V] float32 of each row's last token, exit loops [B] int32, stores).

    Each loop: every layer's q attends (causally) to its sequence's earlier tokens as the
    store holds them and to the chunk's own k, v raw; then the chunk's k, v are appended."""
    config, backend = spec.config, spec.backend
    arch = architecture(config)
    t = tokens.shape[1]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    h = arch.embed(params, tokens)
    heads = []
    for loop in range(config.num_loops):

        def body(layer, h, store, tables_g, j, index, loop=loop):
            ids = layer_ids(seq_ids, j, spec.max_seqs)
            q, k, v = arch.attention_inputs(layer, h, positions, config)
            ctx_k, ctx_v = store.context(tables_g, ids, start, loop=loop, backend=backend)
            store = store.append(k, v, tables_g, ids, start, loop=loop, backend=backend)
            attn = prefill_attention(q, ctx_k, ctx_v, start, k, v)
            return arch.attention_output(layer, h, attn.astype(h.dtype), config), store, None

        h, stores, _ = _scan_groups(spec, params, stores, h, tables, body)
        h = arch.final_norm(params, h, config)
        heads.append(_head(params, config, h[:, -1:], last=loop == config.num_loops - 1))
    logits, exit_loop = _select(config, heads)
    return logits, exit_loop, stores


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


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("stores",))
def decode_step(params, stores, tokens, positions, tables, active, *, spec: StepSpec):
    """One token per slot (all max_seqs slots: tokens, positions int32 [S], active bool [S]
    marks the running ones) -> (logits [S, V] float32, exit loops [S] int32, loops run
    int32 (scalar), stores).

    Each loop and layer: the token's k, v are appended at its position, then its q attends to
    every stored token of its sequence, itself included (`store.attend`). With
    spec.skip_exited, see the module doc."""
    config, backend = spec.config, spec.backend
    arch = architecture(config)
    s = tokens.shape[0]
    seq_ids = jnp.arange(s, dtype=jnp.int32)
    h = arch.embed(params, tokens[:, None])
    pos = positions[:, None]
    if not spec.skip_exited:
        heads = []
        for loop in range(config.num_loops):

            def body(layer, h, store, tables_g, j, index, loop=loop):
                ids = layer_ids(seq_ids, j, spec.max_seqs)
                q, k, v = arch.attention_inputs(layer, h, pos, config)
                store = store.append(k, v, tables_g, ids, positions, loop=loop, backend=backend)
                attn = store.attend(q[:, 0], tables_g, ids, positions + 1, loop=loop,
                                    backend=backend)  # fmt: skip
                h = arch.attention_output(layer, h, attn[:, None].astype(h.dtype), config)
                return h, store, None

            h, stores, _ = _scan_groups(spec, params, stores, h, tables, body)
            h = arch.final_norm(params, h, config)
            heads.append(_head(params, config, h, last=loop == config.num_loops - 1))
        logits, exit_loop = _select(config, heads)
        return logits, exit_loop, jnp.int32(config.num_loops), stores
    return _decode_skipping(params, stores, h, pos, positions, seq_ids, tables, active, spec)


def _decode_skipping(params, stores, h, pos, positions, seq_ids, tables, active, spec):
    config, backend = spec.config, spec.backend
    n = config.num_loops
    threshold = jnp.float32(config.early_exit_threshold)
    s = h.shape[0]

    def run_loop(loop, h, stores, exited, saved):
        """One loop for the rows not exited; exited rows append their saved K/V, flagged."""
        flags = exited[:, None] if loop else None

        def body(layer, h, store, tables_g, j, index):
            ids = layer_ids(seq_ids, j, spec.max_seqs)
            q, k, v = ouro.attention_inputs(layer, h, pos, config)
            if loop:
                keep = exited[:, None, None, None]
                k = jnp.where(keep, saved[0][index], k)
                v = jnp.where(keep, saved[1][index], v)
            store = store.append(k, v, tables_g, ids, positions, loop=loop, backend=backend,
                                 exited=flags)  # fmt: skip
            attn = store.attend(q[:, 0], tables_g, ids, positions + 1, loop=loop,
                                backend=backend)  # fmt: skip
            new_h = ouro.attention_output(layer, h, attn[:, None].astype(h.dtype), config)
            return jnp.where(exited[:, None, None], h, new_h), store, (k, v)

        h, stores, kv = _scan_groups(spec, params, stores, h, tables, body)
        return ouro.final_norm(params, h, config), stores, kv

    def append_only(loop, stores, saved):
        """A loop every active row has exited: only the appends of the saved K/V."""
        flags = jnp.ones((s, 1), bool)

        def body(layer, h, store, tables_g, j, index):
            ids = layer_ids(seq_ids, j, spec.max_seqs)
            store = store.append(saved[0][index], saved[1][index], tables_g, ids, positions,
                                 loop=loop, backend=backend, exited=flags)  # fmt: skip
            return h, store, None

        _, stores, _ = _scan_groups(spec, params, stores, jnp.zeros((), jnp.int32), tables, body)
        return stores

    # The exit rule of `ouro.exit_loops`, loop by loop: p_l = sigmoid(g_l) * stay_{l-1} (the
    # last loop takes the rest, stay_{N-2}); a row exits at the first loop whose running sum
    # of p reaches the threshold.
    h, stores, saved = run_loop(0, h, stores, jnp.zeros((s,), bool), None)
    logits, gate = _head(params, config, h, last=False)
    lam = jax.nn.sigmoid(gate)
    cum, stay = lam, 1.0 - lam
    exited = (cum >= threshold) & (n > 1)
    exit_loop = jnp.zeros((s,), jnp.int32)
    loops_run = jnp.int32(1)
    for loop in range(1, n):
        last = loop == n - 1

        def run(args, loop=loop, last=last):
            h, stores, saved, logits, cum, stay, exit_loop, exited = args
            h, stores, kv = run_loop(loop, h, stores, exited, saved)
            lg, gate = _head(params, config, h, last=False)
            lam = jnp.float32(1.0) if last else jax.nn.sigmoid(gate)
            cum = cum + lam * stay
            now = ~exited & ((cum >= threshold) | last)
            logits = jnp.where(now[:, None], lg, logits)
            exit_loop = jnp.where(now, loop, exit_loop)
            return h, stores, kv, logits, cum, stay * (1.0 - lam), exit_loop, exited | now

        def skip(args, loop=loop):
            h, stores, saved, *rest = args
            return (h, append_only(loop, stores, saved), saved, *rest)

        done = jnp.all(exited | ~active)
        loops_run = loops_run + jnp.where(done, 0, 1)
        h, stores, saved, logits, cum, stay, exit_loop, exited = lax.cond(
            done, skip, run, (h, stores, saved, logits, cum, stay, exit_loop, exited)
        )
    return logits, exit_loop, loops_run, stores
