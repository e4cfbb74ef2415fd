"""`Engine`: continuous-batching generation over quantized paged KV caches.

The layers' caches live in layer-group stores (`kvq_jax.engine.stores`: consecutive layers
with one configuration folded into one `PagedKVCache`), each holding every loop of its layers
(loop 0 as the base plane, loops >= 1 as residual deltas) or, with a shared `loop_kv`, one
plane; all share the block tables of one `PageAllocator`. The jitted steps
(`kvq_jax.engine.runner`: `lax.scan` over layers, loop-KV sharing, exits that skip loops)
run the model's per-layer pieces (`kvq_jax.models`) with the cache between the projections
and attention. What follows is loop_kv "all"; see the runner for the shared modes.

What attention reads (the same rule in prefill and decode):

* decode (`decode_step`, one token per sequence): for every loop and layer, q, k, v of the new
  token; k, v are appended to that layer's cache at that loop (`paged_cache.append`: the base
  plane at loop 0, the residual planes after, quantized when a page fills); then
  `paged_decode_attention` at that loop reads every token of the sequence, the new one
  included, from the cache: complete pages reconstructed through the residual chain, the
  partial page raw from staging, the first `sink` tokens raw (`+win` policies).
* prefill (`prefill`, a chunk of T prompt tokens of one or more sequences): loop by loop and
  layer by layer the chunk's k, v are appended first; then its q attends (causally) to (a)
  the sequence's earlier tokens as the cache holds them after the append (exactly the rows
  decode reads: a page the chunk completed is read reconstructed), read block by block
  (`runner.prefill_attention`), and (b) the chunk's own k, v raw, as the model produced them
  (in decode the newest token is raw too: it sits in the staging page). Appending first lets
  XLA update the pool in place (a read of the old pool followed by the append made it copy
  the whole pool per layer).
  The one difference from decoding the prompt token by token: a token of the chunk sees
  earlier tokens *of the same chunk* raw even when their page filled inside the chunk, where
  token-by-token decode would see them quantized. Long prompts are cut into chunks of
  `prefill_chunk` tokens; the tail is cut into power-of-two pieces (few compiled shapes).

Attention is computed in float32 at HIGHEST precision in both (`kvq_jax.codecs.attention.attend` in
decode), the result rounded to the compute dtype before o_proj.

Policies (`kvq_jax.core.policies`): K and V take the policy's base/residual formats and group
size (INT4 keys are grouped over tokens, so the group must divide the page size: page 64 takes
int4-g64). "+win" keeps the first 4 tokens raw (`sink=4`); the policy's 16 "recent" raw rows
are played by the cache's staging page, which holds the last (length mod page_size) tokens
raw, between 0 and page_size - 1 of them, not a fixed 16. "bf16" is unquantized: a separate
plain paged store (`RawStore`: [loops, pages, page_size, H, D] per layer, same block
tables) in the model's compute dtype, so a bfloat16 model's K/V are stored exactly (a float32
model's in float32; bfloat16 rows as their uint16 bits, which XLA:CPU updates in place).

Looped models: the layer stack runs `num_loops` times per token (`loops=` overrides the
checkpoint's count), the final norm after every loop. Ouro: each loop's logits and exit gate
are computed for the sampled position, and the token's logits are those of its exit loop
(`ouro.exit_loops` with the config's `early_exit_threshold`; 1.0 = the last loop). With a
threshold < 1 a decode step stops looping once every active row has exited (`skip_exited`,
the default where the policy's pages allow; the runner's module doc); `skip_exited=False` runs
every loop, as `ouro.forward` does, and only selects the exit loop's logits. Heavy-row pages
(FORMAT.md 5a) are not served by the cache of exits that skip loops (its depth map reads an
exited row from its exit loop's page): with them every loop runs, unless one loop's K/V is
shared (`loop_kv`). Llama with loops > 1 is an emulation
(`Engine.emulated`; the model was not trained to loop): the last loop's logits, the
semantics of the Torch runner `kvq_torch_bridge.model_eval.looped.run_logits`.

Sampling: greedy (temperature 0), or temperature with optional top-k, with an explicit PRNG
key per request folded with the token's position (a sequence's samples do not depend on which
other sequences share the batch). A request stops at one of its stop ids (default: the
model's EOS ids; the stop token is kept in its output) or after max_new_tokens tokens.

Continuous batching: `decode_step` always runs all `max_seqs` slots (one compiled shape);
free slots compute garbage that lands only in their own staging rows and lengths (their block
table rows are -1, so no page is written) and is cleared (`clear_slot`) when a sequence joins
that slot. Pages are taken on demand: admission takes the prompt's pages and one more row,
each decode step grows a sequence by the row it writes. `submit` + `step` / `run` go through
the `Scheduler` (`kvq_jax.engine.scheduler`: priorities, preemption by swapping a
sequence's K/V to host memory and back, byte for byte); `add_request` admits at once or
raises; `fork` starts a new request on a running one's tokens, sharing its complete pages.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvq_jax.core.allocator import PageAllocator
from kvq_jax.core.policies import (
    POLICIES,
    Policy,
    cache_config_for,
    per_layer_policies,
    serving_support,
)
from kvq_jax.core.registry import layout
from kvq_jax.engine.runner import LOOP_KV, StepSpec, decode_step, prefill_step
from kvq_jax.engine.sampler import sample
from kvq_jax.engine.scheduler import Scheduler
from kvq_jax.engine.stores import QuantizedStore, RawStore, sequence_ids
from kvq_jax.models.config import ModelConfig

__all__ = [
    "Engine",
    "Request",
    "cache_config_for",
    "layer_groups",
    "layer_policies",
    "resolve_policy",
]


def resolve_policy(policy: str | Policy) -> Policy:
    """A `Policy` from its name (ValueError listing the known names) or a Policy."""
    if isinstance(policy, Policy):
        return policy
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES)}")
    return POLICIES[policy]


def layer_policies(policy: Policy, model, num_loops: int | None = None) -> tuple[Policy, ...]:
    """One policy per layer of `model`: `policy` itself, or for a policy with per-layer INTB
    key tables (`Policy.key_tables`) its keys in the per-layer INTB format of the model's
    tables (`IntBLayersCodec`: every layer the same policy and cache configuration, the layer
    a traced index, so the layers compile once) when every table has one row width, else each
    layer's own INTB format (one compiled layer group per layer). Formats are registered in
    the JAX registry. ValueError when `serving_support` refuses the policy at `num_loops`
    (default: the model's) or the tables are not for this model (its `source` "model") or
    miss one of its layers."""
    num_loops = model.config.num_loops if num_loops is None else num_loops
    serving_support(policy, num_loops=num_loops).check()
    num_layers = model.config.num_layers
    if policy.key_tables is None:
        return (policy,) * num_layers
    from kvq_jax.codecs.formats.intb import register_layer_tables, register_table
    from kvq_jax.core.calibration import get_key_tables

    tables = get_key_tables(policy.key_tables)
    name = model.source.get("model") if isinstance(model.source, dict) else None
    c = model.config
    tables.check_fit(policy.name, [name], num_layers, num_kv_heads=c.num_kv_heads,
                     head_dim=c.head_dim, rope_theta=c.rope_theta)  # fmt: skip
    bits = [tables.table(layer) for layer in range(num_layers)]
    one_width = len({sum(t[0]) for t in bits}) == 1
    if policy.heavy is not None:
        return _heavy_policies(policy, tables, bits, one_width, num_loops, tables.rope_theta)
    if one_width:
        key_format = register_layer_tables(bits)
        return (policy.for_key_format(key_format, None, tables.rope_theta),) * num_layers
    return per_layer_policies(policy, tables, range(num_layers), register_table)


def _heavy_policies(policy, tables, bits, one_width: bool, num_loops: int, rope_theta):
    """A heavy policy's layers: keys in a heavy-row format over the INTB format of the key
    tables holding the mean-query tables (one format for every layer when the tables share
    a row width, the layer traced; else one per layer), values in heavy rows over the
    policy's value base format, keys before RoPE with base `rope_theta` (the tables', for a
    pre_rope policy) (`Policy.with_heavy_formats`)."""
    from kvq_jax.codecs.formats.heavy_rows import register_heavy
    from kvq_jax.codecs.formats.intb import register_layer_tables, register_table

    layers = range(len(bits))
    queries = [np.asarray(tables.heavy_table(policy.name, layer)) for layer in layers]
    value_format = register_heavy(policy.formats("value")[0], policy.heavy)
    if one_width:
        key_format = register_heavy(register_layer_tables(bits), policy.heavy, np.stack(queries))
        served = policy.with_heavy_formats(key_format, value_format, num_loops, rope_theta)
        return (served,) * len(bits)
    keys = [register_heavy(register_table(bits[layer]), policy.heavy, queries[layer])
            for layer in layers]  # fmt: skip
    return tuple(policy.with_heavy_formats(k, value_format, num_loops, rope_theta) for k in keys)


# -- requests and the engine -----------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and its state.

    prompt: token ids; tokens: generated ids (the stop token included); finish_reason: None
    while running, "stop" (a stop id) or "length" (max_new_tokens); exit_loops: the loop each
    generated token's logits came from; logits: float32 [V] per generated token when
    keep_logits (the distribution it was sampled from); forced: teacher forcing, the ids
    that become the generated tokens whatever the logits (None: sampled); priority: the
    scheduler's rank (smaller first, then arrival); preemptions: times it was swapped out.
    """

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    key: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(2, np.uint32))
    stop_ids: frozenset = frozenset()
    keep_logits: bool = False
    forced: tuple[int, ...] | None = None
    slot: int | None = None
    position: int = 0
    tokens: list[int] = dataclasses.field(default_factory=list)
    exit_loops: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    priority: int = 0
    arrival: int = 0
    preemptions: int = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


