"""`KVQCache`: a transformers `Cache` whose layers store K/V in kvq's paged serving cache, for
`model.generate(..., past_key_values=KVQCache(model.config, policy="int4-g64"))` and manual
forward loops. Torch and transformers (>= 5) only: no JAX.

Each decoder layer gets a `KVQLayer` (transformers' `CacheLayerMixin`) that owns one
`ServingKVCache` (`allocate_kv_cache`) and writes every new token with `reshape_and_cache`:
sequence b of the batch is one serving sequence, its block j is block `j * B + b` of the pool
(so growing the pool never moves a block). A quantized block stays raw in the sequence's
staging row until its last token is written, then it is packed once, page-local, with the bytes
of kvq's paged cache; raw policies store the rows as they are. A call whose rows all land in
each sequence's already-open block and leave it open (most decode steps) is written straight
into the staging rows (the rows and `stage_count` reshape_and_cache would write, without its
pack of a padded block that every call of it runs to stay free of host syncs).

Memory (`KVQCache.memory()`, bytes): the pages of complete blocks, one staging row
[block_size, H, D] per sequence plus one scratch row, per layer and kind, in the model's dtype,
and the sink rows; `kv_bytes_per_token()` is the steady-state page cost (the format's
accounting, all layers, K and V).

`update(key_states, value_states)` takes [B, H, T, D] (H KV heads, D head_dim, T new tokens)
and returns K, V [B, H, L, D] in the dtype of `key_states` (L = tokens cached so far, the new
ones included): the earlier tokens as the cache holds them (complete blocks decoded, the open
block's staging rows raw, a `+win` policy's first `sink` rows raw) and the call's own tokens as
given, raw: what `paged_attention_prefill` attends (and the JAX engine's chunked prefill);
`raw_new_tokens=False` returns them as stored too (decoded once their block is complete), what
`paged_attention_decode` reads.

Decoding: by default every call decodes the complete blocks again (`keep_decoded=False`): the
cache then holds only the packed pages, the staging rows and the sink rows, which is its point;
a persistent decoded copy would cost as many bytes per token as a bf16 `DynamicCache`.
`keep_decoded=True` decodes each block once, when it is packed, and keeps the rows (faster
steps, more memory); the numbers are identical, since a packed block never changes and its
decode is page-local and deterministic.

Policies (`policy=`): kvq's policy names served by the paged cache with one format per kind
("int4-g64", "int4-g32", "int4-g16", "nvfp4", "fp8" = kvq's per-row-scaled E4M3,
"int4-hint4", ...), their "+win" rows (the first `Window.sink` tokens of each sequence kept
raw, as the paged cache's sink rows; the newest tokens are the staging page's raw rows, as in
the engine), "bf16" (raw bfloat16 rows), and the serving cache's `kv_cache_dtype` names
("bfloat16", "float16", "auto" = the model's dtype, "kvq:<policy>", "int4"). One loop: every
`layer_idx` is stored absolute (a looped model that numbers its (loop, layer) pairs gets one
layer each, added on first use).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvq_jax.core.policies import POLICIES
from kvq_torch_bridge.serving.kv_cache import (
    KV_CACHE_DTYPES,
    KVQ_PREFIX,
    REFUSED_DTYPES,
    ServingKVCache,
    allocate_kv_cache,
    decode_blocks,
    policy_for_kv_cache_dtype,
    read_blocks,
    reshape_and_cache,
)

__all__ = ["KVQCache", "KVQLayer", "resolve_policy"]

#: kvq's unquantized reference policy -> the serving cache's raw name
_RAW_POLICIES = {"bf16": "bfloat16"}
_WIN = "+win"


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What every layer of one KVQCache shares (static)."""

    policy: str
    kv_cache_dtype: str
    sink: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    keep_decoded: bool
    raw_new_tokens: bool
    max_cache_len: int | None


