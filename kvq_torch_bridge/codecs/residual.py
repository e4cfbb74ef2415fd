"""Cross-loop residuals in torch (mirrors kvq_jax.codecs.residual, same bytes):

    D_l = X_l - R_{l-1}              (in the input dtype)
    R_l = R_{l-1} + decode(pack(D_l))  (in the input dtype)

An absolute residual packs the rows themselves: R_l = decode(pack(X_l)) on its rows.
Sparse residuals store only some rows: compact rows [N, H, D] and an owned int32 position map
into [0, T); absent rows inherit R_{l-1}. With a window, the first `sink` and last `recent`
(compact) rows are stored raw. Encode and decode never read data back to the host; the position
map is trusted (check it with `validate_positions`, which does read it).
"""

from __future__ import annotations

import numpy as np
import torch

from kvq_jax.core import checks, rows
from kvq_jax.core.window import Window, check_window
from kvq_torch_bridge.codecs._dtypes import dtype_name, meta
from kvq_torch_bridge.codecs._numerics import add_in_dtype, subtract_in_dtype
from kvq_torch_bridge.codecs.api import own_rows, pack_kv, unpack_kv
from kvq_torch_bridge.codecs.codec import check_values
from kvq_torch_bridge.codecs.packed import KVResidual

__all__ = ["KVResidual", "decode_residual", "encode_residual", "validate_positions"]


def _as_index_tensor(positions, device) -> torch.Tensor:
    if isinstance(positions, torch.Tensor):
        return positions
    return torch.from_numpy(np.array(positions, copy=True)).to(device)


def _check_positions_static(positions, rows: int, num_tokens: int, device):
    """Checks of a position map from its shape and dtype alone (no data read)."""
    if positions is None:
        return None
    positions = _as_index_tensor(positions, device)
    m = meta(positions)
    checks.check_positions_layout(m.shape, dtype_name(m.dtype), rows, num_tokens)
    return positions


def _check_pair(current, previous, positions):
    check_values(current, "current")
    check_values(previous, "previous")
    n, t = checks.check_pair(meta(current), meta(previous), positions is None)
    return _check_positions_static(positions, n, t, previous.device)


#: Torch's row operations for `kvq_jax.core.rows`.
ROW_OPS = rows.RowOps(
    take=lambda x, positions: x[positions],
    put=lambda x, positions, values: x.index_put((positions,), values),
    concat=torch.cat,
    add=add_in_dtype,
    own=own_rows,
)


def validate_positions(positions, num_tokens: int, *, window: Window | None = None) -> None:
    """Host-side check of a position map (torch tensor or numpy array); raises ValueError if
    it is not usable. Same checks and messages as `kvq_jax.validate_positions`: int32, rank 1,
    strictly increasing, in [0, num_tokens), and with a window every window row present. It
    copies the map to the host, so the encode/decode paths never call it."""
    if isinstance(positions, torch.Tensor):
        if positions.dtype != torch.int32:
            raise ValueError(f"positions must have dtype int32, got {dtype_name(positions.dtype)}")
        positions = positions.detach().cpu().numpy()
    checks.host_validate_positions(positions, num_tokens, window=window)


@torch.no_grad()
def encode_residual(
    current: torch.Tensor,
    previous: torch.Tensor,
    *,
    kind: str,
    format: str = "int4",
    group_size: int | None = None,
    axis: str | None = None,
    positions=None,
    window: Window | None = None,
    absolute: bool = False,
) -> KVResidual:
    """Pack `current` as a delta against the reconstructed `previous`, or on its own
    (`absolute`) (same bytes as `kvq_jax.encode_residual`).

    Args:
      current: [T, H, D] (dense) or the compact rows [N, H, D] listed by `positions`.
      previous: the reconstructed predecessor, [T, H, D], same dtype as `current`.
      kind, format, group_size, axis: as for `pack_kv`; the delta is packed with them.
      positions: None (dense) or int32 [N] (torch tensor or numpy array), strictly increasing
        in [0, T) (not checked here: see `validate_positions`). Stored as an owned copy on
        `previous.device`.
      window: keep the first `sink` and last `recent` rows (of the compact rows, for a sparse
        residual, whose map must then include the window rows) raw, in the input dtype.
      absolute: pack the rows of `current` themselves (against zero), not their delta; the
        decoded rows then do not add `previous`.
    """
    if not isinstance(absolute, bool):
        raise TypeError(f"absolute must be a bool, got {type(absolute).__name__}")
    positions = _check_pair(current, previous, positions)
    window = check_window(window)
    if positions is not None:
        positions = own_rows(positions.to(previous.device))
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
        shape=tuple(previous.shape),
        window=window,
        absolute=absolute,
    )


@torch.no_grad()
def decode_residual(residual: KVResidual, previous: torch.Tensor) -> torch.Tensor:
    """Rebuild the loop: `previous` + decoded delta on the owned rows, in the input dtype (an
    absolute residual: the decoded rows alone, `previous` not added).

    Rows a sparse residual does not list are `previous`'s rows, bit for bit; window rows are
    the stored raw rows, bit for bit. Returns a new tensor (`previous` is not modified).
    """
    if not isinstance(residual, KVResidual):
        raise TypeError(f"residual must be a KVResidual, got {type(residual).__name__}")
    check_values(previous, "previous")
    checks.check_previous(residual, meta(previous))
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
