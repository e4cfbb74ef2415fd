"""A KV cache driven the way vLLM's attention backends drive theirs: tensors allocated per
layer from (num_blocks, block_size, num_kv_heads, head_size), every scheduled token written
by its slot (slot = block * block_size + offset; -1 is a padded token and is skipped), read
by block tables. Torch only (CPU and CUDA); no JAX.

    cache = allocate_kv_cache("int4-g64", num_blocks, block_size, num_kv_heads, head_size,
                              max_num_seqs=256, device="cuda")
    reshape_and_cache(key, value, cache, slot_mapping)        # in place, no host sync
    cache.tensors()                                           # name -> every tensor it owns

`kv_cache_dtype` (`KV_CACHE_DTYPES`): vLLM's "auto" / "bfloat16" / "float16" keep raw rows
(`key_cache`, `value_cache` [num_blocks, block_size, H, D], vLLM's layout and meaning).
kvq's policies ("kvq:<policy>", e.g. "kvq:int4-g64", "kvq:nvfp4", "kvq:fp8"; unprefixed where
the name is not also one of vLLM's: "int4-g64", "nvfp4", ..., and "int4" = int4-g64) store
quantized pages with the bytes kvq's paged cache stores for the same page
(`kvq_torch_bridge.pack_paged` of the complete block). vLLM's "fp8" / "fp8_e4m3" (E4M3 with
one scale per layer, `k_scale` / `v_scale`), "fp8_e5m2", "fp8_inc" and "fp8_ds_mla" are other
bytes than kvq's (per-row-scaled E4M3 is "kvq:fp8") and are refused by name (`REFUSED_DTYPES`).

Quantized blocks: a block's rows stay raw in a staging row (`k_stage` / `v_stage`
[max_num_seqs + 1, block_size, H, D]: O(max_num_seqs x block_size), not O(num_blocks)) until
its last slot (offset block_size - 1) is written, then the block is packed once, page-local.
Blocks fill in order (vLLM appends a sequence's tokens in order), at most one open block per
running sequence. The staging row of a block is found on the device (`block_stage`
[num_blocks + 1], -1 when none; `stage_block` [max_num_seqs + 1]), new rows taken from the free
ones by a sort, so a write never reads anything back to the host. The last entry of each
staging / page tensor is a scratch entry that padded tokens write into and nothing reads.

Loops: one cache per (loop, layer), as vLLM's Ouro model has one attention per (loop, layer),
sharing the block tables. Each loop's cache stores its loop absolute, or, allocated with
`previous=` the cache of loop l - 1 of the same layer, as kvq's cross-loop residual: a
complete block holds the delta (in the cache dtype) of its rows against loop l - 1's
reconstructed block, packed in the policy's residual format, the bytes of kvq's paged cache
for loop l of that page; reading adds the chain back. Loop l - 1 must write a block's tokens
before loop l does (the forward order of a looped model).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvq_jax.core import registry
from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.policies import POLICIES, Policy, cache_config_for, serving_support
from kvq_torch_bridge.cache.paged import pack_paged, unpack_paged
from kvq_torch_bridge.codecs._dtypes import numpy_dtype, torch_dtype
from kvq_torch_bridge.codecs._numerics import add_in_dtype, subtract_in_dtype
from kvq_torch_bridge.codecs.packed import PackedKV
from kvq_torch_bridge.codecs.registry import get_codec
from kvq_torch_bridge.codecs.rope import apply_rope, invert_rope, rope_at

__all__ = [
    "KVQ_PREFIX",
    "KV_CACHE_DTYPES",
    "RAW_DTYPES",
    "REFUSED_DTYPES",
    "ServingKVCache",
    "allocate_kv_cache",
    "check_slot_mapping",
    "decode_blocks",
    "policy_for_kv_cache_dtype",
    "read_blocks",
    "reshape_and_cache",
]

#: raw kv_cache_dtype strings -> the torch dtype of the rows (None: the `dtype` argument)
RAW_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: kvq format names accepted as kv_cache_dtype -> the policy that stores both K and V in them
FORMAT_POLICIES = {"int4": "int4-g64", "nvfp4": "nvfp4"}
#: the prefix that names a kvq policy whatever vLLM calls a string
KVQ_PREFIX = "kvq:"
_VLLM_FP8 = (
    "vLLM's {} cache is E4M3 codes with one scale per layer (k_scale / v_scale); kvq's "
    "E4M3 scales each row, other bytes: ask for 'kvq:fp8'"
)
#: vLLM kv_cache_dtype names whose bytes kvq does not store, and why
REFUSED_DTYPES = {
    "fp8": _VLLM_FP8.format("fp8"),
    "fp8_e4m3": _VLLM_FP8.format("fp8_e4m3"),
    "fp8_e5m2": "kvq has no E5M2 format",
    "fp8_inc": "Intel Neural Compressor's fp8 is not a kvq format",
    "fp8_ds_mla": "DeepSeek MLA's fp8 layout is not a kvq format",
}


def _served_policies() -> dict[str, str]:
    names = {}
    for name, policy in POLICIES.items():
        if not policy.quantized or policy.window is not None:
            continue
        uniform = all(len(set(policy.loop_formats(kind, 4))) == 1 for kind in ("key", "value"))
        if uniform and serving_support(policy, num_loops=1).served:
            names[name] = name
    return names


#: every accepted kv_cache_dtype -> "raw" or the kvq policy name it stores: the served policies
#: with one format per kind in every loop (one cache per (loop, layer) stores every loop
#: absolute, so a policy whose loops differ in format has no meaning here), no raw window;
#: as "kvq:<policy>", and unprefixed where vLLM does not use the name for other bytes
KV_CACHE_DTYPES: dict[str, str] = {
    **{name: "raw" for name in RAW_DTYPES},
    **{name: policy for name, policy in FORMAT_POLICIES.items()},
    **{name: name for name in _served_policies() if name not in REFUSED_DTYPES},
    **{KVQ_PREFIX + name: name for name in _served_policies()},
}


def policy_for_kv_cache_dtype(kv_cache_dtype: str) -> Policy | None:
    """The kvq policy a kv_cache_dtype stores (None: raw rows); ValueError naming the argument
    for an unknown or refused name (with the reason)."""
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {type(kv_cache_dtype).__name__}")
    if kv_cache_dtype in REFUSED_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is refused: "
                         f"{REFUSED_DTYPES[kv_cache_dtype]}")  # fmt: skip
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        policy = POLICIES.get(kv_cache_dtype.removeprefix(KVQ_PREFIX))
        why = ""
        if policy is not None and policy.window is not None:
            why = " (raw window rows need per-sequence state this slot-mapped cache does not keep)"
        elif policy is not None:
            why = f" ({serving_support(policy, num_loops=1).reason or 'not served here'})"
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not served{why}; known: "
                         f"{', '.join(sorted(KV_CACHE_DTYPES))}")  # fmt: skip
    name = KV_CACHE_DTYPES[kv_cache_dtype]
    return None if name == "raw" else POLICIES[name]


def _check_int(value, name: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


@dataclasses.dataclass(eq=False)
class ServingKVCache:
    """One layer's (and loop's) cache. Raw: `key_cache` / `value_cache` [num_blocks + 1,
    block_size, H, D]. Quantized: `k_pages` / `v_pages` (`PackedKV`, leading axis num_blocks
    + 1), `k_stage` / `v_stage` [max_num_seqs + 1, block_size, H, D] raw rows, `stage_block`
    int64 [max_num_seqs + 1] (the block a staging row holds, -1 free), `block_stage` int64
    [num_blocks + 1] (a block's staging row, -1 none), `stage_count` int64 [max_num_seqs + 1]
    (rows written), `overflow` int64 [] (tokens dropped on CUDA because more than max_num_seqs
    blocks were open; on the CPU that is a ValueError), `block_start` int64 [num_blocks + 1]
    (keys stored before RoPE: the position of each block's first row). The last entry of each
    is a scratch entry for padded tokens. previous: loop - 1's cache when this one stores
    residual deltas against it (not owned: not in `tensors()`); loop: its loop index (0
    without previous)."""

    kv_cache_dtype: str
    policy: Policy | None
    config: PagedCacheConfig | None
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    max_num_seqs: int
    key_cache: torch.Tensor | None = None
    value_cache: torch.Tensor | None = None
    k_pages: PackedKV | None = None
    v_pages: PackedKV | None = None
    k_stage: torch.Tensor | None = None
    v_stage: torch.Tensor | None = None
    stage_block: torch.Tensor | None = None
    block_stage: torch.Tensor | None = None
    stage_count: torch.Tensor | None = None
    overflow: torch.Tensor | None = None
    block_start: torch.Tensor | None = None
    previous: ServingKVCache | None = None
    loop: int = 0

    @property
    def role(self) -> str:
        """ "base" (the loop stored absolute) or "residual" (deltas against `previous`)."""
        return "base" if self.previous is None else "residual"

    @property
    def quantized(self) -> bool:
        return self.policy is not None

    @property
    def device(self) -> torch.device:
        return (self.key_cache if self.key_cache is not None else self.k_stage).device

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor the cache owns, by name (packed pages as `k_pages.codes`, ...)."""
        out = {}
        for name in ("key_cache", "value_cache", "k_stage", "v_stage", "stage_block",
                     "block_stage", "stage_count", "overflow", "block_start"):  # fmt: skip
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        for name in ("k_pages", "v_pages"):
            packed = getattr(self, name)
            if packed is not None:
                out.update({f"{name}.{n}": a for n, a in packed.arrays.items()})
        return out

    def storage_bytes(self) -> int:
        """Bytes of every tensor the cache owns."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def _empty_pages(config: PagedCacheConfig, kind: str, device, role: str = "base") -> PackedKV:
    """Zero packed pages [num_pages, ...] with the arrays `pack_paged` gives one page."""
    zeros = torch.zeros((1, *config.page_shape), dtype=torch_dtype(config.dtype), device=device)
    args = config.pack_args(kind, role)
    layout = registry.layout(args["format"])
    rows = None
    if hasattr(layout, "heavy_group") and not layout.selects_rows:  # values take their rows
        shape = (1, config.page_size // layout.heavy_group, config.num_heads)
        rows = torch.zeros(shape, dtype=torch.uint8, device=device)
    one = pack_paged(zeros, **args, rows=rows)
    arrays = {
        n: torch.zeros((config.num_pages, *a.shape[1:]), dtype=a.dtype, device=device)
        for n, a in one.arrays.items()
    }
    return dataclasses.replace(one, **arrays)


def allocate_kv_cache(
    kv_cache_dtype: str,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device=None,
    max_num_seqs: int = 256,
    previous: ServingKVCache | None = None,
    layer: int | None = None,
) -> ServingKVCache:
    """A zeroed cache of `num_blocks` blocks of `block_size` tokens x `num_kv_heads` x
    `head_size`, rows in `dtype` (bfloat16 / float16 / float32), on `device` (default CPU).
    `max_num_seqs`: the most sequences with an open (partly written) block at once (staging
    rows of quantized formats). `previous`: the same layer's cache of the loop before, to
    store this loop as residual deltas against it (a quantized kv_cache_dtype, the same
    geometry, dtype and device). `layer`: the model layer, for a policy with per-layer key
    tables (`intb-*`: that layer's INTB format and, for a heavy-row policy, its mean-query
    table; required there, ignored elsewhere). A heavy-row policy (FORMAT.md 5a) stores each
    loop whole (no `previous`): a block's keys choose its heavy rows, its values take them;
    one storing keys before RoPE (FORMAT.md 5b) needs `positions` in `reshape_and_cache`.
    ValueError / TypeError naming the argument."""
    policy = policy_for_kv_cache_dtype(kv_cache_dtype)
    if policy is not None and policy.key_tables is not None:
        policy = _layer_policy(policy, layer, num_kv_heads, head_size)
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_size", head_size),
                        ("max_num_seqs", max_num_seqs)):  # fmt: skip
        _check_int(value, name)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dtype must be torch.bfloat16, float16 or float32, got {dtype!r}")
    device = torch.device("cpu" if device is None else device)
    if previous is not None and policy is not None and policy.absolute:
        raise ValueError(f"previous: kv_cache_dtype {kv_cache_dtype!r} stores its later loops "
                         "whole (heavy rows: each loop its own); allocate each loop's cache "
                         "without previous")  # fmt: skip
    if previous is not None:
        _check_previous(previous, policy, kv_cache_dtype, num_blocks, block_size, num_kv_heads,
                        head_size, dtype, device)  # fmt: skip
    raw = RAW_DTYPES.get(kv_cache_dtype)
    common = dict(kv_cache_dtype=kv_cache_dtype, policy=policy, num_blocks=num_blocks,
                  block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                  max_num_seqs=max_num_seqs)  # fmt: skip
    if policy is None:
        row_dtype = dtype if raw is None else raw
        shape = (num_blocks + 1, block_size, num_kv_heads, head_size)
        return ServingKVCache(
            **common, config=None, dtype=row_dtype,
            key_cache=torch.zeros(shape, dtype=row_dtype, device=device),
            value_cache=torch.zeros(shape, dtype=row_dtype, device=device),
        )  # fmt: skip
    try:
        config = cache_config_for(
            policy, num_pages=num_blocks + 1, page_size=block_size, num_heads=num_kv_heads,
            head_dim=head_size, dtype=numpy_dtype(dtype), num_loops=2, max_seqs=max_num_seqs,
        )  # fmt: skip
    except ValueError as e:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} with block_size {block_size}, "
                         f"head_size {head_size}: {e}") from None  # fmt: skip
    stage = (max_num_seqs + 1, block_size, num_kv_heads, head_size)
    role = "base" if previous is None else "residual"
    return ServingKVCache(
        **common, config=config, dtype=dtype,
        k_pages=_empty_pages(config, "key", device, role),
        v_pages=_empty_pages(config, "value", device, role),
        k_stage=torch.zeros(stage, dtype=dtype, device=device),
        v_stage=torch.zeros(stage, dtype=dtype, device=device),
        stage_block=torch.full((max_num_seqs + 1,), -1, dtype=torch.int64, device=device),
        block_stage=torch.full((num_blocks + 1,), -1, dtype=torch.int64, device=device),
        stage_count=torch.zeros((max_num_seqs + 1,), dtype=torch.int64, device=device),
        overflow=torch.zeros((), dtype=torch.int64, device=device),
        block_start=(None if config.rope_theta is None
                     else torch.zeros((num_blocks + 1,), dtype=torch.int64, device=device)),
        previous=previous, loop=0 if previous is None else previous.loop + 1,
    )  # fmt: skip


def _layer_policy(policy: Policy, layer, num_kv_heads: int, head_size: int) -> Policy:
    """Model layer `layer`'s policy of a key-tables policy, its INTB format registered in the
    Torch registry (`per_layer_policies`); ValueError naming `layer` when it is missing or has
    no table, or the table is for another head shape."""
    from kvq_jax.core.calibration import get_key_tables
    from kvq_jax.core.policies import per_layer_policies
    from kvq_torch_bridge.codecs.formats.intb import register_table

    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer: policy {policy.name!r} has per-layer key tables; pass the "
                         f"model layer (an int >= 0), got {layer!r}")  # fmt: skip
    tables = get_key_tables(policy.key_tables)
    if layer not in tables.tables:
        raise ValueError(f"layer: policy {policy.name!r} has no key table for layer {layer} "
                         f"(tables for layers {sorted(tables.tables)})")  # fmt: skip
    shape = (len(tables.tables[layer]), len(tables.tables[layer][0]))
    if shape != (num_kv_heads, head_size):
        raise ValueError(f"layer: policy {policy.name!r}'s table of layer {layer} is for "
                         f"{shape} (num_kv_heads, head_size), not "
                         f"({num_kv_heads}, {head_size})")  # fmt: skip
    layer_policy = per_layer_policies(policy, tables, [layer], register_table)[0]
    if policy.heavy is None:
        return layer_policy
    from kvq_torch_bridge.codecs.formats.heavy_rows import register_heavy

    # the engine's formats for this layer (`kvq_jax.engine`'s `_heavy_policies`); two loops,
    # as `cache_config_for` is called below (the second stored whole: no residual role)
    key_format = register_heavy(layer_policy.base_format, policy.heavy,
                                np.asarray(tables.heavy_table(policy.name, layer)))  # fmt: skip
    value_format = register_heavy(policy.formats("value")[0], policy.heavy)
    return layer_policy.with_heavy_formats(key_format, value_format, num_loops=2,
                                           rope_theta=layer_policy.rope_theta)  # fmt: skip


def _check_previous(previous, policy, kv_cache_dtype, num_blocks, block_size, num_kv_heads,
                    head_size, dtype, device) -> None:  # fmt: skip
    if not isinstance(previous, ServingKVCache):
        raise TypeError(f"previous must be a ServingKVCache (allocate_kv_cache), got "
                        f"{type(previous).__name__}")  # fmt: skip
    if policy is None:
        raise ValueError(f"previous: kv_cache_dtype {kv_cache_dtype!r} stores raw rows; "
                         "residual loops need a quantized kv_cache_dtype")  # fmt: skip
    # the policy itself (a key-tables policy's per-layer one: the loop before is the same layer)
    mine = (policy, num_blocks, block_size, num_kv_heads, head_size, dtype, device)
    p = previous
    theirs = (p.policy, p.num_blocks, p.block_size, p.num_kv_heads,
              p.head_size, p.dtype, p.device)  # fmt: skip
    if mine != theirs:
        raise ValueError("previous: the loop before must be the same policy, num_blocks, "
                         "block_size, num_kv_heads, head_size, dtype and device: "
                         f"{theirs} vs {mine}")  # fmt: skip


def _check_cache(cache) -> ServingKVCache:
    if not isinstance(cache, ServingKVCache):
        raise TypeError(f"cache must be a ServingKVCache (allocate_kv_cache), got "
                        f"{type(cache).__name__}")  # fmt: skip
    return cache


def _check_tokens(name: str, x, cache: ServingKVCache, n: int | None = None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    want = (cache.num_kv_heads, cache.head_size)
    if x.ndim != 3 or tuple(x.shape[1:]) != want or (n is not None and x.shape[0] != n):
        raise ValueError(f"{name} must be [num_tokens, {want[0]}, {want[1]}]"
                         f"{'' if n is None else f' with num_tokens {n}'}, got "
                         f"{tuple(x.shape)}")  # fmt: skip
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if x.device != cache.device:
        raise ValueError(f"{name} is on {x.device}, the cache on {cache.device}")
    return x


def host_checks(x: torch.Tensor) -> bool:
    """Whether the value checks run: `x` lies in host memory (reading it syncs nothing) and
    the call is not being traced by torch.compile (the values are not known then)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def check_slot_mapping(cache: ServingKVCache, slot_mapping, num_tokens: int) -> torch.Tensor:
    """Shape, dtype and device of `slot_mapping` (int64 [num_tokens]); its values (-1 or in
    [0, num_blocks * block_size)) when it lies in host memory (CPU tensors; reading a CUDA
    tensor would sync the host, which the hot path never does; not under torch.compile)."""
    if not isinstance(slot_mapping, torch.Tensor):
        raise TypeError(f"slot_mapping must be a torch.Tensor, got {type(slot_mapping).__name__}")
    if slot_mapping.dtype not in (torch.int64, torch.int32) or slot_mapping.ndim != 1:
        raise ValueError(f"slot_mapping must be int64 [num_tokens], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")  # fmt: skip
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} "
                         "tokens")  # fmt: skip
    if slot_mapping.device != cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the cache on {cache.device}")
    if host_checks(slot_mapping) and num_tokens:
        size = cache.num_blocks * cache.block_size
        bad = (slot_mapping < -1) | (slot_mapping >= size)
        if bool(bad.any()):
            first = int(slot_mapping[bad][0])
            raise ValueError(f"slot_mapping holds slot {first} outside [-1, {size}) "
                             f"({cache.num_blocks} blocks x {cache.block_size})")  # fmt: skip
        valid = slot_mapping[slot_mapping >= 0]
        if valid.unique().numel() != valid.numel():
            raise ValueError("slot_mapping writes a slot twice in one call")
    return slot_mapping.to(torch.int64)