def loop_skipping(
    config, policy: Policy, loop_kv: str, skip_exited=None, *, loops: int | None = None
) -> tuple[bool, str | None]:
    """(whether an engine's decode skips the loops after every active row has exited, why it
    runs every loop where the exits could skip some: None if not so, or asked) for `policy`
    and `loop_kv` on a model of `config` run at `loops` loops (None: its own). skip_exited: as
    `Engine`'s; ValueError for True where the pages do not allow it (heavy rows, `Policy.heavy`,
    in every loop's planes: the adaptive-exit cache of `PagedCacheConfig` takes none)."""
    if skip_exited is not None and not isinstance(skip_exited, bool):
        raise ValueError(f"skip_exited must be a bool or None, got {skip_exited!r}")
    loops = config.num_loops if loops is None else loops
    gated = config.arch == "ouro" and config.early_exit_threshold < 1 and loops > 1
    shared = loop_kv != "all" and loops > 1
    heavy = policy.quantized and policy.heavy is not None and not shared
    if skip_exited and gated and heavy:
        raise ValueError(
            f"skip_exited: policy {policy.name!r} stores heavy rows, which the cache does not "
            "serve with exits that skip loops; pass skip_exited=None or False (every loop "
            "runs, each token keeps its exit loop's logits)"
        )
    if skip_exited is None and gated and heavy:
        return False, "heavy-row pages are not served with exits that skip loops"
    return gated and skip_exited is not False, None


