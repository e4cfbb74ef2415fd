"""Disaggregated prefill and decode across the stacks: the JAX engine's pages handed to a Torch
serving cache without a copy, and back.

    view = serving_view(engine)        # a ServingKVCache over the engine's buffers
    lm = PagedTorchLM(hf_model, view)  # a transformers causal LM attending through it
    tokens, view = jax_prefill_torch_decode(engine, hf_model, prompt, max_new_tokens)
    request, pointers = torch_prefill_jax_decode(engine, hf_model, prompt, max_new_tokens=n)
    engine.run()                                # JAX decodes what Torch prefilled

`serving_view(engine)` builds one `kvq_torch_bridge.serving.ServingKVCache` whose page arrays
and staging rows are DLPack views of the engine's store buffers (every data pointer checked:
`ServingView.shared_pointers`). The engine folds its layers into one pool: layer l's page p is
block l * P + p, its slot s is staging row l * S + s (P pages, S slots per layer), so one
Torch cache spans every layer and a layer's block table is the sequence's pages + l * P. The
Torch cache's scratch entry (what padded writes land in) is the last block and the last
staging row: the engine's last page and its last slot of the last layer, taken out of the
engine's allocator while the view lives (`PageAllocator.hold_page` / `hold_slot`;
`ServingView.close` gives them back). The block maps (`stage_block`, `block_stage`,
`stage_count`) are Torch-side bookkeeping the engine does not keep: they are rebuilt from the
engine's lengths (an open block of slot s in layer l sits in JAX's staging row l * S + s).

Single-loop models (one plane per layer), one layer group (every layer with one
configuration), and the policies `kvq_torch_bridge.serving` serves ("bf16" maps to raw rows).
CPU and CUDA alike; writing through the view changes the engine's buffers in place, so the
engine must not run while Torch writes (the handoff is a transfer of ownership).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import torch

from kvq_jax.engine.engine import Engine, Request
from kvq_jax.engine.stores import QuantizedStore, RawStore
from kvq_torch_bridge.bridge.dlpack import jax_to_torch
from kvq_torch_bridge.serving.attention import paged_attention_decode, paged_attention_prefill
from kvq_torch_bridge.serving.kv_cache import (
    KV_CACHE_DTYPES,
    KVQ_PREFIX,
    ServingKVCache,
    _empty_pages,
    reshape_and_cache,
)

__all__ = [
    "ATTENTION_NAME",
    "PagedTorchLM",
    "ServingView",
    "jax_prefill_torch_decode",
    "serving_view",
    "torch_prefill_jax_decode",
]

#: the transformers attention implementation name `PagedTorchLM` registers
ATTENTION_NAME = "kvq_paged_serving"


@dataclasses.dataclass(eq=False)
class ServingView:
    """A Torch serving cache over an engine's store buffers (see the module doc).

    cache: the ServingKVCache (all layers); layers, pages_per_layer (P), slots_per_layer (S);
    shared_pointers: name -> (JAX buffer pointer, Torch data pointer) of every shared tensor."""

    engine: Engine
    cache: ServingKVCache
    layers: int
    pages_per_layer: int
    slots_per_layer: int
    shared_pointers: dict
    _held: tuple = ()

    def tables(self, pages) -> torch.Tensor:
        """int64 [layers, len(pages)]: a sequence's block table in every layer."""
        pages = torch.as_tensor(np.asarray(pages, np.int64))
        offsets = torch.arange(self.layers, dtype=torch.int64)[:, None] * self.pages_per_layer
        return (pages[None] + offsets).to(self.cache.device)

    def slots(self, pages, start: int, count: int) -> torch.Tensor:
        """int64 [layers, count]: slot mappings of positions start .. start + count - 1."""
        bs = self.cache.block_size
        pos = torch.arange(start, start + count, dtype=torch.int64)
        table = self.tables(pages).cpu()
        return (table[:, pos // bs] * bs + pos % bs).to(self.cache.device)

    def _open_rows(self, slot: int, pages, length: int) -> list[tuple[int, int]]:
        """(staging row, block) per layer of the open block of `slot` holding `pages` at
        `length` tokens ([] when the cache has no staging or the last block is full)."""
        if self.cache.stage_block is None or length % self.cache.block_size == 0:
            return []
        page = int(np.asarray(pages)[length // self.cache.block_size])
        return [(layer * self.slots_per_layer + slot, layer * self.pages_per_layer + page)
                for layer in range(self.layers)]  # fmt: skip

    def adopt_open_block(self, slot: int, pages, length: int, rows_written=None) -> None:
        """Point the Torch block maps at the engine's staging rows of `slot` for a sequence
        of `length` tokens whose last block is open (JAX keeps it in row l * S + slot), with
        `rows_written` rows already there (default: length mod block_size)."""
        c = self.cache
        count = length % c.block_size if rows_written is None else rows_written
        for row, block in self._open_rows(slot, pages, length):
            c.stage_block[row] = block
            c.block_stage[block] = row
            c.stage_count[row] = count

    def release(self, slot: int, pages, length: int) -> None:
        """Forget the open block of `slot` (before the engine takes the sequence back)."""
        c = self.cache
        for row, block in self._open_rows(slot, pages, length):
            c.stage_block[row] = -1
            c.block_stage[block] = -1
            c.stage_count[row] = 0

    def close(self) -> None:
        """Give the held scratch page and slot back to the engine's allocator."""
        if self._held:
            page, slot = self._held
            self.engine.allocator.release_page(page)
            self.engine.allocator.free(slot)
            self._held = ()


def _kv_cache_dtype(engine: Engine) -> str:
    name = engine.policy.name
    if not engine.policy.quantized:
        return "bfloat16" if engine.dtype == jax.numpy.bfloat16 else "auto"
    key = KVQ_PREFIX + name
    if key not in KV_CACHE_DTYPES:
        raise ValueError(f"engine: policy {name!r} is not served by kvq_torch_bridge.serving "
                         f"(known: {', '.join(sorted(KV_CACHE_DTYPES))})")  # fmt: skip
    return key


def _shared(name, array, out: dict, dtype=None) -> torch.Tensor:
    tensor = jax_to_torch(array, copy=False)
    out[name] = (array.unsafe_buffer_pointer(), tensor.data_ptr())
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.view(dtype)
    return tensor


def serving_view(engine: Engine) -> ServingView:
    """A `ServingView` over `engine`'s store buffers; takes the engine's last page and last
    slot as the Torch cache's scratch entry (ValueError if either is in use, or for a looped
    engine, several layer groups, or a policy the serving cache does not serve)."""
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be a kvq_jax Engine, got {type(engine).__name__}")
    if engine.config.num_loops != 1 or engine.stored_loops != 1:
        raise ValueError("engine: the handoff serves single-loop models (one plane per layer)")
    if len(engine.stores) != 1:
        raise ValueError(f"engine: {len(engine.stores)} layer groups; the handoff needs one "
                         "configuration for every layer")  # fmt: skip
    if engine.cache_config is not None and engine.cache_config.layered:
        raise ValueError(
            f"engine: policy {engine.policy.name!r} stores keys in a per-layer INTB format "
            "(one bit table per layer, picked by the layer index); the Torch serving cache "
            "holds one format for every block, so the handoff needs one format in every layer"
        )
    kv_cache_dtype = _kv_cache_dtype(engine)
    alloc = engine.allocator
    layers, p, s = engine.config.num_layers, alloc.num_pages, engine.max_seqs
    alloc.hold_page(p - 1)
    try:
        alloc.hold_slot(s - 1)
    except ValueError:
        alloc.release_page(p - 1)
        raise
    jax.block_until_ready(engine.stores)
    store, ptrs = engine.stores[0], {}
    c = engine.config
    common = dict(kv_cache_dtype=kv_cache_dtype, num_blocks=layers * p - 1,
                  block_size=engine.page_size, num_kv_heads=c.num_kv_heads,
                  head_size=c.head_dim, max_num_seqs=layers * s - 1)  # fmt: skip
    if isinstance(store, RawStore):
        dtype = torch.bfloat16 if engine.dtype == jax.numpy.bfloat16 else torch.float32
        cache = ServingKVCache(
            **common, policy=None, config=None, dtype=dtype,
            key_cache=_shared("k", store.k, ptrs, dtype)[0],
            value_cache=_shared("v", store.v, ptrs, dtype)[0],
        )  # fmt: skip
    else:
        assert isinstance(store, QuantizedStore)
        jc = store.cache
        config = jc.config
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float32": torch.float32}[np.dtype(config.dtype).name]  # fmt: skip
        one = dataclasses.replace(config, num_pages=1)
        planes = {}
        for plane, kind in (("k_base", "key"), ("v_base", "value")):
            template = _empty_pages(one, kind, "cpu")
            packed = getattr(jc, plane)
            arrays = {n: _shared(f"{plane}.{n}", a, ptrs, template.arrays[n].dtype)
                      for n, a in packed.arrays.items()}  # fmt: skip
            planes[plane] = dataclasses.replace(template, **arrays)
        device = planes["k_base"].arrays[next(iter(planes["k_base"].arrays))].device
        rows = layers * s
        cache = ServingKVCache(
            **common, policy=engine.policy, config=config, dtype=dtype,
            k_pages=planes["k_base"], v_pages=planes["v_base"],
            k_stage=_shared("k_stage", jc.k_stage, ptrs)[0],
            v_stage=_shared("v_stage", jc.v_stage, ptrs)[0],
            stage_block=torch.full((rows,), -1, dtype=torch.int64, device=device),
            block_stage=torch.full((layers * p,), -1, dtype=torch.int64, device=device),
            stage_count=torch.zeros((rows,), dtype=torch.int64, device=device),
            overflow=torch.zeros((), dtype=torch.int64, device=device),
        )  # fmt: skip
    view = ServingView(engine, cache, layers, p, s, ptrs, (p - 1, s - 1))
    for slot, request in engine.running.items():
        view.adopt_open_block(slot, alloc.pages(slot), request.position)
    return view


class PagedTorchLM:
    """A transformers causal LM (Llama family: `model.model.layers[i].self_attn.layer_idx`)
    whose attention writes and reads a `ServingView` (`reshape_and_cache`, then
    `paged_attention_decode` for one token or `paged_attention_prefill` for a prompt), one
    sequence at a time. The model runs without its own cache (use_cache=False)."""

    def __init__(self, model, view: ServingView):
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, _attention)
        self.model, self.view = model, view
        self._step = None

    @torch.no_grad()
    def forward(self, tokens, start: int, pages) -> torch.Tensor:
        """Logits float32 [T, V] of tokens (ints [T]) at positions start .. start + T - 1 of
        the sequence holding `pages`; their K/V are written into the view's cache."""
        tokens = torch.as_tensor(np.asarray(tokens, np.int64))[None]
        n = tokens.shape[1]
        self._step = (self.view, self.view.tables(pages), self.view.slots(pages, start, n),
                      start + n)  # fmt: skip
        config = self.model.config
        saved = config._attn_implementation
        config._attn_implementation = ATTENTION_NAME
        _ACTIVE.append(self)
        try:
            positions = torch.arange(start, start + n, dtype=torch.int64)[None]
            out = self.model(input_ids=tokens, position_ids=positions, use_cache=False)
        finally:
            _ACTIVE.pop()
            config._attn_implementation = saved
        return out.logits[0].float()

    def continue_greedy(self, engine: Engine, request: Request, max_new_tokens: int) -> list:
        """Greedy decoding in Torch of a request the engine prefilled (its first token sampled):
        returns its tokens after max_new_tokens in all (the engine's first one included) or
        at the first of `request.stop_ids` (kept, as the engine keeps it); pages grow through
        the engine's allocator."""
        slot, tokens = request.slot, list(request.tokens)
        position = request.position
        while len(tokens) < max_new_tokens and tokens[-1] not in request.stop_ids:
            engine.allocator.reserve(slot, position + 1)
            logits = self.forward([tokens[-1]], position, engine.allocator.pages(slot))
            position += 1
            tokens.append(int(torch.argmax(logits[-1])))
        return tokens

    def prefill(self, slot: int, pages, prompt) -> np.ndarray:
        """Prefill `prompt` (ints) in Torch as sequence `slot` of the view's engine holding
        `pages`, cut into the chunks the engine cuts it into (`Engine.prefill_chunks`: a
        chunk attends earlier chunks as the cache holds them, itself raw), its open block
        staged in the engine's own staging rows (l * S + slot); returns the last token's
        logits, numpy float32 [V]."""
        n = len(prompt)
        self.view.adopt_open_block(slot, pages, n, rows_written=0)
        start = 0
        for size in self.view.engine.prefill_chunks(n):  # the engine's own chunks
            logits = self.forward(prompt[start : start + size], start, pages)
            start += size
        self.view.release(slot, pages, n)
        return logits[-1].numpy()


def jax_prefill_torch_decode(engine: Engine, model, prompt, max_new_tokens: int, **kwargs):
    """The JAX engine prefills `prompt` (and samples the first token; `kwargs` as
    `Engine.add_request`, e.g. stop_ids), Torch `model` decodes greedily through a
    `serving_view` of the engine's buffers. Returns (tokens, view); the view stays open (its
    scratch page and slot held) until `view.close()`."""
    request = engine.add_request(prompt, max_new_tokens=max_new_tokens, **kwargs)
    view = serving_view(engine)
    tokens = PagedTorchLM(model, view).continue_greedy(engine, request, max_new_tokens)
    return tokens, view


def torch_prefill_jax_decode(engine: Engine, model, prompt, **kwargs):
    """Torch `model` prefills `prompt` into the engine's buffers (`Engine.add_prefilled`, a
    `serving_view` made after the slot is cleared and closed after the prefill); the engine
    then runs it like any request (`engine.run()`). Returns (request, shared pointers)."""
    views = []

    def fill(slot, pages):
        view = serving_view(engine)
        views.append(view)
        try:
            return PagedTorchLM(model, view).prefill(slot, pages, prompt)
        finally:
            view.close()

    request = engine.add_prefilled(prompt, fill, **kwargs)
    return request, views[0].shared_pointers


_ACTIVE: list = []


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers attention: query [1, Hq, T, D], key / value [1, H, T, D] (after RoPE)."""
    del attention_mask, kwargs
    if not _ACTIVE:
        raise RuntimeError(f"{ATTENTION_NAME} attention called outside PagedTorchLM.forward")
    view, tables, slots, length = _ACTIVE[-1]._step
    layer = module.layer_idx
    cache = view.cache
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    reshape_and_cache(k.contiguous(), v.contiguous(), cache, slots[layer])
    table = tables[layer][None]
    lens = torch.tensor([length], dtype=torch.int64, device=q.device)
    if q.shape[0] == 1:
        out = paged_attention_decode(q, cache, table, lens, scale=scaling)
    else:
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int64, device=q.device)
        out = paged_attention_prefill(q, k, v, cache, cu, table, lens, scale=scaling)
    return out.to(query.dtype)[None], None