def _check_positions(cache: ServingKVCache, positions, num_tokens: int):
    """int64 [num_tokens] positions of the tokens for a cache storing keys before RoPE (a
    ValueError naming `positions` when missing or malformed); None for other caches (whatever
    was passed: vLLM hands positions to every layer)."""
    if cache.block_start is None:
        return None
    if positions is None:
        raise ValueError(
            f"positions: kv_cache_dtype {cache.kv_cache_dtype!r} stores keys "
            "before RoPE; pass each token's position (int64 [num_tokens])"
        )
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions must be an int32 / int64 torch.Tensor, got "
                        f"{getattr(positions, 'dtype', type(positions).__name__)}")  # fmt: skip
    if tuple(positions.shape) != (num_tokens,) or positions.device != cache.device:
        raise ValueError(f"positions must be [{num_tokens}] on {cache.device}, got "
                         f"{tuple(positions.shape)} on {positions.device}")  # fmt: skip
    return positions.to(torch.int64)


@torch.no_grad()
def reshape_and_cache(key, value, cache: ServingKVCache, slot_mapping, positions=None) -> None:
    """Write key / value [num_tokens, num_kv_heads, head_size] at `slot_mapping` (int64
    [num_tokens]; slot = block * block_size + offset, -1 skipped), in place: no tensor of the
    cache is reallocated, nothing is read back to the host (CUDA). Tokens of many sequences in
    one call, blocks in any order; within a block, offsets in order across calls. Quantized
    formats pack a block when its last offset is written, with kvq's page bytes. `positions`
    (int64 [num_tokens], the tokens' positions in their sequences, what RoPE turned them by):
    required by a cache storing keys before RoPE (FORMAT.md 5b), which packs a block with RoPE
    taken off at its rows' positions and puts it back when reading; ignored by the others."""
    cache = _check_cache(cache)
    n = _check_tokens("key", key, cache).shape[0]
    _check_tokens("value", value, cache, n)
    slots = check_slot_mapping(cache, slot_mapping, n)
    positions = _check_positions(cache, positions, n)
    if n == 0:
        return
    bs = cache.block_size
    valid = slots >= 0
    block = torch.where(valid, slots // bs, cache.num_blocks)  # padded -> the scratch block
    offset = torch.where(valid, slots % bs, 0)
    if positions is not None:  # every row of a block agrees on its first row's position
        cache.block_start.index_put_((block,), positions - offset)
    if not cache.quantized:
        cache.key_cache[block, offset] = key.to(cache.key_cache.dtype)
        cache.value_cache[block, offset] = value.to(cache.value_cache.dtype)
        return
    _write_staged(cache, key, value, block, offset, valid)


def _groups(keyed: torch.Tensor):
    """(rank, first) of every entry of `keyed` [n] among its distinct values in ascending
    order: rank[i] = index of keyed[i]'s value, first[i] = i is that value's first entry."""
    order = torch.argsort(keyed, stable=True)
    sorted_keys = keyed[order]
    head = torch.ones_like(sorted_keys, dtype=torch.bool)
    head[1:] = sorted_keys[1:] != sorted_keys[:-1]
    rank_sorted = torch.cumsum(head.to(torch.int64), 0) - 1
    rank = torch.empty_like(rank_sorted).scatter_(0, order, rank_sorted)
    first = torch.empty_like(head).scatter_(0, order, head)
    return rank, first


def _write_staged(cache, key, value, block, offset, valid) -> None:
    """Rows of blocks that were open before into their staging rows, and the blocks they
    complete packed (their rows freed); then rows of blocks opened in this call that stay open
    into free staging rows (so a sequence that completes one block and opens the next in one
    call needs one row); blocks opened and completed in this call go straight to their pages."""
    s, bs, n = cache.max_num_seqs, cache.block_size, block.shape[0]
    row = cache.block_stage[block]  # [n], -1: the block has no staging row
    is_last = valid & (offset == bs - 1)
    old = valid & (row >= 0)
    rank, first = _groups(block)  # the scratch block (padded tokens) is one group too
    completes = torch.zeros(n, dtype=torch.bool, device=block.device)
    completes = completes.scatter_reduce(0, rank, is_last, "amax")[rank]
    new = valid & (row < 0)
    whole = new & completes  # written whole in this call: packed from the tokens, no row
    keep = new & ~completes
    # one free staging row per distinct new block that stays open, ranked by a sort; the rows
    # of the old blocks this call completes are free by then
    kept_rank, _ = _groups(torch.where(keep, block, cache.num_blocks + 1))
    if (
        host_checks(block)
        and bool(  # host memory: no sync; checked before any write
            (keep & (kept_rank >= (cache.stage_block[:s] < 0).sum() + (is_last & old).sum())).any()
        )
    ):
        raise ValueError(
            f"reshape_and_cache: more blocks open at once than max_num_seqs "
            f"({cache.max_num_seqs}) staging rows; allocate the cache with a larger max_num_seqs"
        )
    # blocks open before this call: their rows, then the ones completed are packed
    old_row = torch.where(old, row, s)
    cache.k_stage[old_row, offset] = key.to(cache.dtype)
    cache.v_stage[old_row, offset] = value.to(cache.dtype)
    cache.stage_count.index_add_(0, old_row, old.to(torch.int64))
    _reset_scratch(cache)
    _pack_staged(cache, block, old_row, is_last & old, _bound(is_last & old, min(n, s)))
    # blocks opened in this call that stay open: free rows
    free = cache.stage_block[:s] < 0
    free_rows = torch.argsort((~free).to(torch.int8), stable=True)  # free rows first
    fits = kept_rank < free.sum()
    new_row = free_rows[kept_rank.clamp(max=s - 1)]
    assign = keep & fits
    cache.overflow += (keep & ~fits).sum()  # on CUDA such rows are dropped and counted
    row = torch.where(assign, new_row, s)  # everything else: the scratch row
    cache.stage_block.index_put_((row,), torch.where(assign, block, -1))
    cache.block_stage.index_put_((torch.where(assign, block, cache.num_blocks),),
                                 torch.where(assign, row, -1))  # fmt: skip
    cache.k_stage[row, offset] = key.to(cache.dtype)
    cache.v_stage[row, offset] = value.to(cache.dtype)
    cache.stage_count.index_add_(0, row, assign.to(torch.int64))
    _reset_scratch(cache)
    if n >= bs:
        m = _bound(whole & first, n // bs)
        if m:
            _pack_whole(cache, key, value, block, offset, whole, rank, first, m)


def _reset_scratch(cache) -> None:
    s = cache.max_num_seqs
    cache.stage_block[s] = -1
    cache.block_stage[cache.num_blocks] = -1
    cache.stage_count[s] = 0


def _store_pages(cache, k_pages: torch.Tensor, v_pages: torch.Tensor, blocks) -> None:
    """Pack [m, block_size, H, D] K / V pages and write them at `blocks` [m] (in place); a
    residual cache packs their deltas against loop - 1's reconstructed blocks."""
    rows = _heavy_rows(cache, k_pages)  # chosen by the keys (RoPE'd), taken by the values
    rope = _block_rope(cache, blocks)
    if rope is not None:  # keys stored before RoPE: taken off at the rows' positions
        k_pages = invert_rope(k_pages, *rope).to(cache.dtype)
    for kind, raw, pages in (("key", k_pages, cache.k_pages), ("value", v_pages, cache.v_pages)):
        if cache.previous is not None:
            raw = subtract_in_dtype(raw.to(cache.dtype), _decoded(cache.previous, kind, blocks))
        packed = pack_paged(raw, **cache.config.pack_args(kind, cache.role), rows=rows)
        for name, arr in packed.arrays.items():
            pages.arrays[name][blocks] = arr


def _heavy_rows(cache, k_pages: torch.Tensor):
    """uint8 [m, block_size / G, H]: the heavy rows the keys' format chooses for key pages
    [m, block_size, H, D] (as written: after RoPE), which the values take; None for formats
    without heavy rows."""
    codec = get_codec(cache.config.pack_args("key", cache.role)["format"])
    if not getattr(codec, "selects_rows", False):
        return None
    m, bs, h, d = k_pages.shape
    rows = codec.select_rows(k_pages.reshape(m * bs, h, d))  # groups never span a block
    return rows.reshape(m, bs // codec.heavy_group, h)


def _block_rope(cache, blocks: torch.Tensor):
    """(cos, sin) float32 [m, block_size, 1, D] of the rows of `blocks` [m] (their first row's
    position, `block_start`, onwards) for a cache storing keys before RoPE, else None."""
    if cache.block_start is None:
        return None
    pos = cache.block_start[blocks][:, None] + torch.arange(cache.block_size, device=blocks.device)
    return rope_at(pos, cache.head_size, cache.config.rope_theta)


def _bound(flags: torch.Tensor, bound: int) -> int:
    """How many blocks to pack: `flags.sum()` where reading it costs no sync (CPU tensors,
    eager), else the static `bound` (CUDA, torch.compile: the extra packs go to the scratch
    block, so shapes stay fixed and nothing is read back)."""
    return int(flags.sum()) if host_checks(flags) else bound


def _pack_staged(cache, block, row, done, m: int) -> None:
    """Pack the staged blocks whose last offset was written in this call (at most m: one per
    staging row; `_bound`) and free their rows."""
    if m == 0:
        return
    s = cache.max_num_seqs
    cand = torch.argsort((~done).to(torch.int8), stable=True)[:m]  # completing tokens first
    ok = done[cand]
    blocks = torch.where(ok, block[cand], cache.num_blocks)
    rows = torch.where(ok, row[cand], s)
    _store_pages(cache, cache.k_stage[rows], cache.v_stage[rows], blocks)
    cache.stage_block[rows] = -1
    cache.block_stage[blocks] = -1
    cache.stage_count[rows] = 0
    _reset_scratch(cache)


def _pack_whole(cache, key, value, block, offset, whole, rank, first, m: int) -> None:
    """Pack the blocks written whole in this call (at most num_tokens // block_size) straight
    from the tokens: a page buffer of m blocks, O(the tokens)."""
    bs, h, d = cache.block_size, cache.num_kv_heads, cache.head_size
    # index of each whole block among the whole blocks (ascending block order)
    heads = whole & first
    n = rank.numel()
    slot_of_group = torch.full((n + 1,), m, dtype=torch.int64, device=rank.device)
    page_index = torch.cumsum(heads.to(torch.int64), 0) - 1  # group rank -> page buffer index
    slot_of_group = slot_of_group.scatter(0, torch.where(heads, rank, n),
                                          torch.where(heads, page_index, m))  # fmt: skip
    idx = torch.where(whole, slot_of_group[rank].clamp(max=m), m)
    kbuf = torch.zeros((m + 1, bs, h, d), dtype=cache.dtype, device=key.device)
    vbuf = torch.zeros_like(kbuf)
    kbuf[idx, offset] = key.to(cache.dtype)
    vbuf[idx, offset] = value.to(cache.dtype)
    blocks = torch.full((m + 1,), cache.num_blocks, dtype=torch.int64, device=key.device)
    blocks.index_put_((idx,), torch.where(whole, block, cache.num_blocks))
    blocks[m] = cache.num_blocks
    _store_pages(cache, kbuf[:m], vbuf[:m], blocks[:m])


def read_blocks(cache: ServingKVCache, block_tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """K and V of the blocks in `block_tables` [B, M] (entries in [0, num_blocks)), in the
    cache's row dtype [B, M * block_size, H, D]: raw rows, staging rows of open blocks, packed
    blocks decoded (`unpack_paged`). The reference read path, O(B x M) blocks."""
    b, m = block_tables.shape
    bs, h, d = cache.block_size, cache.num_kv_heads, cache.head_size
    flat = block_tables.reshape(-1).to(torch.int64)
    if not cache.quantized:
        k, v = cache.key_cache[flat], cache.value_cache[flat]
    else:
        rows = cache.block_stage[flat]
        open_ = (rows >= 0)[:, None, None, None]
        rows = rows.clamp(min=0)
        pairs = zip(decode_blocks(cache, flat), (cache.k_stage, cache.v_stage), strict=True)
        k, v = (torch.where(open_, stage[rows], decoded) for decoded, stage in pairs)
    return k.reshape(b, m * bs, h, d), v.reshape(b, m * bs, h, d)


def decode_blocks(cache: ServingKVCache, blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """K and V [m, block_size, H, D] in the cache's row dtype of packed blocks `blocks` [m]:
    decoded through the residual chain, keys stored before RoPE turned back at their rows'
    positions (FORMAT.md 5b)."""
    k, v = (_decoded(cache, kind, blocks) for kind in ("key", "value"))
    rope = _block_rope(cache, blocks)
    if rope is not None:
        k = apply_rope(k, *rope).to(cache.dtype)
    return k, v


def _decoded(cache: ServingKVCache, kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """Packed blocks `blocks` [m] of K or V decoded [m, block_size, H, D] in the cache dtype,
    through the residual chain (loop 0's block, plus each later loop's decoded delta)."""
    pages = cache.k_pages if kind == "key" else cache.v_pages
    picked = dataclasses.replace(pages, **{n: a[blocks] for n, a in pages.arrays.items()})
    decoded = unpack_paged(picked, cache.config.dtype).to(cache.dtype)
    if cache.previous is None:
        return decoded
    return add_in_dtype(_decoded(cache.previous, kind, blocks), decoded)
