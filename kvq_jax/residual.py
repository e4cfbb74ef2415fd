"""Cross-loop residuals: store loop l as a packed delta against the reconstructed loop l-1.

    D_l = X_l - R_{l-1}              (in the input dtype)
    R_l = R_{l-1} + decode(pack(D_l))  (in the input dtype)

Encoding against the reconstruction (not the original) keeps the error of loop l at the level
of one encoding instead of compounding. Sparse residuals store only some rows: compact rows
[N, H, D] and an owned int32 position map into [0, T); absent rows inherit R_{l-1}.

This layer sits above the codecs and works with any registered format.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvq_jax._numerics import add_in_dtype, subtract_in_dtype
from kvq_jax.api import pack_kv, unpack_kv
from kvq_jax.codec import check_values
from kvq_jax.containers import KVResidualMixin
from kvq_jax.packed import PackedKV
from kvq_jax.window import Window, check_window, split_rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVResidual(KVResidualMixin):
    """One loop stored as a delta against the reconstructed previous loop.

    payload:   PackedKV of the delta of the quantized rows, [M, H, D].
    positions: int32 [N] rows of [0, T) this residual owns (None: dense, every row).
    head/tail: raw rows of the current loop kept by the window (None without a window),
               [h, H, D] and [t, H, D] in the input dtype.
    shape:     (T, H, D) of the full loop.
    window:    the Window, or None.

    Dense without window M = T; sparse M = N; a window takes h rows from the front and t rows
    from the back of the (compact) rows before the rest is packed.
    """

    payload: PackedKV
    positions: Any = None
    head: Any = None
    tail: Any = None
    shape: tuple[int, int, int]
    window: Window | None = None


jax.tree_util.register_dataclass(
    KVResidual,
    data_fields=["payload", "positions", "head", "tail"],
    meta_fields=["shape", "window"],
)


def check_positions_dtype(positions, name: str = "positions") -> None:
    """Raise TypeError unless `positions` is None or an int32 array (checked before jit, which
    would otherwise turn int64 numpy input into int32 silently)."""
    if positions is None:
        return
    dtype = getattr(positions, "dtype", None)
    if dtype is None:
        raise TypeError(f"{name} must be an int32 array, got {type(positions).__name__}")
    if np.dtype(dtype) != np.int32:
        raise TypeError(f"{name} must have dtype int32, got {np.dtype(dtype)}")


def gather_rows(x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
    """x[positions]; an out-of-range position reads NaN rows (visible in the payload) instead of
    XLA's silent clamp. `validate_positions` rejects such maps on the host."""
    return x.at[positions].get(mode="fill", fill_value=jnp.nan)


def _check_positions_static(positions, rows: int, num_tokens: int):
    """Trace-time checks of a position map: rank, dtype, length (no data needed)."""
    if positions is None:
        return None
    positions = jnp.asarray(positions)
    check_positions_layout(positions.shape, positions.dtype, rows, num_tokens)
    return positions


def check_positions_layout(shape, dtype, rows: int, num_tokens: int) -> None:
    """Rank, dtype and length of a position map for `rows` compact rows of a `num_tokens`
    loop, from its shape and (numpy-comparable) dtype alone; shared by both stacks."""
    if len(shape) != 1:
        raise ValueError(f"positions must be rank 1 [N], got shape {tuple(shape)}")
    if np.dtype(dtype) != np.int32:
        raise TypeError(f"positions must have dtype int32, got {np.dtype(dtype)}")
    if shape[0] != rows:
        raise ValueError(f"positions has {shape[0]} entries but current has {rows} rows")
    if rows > num_tokens:
        raise ValueError(f"positions has {rows} entries, more than the {num_tokens} tokens")


def check_pair_layout(current, previous, dense: bool) -> tuple[int, int]:
    """`current` and `previous` are (shape, dtype) pairs (from check_values); raise unless they
    can form a residual; return (N, T). Shared by the JAX and Torch encoders."""
    ((n, h, d), dtype), ((t, hp, dp), dtype_p) = current, previous
    if dtype != dtype_p:
        raise TypeError(f"current.dtype {dtype} != previous.dtype {dtype_p}")
    if (h, d) != (hp, dp):
        raise ValueError(
            f"current [N, H, D] = {(n, h, d)} does not match "
            f"previous [T, H, D] = {(t, hp, dp)} in H, D"
        )
    if dense and n != t:
        raise ValueError(
            f"dense residual: current has {n} rows but previous has {t} "
            f"(pass positions for a sparse residual)"
        )
    return n, t


def _check_pair(current, previous, positions):
    current, previous = jnp.asarray(current), jnp.asarray(previous)
    n, t = check_pair_layout(
        check_values(current, "current"), check_values(previous, "previous"), positions is None
    )
    return current, previous, _check_positions_static(positions, n, t)


def check_previous(residual, shape, dtype) -> None:
    """Raise ValueError unless a predecessor of `shape`/`dtype` is the one `residual` was
    encoded against (shared by the JAX and Torch decoders)."""
    if tuple(shape) != residual.shape or dtype != residual.dtype:
        raise ValueError(
            f"previous is {dtype}{list(shape)} but the residual was encoded "
            f"against {residual.dtype}{list(residual.shape)}"
        )


