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
_FORMAT_FIELDS = ("k_base_format", "k_residual_format", "v_base_format", "v_residual_format")


def resolve_paged(format: str, kind: str, page_shape, axis, group_size) -> tuple[str, int]:
    """(axis, group_size) of `format` for pages of `page_shape` = (page_size, H, D).

    Token-axis groups must divide page_size (a group never spans two pages). With group_size
    None, a format whose group size is free (INT4) takes gcd(default, page_size), e.g. 16 for
    16-token pages, 64 for 128.
    """
    layout = registry.layout(format)
    page_size = page_shape[0]
    axis, resolved = layout.resolve(page_shape, kind, axis, group_size)
    free = group_size is None and not layout.fixed_group_size
    if axis == "tokens" and page_size % resolved and free:
        resolved = math.gcd(resolved, page_size)
    if axis == "tokens" and page_size % resolved:
        raise ValueError(
            f"group_size {resolved} must divide page_size {page_size} for token-axis "
            f"groups: a group may not span two pages (pick a divisor of {page_size})"
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
    """

    num_pages: int
    page_size: int
    num_heads: int
    head_dim: int
    dtype: Any = "float32"
    num_loops: int = 1
    k_base_format: str = "int4"
    k_residual_format: str = "int4"
    v_base_format: str = "int4"
    v_residual_format: str = "int4"
    k_group_size: int | None = None
    v_group_size: int | None = None
    sink: int = 0
    max_seqs: int = 1
    adaptive_exit: bool = False

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
        if self.num_loops > 255:
            raise ValueError(f"PagedCacheConfig.num_loops must be <= 255, got {self.num_loops}")
        for name in _FORMAT_FIELDS:
            try:
                registry.layout(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"PagedCacheConfig.{name}: {e}") from None
        for kind in ("key", "value"):
            for level in ("base", "residual"):
                self.pack_args(kind, level)  # raises for a group size that does not fit a page

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """(page_size, H, D)."""
        return (self.page_size, self.num_heads, self.head_dim)

    @property
    def formats(self) -> tuple[str, ...]:
        """The distinct formats the cache stores (base and, with loops, residual)."""
        names = [self.k_base_format, self.v_base_format]
        if self.num_loops > 1:
            names += [self.k_residual_format, self.v_residual_format]
        return tuple(dict.fromkeys(names))

    def pack_args(self, kind: str, level: str) -> dict:
        """`pack_kv` keyword arguments {kind, format, axis, group_size} of the K ("key") or V
        ("value") pages of `level` "base" (loop 0) or "residual" (loops >= 1)."""
        prefix = {"key": "k", "value": "v"}[kind]
        base_format = getattr(self, f"{prefix}_base_format")
        group_size = getattr(self, f"{prefix}_group_size")
        format = base_format
        if level == "residual":
            format = getattr(self, f"{prefix}_residual_format")
            group_size = group_size if format == base_format else None
        axis, group_size = resolve_paged(format, kind, self.page_shape, None, group_size)
        return dict(kind=kind, format=format, axis=axis, group_size=group_size)
