"""The paged cache's static configuration and the page-local group-size rule (both stacks).

`PagedCacheConfig` is hashable (a static jit argument) and framework-neutral: the JAX cache
(`kvq_jax.cache.paged_cache`) and the Torch cache (`kvq_torch_bridge.cache.paged_cache`) take the
same object. Formats are looked up by name in the stacks' registries (`kvq_jax.core.registry`), so a
codec registered by a user works in the cache like a built-in one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kvq_jax.core import registry
from kvq_jax.core.checks import is_int
from kvq_jax.core.layouts import check_float_dtype

_INT_FIELDS = ("num_pages", "page_size", "num_heads", "head_dim", "num_loops", "max_seqs")
_PREFIX = {"key": "k", "value": "v"}


def resolve_paged(format: str, kind: str, page_shape, axis, group_size) -> tuple[str, int]:
    """(axis, group_size) of `format` for pages of `page_shape` = (page_size, H, D).

    Token-axis groups must divide page_size (a group never spans two pages). With group_size
    None, a format whose group size is free (INT4) takes gcd(default, page_size), e.g. 16 for
    16-token pages, 64 for 128.
    """
    layout = registry.layout(format)
    page_size = page_shape[0]
    rows = layout.page_rows(page_size)
    axis, resolved = layout.resolve(page_shape, kind, axis, group_size)
    free = group_size is None and not layout.fixed_group_size
    if axis == "tokens" and rows % resolved and free:
        resolved = math.gcd(resolved, rows)
    if axis == "tokens" and rows % resolved:
        raise ValueError(
            f"group_size {resolved} must divide page_size {page_size} for token-axis "
            f"groups: a group may not span two pages (pick a divisor of {page_size})"
            if rows == page_size
            else f"group_size {resolved} must divide the {rows} rows of a page that format "
            f"{format!r} packs outside its heavy rows"
        )
    return axis, resolved


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedCacheConfig:
    """Static (hashable) configuration of a paged KV cache.

    P = num_pages physical pages of page_size tokens, H = num_heads KV heads of head_dim
    channels, L = num_loops loop planes, S = max_seqs sequence slots, `sink` raw rows per
    sequence. Group sizes of None take the `resolve_paged` defaults; the residual formats use
    the base's group size when they share its format, else their own default (as
    `encode_loops`). Token-axis groups must divide page_size. `adaptive_exit` adds the
    per-row exit record of early-exiting tokens (`kvq_jax.cache.paged_cache`; 1 byte per token
    and page row, plus a bool per staging row): served by the XLA path.

    Later loops: `k_residual_format` / `v_residual_format` name one format for every loop
    >= 1, or one per later loop (a tuple of num_loops - 1 names, e.g. FlashLoop's values
    ("int4", "int2", "int2"); a tuple of one repeated name is that name). `k_absolute` /
    `v_absolute`: the loops (in [1, num_loops)) stored absolute, packed on their own instead of
    as a delta against the reconstructed previous loop (`encode_loops(absolute=...)`); with
    adaptive exits a row that exited earlier is packed there as its reconstructed previous
    loop and read as its exit loop (`depth`). Per-loop formats and absolute loops are served by
    the XLA path and the kernels (`per_loop`).

    `rope_theta`: keys stored before RoPE (FORMAT.md 5b) with this base, or None (the keys as
    handed over). The cache is handed RoPE'd keys, as the model makes them; a key page that
    completes packs `invert_rope` of its rows at their positions in the sequence (row i of
    logical page j: position j * page_size + i; heavy rows are still chosen from the RoPE'd
    rows), and every read of a key page (`gather`, decode attention) re-applies RoPE at the
    same positions after decoding. Raw rows (staging, sink) keep the keys as handed over.
    `decode_pages` returns the stored (pre-RoPE) pages.
    """

    num_pages: int
    page_size: int
    num_heads: int
    head_dim: int
    dtype: Any = "float32"
    num_loops: int = 1
    k_base_format: str = "int4"
    k_residual_format: str | tuple[str, ...] = "int4"
    v_base_format: str = "int4"
    v_residual_format: str | tuple[str, ...] = "int4"
    k_group_size: int | None = None
    v_group_size: int | None = None
    sink: int = 0
    max_seqs: int = 1
    adaptive_exit: bool = False
    k_absolute: tuple[int, ...] = ()
    v_absolute: tuple[int, ...] = ()
    rope_theta: float | None = None

    def __post_init__(self):
        for name in (*_INT_FIELDS, "sink"):
            value = getattr(self, name)
            low = 0 if name == "sink" else 1
            if not is_int(value) or value < low:
                raise ValueError(f"PagedCacheConfig.{name} must be an int >= {low}, got {value!r}")
        object.__setattr__(self, "dtype", check_float_dtype(self.dtype, "PagedCacheConfig.dtype"))
        if not isinstance(self.adaptive_exit, bool):
            raise ValueError(
                f"PagedCacheConfig.adaptive_exit must be a bool, got {self.adaptive_exit!r}"
            )
        if self.rope_theta is not None:
            theta = self.rope_theta
            if isinstance(theta, bool) or not isinstance(theta, int | float):
                raise ValueError(f"PagedCacheConfig.rope_theta must be a float or None, "
                                 f"got {theta!r}")  # fmt: skip
            if not (math.isfinite(theta) and theta > 0):
                raise ValueError(f"PagedCacheConfig.rope_theta must be positive and finite, "
                                 f"got {theta!r}")  # fmt: skip
            if self.head_dim % 2:
                raise ValueError(f"PagedCacheConfig.rope_theta: RoPE needs an even head_dim, "
                                 f"got {self.head_dim}")  # fmt: skip
            object.__setattr__(self, "rope_theta", float(theta))
        if self.num_loops > 255:
            raise ValueError(f"PagedCacheConfig.num_loops must be <= 255, got {self.num_loops}")
        for prefix in ("k", "v"):
            self._normalize_loops(prefix)
            for name in (f"{prefix}_base_format", f"{prefix}_residual_format"):
                value = getattr(self, name)
                for fmt in (value,) if isinstance(value, str) else value:
                    try:
                        registry.layout(fmt)
                    except ValueError as e:
                        raise ValueError(f"PagedCacheConfig.{name}: {e}") from None
        for kind in ("key", "value"):
            for loop in range(max(self.num_loops, 2)):
                self.loop_pack_args(kind, loop)  # raises for a group size that does not fit
        for loop in range(self.num_loops):
            self._check_heavy(loop)

    def _check_heavy(self, loop: int) -> None:
        """Heavy-row formats (`HeavyLayout`) are stored in loops stored whole (a delta has no
        rows of its own), without adaptive exits; the keys choose the rows (a mean-query
        table) and heavy-row values take them (the same heavy group)."""
        k_lay, v_lay = (registry.layout(self.loop_format(kind, loop)) for kind in ("key", "value"))
        for kind, lay in (("key", k_lay), ("value", v_lay)):
            if not hasattr(lay, "heavy_group"):
                continue
            prefix = _PREFIX[kind]
            field = f"{prefix}_base_format" if loop == 0 else f"{prefix}_residual_format"
            where = f"PagedCacheConfig.{field}: heavy-row format {lay.name!r} in loop {loop}"
            if loop and loop not in self.absolute_loops(kind):
                raise ValueError(
                    f"{where}, a delta loop: heavy rows are stored in loops stored whole "
                    f"(loop 0, or a loop in {prefix}_absolute)"
                )
            if self.adaptive_exit:
                raise ValueError(f"{where}: heavy rows are not served with adaptive_exit")
            if kind == "key" and not lay.selects_rows:
                raise ValueError(f"{where}: the keys choose the heavy rows, so their format "
                                 "needs a mean-query table")  # fmt: skip
        if hasattr(v_lay, "heavy_group"):
            ok = getattr(k_lay, "selects_rows", False) and k_lay.heavy_group == v_lay.heavy_group
            if not ok:
                raise ValueError(
                    f"PagedCacheConfig.v_base_format / v_residual_format: heavy-row values "
                    f"({v_lay.name!r}, loop {loop}) take the rows chosen from their keys: the "
                    f"keys' format there must choose rows of the same heavy group, got "
                    f"{k_lay.name!r}"
                )

    def _normalize_loops(self, prefix: str) -> None:
        """Residual formats: a str, or a tuple of num_loops - 1 names (one repeated name: that
        name); absolute loops: a sorted tuple of distinct ints in [1, num_loops)."""
        name = f"{prefix}_residual_format"
        value = getattr(self, name)
        if isinstance(value, list):
            value = tuple(value)
        if isinstance(value, tuple):
            if not all(isinstance(f, str) for f in value):
                raise ValueError(f"PagedCacheConfig.{name} must be a str or a tuple of str, "
                                 f"got {value!r}")  # fmt: skip
            if len(value) != self.num_loops - 1:
                raise ValueError(
                    f"PagedCacheConfig.{name}: {len(value)} formats for {self.num_loops - 1} "
                    f"later loops (one per loop >= 1), got {value!r}"
                )
            value = value[0] if len(set(value)) == 1 else value
            if not value:
                value = getattr(self, f"{prefix}_base_format")
        elif not isinstance(value, str):
            raise ValueError(f"PagedCacheConfig.{name} must be a str or a tuple of str, "
                             f"got {value!r}")  # fmt: skip
        object.__setattr__(self, name, value)
        name = f"{prefix}_absolute"
        loops = getattr(self, name)
        if isinstance(loops, (str, bytes)) or not hasattr(loops, "__iter__"):
            raise ValueError(f"PagedCacheConfig.{name} must be a tuple of loop indices, "
                             f"got {loops!r}")  # fmt: skip
        loops = tuple(loops)
        for loop in loops:
            if not is_int(loop) or not 1 <= loop < self.num_loops:
                raise ValueError(
                    f"PagedCacheConfig.{name}: loops stored absolute are ints in [1, "
                    f"{self.num_loops}) (loop 0 is always packed on its own), got {loops!r}"
                )
        loops = tuple(sorted({int(loop) for loop in loops}))
        object.__setattr__(self, name, loops)

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """(page_size, H, D)."""
        return (self.page_size, self.num_heads, self.head_dim)

    @property
    def formats(self) -> tuple[str, ...]:
        """The distinct formats the cache stores (base and, with loops, residual)."""
        names = [
            self.loop_format(kind, loop)
            for loop in range(self.num_loops)
            for kind in ("key", "value")
        ]
        return tuple(dict.fromkeys(names))

    def loop_format(self, kind: str, loop: int) -> str:
        """The format of loop `loop` of K ("key") or V ("value") pages."""
        prefix = _PREFIX[kind]
        if loop == 0:
            return getattr(self, f"{prefix}_base_format")
        residual = getattr(self, f"{prefix}_residual_format")
        return residual if isinstance(residual, str) else residual[loop - 1]

    def loop_pack_args(self, kind: str, loop: int) -> dict:
        """`pack_kv` keyword arguments {kind, format, axis, group_size} of loop `loop` of the K
        ("key") or V ("value") pages: a later loop in the base's format takes its group size,
        another format its own default (as `encode_loops`)."""
        prefix = _PREFIX[kind]
        base_format = getattr(self, f"{prefix}_base_format")
        group_size = getattr(self, f"{prefix}_group_size")
        format = self.loop_format(kind, loop)
        if format != base_format:
            group_size = None
        axis, group_size = resolve_paged(format, kind, self.page_shape, None, group_size)
        return dict(kind=kind, format=format, axis=axis, group_size=group_size)

    def pack_args(self, kind: str, level: str) -> dict:
        """`loop_pack_args` of `level` "base" (loop 0) or "residual" (every loop >= 1; a
        ValueError when the later loops differ in format: ask `loop_pack_args`)."""
        if level == "residual" and len(self.delta_runs(kind)) > 1:
            raise ValueError(
                f"the later loops of {kind}s have formats {self.loop_formats(kind)[1:]}: take "
                "one loop's pack arguments (loop_pack_args)"
            )
        return self.loop_pack_args(kind, 0 if level == "base" else 1)

    def loop_formats(self, kind: str) -> tuple[str, ...]:
        """The format of every loop of `kind`."""
        return tuple(self.loop_format(kind, loop) for loop in range(self.num_loops))

    def absolute_loops(self, kind: str) -> tuple[int, ...]:
        """The loops of `kind` stored absolute (sorted)."""
        return getattr(self, f"{_PREFIX[kind]}_absolute")

    @property
    def layered(self) -> bool:
        """True when a stored format holds one table per model layer (`FormatLayout.per_layer`):
        the cache then carries the layer it is read and written as (`cache_state.at_layer`)."""
        names = {*self.loop_formats("key"), *self.loop_formats("value")}
        return any(registry.layout(name).per_layer for name in names)

    def delta_runs(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """The later loops of `kind` grouped into runs of consecutive loops with the same pack
        arguments: each run is one stored plane [len(run), num_pages, ...]. ((1, .., L - 1),)
        when every later loop has one format; () for one loop."""
        runs: list[list[int]] = []
        for loop in range(1, self.num_loops):
            if runs and self.loop_pack_args(kind, loop) == self.loop_pack_args(kind, runs[-1][0]):
                runs[-1].append(loop)
            else:
                runs.append([loop])
        return tuple(tuple(run) for run in runs)

    def per_loop(self, kind: str) -> bool:
        """True when `kind`'s later loops differ in format or some are stored absolute (each
        loop's chain then reads planes of several formats or starts at an absolute loop)."""
        return len(self.delta_runs(kind)) > 1 or bool(self.absolute_loops(kind))

    def chain(self, kind: str, loop: int) -> tuple[int, ...]:
        """The loops whose planes reconstructing loop `loop` reads, in order: from the last loop
        stored on its own at or before `loop` (0 or an absolute loop) up to `loop`; from loop 0
        in an adaptive-exit cache (a row that exited keeps an earlier loop's value)."""
        absolute = () if self.adaptive_exit else self.absolute_loops(kind)
        start = max((a for a in absolute if a <= loop), default=0)
        return tuple(range(start, loop + 1))

    def plane_of(self, kind: str, loop: int) -> tuple[str, int | None, int | None]:
        """Where loop `loop` of `kind` is stored: (field, run, level): field "k_base" or
        "k_delta" ("v_" for values), run the index into the field's tuple of runs (None when
        the field is one plane), level the index on the plane's loop axis (None for a base)."""
        prefix = _PREFIX[kind]
        if loop == 0:
            return f"{prefix}_base", None, None
        runs = self.delta_runs(kind)
        for r, run in enumerate(runs):
            if loop in run:
                return f"{prefix}_delta", (r if len(runs) > 1 else None), run.index(loop)
        raise ValueError(f"loop {loop} is not stored (num_loops {self.num_loops})")

    def plane_specs(self) -> tuple[tuple[str, str, tuple[int, ...], dict], ...]:
        """(name, kind, loops, pack arguments) of every stored packed plane, in the cache's
        order: "k_base", "v_base" (loop 0, batch (P,)), then each kind's later-loop planes
        (batch (len(loops), P)): "k_delta" for one run of one format (`delta_runs`), else
        "k_delta.0", "k_delta.1", ... one per run (same for "v_")."""
        specs = [
            (f"{_PREFIX[kind]}_base", kind, (0,), self.loop_pack_args(kind, 0))
            for kind in ("key", "value")
        ]
        for kind in ("key", "value"):
            runs = self.delta_runs(kind)
            for r, run in enumerate(runs):
                name = f"{_PREFIX[kind]}_delta" + ("" if len(runs) == 1 else f".{r}")
                specs.append((name, kind, run, self.loop_pack_args(kind, run[0])))
        return tuple(specs)