def validate_positions(positions, num_tokens: int, *, window: Window | None = None) -> None:
    """Host-side check of a position map; raises ValueError if it is not usable.

    Checks: int32, rank 1, strictly increasing (sorted and unique), every entry in
    [0, num_tokens), and with a window, that the map holds every window row (the first
    min(sink, T) and the last tokens the window keeps). Call it when you want it: it reads the
    data (a device->host transfer), so the jitted encode/decode paths never call it.
    """
    p = np.asarray(positions)
    if p.ndim != 1:
        raise ValueError(f"positions must be rank 1, got shape {p.shape}")
    if p.dtype != np.int32:
        raise ValueError(f"positions must have dtype int32, got {p.dtype}")
    if p.size and (p.min() < 0 or p.max() >= num_tokens):
        raise ValueError(
            f"positions must lie in [0, {num_tokens}), got range [{p.min()}, {p.max()}]"
        )
    if p.size > 1 and not np.all(np.diff(p) > 0):
        bad = int(np.argmax(np.diff(p) <= 0))
        raise ValueError(
            f"positions must be strictly increasing; positions[{bad}] = {p[bad]} "
            f">= positions[{bad + 1}] = {p[bad + 1]}"
        )
    if window is not None:
        head, _, tail = window.split_sizes(num_tokens)
        need = np.concatenate([np.arange(head), np.arange(num_tokens - tail, num_tokens)])
        missing = np.setdiff1d(need, p)
        if missing.size:
            raise ValueError(
                f"with a window, positions must include every window row; "
                f"missing {missing[:8].tolist()}"
            )


def encode_residual(
    current,
    previous,
    *,
    kind: str,
    format: str = "int4",
    group_size: int | None = None,
    axis: str | None = None,
    positions=None,
    window: Window | None = None,
) -> KVResidual:
    """Pack `current` as a delta against the reconstructed `previous`.

    Args:
      current: [T, H, D] (dense) or the compact rows [N, H, D] listed by `positions`.
      previous: the reconstructed predecessor, [T, H, D], same dtype as `current`.
      kind, format, group_size, axis: as for `pack_kv`; the delta is packed with them.
      positions: None (dense) or int32 [N], strictly increasing in [0, T). Only the dtype is
        checked here; `validate_positions` checks the values on the host (an out-of-range
        entry reads NaN rows, so it shows up as NaN in the payload, never as a clamped row).
      window: keep the first `sink` and last `recent` rows (of the compact rows, for a sparse
        residual, whose map must then include the window rows) raw, in the input dtype.
    """
    check_positions_dtype(positions)
    return _encode_residual(
        current,
        previous,
        kind=kind,
        format=format,
        group_size=group_size,
        axis=axis,
        positions=positions,
        window=window,
    )


@functools.partial(jax.jit, static_argnames=("kind", "format", "group_size", "axis", "window"))
def _encode_residual(
    current,
    previous,
    *,
    kind: str,
    format: str = "int4",
    group_size: int | None = None,
    axis: str | None = None,
    positions=None,
    window: Window | None = None,
) -> KVResidual:
    """Jitted body of `encode_residual` (positions dtype already checked)."""
    current, previous, positions = _check_pair(current, previous, positions)
    window = check_window(window)
    head = tail = None
    if window is not None:
        head, current, tail = split_rows(current, window)
        if positions is not None:
            _, positions_mid, _ = split_rows(positions, window)
            base = gather_rows(previous, positions_mid)
        else:
            base = split_rows(previous, window)[1]
    else:
        base = previous if positions is None else gather_rows(previous, positions)
    delta = subtract_in_dtype(current, base)
    payload = pack_kv(delta, kind=kind, format=format, group_size=group_size, axis=axis)
    return KVResidual(
        payload=payload,
        positions=positions,
        head=head,
        tail=tail,
        shape=previous.shape,
        window=window,
    )


@jax.jit
def decode_residual(residual: KVResidual, previous) -> jnp.ndarray:
    """Rebuild the loop: `previous` + decoded delta on the owned rows, in the input dtype.

    Rows a sparse residual does not list are `previous`'s rows, bit for bit; window rows are
    the stored raw rows, bit for bit.
    """
    if not isinstance(residual, KVResidual):
        raise TypeError(f"residual must be a KVResidual, got {type(residual).__name__}")
    previous = jnp.asarray(previous)
    check_previous(residual, *check_values(previous, "previous"))
    delta = unpack_kv(residual.payload)
    window, positions = residual.window, residual.positions
    if positions is None:
        if window is None:
            return add_in_dtype(previous, delta)
        _, middle, _ = split_rows(previous, window)
        return jnp.concatenate([residual.head, add_in_dtype(middle, delta), residual.tail])
    if window is None:
        return previous.at[positions].set(add_in_dtype(gather_rows(previous, positions), delta))
    head_pos, mid_pos, tail_pos = split_rows(positions, window)
    out = previous.at[mid_pos].set(add_in_dtype(gather_rows(previous, mid_pos), delta))
    return out.at[head_pos].set(residual.head).at[tail_pos].set(residual.tail)
