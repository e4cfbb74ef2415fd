"""An independent reference of the engine's decode: token by token, eager, page by page.

`reference_decode` feeds a model one token at a time (the prompt, then its own greedy or the
given tokens) and keeps, per layer and loop, the raw K/V rows the model produced. What a
token attends in loop l is rebuilt from them with the public codec functions only: each
complete page of loop 0 is `unpack_kv(pack_kv(page))`, of loop l > 0
`decode_residual(encode_residual(page, recon_{l-1}), recon_{l-1})` (the cache config's
formats and groups of each loop, `PagedCacheConfig.loop_pack_args`; with `absolute=True` for
a loop the config stores absolute); a heavy-row format's page is
`unpack_heavy(pack_heavy(page, select_heavy(key page, the layer's table)))` over its base
format (per-layer INTB: the plain INTB format of the layer's table); a cache storing keys
before RoPE (`rope_theta`) packs `invert_rope` of each key page at its positions (heavy
rows still chosen from the RoPE'd keys), chains loops in that space and attends
`apply_rope` of the reconstruction; the partial page and the first `sink` rows are raw.
Attention is float64 NumPy. No code is shared with the engine's stores, cache ops or
kernels: only the model's layer pieces (`kvq_jax.models`).

Exits that skip loops (`skip=True`, Ouro): a token that exits after loop e keeps its hidden
state, and in every later loop each layer's K/V rows of the token are its loop-e rows; a
complete page reconstructs such a row as loop l - 1 does (its delta is not applied).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kvq_jax.codecs.api import pack_kv, unpack_kv
from kvq_jax.codecs.formats.intb import register_table
from kvq_jax.codecs.heavy import pack_heavy, select_heavy, unpack_heavy
from kvq_jax.codecs.residual import decode_residual, encode_residual
from kvq_jax.codecs.rope import apply_rope, invert_rope
from kvq_jax.core.registry import layout
from kvq_jax.core.rope import rope_tables
from kvq_jax.models import architecture, ouro


def _attend(q, k, v) -> np.ndarray:
    """q [Hq, D] over k, v [T, H, D], float64 softmax (GQA) -> float32 [Hq, D]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    hq, d = q.shape
    g = hq // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [T, Hq, D]
    s = np.einsum("hd,thd->ht", q, kk) / np.sqrt(d)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("ht,thd->hd", p, vv).astype(np.float32)


class _Plane:
    """Raw rows and reconstructed complete pages of one (layer, loop, K or V)."""

    def __init__(self):
        self.raw, self.exited, self.pages = [], [], []
        self.stored = []  # the pages as stored (keys before RoPE in a pre-RoPE cache)

    def add_page(self, config, kind, page, stored):
        """Page `page` reconstructed as stored; attended with RoPE back where it was taken off."""
        self.stored.append(stored)
        self.pages.append(_turn(config, kind, stored, page, invert=False))


def _turn(config, kind, rows, page, *, invert):
    """Key rows [ps, H, D] of page `page` of a cache storing keys before RoPE, RoPE taken off
    (`invert_rope`) or put back (`apply_rope`) at positions page * ps .., in the rows' dtype
    (FORMAT.md 5b); other rows as they are."""
    if kind != "key" or config.rope_theta is None:
        return rows
    ps = config.page_size
    cos, sin = rope_tables(ps, config.head_dim, config.rope_theta, offset=page * ps)
    turn = invert_rope if invert else apply_rope
    return np.asarray(turn(jnp.asarray(rows), cos, sin)).astype(rows.dtype)


def _heavy_page(config, kind, loop, rows, keys, layer):
    """A page [ps, H, D] of a heavy-row format (FORMAT.md 5a) through `select_heavy` (rows
    chosen from the key page `keys` with model layer `layer`'s mean-query table) and
    `pack_heavy` / `unpack_heavy` over the base format (a per-layer INTB base: the plain INTB
    format of the layer's table)."""
    fmt = layout(config.loop_format(kind, loop))
    tables = layout(config.loop_format("key", loop)).tables
    table = tables[layer] if tables.ndim == 4 else tables
    chosen = select_heavy(jnp.asarray(keys), table, group_size=fmt.heavy_group)
    base = register_table(fmt.base.tables[layer]) if fmt.base.per_layer else fmt.base.name
    axis = config.loop_pack_args(kind, loop)["axis"]
    packed = pack_heavy(jnp.asarray(rows), chosen, kind=kind, format=base,
                        group_size=fmt.heavy_group, axis=axis)  # fmt: skip
    return np.asarray(unpack_heavy(packed))