def resolve_policy(policy) -> tuple[str, int]:
    """(kv_cache_dtype, sink rows) of a `policy` name (module doc); ValueError naming `policy`
    for an unknown name or one the serving cache does not serve (with the reason)."""
    if not isinstance(policy, str):
        raise TypeError(f"policy must be a str (a kvq policy name), got {type(policy).__name__}")
    sink = 0
    if policy in _RAW_POLICIES:
        kv = _RAW_POLICIES[policy]
    elif policy in POLICIES:
        p = POLICIES[policy]
        base = policy
        if p.window is not None:
            base = policy.removesuffix(_WIN)
            same = (
                base in POLICIES
                and dataclasses.replace(p, name=base, window=None) == (POLICIES[base])
            )
            if not same:
                raise ValueError(f"policy {policy!r}: its window is not a '+win' row of a policy")
            sink = p.window.sink
        kv = KVQ_PREFIX + base
    elif policy in KV_CACHE_DTYPES or policy in REFUSED_DTYPES or policy.startswith(KVQ_PREFIX):
        kv = policy
    else:
        known = sorted({*_RAW_POLICIES, *POLICIES, *KV_CACHE_DTYPES})
        raise ValueError(f"policy {policy!r} is not a kvq policy or kv_cache_dtype; known: "
                         f"{', '.join(known)}")  # fmt: skip
    try:
        policy_for_kv_cache_dtype(kv)
    except ValueError as e:
        raise ValueError(f"policy {policy!r} cannot be served by KVQCache: {e}") from None
    return kv, sink


