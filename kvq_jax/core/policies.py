"""KV storage policies compared by `kvq report`: one named row per (format, window) choice.

A policy says how a loop stack [L, T, H, D] of keys or values is stored: loop 0 whole in
`base_format`, each later loop as a residual in `residual_format` against the reconstructed
previous loop (`kvq_jax.encode_loops`), keys grouped over tokens and values over channels
(the defaults), with an optional BF16 window of raw rows (`kvq_jax.Window`). A single-loop
capture uses the base format only. "bf16" is the unquantized reference row.

Values may have their own formats (`v_base_format`, `v_residual_format`) and a residual
format may differ per loop (a tuple), which expresses FlashLoop's codec profiles
(`flashloop_torch.kv_quantization.CODEC_PROFILES`): "legacy" stores keys in 2 bits in every
loop and values in 4/4/2/2 bits over four loops, "kivi" everything in 2 bits, all in groups
of 64 (keys per channel over tokens, values per token over channels).

A later loop may be stored absolute (`absolute`, `v_absolute`): packed on its own instead of
as a delta against the reconstructed previous loop (`encode_loops(absolute=...)`). On loops
that do not converge (the embedded capture's emulated loops: V's loop-to-loop delta is about
as large as V) a delta costs as many bits as the loop and carries the previous loop's error
too; "loops-abs-v2442" spends FlashLoop legacy's 3.000 bits (two INT4 slots, six INT2) with
keys absolute in every loop and values at 2/4/4/2 bits, loops 1 and 2 absolute.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvq_jax.core.cache_config import PagedCacheConfig
from kvq_jax.core.window import Window

#: The BF16 window of the "+win" rows: 4 attention-sink rows and the 16 most recent rows.
DEFAULT_WINDOW = Window(sink=4, recent=16)


@dataclasses.dataclass(frozen=True)
class Policy:
    """One storage policy (hashable, static).

    name: the row label, e.g. "int4-g64+win".
    base_format / residual_format: registry names ("int4", "nvfp4", "fp8_e4m3", "int2"), or
      "bf16" for both in the unquantized reference; the key formats, and the value formats
      too unless overridden. residual_format may be a tuple: loop 1, 2, ... in turn, its
      last entry repeating for further loops (a profile written for 4 loops runs on fewer).
    group_size: group size of every loop in the base's format (None: the format's default);
      a residual loop in another format takes that format's default (as `encode_loops`).
    window: raw BF16 rows kept unquantized, or None.
    v_base_format / v_residual_format: the values' formats (None: the key formats).
    absolute: the later loops (0-based, >= 1) of keys stored absolute, packed on their own
      instead of as deltas; loops past a stack's end are ignored (a 4-loop profile runs on
      fewer loops). v_absolute: the values' (None: the same as the keys').
    key_tables: the name of a per-model set of INTB key bit tables (FORMAT.md 2b,
      `kvq_jax.core.calibration.KeyTables`), or None. The keys of model layer l are then
      stored in every loop in the INTB format of layer l's table (base_format and
      residual_format are the label "intb"); `for_key_format` gives a layer's own policy.
    heavy: heavy rows (FORMAT.md 5a): the token group size G (one INT8 row per G tokens and
      KV head, chosen from that loop's keys, the same rows for the values), or None. Needs
      key_tables whose set holds mean-query tables; every loop is then stored whole (each
      with its own rows: absolute), in its base formats (K payload groups of G - 1 tokens).
    heavy_table: one layer's bfloat16 mean-query table as nested tuples [H][R][D] (set by
      `for_key_format` on a key_tables policy's per-layer policies; static).
    pre_rope: store the keys before RoPE (KVQuant): RoPE is inverted before packing and
      re-applied after decoding, with the base its key tables were calibrated for (their
      `rope_theta`); heavy rows are still chosen from the RoPE'd keys. Heavy policies only.
    rope_theta: that base, set by `for_key_format` on a pre_rope policy's per-layer policies.
    """

    name: str
    base_format: str
    residual_format: str | tuple[str, ...]
    group_size: int | None = None
    window: Window | None = None
    v_base_format: str | None = None
    v_residual_format: str | tuple[str, ...] | None = None
    absolute: tuple[int, ...] = ()
    v_absolute: tuple[int, ...] | None = None
    key_tables: str | None = None
    heavy: int | None = None
    heavy_table: tuple | None = None
    pre_rope: bool = False
    rope_theta: float | None = None

    def __post_init__(self):
        if not isinstance(self.pre_rope, bool):
            raise TypeError(f"Policy.pre_rope must be a bool, got {self.pre_rope!r}")
        if self.pre_rope and self.heavy is None:
            raise ValueError(
                "Policy.pre_rope: keys before RoPE are implemented for heavy-row policies "
                "(every loop stored whole); set heavy"
            )
        if self.heavy is not None:
            if isinstance(self.heavy, bool) or not isinstance(self.heavy, int):
                raise TypeError(
                    f"Policy.heavy must be a group size (int) or None, got {self.heavy!r}"
                )
            if not 2 <= self.heavy <= 256:
                raise ValueError(
                    f"Policy.heavy: the group size must be in 2..256, got {self.heavy}"
                )
            if self.key_tables is None and self.heavy_table is None:
                raise ValueError(
                    "Policy.heavy: heavy rows need key_tables (a table set with mean-query tables)"
                )
        if self.key_tables is not None:
            if not isinstance(self.key_tables, str) or not self.key_tables:
                raise TypeError(
                    f"Policy.key_tables must be a table-set name or None, got {self.key_tables!r}"
                )
            if self.v_base_format is None:
                raise ValueError(
                    "Policy.v_base_format: a policy with key_tables names its value formats"
                )
        for field in ("absolute", "v_absolute"):
            loops = getattr(self, field)
            if loops is None and field == "v_absolute":
                continue
            if isinstance(loops, str) or not isinstance(loops, tuple | list):
                raise TypeError(f"Policy.{field} must be a tuple of loop indices, got {loops!r}")
            for loop in loops:
                if isinstance(loop, bool) or not isinstance(loop, int) or loop < 1:
                    raise ValueError(
                        f"Policy.{field}: loops stored absolute are ints >= 1 (loop 0 is the "
                        f"base, always stored whole), got {loops!r}"
                    )
            if len(set(loops)) != len(loops):
                raise ValueError(f"Policy.{field}: a loop is listed twice in {loops!r}")
            object.__setattr__(self, field, tuple(sorted(loops)))

    def _check_rope_theta(self, rope_theta) -> None:
        """A RoPE base (its tables') is given exactly for a pre_rope policy."""
        if self.pre_rope != (rope_theta is not None):
            raise ValueError(
                f"rope_theta: policy {self.name!r} "
                + (
                    "stores keys before RoPE: its tables must give"
                    if self.pre_rope
                    else "stores RoPE'd keys: its tables must not be calibrated for"
                )
                + " a RoPE base"
            )

    def for_key_format(self, key_format: str, heavy_table=None, rope_theta=None) -> Policy:
        """This policy with its keys in `key_format` in every loop (a key_tables policy's
        policy for one layer, whose INTB format is registered under `key_format`), for a
        heavy policy that layer's mean-query table (an array [H, R, D] of bfloat16 values),
        and for a pre_rope policy the RoPE base of its tables."""
        self._check_rope_theta(rope_theta)
        table = None
        if self.heavy is not None:
            if heavy_table is None:
                raise ValueError(f"heavy_table: policy {self.name!r} stores heavy rows")
            table = tuple(
                tuple(tuple(float(x) for x in row) for row in head)
                for head in np.asarray(heavy_table, np.float32)
            )
        return dataclasses.replace(
            self,
            base_format=key_format,
            residual_format=key_format,
            key_tables=None,
            heavy_table=table,
            rope_theta=None if rope_theta is None else float(rope_theta),
        )

    def with_heavy_formats(self, key_format: str, value_format: str, num_loops: int,
                           rope_theta: float | None = None) -> Policy:  # fmt: skip
        """This heavy policy as the paged cache serves it at `num_loops` loops: keys in the
        heavy-row format `key_format` (it holds the mean-query tables and chooses the rows),
        values in `value_format` (heavy rows over the values' base format, taking the keys'
        rows), every loop stored whole, and for a pre_rope policy the keys stored before RoPE
        with base `rope_theta` (its tables'); the formats carry the heavy rows, so the result
        has no `heavy` / `key_tables` of its own (FORMAT.md 5a, 5b;
        `kvq_jax.core.layouts.HeavyLayout`, `PagedCacheConfig.rope_theta`)."""
        if self.heavy is None:
            raise ValueError(f"policy {self.name!r} stores no heavy rows")
        self._check_rope_theta(rope_theta)
        loops = tuple(range(1, num_loops))
        return dataclasses.replace(
            self, base_format=key_format, residual_format=key_format, group_size=None,
            v_base_format=value_format, v_residual_format=value_format, absolute=loops,
            v_absolute=loops, key_tables=None, heavy=None, heavy_table=None, pre_rope=False,
            rope_theta=None if rope_theta is None else float(rope_theta),
        )  # fmt: skip

    @property
    def quantized(self) -> bool:
        return self.base_format != "bf16"

    def formats(self, kind: str) -> tuple[str, str | tuple[str, ...]]:
        """(base format, residual format or per-loop tuple) of `kind` ("key" or "value")."""
        if kind not in ("key", "value"):
            raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
        if kind == "value" and self.v_base_format is not None:
            residual = self.v_residual_format
            return self.v_base_format, self.v_base_format if residual is None else residual
        return self.base_format, self.residual_format

    @property
    def per_loop(self) -> bool:
        """True when some kind's later loops do not all share one residual format."""
        for kind in ("key", "value"):
            residual = self.formats(kind)[1]
            if not isinstance(residual, str) and len(set(residual)) > 1:
                return True
        return False

    def loop_formats(self, kind: str, num_loops: int) -> tuple[str, ...]:
        """The format of each of `num_loops` loops of `kind`: the base, then the residuals
        (a tuple's last entry repeats past its end)."""
        base, residual = self.formats(kind)
        if isinstance(residual, str):
            return (base,) + (residual,) * (num_loops - 1)
        later = tuple(residual[min(i, len(residual) - 1)] for i in range(num_loops - 1))
        return (base, *later)

    def absolute_loops(self, kind: str, num_loops: int) -> tuple[int, ...]:
        """The loops (0-based, in [1, num_loops)) of `kind` stored absolute."""
        if kind not in ("key", "value"):
            raise ValueError(f"kind must be 'key' or 'value', got {kind!r}")
        if self.heavy is not None:
            return tuple(range(1, num_loops))  # every loop stored whole, with its own rows
        loops = self.absolute
        if kind == "value" and self.v_absolute is not None:
            loops = self.v_absolute
        return tuple(loop for loop in loops if loop < num_loops)

    def stream(self, kind: str, loop: int) -> tuple[str, int | None]:
        """(format, group_size) of loop `loop` (0-based) of `kind`, as `encode_loops` resolves
        them: the policy's group size for a loop in the base's format, else None (the
        format's default)."""
        formats = self.loop_formats(kind, loop + 1)
        fmt = formats[loop]
        return fmt, self.group_size if fmt == formats[0] else None

    def loop_kwargs(self, kind: str, num_loops: int | None = None) -> dict:
        """Keyword arguments of `kvq_jax.encode_loops` (and the Torch mirror) for `kind`;
        `num_loops` (L) is needed when the residual formats differ per loop or some loops
        are stored absolute (then `absolute` is among them)."""
        if not self.quantized:
            raise ValueError(f"policy {self.name!r} is the unquantized reference")
        if self.heavy is not None:
            raise ValueError(
                f"policy {self.name!r} stores heavy rows: every loop is packed with "
                "kvq_jax.pack_heavy, not encode_loops"
            )
        if self.key_tables is not None and kind == "key":
            raise ValueError(
                f"policy {self.name!r} stores keys with per-layer tables ({self.key_tables}): "
                "take one layer's policy with for_key_format"
            )
        base, residual = self.formats(kind)
        absolute = self.absolute if kind == "key" or self.v_absolute is None else self.v_absolute
        if absolute and num_loops is None:
            raise ValueError(
                f"num_loops: policy {self.name!r} stores some loops absolute; pass the number "
                "of loops"
            )
        if not isinstance(residual, str):
            if num_loops is None:
                raise ValueError(
                    f"num_loops: policy {self.name!r} has per-loop residual formats; pass the "
                    "number of loops"
                )
            residual = self.loop_formats(kind, num_loops)[1:]
            if len(set(residual)) == 1:
                residual = residual[0]
        kwargs = dict(
            kind=kind,
            base_format=base,
            residual_format=residual,
            group_size=self.group_size,
            window=self.window,
        )
        if absolute and self.absolute_loops(kind, num_loops):
            kwargs["absolute"] = self.absolute_loops(kind, num_loops)
        return kwargs


def _with_window(policies: list[Policy]) -> list[Policy]:
    out = []
    for p in policies:
        out.append(p)
        out.append(dataclasses.replace(p, name=f"{p.name}+win", window=DEFAULT_WINDOW))
    return out


#: Every policy of the default report, in table order.
POLICIES: dict[str, Policy] = {
    p.name: p
    for p in [
        Policy("bf16", "bf16", "bf16"),
        *_with_window(
            [
                Policy("int4-g16", "int4", "int4", group_size=16),
                Policy("int4-g32", "int4", "int4", group_size=32),
                Policy("int4-g64", "int4", "int4", group_size=64),
                Policy("nvfp4", "nvfp4", "nvfp4"),
                Policy("fp8", "fp8_e4m3", "fp8_e4m3"),
                Policy("mixed", "int4", "nvfp4", group_size=64),
                # FlashLoop's codec profiles (flashloop_torch CODEC_PROFILES), groups of 64:
                # keys 2-bit in every loop, values 4/4/2/2 bits; "kivi": all 2-bit.
                Policy(
                    "flashloop-legacy",
                    "int2",
                    "int2",
                    group_size=64,
                    v_base_format="int4",
                    v_residual_format=("int4", "int2", "int2"),
                ),
                Policy("flashloop-kivi", "int2", "int2", group_size=64),
                # Absolute loops (issue 16's second goal; the embedded capture's loops do not
                # converge): FlashLoop legacy's 3.000 bits with keys INT2 absolute in every
                # loop and values INT2/INT4/INT4/INT2, loops 1-2 absolute, loop 3 a delta.
                Policy(
                    "loops-abs-v2442",
                    "int2",
                    "int2",
                    group_size=64,
                    v_base_format="int2",
                    v_residual_format=("int4", "int4", "int2"),
                    absolute=(1, 2, 3),
                    v_absolute=(1, 2),
                ),
                # FlashLoop legacy's formats with only the keys absolute.
                Policy(
                    "loops-abs-keys",
                    "int2",
                    "int2",
                    group_size=64,
                    v_base_format="int4",
                    v_residual_format=("int4", "int2", "int2"),
                    absolute=(1, 2, 3),
                    v_absolute=(),
                ),
                # Issue 16: keys in INTB with SmolLM2's per-layer tables (calibrated on
                # Wikipedia and Python source, not on the embedded capture's text), values INT4.
                Policy(
                    "intb-smollm2",
                    "intb",
                    "intb",
                    group_size=64,
                    v_base_format="int4",
                    v_residual_format="int4",
                    key_tables="smollm2",
                ),
                # Issue 16: values Hadamard-rotated before INT4 (FORMAT.md 2c): keys INT4,
                # then keys INTB as above.
                Policy(
                    "int4-hint4",
                    "int4",
                    "int4",
                    group_size=64,
                    v_base_format="hint4",
                    v_residual_format="hint4",
                ),
                Policy(
                    "intb-hint4-smollm2",
                    "intb",
                    "intb",
                    group_size=64,
                    v_base_format="hint4",
                    v_residual_format="hint4",
                    key_tables="smollm2",
                ),
                # Heavy rows (FORMAT.md 5a): per 64 tokens and KV head, the row the mean query
                # attends to most is stored INT8 for K and V; keys INTB at 3.75 bits over the
                # other 63 rows, values HINT4 G64 (4.44 bits/element on complete groups).
                Policy(
                    "intb-hint4-heavy-smollm2",
                    "intb",
                    "intb",
                    group_size=64,
                    v_base_format="hint4",
                    v_residual_format="hint4",
                    key_tables="smollm2-heavy",
                    heavy=64,
                ),
                # The same with the keys stored before RoPE (KVQuant; tables calibrated for
                # pre-RoPE keys with RoPE-aware query energy).
                Policy(
                    "intb-prerope-hint4-heavy-smollm2",
                    "intb",
                    "intb",
                    group_size=64,
                    v_base_format="hint4",
                    v_residual_format="hint4",
                    key_tables="smollm2-heavy-prerope",
                    heavy=64,
                    pre_rope=True,
                ),
                # loops-abs-v2442 with every value loop rotated (2/4/4/2 bits).
                Policy(
                    "loops-abs-v2442-h",
                    "int2",
                    "int2",
                    group_size=64,
                    v_base_format="hint2",
                    v_residual_format=("hint4", "hint4", "hint2"),
                    absolute=(1, 2, 3),
                    v_absolute=(1, 2),
                ),
            ]
        ),
    ]
}


@dataclasses.dataclass(frozen=True)
class ServingSupport:
    """Whether the paged cache, the engine and `kvq generate` serve a policy.

    served: True or False (also the object's truth value); reason: why not ("" when served),
    a sentence that names the policy. `check()` raises it as a ValueError.
    """

    served: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.served

    def check(self) -> None:
        if not self.served:
            raise ValueError(self.reason)


def serving_support(policy: Policy, *, num_loops: int | None = None) -> ServingSupport:
    """Can the paged cache and the engine serve `policy` at `num_loops` loops, and if not, why.

    num_loops: the model's loop count, or None (any). The one answer every refusal quotes:
    the engine, `kvq generate`, `kvq report` (a policy it refuses is marked) and
    `cache_config_for`. Every policy of the registry is served now: per-layer key tables
    (`Policy.key_tables`), heavy rows, keys before RoPE, per-loop formats and absolute loops,
    by the XLA path and the kernels (each kernel's `config_support` says what it declines);
    whether a table set fits a model is checked where the model is known
    (`KeyTables.check_fit`).
    """
    if isinstance(num_loops, bool) or not (num_loops is None or isinstance(num_loops, int)):
        raise TypeError(f"num_loops must be an int or None, got {num_loops!r}")
    if num_loops is not None and num_loops < 1:
        raise ValueError(f"num_loops must be >= 1, got {num_loops}")
    return ServingSupport(True)


def cache_config_for(
    policy: Policy, *, num_pages, page_size, num_heads, head_dim, dtype, num_loops, max_seqs
) -> PagedCacheConfig:
    """The `PagedCacheConfig` of a quantized policy at `num_loops` loops: ValueError for
    "bf16", for a policy `serving_support` refuses (its reason), for a `key_tables` policy
    (take one layer's policy first: `per_layer_policies`) and for a group size that does not
    fit the page."""
    if not policy.quantized:
        raise ValueError(f"policy {policy.name!r} is unquantized: it has no PagedCacheConfig")
    serving_support(policy, num_loops=num_loops).check()
    if policy.key_tables is not None:
        raise ValueError(
            f"policy {policy.name!r} stores keys with per-layer INTB tables "
            f"({policy.key_tables}): take one layer's policy (per_layer_policies) first"
        )
    k_base, *k_res = policy.loop_formats("key", num_loops)
    v_base, *v_res = policy.loop_formats("value", num_loops)
    return PagedCacheConfig(
        num_pages=num_pages,
        page_size=page_size,
        num_heads=num_heads,
        head_dim=head_dim,
        dtype=dtype,
        num_loops=num_loops,
        k_base_format=k_base,
        k_residual_format=tuple(k_res) or k_base,
        v_base_format=v_base,
        v_residual_format=tuple(v_res) or v_base,
        k_absolute=policy.absolute_loops("key", num_loops),
        v_absolute=policy.absolute_loops("value", num_loops),
        rope_theta=policy.rope_theta,
        k_group_size=policy.group_size,
        v_group_size=policy.group_size,
        sink=policy.window.sink if policy.window is not None else 0,
        max_seqs=max_seqs,
    )


def per_layer_policies(policy: Policy, tables, layers, register) -> tuple[Policy, ...]:
    """The policy of each model layer in `layers` for a `key_tables` policy: its keys in the
    INTB format of that layer's bit table, registered by `register(table) -> format name`
    (a stack's `formats.intb.register_table`), with the layer's mean-query table for heavy
    rows and the tables' RoPE base. tables: the policy's `KeyTables`, already checked to fit
    the model (`KeyTables.check_fit`); a missing layer is a ValueError."""
    out = []
    for layer in layers:
        heavy = tables.heavy_table(policy.name, layer) if policy.heavy is not None else None
        out.append(policy.for_key_format(register(tables.table(layer)), heavy, tables.rope_theta))
    return tuple(out)


#: The rows of `kvq report` with no --policies, at most 12: the bf16 reference, the formats
#: of FlashLoop and vLLM, FlashLoop's profiles against absolute loops at the same 3 bits, and
#: the calibrated policies up to the best served; "all" adds the rest of the registry.
DEFAULT_REPORT = (
    "bf16",
    "int4-g64",
    "int4-g64+win",
    "nvfp4",
    "fp8",
    "mixed",
    "flashloop-kivi",
    "flashloop-legacy",
    "loops-abs-v2442",
    "intb-hint4-smollm2",
    "intb-prerope-hint4-heavy-smollm2",
    "intb-prerope-hint4-heavy-smollm2+win",
)


def parse_policies(text: str | None) -> list[Policy]:
    """'int4-g64,nvfp4+win' -> those policies; None: the default rows (`DEFAULT_REPORT`);
    "all": every policy.

    Raises ValueError naming the unknown entries and listing the known names.
    """
    if text is None:
        return [POLICIES[n] for n in DEFAULT_REPORT]
    if text.strip() == "all":
        return list(POLICIES.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise ValueError(
            f"policies: unknown {unknown or '(empty list)'}; known: {', '.join(POLICIES)}"
        )
    return [POLICIES[n] for n in dict.fromkeys(names)]