def _key_data(key, seed) -> np.ndarray:
    if key is None:
        key = jax.random.PRNGKey(seed)
    if jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    key = np.asarray(key, np.uint32)
    if key.shape != (2,):
        raise ValueError(f"key must be a raw uint32[2] PRNG key, got shape {key.shape}")
    return key


def _check_priority(priority) -> int:
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise ValueError(f"priority must be an int (smaller runs first), got {priority!r}")
    return int(priority)


def _shard(stores, params, mesh, axis: str):
    """Stores split over their KV heads along mesh axis `axis`, parameters replicated."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
    placed = tuple(jax.device_put(store, store.shardings(mesh, axis)) for store in stores)
    return placed, jax.device_put(params, NamedSharding(mesh, P()))


def layer_groups(configs) -> tuple[int, ...]:
    """Lengths of the runs of equal consecutive per-layer cache configurations."""
    groups, previous = [], object()
    for config in configs:
        if config == previous:
            groups[-1] += 1
        else:
            groups.append(1)
        previous = config
    return tuple(groups)


class Engine:
    """Generation with per-layer paged KV caches under a storage policy.

    model: a `kvq_jax.models.Model`; policy: a name of `kvq_jax.core.policies.POLICIES` (or a
    Policy); num_pages, page_size, max_seqs, max_pages_per_seq: the pool (shared by every
    layer and loop: one physical page of a sequence holds its page_size tokens in every
    layer's cache); loops: the loop count (None: the checkpoint's; on Llama, loops > 1 is
    the 4-loop *emulation* of `kvq report --model ... --loops N`: the final-normed hidden
    state is fed back through the layer stack, one cache plane per loop);
    prefill_chunk: prompt tokens per prefill call; backend: the cache ops' backend; mesh (a
    `jax.sharding.Mesh`, or None) and mesh_axis: split every cache over its KV heads along
    that mesh axis (`cache_state.head_shardings`; the parameters are replicated), the same
    tokens as unsharded; skip_exited: decode stops looping once every active row has exited
    (Ouro, early_exit_threshold < 1; None: where the pages allow, not with heavy rows in
    every loop's planes; True there is a ValueError); loop_kv: "all", "last" or "mean"
    (`runner.LOOP_KV`: one shared K/V plane per layer at decode time, the prompts' per-loop
    planes in a scratch pool of prefill_batch sequences while they prefill); prefill_batch:
    requests `step` admits and prefills together (at most max_seqs).

    See the module doc for what attention reads, the policies and the batching rules.
    Every error (ValueError) is raised before anything changes, so the engine stays usable.
    """

    def __init__(
        self,
        model,
        policy: str | Policy,
        *,
        num_pages: int,
        page_size: int,
        max_seqs: int,
        max_pages_per_seq: int,
        loops: int | None = None,
        prefill_chunk: int = 256,
        backend: str = "auto",
        mesh=None,
        mesh_axis: str = "heads",
        skip_exited: bool | None = None,
        loop_kv: str = "all",
        prefill_batch: int = 4,
    ):
        config: ModelConfig = model.config
        if loops is not None:
            if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
                raise ValueError(f"loops must be an int >= 1, got {loops!r}")
            config = dataclasses.replace(config, num_loops=loops)
        #: loops imposed on a model that was not trained to loop (Llama with loops > 1).
        self.emulated = config.arch != "ouro" and config.num_loops > 1
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
        if (
            isinstance(prefill_batch, bool)
            or not isinstance(prefill_batch, int)
            or (prefill_batch < 1)
        ):
            raise ValueError(f"prefill_batch must be an int >= 1, got {prefill_batch!r}")
        #: requests admitted (and prefilled together) per `step`, at most
        self.prefill_batch = min(prefill_batch, max_seqs)
        self.policy = resolve_policy(policy)
        self.model, self.config, self.params = model, config, model.params
        self.dtype = jnp.dtype(model.params["embed_tokens"].dtype)
        self.backend, self.prefill_chunk = backend, prefill_chunk
        self.page_size, self.max_seqs = page_size, max_seqs
        self.allocator = PageAllocator(num_pages, page_size, max_seqs, max_pages_per_seq)
        dims = dict(num_heads=config.num_kv_heads, head_dim=config.head_dim)
        if loop_kv not in LOOP_KV:
            raise ValueError(f"loop_kv must be one of {LOOP_KV}, got {loop_kv!r}")
        #: what later tokens attend across loops (`kvq_jax.engine.runner`)
        self.loop_kv = loop_kv
        shared = loop_kv != "all" and config.num_loops > 1
        #: loop planes the stores keep per token (1 with a shared loop_kv)
        self.stored_loops = 1 if shared else config.num_loops
        #: decode skips the loops after every active row has exited (Ouro, threshold < 1), and
        #: why it runs every loop where exits could skip some (None: not so, or asked)
        self.skip_exited, self.every_loop_reason = loop_skipping(
            config, self.policy, loop_kv, skip_exited
        )
        # Shared loop_kv: a prompt being prefilled keeps every loop in a scratch pool of
        # prefill_batch sequences (its own allocator), freed when its prefill ends.
        nb = self.prefill_batch
        scratch_pages = nb * max_pages_per_seq
        self.prefill_allocator = (
            PageAllocator(scratch_pages, page_size, nb, max_pages_per_seq) if shared else None
        )
        if self.policy.quantized:
            policies = layer_policies(self.policy, model, config.num_loops)

            def configs(loops, pages, seqs, adaptive):
                return tuple(
                    dataclasses.replace(
                        cache_config_for(
                            p,
                            num_pages=pages,
                            page_size=page_size,
                            dtype=self.dtype,
                            num_loops=loops,
                            max_seqs=seqs,
                            **dims,
                        ),
                        adaptive_exit=adaptive,
                    )
                    for p in policies
                )

            #: each layer's cache configuration (they differ only in per-layer key tables)
            self.cache_configs = configs(self.stored_loops, num_pages, max_seqs,
                                         self.skip_exited and not shared)  # fmt: skip
            self.cache_config = self.cache_configs[0]
            groups = layer_groups(self.cache_configs)
            firsts = np.cumsum((0, *groups[:-1]))

            def stores(cfgs):
                return tuple(QuantizedStore.empty(cfgs[f], g)
                             for f, g in zip(firsts, groups, strict=True))  # fmt: skip

            self.stores = stores(self.cache_configs)
            #: each layer's configuration of the prompts' scratch pool (every loop; shared
            #: loop_kv only, else None)
            self.scratch_configs = (
                configs(config.num_loops, scratch_pages, nb, False) if shared else None
            )
            self.scratch = None if self.scratch_configs is None else stores(self.scratch_configs)
        else:
            self.cache_config = None
            self.cache_configs = self.scratch_configs = None
            groups = (config.num_layers,)
            shape = (self.stored_loops, num_pages, page_size, *dims.values())
            self.stores = (RawStore.empty(*shape, self.dtype, config.num_layers),)
            shape = (config.num_loops, scratch_pages, page_size, *dims.values())
            self.scratch = (
                (RawStore.empty(*shape, self.dtype, config.num_layers),) if shared else None
            )
        #: the static description of the jitted steps (`kvq_jax.engine.runner.StepSpec`)
        self.spec = StepSpec(
            config=config, groups=groups, num_pages=num_pages, max_seqs=max_seqs,
            backend=backend, skip_exited=self.skip_exited,
            loop_kv=loop_kv if shared else "all",
            scratch_pages=scratch_pages if shared else 0,
            scratch_seqs=nb if shared else 0,
        )  # fmt: skip
        if mesh is not None:
            self.stores, self.params = _shard(self.stores, self.params, mesh, mesh_axis)
            if self.scratch is not None:
                self.scratch, _ = _shard(self.scratch, self.params, mesh, mesh_axis)
        eos = config.eos_token_id
        self.default_stop_ids = frozenset(
            () if eos is None else (eos if isinstance(eos, tuple) else (eos,))
        )
        #: admission, priorities, preemption (`kvq_jax.engine.scheduler`)
        self.scheduler = Scheduler(self.allocator, self.prefill_batch)
        self._host_kv: dict = {}  # swapped-out request -> (K/V rows per store, pages held)
        self.stats = {"prefill_tokens": 0, "prefill_s": 0.0, "decode_tokens": 0, "decode_s": 0.0,
                      "decode_steps": 0, "decode_loops": 0, "prefill_calls": 0,
                      "preemptions": 0, "swap_bytes": 0, "forks": 0}  # fmt: skip

    @property
    def running(self) -> dict[int, Request]:
        """slot -> the request running there."""
        return self.scheduler.running

    @property
    def waiting(self) -> list[Request]:
        """Requests queued, not started."""
        return self.scheduler.waiting

    @property
    def swapped(self) -> list[Request]:
        """Requests preempted, their K/V in host memory until they resume."""
        return self.scheduler.swapped

    # -- sizes ----------------------------------------------------------------------------------

    @property
    def max_tokens_per_seq(self) -> int:
        return self.allocator.max_pages_per_seq * self.page_size

    def kv_bytes_per_token(self) -> float:
        """Bytes of stored K/V per token over every layer and stored loop plane (the pages:
        packed base and residual planes, or the raw store; one plane per layer with a shared
        loop_kv), excluding the per-sequence raw rows and the prefill scratch pool."""
        pool_tokens = self.allocator.num_pages * self.page_size
        return sum(store.page_bytes for store in self.stores) / pool_tokens

    def calibration_bytes(self) -> int:
        """Bytes of per-model calibration data the cache formats carry, counted once per model
        (not per token): an INTB bit table is one byte per (layer, head, channel) width
        (FORMAT.md 2b), a heavy-row mean-query table two per (layer, head, query, channel)
        (5a); 0 for formats without tables."""
        if self.cache_configs is None:
            return 0
        names = {f for c in set(self.cache_configs) for kind in ("key", "value")
                 for f in c.loop_formats(kind)}  # fmt: skip
        total = 0
        for name in names:
            fmt = layout(name)
            if hasattr(fmt, "heavy_group"):  # heavy rows: mean-query tables (bfloat16)
                total += 0 if fmt.tables is None else fmt.tables.nbytes
                fmt = fmt.base
            tables = fmt.tables if fmt.per_layer else (getattr(fmt, "bits", None),)
            total += sum(len(t) * len(t[0]) for t in tables if t is not None)
        return total

    def scratch_bytes(self) -> int:
        """Bytes of the prefill scratch pool's pages (shared loop_kv: every loop of one prompt
        of up to max_pages_per_seq pages; 0 for loop_kv "all")."""
        return 0 if self.scratch is None else sum(store.page_bytes for store in self.scratch)

    def layer_cache(self, layer: int):
        """A copy of decoder layer `layer`'s store: a `PagedKVCache` of the allocator's pages
        and slots (quantized policies) or a `RawStore` (k, v [loops, pages, page_size, H, D])."""
        if not 0 <= layer < self.config.num_layers:
            raise ValueError(f"layer must be in [0, {self.config.num_layers}), got {layer!r}")
        first = 0
        for count, store in zip(self.spec.groups, self.stores, strict=True):
            if layer < first + count:
                return store.layer(layer - first, self.allocator.num_pages, self.max_seqs,
                                   index=layer)  # fmt: skip
            first += count
        raise AssertionError("unreachable")

    def bf16_bytes_per_token(self) -> int:
        """Bytes per token of the same K/V in bfloat16 (2 bytes x K, V x loops x layers x H x D)."""
        c = self.config
        return 2 * 2 * c.num_loops * c.num_layers * c.num_kv_heads * c.head_dim

    def raw_rows_per_sequence(self) -> int:
        """Raw (compute-dtype) rows a slot keeps per layer and loop besides the pages: the
        staging page plus the sink rows (0 for the unquantized store)."""
        if self.cache_config is None:
            return 0
        return self.cache_config.page_size + self.cache_config.sink

    # -- requests -------------------------------------------------------------------------------

    def make_request(
        self,
        prompt,
        *,
        max_new_tokens: int = 16,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
        key=None,
        stop_ids=None,
        keep_logits: bool = False,
        forced_tokens=None,
        priority: int = 0,
    ) -> Request:
        """A validated `Request` (ValueError: empty prompt, token ids outside the vocabulary,
        prompt + max_new_tokens longer than a sequence or the whole pool, a priority that
        is not an int; smaller priorities run first).

        forced_tokens: teacher forcing: max_new_tokens ids that are fed (and recorded) in turn
        instead of sampled ones, each after the logits that predict it are computed (with
        keep_logits: logits[i] is the model's distribution for forced_tokens[i]); a forced
        request stops at its length only."""
        prompt = [int(t) for t in np.asarray(prompt).reshape(-1)]
        if not prompt:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside [0, {self.config.vocab_size})")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        need = len(prompt) + max_new_tokens
        if need > self.max_tokens_per_seq:
            raise ValueError(
                f"prompt too long: {len(prompt)} prompt + {max_new_tokens} new tokens exceed a "
                f"sequence's {self.max_tokens_per_seq} tokens (max_pages_per_seq = "
                f"{self.allocator.max_pages_per_seq} x page_size = {self.page_size})"
            )
        pool = self.allocator.num_pages * self.page_size
        if need > pool:
            raise ValueError(
                f"prompt too long: {len(prompt)} prompt + {max_new_tokens} new tokens exceed the "
                f"whole pool of {pool} tokens ({self.allocator.num_pages} pages)"
            )
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        _check_priority(priority)
        stops = self.default_stop_ids if stop_ids is None else frozenset(int(s) for s in stop_ids)
        forced = None
        if forced_tokens is not None:
            forced = tuple(int(t) for t in np.asarray(forced_tokens).reshape(-1))
            if len(forced) != max_new_tokens:
                raise ValueError(
                    f"forced_tokens: {len(forced)} ids for max_new_tokens={max_new_tokens}"
                )
            bad = [t for t in forced if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(
                    f"forced_tokens: ids {bad[:5]} outside [0, {self.config.vocab_size})"
                )
            stops = frozenset()
        return Request(
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            top_k=int(top_k),
            key=_key_data(key, seed),
            stop_ids=stops,
            keep_logits=keep_logits,
            forced=forced,
            priority=int(priority),
        )

    def add_request(self, prompt, **kwargs) -> Request:
        """Admit a request now: a slot, pages for prompt + max_new_tokens, the prefill (its
        first token is sampled). Raises ValueError ("no free sequence slot", "out of pages",
        or `make_request`'s) with nothing changed."""
        request = prompt if isinstance(prompt, Request) else self.make_request(prompt, **kwargs)
        self._admit(request)
        self.scheduler.stamp(request)
        return request

    def add_prefilled(self, prompt, fill, **kwargs) -> Request:
        """Admit a request whose prompt another producer prefills (disaggregated prefill: a
        Torch model writing through `kvq_torch_bridge.bridge.handoff`): a slot and pages for
        prompt + max_new_tokens are taken, its slots cleared, then `fill(slot, pages)` (pages:
        int32, the prompt's and the first decode row's) must write every layer's K/V of the
        prompt into the stores' buffers, byte for byte as `prefill` would store them, and
        return the logits float32 [V] of the last prompt token; the engine records the
        lengths and samples the first token. Single-loop models only (ValueError). On any
        error the slot and pages are released, nothing changed."""
        if self.config.num_loops != 1:
            raise ValueError("add_prefilled: single-loop models only (a looped model's loop "
                             "planes are not produced elsewhere)")  # fmt: skip
        request = prompt if isinstance(prompt, Request) else self.make_request(prompt, **kwargs)
        if request.slot is not None or request.done:
            raise ValueError("request was already admitted")
        n = len(request.prompt)
        slot = self.allocator.add_sequence(n + 1)
        try:
            groups = self._group_ids(slot, [])
            self.stores = tuple(
                store.clear_slots(slots.tolist())
                for store, (slots, _) in zip(self.stores, groups, strict=True)
            )
            jax.block_until_ready(self.stores)  # the producer writes into these buffers
            logits = np.asarray(fill(slot, self.allocator.pages(slot)), np.float32)
            if logits.shape != (self.config.vocab_size,):
                raise ValueError(f"add_prefilled: fill returned logits of shape {logits.shape}, "
                                 f"expected ({self.config.vocab_size},)")  # fmt: skip
            self.stores = tuple(
                store.set_lengths(slots.tolist(), n)
                for store, (slots, _) in zip(self.stores, groups, strict=True)
            )
        except Exception:
            self.allocator.free(slot)
            raise
        request.slot = slot
        request.position = n
        self.running[slot] = request
        self.stats["prefill_tokens"] += n
        self._accept(request, logits, 0)
        self.scheduler.stamp(request)
        return request

    def submit(self, prompt, **kwargs) -> Request:
        """Queue a request (validated now); `step` / `run` admit it when a slot and pages are
        free."""
        request = self.make_request(prompt, **kwargs)
        self.scheduler.add(request)
        return request

    def run(self, requests=None) -> list[Request]:
        """Step until every queued and running request is done; returns `requests` (default:
        the ones finished by this call, in finishing order)."""
        finished = []
        while self.scheduler.busy:
            finished += self.step()
        return finished if requests is None else list(requests)

    def generate(self, prompts, **kwargs) -> list[Request]:
        """Queue every prompt (same options) and run them to the end (continuous batching)."""
        requests = [self.submit(p, **kwargs) for p in prompts]
        return self.run(requests)

    def step(self) -> list[Request]:
        """One scheduler step (`Scheduler.schedule`): preempt (swap out) what the pool cannot
        grow, resume swapped-out requests and admit queued ones (up to `prefill_batch`,
        prefilled together), then one decode step for every running sequence (which grows
        them). Returns the requests that finished in this step."""
        plan = self.scheduler.schedule()
        for r in plan.preempt:
            self._swap_out(r)
        for r in plan.resume:
            self._swap_in(r)
        finished = []
        if plan.admit:
            self._admit(plan.admit)
            finished = [r for r in plan.admit if r.done]
        if not self.running:
            if self.scheduler.busy:  # validated against the pool: it fits once others leave
                raise RuntimeError("queued request cannot be admitted into an idle engine")
            return finished
        return finished + self.decode_step()

    # -- preemption and forks ----------------------------------------------------------------

    def _group_ids(self, slot: int, pages):
        """Per store: (folded slots, folded pages) of one sequence."""
        return [
            sequence_ids(
                slot,
                pages,
                layers=count,
                num_pages=self.allocator.num_pages,
                max_seqs=self.max_seqs,
            )
            for count in self.spec.groups
        ]

    def _swap_out(self, request: Request) -> None:
        """Copy a request's K/V (its pages and slot rows, every store) to host memory and give
        its slot and pages back (`Scheduler.schedule` took it off the running set)."""
        pages = self.allocator.pages(request.slot)
        rows = [store.take(slots, ids) for store, (slots, ids) in
                zip(self.stores, self._group_ids(request.slot, pages), strict=True)]  # fmt: skip
        self._host_kv[request] = (rows, len(pages))
        self.allocator.free(request.slot)
        request.slot = None
        request.preemptions += 1
        self.stats["preemptions"] += 1
        self.stats["swap_bytes"] += sum(a.nbytes for r in rows for a in r.values())

    def _swap_in(self, request: Request) -> None:
        """A slot and pages for a swapped-out request (its position + 1 tokens) and its K/V
        written back into them, byte for byte."""
        rows, n = self._host_kv.pop(request)
        slot = self.allocator.add_sequence(request.position + 1)
        pages = self.allocator.pages(slot)[:n]
        self.stores = tuple(
            store.put(r, slots, ids)
            for store, r, (slots, ids) in zip(
                self.stores, rows, self._group_ids(slot, pages), strict=True
            )
        )
        request.slot = slot
        self.running[slot] = request

    def fork(self, request: Request, *, max_new_tokens: int | None = None, seed: int = 0,
             key=None, temperature: float | None = None, top_k: int | None = None,
             priority: int | None = None) -> Request:  # fmt: skip
        """A new running request that continues `request` (running) from its tokens so far:
        the same prompt and generated tokens, sharing its complete pages (reference-counted,
        never written again; the partial page is copied). Options not given are the
        parent's; the child samples with its own key (seed / key) from here on, so a greedy
        fork generates what the parent does. ValueError (no slot, out of pages, the request
        not running, bad options), nothing changed."""
        if request.slot is None or self.running.get(request.slot) is not request:
            raise ValueError("fork: the request is not running (queued, swapped out or done)")
        temperature = request.temperature if temperature is None else float(temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        max_new_tokens = request.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not isinstance(max_new_tokens, int) or max_new_tokens <= len(request.tokens):
            raise ValueError(f"max_new_tokens must be an int > the {len(request.tokens)} tokens "
                             f"generated so far, got {max_new_tokens!r}")  # fmt: skip
        if len(request.prompt) + max_new_tokens > self.max_tokens_per_seq:
            raise ValueError(f"max_new_tokens={max_new_tokens}: the sequence would exceed "
                             f"{self.max_tokens_per_seq} tokens")  # fmt: skip
        priority = request.priority if priority is None else _check_priority(priority)
        child = dataclasses.replace(
            request,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=request.top_k if top_k is None else int(top_k),
            key=_key_data(key, seed),
            tokens=list(request.tokens),
            exit_loops=list(request.exit_loops),
            logits=list(request.logits),
            priority=priority,
            preemptions=0,
            slot=None,
        )
        n = request.position
        parent_pages = self.allocator.pages(request.slot)
        slot = self.allocator.fork(request.slot, n)  # raises with nothing changed
        try:
            self.allocator.reserve(slot, n + 1)
        except ValueError:
            self.allocator.free(slot)
            raise
        child_pages = self.allocator.pages(slot)
        self.stores = tuple(
            store.fork(
                request.slot,
                slot,
                n,
                parent_pages,
                child_pages,
                layers=count,
                num_pages=self.allocator.num_pages,
                max_seqs=self.max_seqs,
            )
            for count, store in zip(self.spec.groups, self.stores, strict=True)
        )
        child.slot = slot
        self.scheduler.stamp(child)
        self.running[slot] = child
        self.stats["forks"] += 1
        return child

    # -- prefill and decode ------------------------------------------------------------------

    def _admit(self, requests) -> None:
        """Slots and pages for `requests` (a Request or a list), then their prefill together;
        on any error every one is released and the error raised (nothing changed)."""
        requests = [requests] if isinstance(requests, Request) else list(requests)
        for r in requests:
            if r.slot is not None or r.done:
                raise ValueError("request was already admitted")
        taken = []
        try:
            for r in requests:  # the prompt and the row the first decode writes
                r.slot = self.allocator.add_sequence(len(r.prompt) + 1)
                taken.append(r)
            slots = [r.slot for r in requests]
            self.stores = tuple(
                store.clear_slots([j * self.max_seqs + s for j in range(count) for s in slots])
                for count, store in zip(self.spec.groups, self.stores, strict=True)
            )
            results = self.prefill(requests)
        except Exception:
            for r in taken:
                self.allocator.free(r.slot)
                r.slot = None
            raise
        for r, (logits, exit_loop) in zip(requests, results, strict=True):
            self.running[r.slot] = r
            self._accept(r, logits, exit_loop)

    def prefill(self, requests):
        """Run the prompts of admitted requests (a Request or a list of at most
        `prefill_batch`) through the model, filling the caches; returns [(logits [V] of the
        last prompt token, its exit loop)] per request (a single pair for a single Request).

        Rounds of one chunk size S each: S = min(prefill_chunk, the largest power of two <=
        the longest remaining prompt); every request with >= S tokens left takes part, the
        rows of one round in calls of power-of-two batch sizes (few compiled shapes). Alone,
        a prompt is cut as `prefill_chunks` says."""
        import time

        single = isinstance(requests, Request)
        requests = [requests] if single else list(requests)
        if len(requests) > self.prefill_batch:
            raise ValueError(f"{len(requests)} requests exceed prefill_batch={self.prefill_batch}")
        prompts = [np.asarray(r.prompt, np.int32) for r in requests]
        tables = jnp.asarray(self.allocator.block_tables())
        t0 = time.perf_counter()
        scratch_slots, scratch_tables = [], None
        done = [0] * len(requests)
        results = [None] * len(requests)
        try:
            if self.prefill_allocator is not None:  # the prompts' per-loop planes
                scratch_slots = [self.prefill_allocator.add_sequence(len(p)) for p in prompts]
                nb = self.prefill_allocator.max_seqs
                self.scratch = tuple(
                    store.clear_slots([j * nb + s for j in range(count) for s in scratch_slots])
                    for count, store in zip(self.spec.groups, self.scratch, strict=True)
                )
                scratch_tables = jnp.asarray(self.prefill_allocator.block_tables())
            while True:
                left = [len(p) - d for p, d in zip(prompts, done, strict=True)]
                if max(left) == 0:
                    break
                size = self._chunk_size(max(left))
                rows = [i for i, n in enumerate(left) if n >= size]
                while rows:
                    part = rows[: 1 << (len(rows).bit_length() - 1)]  # a power of two
                    rows = rows[len(part) :]
                    tokens = np.stack([prompts[i][done[i] : done[i] + size] for i in part])
                    ids = [requests[i].slot for i in part]
                    scratch_ids = (
                        None
                        if scratch_tables is None
                        else jnp.asarray([scratch_slots[i] for i in part], jnp.int32)
                    )
                    logits, exit_loop, self.stores, self.scratch = prefill_step(
                        self.params, self.stores, self.scratch, jnp.asarray(tokens),
                        jnp.asarray([done[i] for i in part], jnp.int32), tables,
                        jnp.asarray(ids, jnp.int32), scratch_tables, scratch_ids,
                        spec=self.spec,
                    )  # fmt: skip
                    self.stats["prefill_calls"] += 1
                    for j, i in enumerate(part):
                        done[i] += size
                        if done[i] == len(prompts[i]):
                            results[i] = (logits[j], exit_loop[j])
        finally:
            for s in scratch_slots:
                self.prefill_allocator.free(s)
        logits.block_until_ready()  # the last call's: every call before it is done
        self.stats["prefill_s"] += time.perf_counter() - t0
        self.stats["prefill_tokens"] += sum(len(p) for p in prompts)
        for r, p in zip(requests, prompts, strict=True):
            r.position = len(p)
        return results[0] if single else results

    def _chunk_size(self, remaining: int) -> int:
        """prefill_chunk tokens while that many remain, else the largest power of two."""
        chunk = self.prefill_chunk
        return chunk if remaining >= chunk else 1 << (remaining.bit_length() - 1)

    def prefill_chunks(self, prompt_len: int) -> list[int]:
        """The chunk sizes a prompt of `prompt_len` tokens is prefilled in: prefill_chunk
        tokens while that many remain, then powers of two (few compiled shapes)."""
        sizes, rest = [], prompt_len
        while rest > 0:
            sizes.append(self._chunk_size(rest))
            rest -= sizes[-1]
        return sizes

    def compile_steps(self, prompt_len: int) -> dict:
        """Compile (ahead of time, nothing runs, no state changes) the prefill programs a
        prompt of `prompt_len` tokens needs and the decode program; returns the seconds
        {"prefill": sum over the distinct chunk shapes, "decode": ..., "prefill_shapes":
        [T, ...]}. Later calls of these shapes reuse the compiled programs."""
        import time

        i32 = jax.ShapeDtypeStruct
        tables = jnp.asarray(self.allocator.block_tables())
        scratch_tables = (
            None
            if self.prefill_allocator is None
            else jnp.asarray(self.prefill_allocator.block_tables())
        )
        shapes = sorted(set(self.prefill_chunks(prompt_len)))
        t0 = time.perf_counter()
        # the arguments `prefill` passes, positionally (a missing trailing argument would be
        # another jit signature: the run would compile again)
        scratch_ids = None if scratch_tables is None else i32((1,), jnp.int32)
        for t in shapes:
            prefill_step.lower(
                self.params, self.stores, self.scratch, i32((1, t), jnp.int32),
                i32((1,), jnp.int32), tables, i32((1,), jnp.int32), scratch_tables, scratch_ids,
                spec=self.spec,
            ).compile()  # fmt: skip
        t1 = time.perf_counter()
        s = self.max_seqs
        decode_step.lower(
            self.params, self.stores, i32((s,), jnp.int32), i32((s,), jnp.int32), tables,
            i32((s,), jnp.bool_), spec=self.spec,
        ).compile()  # fmt: skip
        t2 = time.perf_counter()
        return {"prefill": t1 - t0, "decode": t2 - t1, "prefill_shapes": shapes}

    def decode_step(self) -> list[Request]:
        """One token for every running sequence (all slots computed, see the module doc)."""
        import time

        if not self.running:
            return []
        self._grow()
        s = self.max_seqs
        tokens = np.zeros(s, np.int32)
        positions = np.zeros(s, np.int32)
        active = np.zeros(s, bool)
        for slot, r in self.running.items():
            tokens[slot], positions[slot], active[slot] = r.tokens[-1], r.position, True
        t0 = time.perf_counter()
        logits, exit_loops, loops_run, self.stores = decode_step(
            self.params, self.stores, jnp.asarray(tokens), jnp.asarray(positions),
            jnp.asarray(self.allocator.block_tables()), jnp.asarray(active), spec=self.spec,
        )  # fmt: skip
        finished = []
        slots = sorted(self.running)
        idx = np.asarray(slots)
        for slot in slots:
            self.running[slot].position += 1  # the fed token is in the cache now
        next_tokens = self._sample_rows([self.running[i] for i in slots], logits[idx])
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["decode_tokens"] += len(slots)
        self.stats["decode_steps"] += 1
        self.stats["decode_loops"] += int(loops_run)
        exit_loops = np.asarray(exit_loops)
        logits_host = (
            np.asarray(logits) if any(self.running[i].keep_logits for i in slots) else None
        )
        for j, slot in enumerate(slots):
            r = self.running[slot]
            self._record(r, next_tokens[j], exit_loops[slot],
                         None if logits_host is None else logits_host[slot])  # fmt: skip
            if r.done:
                finished.append(r)
        return finished

    def _grow(self) -> None:
        """Pages for the row each running sequence writes next (its position); ValueError
        "out of pages", nothing changed, when the pool cannot hold them all (`step`
        preempts first, so only direct `decode_step` callers see it)."""
        ps = self.page_size
        need = {s: -(-(r.position + 1) // ps) - len(self.allocator.pages(s))
                for s, r in self.running.items()}  # fmt: skip
        total = sum(max(0, n) for n in need.values())
        if total > self.allocator.num_free_pages:
            raise ValueError(
                f"out of pages: the running sequences need {total} more page(s), "
                f"{self.allocator.num_free_pages} free (step() preempts; decode_step does not)"
            )
        for s, r in self.running.items():
            if need[s] > 0:
                self.allocator.reserve(s, r.position + 1)

    def _sample_rows(self, requests, logits) -> np.ndarray:
        keys = np.stack([r.key for r in requests])
        positions = np.asarray([r.position for r in requests], np.int32)
        temps = np.asarray([r.temperature for r in requests], np.float32)
        top_k = np.asarray([r.top_k for r in requests], np.int32)
        return np.asarray(sample(logits, keys, positions, temps, top_k))

    def _accept(self, request: Request, logits, exit_loop) -> None:
        token = self._sample_rows([request], logits[None])[0]
        self._record(request, token, int(exit_loop), np.asarray(logits))

    def _record(self, request: Request, token, exit_loop, logits) -> None:
        token = int(token) if request.forced is None else request.forced[len(request.tokens)]
        request.tokens.append(token)
        request.exit_loops.append(int(exit_loop))
        if request.keep_logits:
            request.logits.append(np.asarray(logits, np.float32))
        if token in request.stop_ids:
            request.finish_reason = "stop"
        elif len(request.tokens) >= request.max_new_tokens:
            request.finish_reason = "length"
        if request.done:
            self._release(request)

    def _release(self, request: Request) -> None:
        slot = request.slot
        if slot is not None and self.running.get(slot) is request:
            del self.running[slot]
        if slot is not None:
            self.allocator.free(slot)