def _config_shape(config) -> tuple[int, int, int]:
    """(num_hidden_layers, num_key_value_heads, head_dim) of a transformers config."""
    if not hasattr(config, "get_text_config"):
        raise TypeError(f"config must be a transformers PretrainedConfig, got "
                        f"{type(config).__name__}")  # fmt: skip
    text = config.get_text_config(decoder=True)
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None)
    if head_dim is None and heads:
        head_dim = text.hidden_size // heads
    for name, value in (("num_hidden_layers", layers), ("num_key_value_heads", kv_heads),
                        ("head_dim", head_dim)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be an int >= 1, got {value!r}")
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if types - {"full_attention"}:
        raise ValueError(f"config has layer types {sorted(types)}: KVQCache serves "
                         "full-attention layers only")  # fmt: skip
    if getattr(text, "sliding_window", None) is not None and getattr(
        text, "use_sliding_window", True
    ):
        raise ValueError(f"config sets sliding_window {text.sliding_window}: KVQCache serves "
                         "full-attention layers only")  # fmt: skip
    return layers, kv_heads, head_dim


class KVQLayer(CacheLayerMixin):
    """One decoder layer's cache (see the module doc). After the first `update`: `serving` is
    its `ServingKVCache`, `num_seqs` the batch size B, `length` the tokens cached per
    sequence, `dtype` / `device` those of the first `key_states`; `block_table()` gives each
    sequence's blocks."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, spec: _Spec, layer: int = 0):
        super().__init__()
        self.spec = spec
        self.layer = layer  # the model layer (a policy with per-layer key tables)
        self._clear()

    def _clear(self) -> None:
        self.serving: ServingKVCache | None = None
        self.num_seqs = 0
        self.length = 0
        self.blocks_per_seq = 0
        self.dtype = None
        self.sink_k = self.sink_v = None  # [B, sink, H, D] raw rows (a "+win" policy)
        self.decoded_k = self.decoded_v = None  # [B, c * block_size, H, D] (keep_decoded)
        self.is_initialized = False

    def __repr__(self):
        return (f"KVQLayer(policy={self.spec.policy!r}, num_seqs={self.num_seqs}, "
                f"length={self.length})")  # fmt: skip

    # -- transformers' layer interface ------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.num_seqs = key_states.shape[0]
        self.dtype = key_states.dtype
        self.device = key_states.device
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"key_states must be bfloat16, float16 or float32, got {self.dtype}")
        want = self.spec.max_cache_len or 1
        self.serving = self._allocate(self.num_seqs, math.ceil(want / self.spec.block_size))
        if self.spec.sink:
            shape = (self.num_seqs, self.spec.sink, self.spec.num_kv_heads, self.spec.head_dim)
            self.sink_k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.sink_v = torch.zeros_like(self.sink_k)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Store key_states / value_states [B, H, T, D]; return K, V [B, H, L, D] (module
        doc) in key_states' dtype."""
        self._check_states(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[2]
        start = self.length
        self._write(key_states, value_states, start)
        self.length = start + t
        if self.spec.raw_new_tokens:
            k, v = self._stored_rows(start)
            k = torch.cat([k, key_states.transpose(1, 2).to(self.dtype)], dim=1)
            v = torch.cat([v, value_states.transpose(1, 2).to(self.dtype)], dim=1)
        else:
            k, v = self._stored_rows(self.length)
        return (k.transpose(1, 2).to(key_states.dtype),
                v.transpose(1, 2).to(value_states.dtype))  # fmt: skip

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Drop every token (the next `update` allocates again)."""
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("KVQCache layers cannot be cropped: packed blocks are final "
                             f"(tokens_to_remove {tokens_to_remove})")  # fmt: skip

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select(torch.arange(self.num_seqs).repeat_interleave(repeats))

    # -- storage ----------------------------------------------------------------------------

    def block_table(self) -> torch.Tensor:
        """int64 [B, blocks in use]: the serving-cache block of each sequence's block j."""
        used = math.ceil(self.length / self.spec.block_size)
        j = torch.arange(used, device=self.device)[None, :]
        return j * self.num_seqs + torch.arange(self.num_seqs, device=self.device)[:, None]

    def page_bytes(self) -> int:
        """Bytes one block (K and V) occupies in the pool: packed pages, or raw rows."""
        s = self.serving
        if s is None:
            return 0
        if s.quantized:
            return sum(a[0].numel() * a.element_size()
                       for p in (s.k_pages, s.v_pages) for a in p.arrays.values())  # fmt: skip
        return 2 * s.key_cache[0].numel() * s.key_cache.element_size()

    def memory(self) -> dict[str, int]:
        """Bytes by use: `pages` (complete blocks in use; raw caches: every block in use),
        `staging` (the staging rows allocated), `sink`, `decoded` (keep_decoded copies),
        `allocated` (every tensor this layer owns, the pool's spare capacity included)."""
        out = dict(pages=0, staging=0, sink=0, decoded=0, allocated=0)
        s = self.serving
        if s is None:
            return out
        if s.quantized:
            out["pages"] = self.num_seqs * (self.length // s.block_size) * self.page_bytes()
            out["staging"] = sum(_nbytes(x) for x in (s.k_stage, s.v_stage))
        else:
            used = math.ceil(self.length / s.block_size)
            out["pages"] = self.num_seqs * used * self.page_bytes()
        out["sink"] = sum(_nbytes(x) for x in (self.sink_k, self.sink_v))
        out["decoded"] = sum(_nbytes(x) for x in (self.decoded_k, self.decoded_v))
        out["allocated"] = s.storage_bytes() + out["sink"] + out["decoded"]
        return out

    # -- internals --------------------------------------------------------------------------

    def _allocate(self, num_seqs: int, blocks_per_seq: int) -> ServingKVCache:
        self.blocks_per_seq = max(blocks_per_seq, 1)
        return allocate_kv_cache(
            self.spec.kv_cache_dtype, self.blocks_per_seq * num_seqs, self.spec.block_size,
            self.spec.num_kv_heads, self.spec.head_dim, dtype=self.dtype, device=self.device,
            max_num_seqs=num_seqs, layer=self.layer,
        )  # fmt: skip

    def _check_states(self, key_states, value_states) -> None:
        h, d = self.spec.num_kv_heads, self.spec.head_dim
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                raise TypeError(f"{name} must be a floating torch.Tensor, got "
                                f"{getattr(x, 'dtype', type(x).__name__)}")  # fmt: skip
            if x.ndim != 4 or x.shape[1] != h or x.shape[3] != d:
                raise ValueError(f"{name} must be [batch, {h}, tokens, {d}] (the config's KV "
                                 f"heads and head_dim), got {tuple(x.shape)}")  # fmt: skip
        if value_states.shape != key_states.shape:
            raise ValueError(f"value_states {tuple(value_states.shape)} must have key_states' "
                             f"shape {tuple(key_states.shape)}")  # fmt: skip
        if self.is_initialized:
            if key_states.shape[0] != self.num_seqs:
                raise ValueError(f"key_states has batch {key_states.shape[0]}, the cache holds "
                                 f"{self.num_seqs} sequences")  # fmt: skip
            if key_states.device != self.device:
                raise ValueError(f"key_states is on {key_states.device}, the cache on "
                                 f"{self.device}")  # fmt: skip

    def _grow(self, tokens: int) -> None:
        """Make room for `tokens` per sequence: a larger pool (double the blocks), every
        tensor copied (block j * B + b keeps its index)."""
        need = math.ceil(tokens / self.spec.block_size)
        if need <= self.blocks_per_seq:
            return
        old, old_blocks = self.serving, self.serving.num_blocks
        new = self._allocate(self.num_seqs, max(need, 2 * self.blocks_per_seq))
        olds, news = old.tensors(), new.tensors()
        with torch.no_grad():
            for name, src in olds.items():
                dst = news[name]
                if dst.shape == src.shape:
                    dst.copy_(src)
                else:  # a leading axis of num_blocks + 1 (its last entry: scratch)
                    dst[:old_blocks] = src[:old_blocks]
        self.serving = new

    def _write(self, key_states, value_states, start: int) -> None:
        b, h, t, d = key_states.shape
        if t == 0:
            return
        self._grow(start + t)
        bs = self.spec.block_size
        # a call that completes a sequence's open block and opens another is written in two
        # (the open block's rest, then the others): one staging row per sequence suffices
        cut = min(t, -start % bs) if self.serving.quantized and start % bs else t
        seq = torch.arange(b, device=self.device)[:, None]
        parts = ((0, cut), (cut, t))
        if start % bs and cut == t and (start + t) % bs and self.serving.quantized:
            # every row lands in each sequence's open block (opened by an earlier call) and
            # leaves it open: reshape_and_cache's staged write, without its pack of no block
            self._stage(key_states, value_states, start)
            parts = ()
        for lo, hi in parts:
            if hi == lo:
                continue
            pos = torch.arange(start + lo, start + hi, device=self.device)
            slots = ((pos // bs)[None, :] * b + seq) * bs + pos % bs  # [B, hi - lo]
            k = key_states[:, :, lo:hi].transpose(1, 2).reshape(b * (hi - lo), h, d)
            v = value_states[:, :, lo:hi].transpose(1, 2).reshape(b * (hi - lo), h, d)
            positions = pos.expand(b, -1).reshape(-1)  # used by caches of pre-RoPE keys
            reshape_and_cache(k, v, self.serving, slots.reshape(-1), positions)
        sink = self.spec.sink
        if sink and start < sink:
            n = min(sink, start + t) - start
            with torch.no_grad():
                self.sink_k[:, start : start + n] = key_states[:, :, :n].transpose(1, 2)
                self.sink_v[:, start : start + n] = value_states[:, :, :n].transpose(1, 2)

    @torch.no_grad()
    def _stage(self, key_states, value_states, start: int) -> None:
        """Rows start .. start + T - 1 of every sequence into its open block's staging row
        (the block was opened by an earlier call and stays open): what reshape_and_cache
        does for them (rows, stage_count), with host-known offsets."""
        s, bs, t = self.serving, self.spec.block_size, key_states.shape[2]
        rows = s.block_stage[self.block_table()[:, start // bs]]  # [B]
        off = start % bs
        s.k_stage[rows, off : off + t] = key_states.transpose(1, 2).to(s.dtype)
        s.v_stage[rows, off : off + t] = value_states.transpose(1, 2).to(s.dtype)
        s.stage_count[rows] += t

    @torch.no_grad()
    def _decode(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, M * block_size, H, D] (the cache's row dtype) of the packed blocks
        `table` [B, M], decoded as the serving cache reads them (`decode_blocks`)."""
        s = self.serving
        b, m = table.shape
        shape = (b, m * s.block_size, s.num_kv_heads, s.head_size)
        k, v = decode_blocks(s, table.reshape(-1))
        return k.reshape(shape), v.reshape(shape)

    @torch.no_grad()
    def _complete(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, count * block_size, H, D] of each sequence's first `count` (complete,
        packed) blocks, decoded."""
        table = self.block_table()
        if not self.spec.keep_decoded:
            return self._decode(table[:, :count])
        have = 0 if self.decoded_k is None else self.decoded_k.shape[1] // self.spec.block_size
        if count > have:
            k, v = self._decode(table[:, have:count])
            if self.decoded_k is None:
                self.decoded_k, self.decoded_v = k, v
            else:
                self.decoded_k = torch.cat([self.decoded_k, k], dim=1)
                self.decoded_v = torch.cat([self.decoded_v, v], dim=1)
        rows = count * self.spec.block_size
        return self.decoded_k[:, :rows], self.decoded_v[:, :rows]

    @torch.no_grad()
    def _stored_rows(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, length, H, D] (the cache's row dtype): each sequence's first `length`
        tokens as the cache holds them."""
        s, bs = self.serving, self.spec.block_size
        if length == 0:
            empty = torch.zeros((self.num_seqs, 0, s.num_kv_heads, s.head_size),
                                dtype=self.dtype, device=self.device)  # fmt: skip
            return empty, empty
        if not s.quantized:
            k, v = read_blocks(s, self.block_table()[:, : math.ceil(length / bs)])
            return k[:, :length], v[:, :length]
        # blocks packed by now (a block that held row `length` may have completed since)
        full = min(self.length // bs, math.ceil(length / bs))
        rest = length - full * bs
        parts_k, parts_v = [], []
        if full:
            k, v = self._complete(full)
            parts_k.append(k[:, :length])
            parts_v.append(v[:, :length])
        if rest > 0:  # the open block: its staging rows
            rows = s.block_stage[self.block_table()[:, full]]
            parts_k.append(s.k_stage[rows, :rest])
            parts_v.append(s.v_stage[rows, :rest])
        k = torch.cat(parts_k, dim=1) if len(parts_k) > 1 else parts_k[0].clone()
        v = torch.cat(parts_v, dim=1) if len(parts_v) > 1 else parts_v[0].clone()
        n = min(self.spec.sink, length)
        if n:
            k[:, :n] = self.sink_k[:, :n]
            v[:, :n] = self.sink_v[:, :n]
        return k, v

    @torch.no_grad()
    def _select(self, index: torch.Tensor) -> None:
        """Keep sequences `index` [B'] (int; repeats allowed) in that order: every block,
        staging row, sink row and decoded row of old sequence index[i] becomes sequence i."""
        if not self.is_initialized:
            return
        index = torch.as_tensor(index, device=self.device).to(torch.int64).reshape(-1)
        old, b_old, b_new = self.serving, self.num_seqs, index.numel()
        if b_new and (int(index.min()) < 0 or int(index.max()) >= b_old):
            raise ValueError(f"indices must lie in [0, {b_old}), got {index.tolist()}")
        per = self.blocks_per_seq
        new = self._allocate(b_new, per)
        j = torch.arange(per, device=self.device)[:, None]
        src = (j * b_old + index[None, :]).reshape(-1)  # new block j * B' + i <- old block
        n = per * b_new
        if old.quantized:
            for name in ("k_pages", "v_pages"):
                for arr, dst in zip(getattr(old, name).arrays.values(),
                                    getattr(new, name).arrays.values(), strict=True):  # fmt: skip
                    dst[:n] = arr[src]
            full, rest = divmod(self.length, self.spec.block_size)
            if rest:
                rows = old.block_stage[full * b_old + index]  # the open block's staging row
                seqs = torch.arange(b_new, device=self.device)
                new.k_stage[:b_new] = old.k_stage[rows]
                new.v_stage[:b_new] = old.v_stage[rows]
                new.stage_count[:b_new] = old.stage_count[rows]
                new.stage_block[:b_new] = full * b_new + seqs
                new.block_stage[full * b_new + seqs] = seqs
        else:
            new.key_cache[:n] = old.key_cache[src]
            new.value_cache[:n] = old.value_cache[src]
        self.serving, self.num_seqs = new, b_new
        for name in ("sink_k", "sink_v", "decoded_k", "decoded_v"):
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, x.index_select(0, index))


def _nbytes(x) -> int:
    return 0 if x is None else x.numel() * x.element_size()


class KVQCache(Cache):
    """A transformers `Cache` that stores K/V with a kvq policy (module doc).

    config: the model's transformers config (full-attention decoder layers; its KV heads and
      head_dim size the pages).
    policy: a kvq policy or kv_cache_dtype name, e.g. "int4-g64", "nvfp4", "fp8",
      "int4-g64+win", "bfloat16".
    block_size: tokens per block (page); token-grouped formats need a multiple of their
      group (int4-g64: 64).
    max_cache_len: tokens per sequence to allocate for up front (None: grow on demand,
      doubling the pool).
    keep_decoded: keep each block's decoded rows once it is packed (faster, costs bf16-cache
      memory); raw_new_tokens: return a call's own tokens raw (default) or as stored.
    """

    def __init__(
        self,
        config,
        policy: str = "int4-g64",
        *,
        block_size: int = 64,
        max_cache_len: int | None = None,
        keep_decoded: bool = False,
        raw_new_tokens: bool = True,
    ):
        kv_cache_dtype, sink = resolve_policy(policy)
        num_layers, kv_heads, head_dim = _config_shape(config)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if max_cache_len is not None and (
            isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
            or max_cache_len < 1
        ):  # fmt: skip
            raise ValueError(f"max_cache_len must be an int >= 1 or None, got {max_cache_len!r}")
        for name, flag in (("keep_decoded", keep_decoded), ("raw_new_tokens", raw_new_tokens)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        _check_fit(kv_cache_dtype, policy, block_size, kv_heads, head_dim, num_layers)
        if sink > block_size:
            raise ValueError(f"block_size {block_size} must hold policy {policy!r}'s {sink} "
                             "sink rows")  # fmt: skip
        self.spec = _Spec(policy, kv_cache_dtype, sink, block_size, kv_heads, head_dim,
                          keep_decoded, raw_new_tokens, max_cache_len)  # fmt: skip
        super().__init__(layers=[KVQLayer(self.spec, i) for i in range(num_layers)])

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """`Cache.update`; a `layer_idx` past the config's layers adds layers."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be an int >= 0, got {layer_idx!r}")
        while len(self.layers) <= layer_idx:
            self.layers.append(KVQLayer(self.spec, len(self.layers)))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def memory(self) -> dict[str, int]:
        """`KVQLayer.memory` summed over the layers (bytes)."""
        total = dict(pages=0, staging=0, sink=0, decoded=0, allocated=0)
        for layer in self.layers:
            for key, value in layer.memory().items():
                total[key] += value
        return total

    def kv_bytes_per_token(self) -> float:
        """Bytes one token of one sequence costs in the pages, every layer's K and V (the
        format's accounting: page bytes / block_size; staging and sink rows excluded)."""
        return sum(layer.page_bytes() for layer in self.layers) / self.spec.block_size


def _check_fit(kv_cache_dtype: str, policy: str, block_size: int, heads: int, head_dim: int,
               num_layers: int):  # fmt: skip
    """A policy whose formats do not fit the config's head_dim (ValueError naming config) or
    the block size (naming block_size); a per-layer key-tables policy must have a table of the
    config's KV heads x head_dim for each of its layers (the model's name is not checked: a
    transformers config does not say which model it is)."""
    kvq_policy = policy_for_kv_cache_dtype(kv_cache_dtype)
    if kvq_policy is None:
        return
    if kvq_policy.key_tables is not None:
        from kvq_jax.core.calibration import get_key_tables

        tables = get_key_tables(kvq_policy.key_tables)
        try:
            tables.check_fit(policy, None, num_layers, num_kv_heads=heads, head_dim=head_dim)
        except ValueError as e:
            shape = f"{num_layers} layers, {heads} KV heads, head_dim {head_dim}"
            raise ValueError(f"config ({shape}) does not fit policy {policy!r}: {e}") from None
    widest = 256  # a page size every token-axis group of kvq's formats divides
    try:
        allocate_kv_cache(kv_cache_dtype, 1, widest, heads, head_dim, max_num_seqs=1, layer=0)
    except ValueError as e:
        raise ValueError(f"config (head_dim {head_dim}, {heads} KV heads) does not fit policy "
                         f"{policy!r}: {e}") from None  # fmt: skip
    try:
        allocate_kv_cache(kv_cache_dtype, 1, block_size, heads, head_dim, max_num_seqs=1,
                          layer=0)  # fmt: skip
    except ValueError as e:
        raise ValueError(f"block_size {block_size} does not fit policy {policy!r}: {e}") from None
