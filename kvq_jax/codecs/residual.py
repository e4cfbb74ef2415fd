"""Cross-loop residuals: store loop l as a packed delta against the reconstructed loop l-1.

    D_l = X_l - R_{l-1}              (in the input dtype)
    R_l = R_{l-1} + decode(pack(D_l))  (in the input dtype)

Encoding against the reconstruction (not the original) keeps the error of loop l at the level
of one encoding instead of compounding. Sparse residuals store only some rows: compact rows
[N, H, D] and an owned int32 position map into [0, T); absent rows inherit R_{l-1}.
An absolute residual (`absolute=True`) packs the rows themselves, R_l = decode(pack(X_l)) on
the rows it owns: for loops that do not converge, where a delta is as large as the loop.

This layer sits above the codecs and works with any registered format.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvq_jax.codecs._numerics import add_in_dtype, subtract_in_dtype
from kvq_jax.codecs.api import pack_kv, unpack_kv
from kvq_jax.core import checks, rows
from kvq_jax.core.containers import KVResidualBase
from kvq_jax.core.window import Window, check_window


class KVResidual(KVResidualBase):
    """One loop as a packed delta against the reconstructed previous loop, jax arrays
    (fields: `kvq_jax.core.containers.KVResidualBase`)."""


jax.tree_util.register_dataclass(
    KVResidual,
    data_fields=["payload", "positions", "head", "tail"],
    meta_fields=["shape", "window", "absolute"],
)


def gather_rows(x: jnp.ndarray, positions: jnp.ndarray) -> jnp.ndarray:
    """x[positions]; an out-of-range position reads NaN rows (visible in the payload) instead of
    XLA's silent clamp. `validate_positions` rejects such maps on the host."""
    return x.at[positions].get(mode="fill", fill_value=jnp.nan)


#: JAX's row operations for `kvq_jax.core.rows`.
ROW_OPS = rows.RowOps(
    take=gather_rows,
    put=lambda x, positions, values: x.at[positions].set(values),
    concat=jnp.concatenate,
    add=add_in_dtype,
    own=lambda x: x,
)


def validate_positions(positions, num_tokens: int, *, window: Window | None = None) -> None:
    """Host-side check of a position map; raises ValueError if it is not usable.

    Checks: int32, rank 1, strictly increasing (sorted and unique), every entry in
    [0, num_tokens), and with a window, that the map holds every window row (the first
    min(sink, T) and the last tokens the window keeps). Call it when you want it: it reads the
    data (a device->host transfer), so the jitted encode/decode paths never call it.
    """
    checks.host_validate_positions(np.asarray(positions), num_tokens, window=window)


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
    absolute: bool = False,
) -> KVResidual:
    """Pack `current` as a delta against the reconstructed `previous` (or on its own).

    Args:
      current: [T, H, D] (dense) or the compact rows [N, H, D] listed by `positions`.
      previous: the reconstructed predecessor, [T, H, D], same dtype as `current`.
      kind, format, group_size, axis: as for `pack_kv`; the delta is packed with them.
      positions: None (dense) or int32 [N], strictly increasing in [0, T). Only the dtype is
        checked here; `validate_positions` checks the values on the host (an out-of-range
        entry reads NaN rows, so it shows up as NaN in the payload, never as a clamped row).
      window: keep the first `sink` and last `recent` rows (of the compact rows, for a sparse
        residual, whose map must then include the window rows) raw, in the input dtype.
      absolute: pack the rows of `current` themselves (against zero), not their delta; the
        decoded rows then do not add `previous` (which still sets the shape, and the rows a
        sparse residual does not list).
    """
    checks.check_positions_dtype(positions)
    if not isinstance(absolute, bool):
        raise TypeError(f"absolute must be a bool, got {type(absolute).__name__}")
    return _encode_residual(
        current,
        previous,
        kind=kind,
        format=format,
        group_size=group_size,
        axis=axis,
        positions=positions,
        window=window,
        absolute=absolute,
    )


@functools.partial(
    jax.jit, static_argnames=("kind", "format", "group_size", "axis", "window", "absolute")
)
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
    absolute: bool = False,
) -> KVResidual:
    """Jitted body of `encode_residual` (positions dtype already checked)."""
    current, previous = jnp.asarray(current), jnp.asarray(previous)
    n, t = checks.check_pair(current, previous, positions is None)
    if positions is not None:
        positions = jnp.asarray(positions)
        checks.check_positions_layout(positions.shape, positions.dtype, n, t)
    window = check_window(window)
    head, current, tail, base = rows.encode_rows(
        current, previous, positions, window, ROW_OPS, absolute
    )
    delta = current if absolute else subtract_in_dtype(current, base)
    payload = pack_kv(delta, kind=kind, format=format, group_size=group_size, axis=axis)
    return KVResidual(
        payload=payload,
        positions=positions,
        head=head,
        tail=tail,
        shape=previous.shape,
        window=window,
        absolute=absolute,
    )


@jax.jit
def decode_residual(residual: KVResidual, previous) -> jnp.ndarray:
    """Rebuild the loop: `previous` + decoded delta on the owned rows, in the input dtype (an
    absolute residual: the decoded rows alone, `previous` not added).

    Rows a sparse residual does not list are `previous`'s rows, bit for bit; window rows are
    the stored raw rows, bit for bit.
    """
    if not isinstance(residual, KVResidual):
        raise TypeError(f"residual must be a KVResidual, got {type(residual).__name__}")
    previous = jnp.asarray(previous)
    checks.check_previous(residual, previous)
    delta = unpack_kv(residual.payload)
    return rows.decode_rows(
        previous,
        delta,
        residual.head,
        residual.tail,
        residual.positions,
        residual.window,
        ROW_OPS,
        residual.absolute,
    )