def _reconstruct(config, kind, loop, plane, below, page, keys=None, layer=0):
    """Reconstruct complete page `page` of `plane` (loop `loop`; `below` the loop l - 1 plane;
    `keys`: the key plane of the same loop, for heavy rows; `layer`: the model layer), as
    stored (a pre-RoPE cache's keys before RoPE)."""
    ps = config.page_size
    raw = np.stack(plane.raw[page * ps : (page + 1) * ps])
    rows = _turn(config, kind, raw, page, invert=True)
    args = config.loop_pack_args(kind, loop)
    if hasattr(layout(args["format"]), "heavy_group"):  # a loop stored whole (no exits)
        key_rows = np.stack(keys.raw[page * ps : (page + 1) * ps])  # RoPE'd: they choose
        return _heavy_page(config, kind, loop, rows, key_rows, layer)
    if loop == 0:
        return np.asarray(unpack_kv(pack_kv(jnp.asarray(rows), **args)))
    prev = below.stored[page]
    exited = np.asarray(plane.exited[page * ps : (page + 1) * ps])[:, None, None]
    current = np.where(exited, prev, rows)  # an exited row's delta is zero ...
    absolute = loop in config.absolute_loops(kind)  # packed on its own (no exits then)
    res = encode_residual(jnp.asarray(current), jnp.asarray(prev), **args, absolute=absolute)
    recon = np.asarray(decode_residual(res, jnp.asarray(prev)))
    return np.where(exited, prev, recon)  # ... and not applied


