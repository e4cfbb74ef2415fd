"""Calibrating an INTB bit table (docs/FORMAT.md section 2b) from sample keys and queries.

NumPy only. The table gives each (KV head, channel) the width that minimizes the expected
squared error of the attention logits q . k at a fixed bit budget: under uniform affine
quantization channel c's squared error is about S_c / (2^b - 1)^2 (S_c: mean squared group
span), and it reaches a logit weighted by E[q_c^2], summed over the query heads that share the
KV head. Errors of this form are convex in b, so adding one bit at a time where it removes the
most weighted error is optimal (greedy marginal allocation).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import ml_dtypes
import numpy as np

from kvq_jax import data
from kvq_jax.core.layouts import check_bit_table, check_group_size
from kvq_jax.core.rope import rope_aware_weights, rope_tables


def _as_4d(x, name: str) -> np.ndarray:
    x = np.asarray(x, np.float64)
    if x.ndim == 3:
        x = x[None]
    if x.ndim != 4 or 0 in x.shape:
        raise ValueError(f"{name} must be [N, T, H, D] or [T, H, D] and non-empty, got {x.shape}")
    return x


def query_energy(queries, num_kv_heads: int) -> np.ndarray:
    """float64 [H, D]: mean q_c^2 over samples and tokens, summed over the query heads of each
    KV head (GQA: query head j reads KV head j // (Hq / H)). queries: [N, T, Hq, D]."""
    q = _as_4d(queries, "queries")
    hq = q.shape[2]
    if hq % num_kv_heads:
        raise ValueError(f"queries has {hq} heads, not a multiple of num_kv_heads={num_kv_heads}")
    energy = np.mean(q**2, axis=(0, 1))  # [Hq, D]
    return energy.reshape(num_kv_heads, hq // num_kv_heads, -1).sum(axis=1)


def group_span_power(keys, group_size: int) -> np.ndarray:
    """float64 [H, D]: mean over token groups of (max - min)^2 of each (head, channel), groups
    of `group_size` consecutive tokens of each sample (a partial last group included).
    keys: [N, T, H, D]."""
    k = _as_4d(keys, "keys")
    g = check_group_size(group_size)
    t = k.shape[1]
    spans = []
    for start in range(0, t, g):
        block = k[:, start : start + g]
        spans.append(block.max(axis=1) - block.min(axis=1))  # [N, H, D]
    return np.mean(np.stack(spans) ** 2, axis=(0, 1))


def allocate_bits(
    weight, *, mean_bits: float = 4.0, min_bits: int = 1, max_bits: int = 8
) -> tuple[tuple[int, ...], ...]:
    """[H, D] error weights (w_c = E[q_c^2] * S_c) -> bit table of widths in
    [min_bits, max_bits] with `mean_bits * D` bits per head, minimizing
    sum_c w_c / (2^b_c - 1)^2. Ties go to the lower channel index."""
    w = np.asarray(weight, np.float64)
    if w.ndim != 2 or 0 in w.shape or not np.isfinite(w).all() or (w < 0).any():
        raise ValueError(f"weight must be a finite, non-negative [H, D] array, got shape {w.shape}")
    if not 1 <= min_bits <= max_bits <= 8:
        raise ValueError(f"need 1 <= min_bits <= max_bits <= 8, got {min_bits}, {max_bits}")
    h, d = w.shape
    budget = mean_bits * d
    if budget != int(budget) or int(budget) % 8 or not min_bits * d <= budget <= max_bits * d:
        raise ValueError(
            f"mean_bits * D must be a multiple of 8 within [min_bits * D, max_bits * D], got "
            f"{mean_bits} * {d}"
        )
    error = w[..., None] / ((2.0 ** np.arange(9) - 1) ** 2).clip(min=1.0)  # [H, D, b], b = 0..8
    table = np.full((h, d), min_bits)
    rows = np.arange(d)
    for head in range(h):
        for _ in range(int(budget) - min_bits * d):
            b = table[head]
            gain = np.where(
                b < max_bits, error[head, rows, b] - error[head, rows, np.minimum(b + 1, 8)], -1.0
            )
            table[head, int(np.argmax(gain))] += 1
    return check_bit_table(table)


def intb_bit_table(
    keys,
    queries,
    *,
    mean_bits: float = 4.0,
    group_size: int = 64,
    min_bits: int = 1,
    max_bits: int = 8,
    rope_theta: float | None = None,
) -> tuple[tuple[int, ...], ...]:
    """The INTB key bit table for one layer from calibration samples, as stored: post-RoPE,
    or with `rope_theta` for keys stored before RoPE (the captured keys and queries are
    rotated back; channel c's query energy mixes with its rotation partner's by the share
    `core.rope.rope_aware_weights` of query-key distances where they stay aligned).

    keys: [N, T, H, D] or [T, H, D]; queries: [N, T, Hq, D] or [T, Hq, D], Hq a multiple of
    H. The table has `mean_bits * D` bits per head (4.0 at G = 64: INT4 G64's 4.5
    bits/element with the metadata). Calibrate on other text than you evaluate on.
    """
    k = _as_4d(keys, "keys")
    if rope_theta is None:
        energy = query_energy(queries, k.shape[2])
    else:  # keys stored before RoPE: tables for the pre-RoPE channels
        q = _as_4d(queries, "queries")
        cos, sin = rope_tables(k.shape[1], k.shape[3], rope_theta)
        k = _unrope(k, cos, sin)
        energy = query_energy(_unrope(q, cos, sin), k.shape[2])
        a = rope_aware_weights(k.shape[3], rope_theta, k.shape[1])
        d2 = k.shape[3] // 2
        partner = np.concatenate([energy[:, d2:], energy[:, :d2]], axis=1)
        energy = a * energy + (1 - a) * partner
    weight = energy * group_span_power(k, group_size)
    return allocate_bits(weight, mean_bits=mean_bits, min_bits=min_bits, max_bits=max_bits)


def _unrope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """[N, T, H, D] float64 rotated back to before RoPE (positions 0 .. T-1)."""
    h = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos.astype(np.float64) - rotated * sin.astype(np.float64)


def mean_query_table(queries, num_kv_heads: int, *, skip: int = 4) -> np.ndarray:
    """The heavy-row selection table (FORMAT.md 5a) of one layer: bfloat16 [H, R, D], the mean
    query of each of the R = Hq / H query heads that read KV head h, over samples and tokens
    from `skip` on (the first tokens, attention sinks kept raw by a window, are left out).
    queries: [N, T, Hq, D] or [T, Hq, D], post-RoPE as the cache's keys."""
    q = _as_4d(queries, "queries")
    _, t, hq, d = q.shape
    if hq % num_kv_heads:
        raise ValueError(f"queries has {hq} heads, not a multiple of num_kv_heads={num_kv_heads}")
    if not 0 <= skip < t:
        raise ValueError(f"skip must be in [0, T={t}), got {skip}")
    mean = q[:, skip:].mean(axis=(0, 1)).reshape(num_kv_heads, hq // num_kv_heads, d)
    return mean.astype(np.float32).astype(ml_dtypes.bfloat16)


@dataclasses.dataclass(frozen=True)
class KeyTables:
    """The INTB key bit tables of one model, per model layer (a policy's `key_tables`).

    models: the names a capture's meta may give the model ("model" or "source.model").
    tables: model layer index -> bit table (H tuples of D widths).
    group_size: the token group size the tables were calibrated for.
    source: what they were calibrated on (text, tokens, capture).
    mean_query: model layer index -> bfloat16 [H, R, D] heavy-row selection table
      (`mean_query_table`), or None when the set has none.
    rope_theta: the RoPE base the tables were calibrated for keys stored before RoPE, or
      None for post-RoPE keys (the cache's keys as the model hands them over).
    """

    models: tuple[str, ...]
    tables: dict[int, tuple[tuple[int, ...], ...]]
    group_size: int
    source: str
    mean_query: dict[int, np.ndarray] | None = None
    rope_theta: float | None = None

    def check_fit(self, policy_name: str, model_names, num_layers: int, *,
                  num_kv_heads: int | None = None, head_dim: int | None = None,
                  rope_theta: float | None = None, spec: str | None = None) -> None:  # fmt: skip
        """ValueError unless one of `model_names` (the names a model goes by; the first is
        quoted; None: a model whose name is not known, not checked; `spec`: the model as
        `kvq calibrate --model` takes it, for the command the refusal names, default the
        first name) is among `models`, every
        layer in [0, num_layers) has a table, each table is
        [num_kv_heads][head_dim] (when given), and pre-RoPE tables were calibrated for the
        model's RoPE base `rope_theta` (when given)."""
        names = None if model_names is None else list(model_names)
        if names is not None and not any(name in self.models for name in names):
            raise ValueError(
                f"policy {policy_name!r}: its key tables are for {' / '.join(self.models)}, "
                f"not {names[0]!r}; tables of this kind for it: "
                f"{self.calibrate_command(spec or names[0])}"
                " (then --tables TABLES.npz)"
            )
        missing = sorted(set(range(num_layers)) - set(self.tables))
        if missing:
            raise ValueError(f"policy {policy_name!r}: no key table for layers {missing}")
        for layer in range(num_layers):
            shape = (len(self.tables[layer]), len(self.tables[layer][0]))
            if (num_kv_heads or shape[0], head_dim or shape[1]) != shape:
                raise ValueError(f"policy {policy_name!r}: layer {layer}'s key table is for "
                                 f"{shape} (KV heads, head dim), the model has "
                                 f"({num_kv_heads}, {head_dim})")  # fmt: skip
        theirs = self.rope_theta
        if theirs is not None and rope_theta is not None and float(rope_theta) != float(theirs):
            raise ValueError(f"policy {policy_name!r}: its pre-RoPE key tables are for RoPE "
                             f"base {theirs}, the model's is {rope_theta}")  # fmt: skip

    def calibrate_command(self, model: str) -> str:
        """The `kvq calibrate` command that makes a table set of this kind (mean width, token
        group, mean-query tables, keys before RoPE) for `model`."""
        widths = [b for table in self.tables.values() for row in table for b in row]
        mean_bits = float(np.mean(widths)) if widths else 4.0
        flags = [f"--mean-bits {mean_bits:g}" if round(mean_bits, 4) != 4.0 else "",
                 f"--group-size {self.group_size}" if self.group_size != 64 else "",
                 "--mean-query" if self.mean_query is not None else "",
                 "--pre-rope" if self.rope_theta is not None else ""]  # fmt: skip
        flags = "".join(f" {f}" for f in flags if f)
        return f"kvq calibrate --model {model} --text FILE ...{flags} --out TABLES.npz"

    def heavy_table(self, policy_name: str, layer: int) -> np.ndarray:
        """The bfloat16 mean-query table of model layer `layer`, or a ValueError."""
        if self.mean_query is None:
            raise ValueError(
                f"policy {policy_name!r}: its table set has no mean-query tables for heavy rows"
            )
        try:
            return self.mean_query[layer]
        except KeyError:
            raise ValueError(
                f"policy {policy_name!r}: no mean-query table for layer {layer}"
            ) from None

    def table(self, layer: int) -> tuple[tuple[int, ...], ...]:
        """The bit table of model layer `layer`, or a ValueError listing the layers held."""
        try:
            return self.tables[layer]
        except KeyError:
            raise ValueError(
                f"layer {layer} has no key table (tables for layers {sorted(self.tables)})"
            ) from None


def save_key_tables(path, key_tables: KeyTables) -> None:
    """Write `key_tables` as an .npz: layers int32 [N], bits uint8 [N, H, D], meta JSON."""
    layers = sorted(key_tables.tables)
    meta = dict(
        models=list(key_tables.models), group_size=key_tables.group_size, source=key_tables.source
    )
    if key_tables.rope_theta is not None:
        meta["rope_theta"] = float(key_tables.rope_theta)
    extra = {}
    if key_tables.mean_query is not None:
        mq = np.stack([np.asarray(key_tables.mean_query[i], ml_dtypes.bfloat16) for i in layers])
        extra["mean_query"] = mq.view(np.uint16)  # bfloat16 bits
    np.savez_compressed(
        path,
        layers=np.asarray(layers, np.int32),
        bits=np.asarray([key_tables.tables[i] for i in layers], np.uint8),
        meta=np.asarray(json.dumps(meta)),
        **extra,
    )


def load_key_tables(path) -> KeyTables:
    """Read a file written by `save_key_tables` (every table checked as a bit table)."""
    with np.load(path) as data:
        meta = json.loads(str(data["meta"]))
        layers, bits = data["layers"].tolist(), data["bits"].astype(np.int64)
        mq = data["mean_query"].view(ml_dtypes.bfloat16) if "mean_query" in data else None
    if len(layers) != len(bits) or (mq is not None and len(mq) != len(layers)):
        raise ValueError(f"{path}: {len(layers)} layers but {len(bits)} tables")
    return KeyTables(
        models=tuple(meta["models"]),
        tables={int(i): check_bit_table(b) for i, b in zip(layers, bits, strict=True)},
        group_size=check_group_size(int(meta["group_size"])),
        source=str(meta["source"]),
        mean_query=None if mq is None else {int(i): m for i, m in zip(layers, mq, strict=True)},
        rope_theta=meta.get("rope_theta"),
    )


#: Shipped table sets: name -> file in kvq_jax.data.
SHIPPED_KEY_TABLES = {
    "smollm2": "intb_smollm2.npz",
    "smollm2-heavy": "intb_smollm2_heavy.npz",
    "smollm2-heavy-prerope": "intb_smollm2_heavy_prerope.npz",
}
#: Prefix of the table-set names of files (`with_key_tables`): "file:<absolute path>".
FILE_PREFIX = "file:"


@functools.cache
def _shipped(name: str) -> KeyTables:
    return load_key_tables(data.path(SHIPPED_KEY_TABLES[name]))


@functools.cache
def _from_file(path: str) -> KeyTables:
    return load_key_tables(path)


def get_key_tables(name: str) -> KeyTables:
    """The table set `name` (a policy's `key_tables`): a shipped one, or "file:<path>" (a
    file `kvq calibrate` wrote); a ValueError listing the shipped ones otherwise."""
    if name.startswith(FILE_PREFIX):
        return _from_file(name.removeprefix(FILE_PREFIX))
    if name not in SHIPPED_KEY_TABLES:
        raise ValueError(f"key_tables must be one of {sorted(SHIPPED_KEY_TABLES)} or "
                         f"'{FILE_PREFIX}<path>', got {name!r}")  # fmt: skip
    return _shipped(name)


def apply_key_tables(policies, path) -> list:
    """`with_key_tables` on every policy of `policies` that takes key tables (the others as
    they are); `path` None returns the list unchanged. ValueError if none takes tables."""
    policies = list(policies)
    if path is None:
        return policies
    if not any(p.key_tables is not None for p in policies):
        raise ValueError(f"--tables: none of the policies ({', '.join(p.name for p in policies)}) "
                         "stores per-layer key tables; pick an intb-* policy")  # fmt: skip
    return [p if p.key_tables is None else with_key_tables(p, path) for p in policies]


def with_key_tables(policy, path):
    """`policy` (one with `key_tables`) on the tables of file `path` (`kvq calibrate --out`):
    key_tables "file:<absolute path>", named "<policy without its shipped set's model>@<file
    stem>" ("intb-hint4-smollm2+win" on t.npz: "intb-hint4@t+win"). ValueError if the policy
    takes no tables, or the file lacks what the policy needs (mean-query tables for heavy
    rows; tables for keys before RoPE exactly when the policy stores them so)."""
    import pathlib

    if policy.key_tables is None:
        raise ValueError(f"--tables: policy {policy.name!r} stores no per-layer key tables "
                         "(use an intb-* policy)")  # fmt: skip
    path = pathlib.Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"--tables: {path} does not exist")
    tables = _from_file(str(path))
    if policy.heavy is not None and tables.mean_query is None:
        raise ValueError(f"--tables: policy {policy.name!r} stores heavy rows and {path.name} "
                         "has no mean-query tables (kvq calibrate --mean-query)")  # fmt: skip
    if policy.pre_rope != (tables.rope_theta is not None):
        want = "before RoPE (kvq calibrate --pre-rope)" if policy.pre_rope else "after RoPE"
        raise ValueError(f"--tables: policy {policy.name!r} stores keys {want}; {path.name} "
                         f"was calibrated for the other")  # fmt: skip
    # "intb-hint4-smollm2+win" on t.npz: "intb-hint4@t+win" (the shipped set's model dropped)
    name = policy.name.replace("-" + policy.key_tables.split("-")[0].split(":")[0], "")
    base, plus, win = name.partition("+")
    return dataclasses.replace(policy, name=f"{base}@{path.stem}{plus}{win}",
                               key_tables=FILE_PREFIX + str(path))  # fmt: skip