def _rows(config, plane, length, stored):
    """The rows [length, H, D] a token attends: the pages complete within the first `stored`
    rows reconstructed, the rest raw, the first `sink` rows raw (a copy)."""
    raw = np.stack(plane.raw[:length])
    if config is None:
        return raw.copy()
    ps = config.page_size
    out = raw.copy()
    for p in range(stored // ps):
        out[p * ps : (p + 1) * ps] = plane.pages[p]
    out[: config.sink] = raw[: config.sink]
    return out


def reference_decode(model, tokens, num_new, *, cache_config=None, loops=None, skip=False,
                     forced=None, loop_kv="all", scratch_config=None):  # fmt: skip
    """Greedy decode of `num_new` tokens after prompt `tokens` (or feed `forced`, num_new ids).

    cache_config: the engine's `PagedCacheConfig` of every layer, or a tuple of one per layer
    (`Engine.cache_configs`: per-layer formats), or None (the raw bf16 store);
    loops: the loop count (None: the config's); loop_kv: "all", or "last" / "mean" (the
    prompt attends per loop, as its scratch holds it; a decode token at loop l attends to
    the earlier tokens' shared rows, stored as a one-plane cache, and to its own loop-l row;
    each token's shared row, its last loop's K/V or the float32 mean over its loops, is
    stored after its last loop); scratch_config: with a shared loop_kv, the configurations of
    the prompt's every-loop scratch (`Engine.scratch_configs`; None: `cache_config` at every
    loop, which does not hold for heavy rows, stored in loops stored whole). Returns (tokens
    [num_new], logits float32 [num_new, V], exit loops [num_new]).
    """
    config = model.config if loops is None else dataclasses.replace(model.config, num_loops=loops)
    arch = architecture(config)
    params = model.params
    n_loops, n_layers = config.num_loops, config.num_layers
    planes = {(i, j, kind): _Plane() for i in range(n_layers) for j in range(n_loops)
              for kind in ("key", "value")}  # fmt: skip
    shared = loop_kv != "all" and n_loops > 1
    shared_planes = {(i, kind): _Plane() for i in range(n_layers) for kind in ("key", "value")}
    per_layer = cache_config if isinstance(cache_config, tuple) else (cache_config,) * n_layers
    shared_configs, loop_configs = per_layer, per_layer
    if shared and scratch_config is not None:  # the prompt's scratch keeps every loop
        loop_configs = scratch_config
    elif shared and cache_config is not None:
        loop_configs = tuple(dataclasses.replace(c, num_loops=n_loops) for c in per_layer)
    ouro_exit = config.arch == "ouro"
    threshold = config.early_exit_threshold
    seq = list(tokens)
    out_tokens, out_logits, out_exits = [], [], []
    pos = 0
    while len(out_tokens) < num_new:
        token = seq[pos]
        h = arch.embed(params, jnp.asarray([[token]]))
        heads, exited, saved, exit_loop = [], False, {}, n_loops - 1
        prefill = pos < len(tokens)  # the prompt runs every loop (no skipping)
        history = {i: [] for i in range(n_layers)}  # per layer: (k, v) of each loop
        for loop in range(n_loops):
            for i in range(n_layers):
                layer = arch.layer_params(params, i)
                loop_config, shared_config = loop_configs[i], shared_configs[i]
                q, k, v = arch.attention_inputs(layer, h, jnp.asarray([[pos]]), config)
                if exited:
                    k, v = saved[i]
                saved[i] = (k, v)
                history[i].append((np.asarray(k)[0, 0], np.asarray(v)[0, 0]))
                if shared and not prefill:  # the shared rows of the earlier tokens + its own
                    rows = [np.concatenate([_rows(shared_config, shared_planes[(i, kind)],
                                                  pos, pos), np.asarray(x)[0]])
                            for kind, x in (("key", k), ("value", v))]  # fmt: skip
                    attn = _attend(np.asarray(q)[0, 0], *rows)
                    attn = jnp.asarray(attn)[None, None].astype(h.dtype)
                    new_h = arch.attention_output(layer, h, attn, config)
                    h = h if exited else new_h
                    continue
                for kind, x in (("key", k), ("value", v)):
                    plane = planes[(i, loop, kind)]
                    plane.raw.append(np.asarray(x)[0, 0])
                    plane.exited.append(exited)
                    if loop_config is not None and (pos + 1) % loop_config.page_size == 0:
                        page = pos // loop_config.page_size
                        below = planes[(i, loop - 1, kind)] if loop else None
                        stored = _reconstruct(loop_config, kind, loop, plane, below, page,
                                              planes[(i, loop, "key")], i)  # fmt: skip
                        plane.add_page(loop_config, kind, page, stored)
                # the store is read after the append (the token's page may have just been
                # quantized); prefill attends to the chunk's own rows raw
                keys = _rows(loop_config, planes[(i, loop, "key")], pos + 1, pos + 1)
                vals = _rows(loop_config, planes[(i, loop, "value")], pos + 1, pos + 1)
                if prefill:
                    keys[pos], vals[pos] = np.asarray(k)[0, 0], np.asarray(v)[0, 0]
                attn = _attend(np.asarray(q)[0, 0], keys, vals)
                attn = jnp.asarray(attn)[None, None].astype(h.dtype)
                new_h = arch.attention_output(layer, h, attn, config)
                h = h if exited else new_h
            if not exited:
                h = arch.final_norm(params, h, config)
            if shared and loop == n_loops - 1:  # the token's shared rows, after its last loop
                for i in range(n_layers):
                    shared_config = shared_configs[i]
                    for c, kind in enumerate(("key", "value")):
                        xs = [kv[c] for kv in history[i]]
                        row = (
                            xs[-1]
                            if loop_kv == "last"
                            else (np.mean(np.stack(xs).astype(np.float32), 0).astype(xs[0].dtype))
                        )
                        plane = shared_planes[(i, kind)]
                        plane.raw.append(row)
                        plane.exited.append(False)
                        if shared_config is not None and (pos + 1) % shared_config.page_size == 0:
                            page = pos // shared_config.page_size
                            stored = _reconstruct(shared_config, kind, 0, plane, None, page,
                                                  shared_planes[(i, "key")], i)  # fmt: skip
                            plane.add_page(shared_config, kind, page, stored)
            if exited:
                continue
            if ouro_exit:
                heads.append((np.asarray(ouro.logits(params, h, config))[0, 0],
                              float(np.asarray(ouro.exit_logit(params, h))[0, 0])))  # fmt: skip
                if skip and not prefill and loop < n_loops - 1:
                    gates = jnp.asarray([g for _, g in heads] + [0.0] * (n_loops - len(heads)))
                    probs = np.asarray(ouro.exit_probabilities(gates))
                    if np.cumsum(probs)[loop] >= threshold:
                        exited, exit_loop = True, loop
        if ouro_exit:
            if not skip or prefill:
                gates = jnp.asarray([g for _, g in heads])
                exit_loop = int(ouro.exit_loops(ouro.exit_probabilities(gates), threshold))
            logits = heads[exit_loop][0]
        else:
            logits = np.asarray(arch.logits(params, h, config))[0, 0]
        pos += 1
        if pos >= len(tokens):  # the logits predict a new token
            nxt = int(np.argmax(logits)) if forced is None else int(forced[len(out_tokens)])
            out_tokens.append(nxt)
            out_logits.append(np.asarray(logits, np.float32))
            out_exits.append(exit_loop)
            seq.append(nxt)
    reference_decode.planes = planes  # for debugging: the last run's planes
    return out_tokens, np.stack(out_logits), out_exits
