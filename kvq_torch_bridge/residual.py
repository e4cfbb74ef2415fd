"""Cross-loop residuals in torch (mirrors kvq_jax.residual, same bytes):

    D_l = X_l - R_{l-1}              (in the input dtype)
    R_l = R_{l-1} + decode(pack(D_l))  (in the input dtype)

Sparse residuals store only some rows: compact rows [N, H, D] and an owned int32 position map
into [0, T); absent rows inherit R_{l-1}. With a window, the first `sink` and last `recent`
(compact) rows are stored raw. Encode and decode never read data back to the host; the position
map is trusted (check it with `validate_positions`, which does read it).
"""

from __future__ import annotations

import numpy as np
import torch

from kvq_jax import residual as _jax_residual
from kvq_jax.window import Window, check_window, split_rows
from kvq_torch_bridge._dtypes import dtype_name, numpy_dtype
from kvq_torch_bridge._numerics import add_in_dtype, subtract_in_dtype
from kvq_torch_bridge.api import own_rows, pack_kv, unpack_kv
from kvq_torch_bridge.codec import check_values
from kvq_torch_bridge.packed import KVResidual

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
    dtype = numpy_dtype(positions.dtype) or dtype_name(positions.dtype)
    _jax_residual.check_positions_layout(tuple(positions.shape), dtype, rows, num_tokens)
    return positions


def _check_pair(current, previous, positions):
    n, t = _jax_residual.check_pair_layout(
        check_values(current, "current"), check_values(previous, "previous"), positions is None
    )
    return _check_positions_static(positions, n, t, previous.device)


def validate_positions(positions, num_tokens: int, *, window: Window | None = None) -> None:
    """Host-side check of a position map (torch tensor or numpy array); raises ValueError if
    it is not usable. Same checks and messages as `kvq_jax.validate_positions`: int32, rank 1,
    strictly increasing, in [0, num_tokens), and with a window every window row present. It
    copies the map to the host, so the encode/decode paths never call it."""
    if isinstance(positions, torch.Tensor):
        if positions.dtype != torch.int32:
            raise ValueError(f"positions must have dtype int32, got {dtype_name(positions.dtype)}")
        positions = positions.detach().cpu().numpy()
    _jax_residual.validate_positions(positions, num_tokens, window=window)


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
) -> KVResidual:
    """Pack `current` as a delta against the reconstructed `previous` (same bytes as
    `kvq_jax.encode_residual`).

    Args:
      current: [T, H, D] (dense) or the compact rows [N, H, D] listed by `positions`.
      previous: the reconstructed predecessor, [T, H, D], same dtype as `current`.
      kind, format, group_size, axis: as for `pack_kv`; the delta is packed with them.
      positions: None (dense) or int32 [N] (torch tensor or numpy array), strictly increasing
        in [0, T) (not checked here: see `validate_positions`). Stored as an owned copy on
        `previous.device`.
      window: keep the first `sink` and last `recent` rows (of the compact rows, for a sparse
        residual, whose map must then include the window rows) raw, in the input dtype.
    """
    positions = _check_pair(current, previous, positions)
    window = check_window(window)
    head = tail = None
    if positions is not None:
        positions = own_rows(positions.to(previous.device))
    if window is not None:
        head, current, tail = split_rows(current, window)
        head, tail = own_rows(head), own_rows(tail)
        if positions is not None:
            _, positions_mid, _ = split_rows(positions, window)
            base = previous[positions_mid]
        else:
            base = split_rows(previous, window)[1]
    else:
        base = previous if positions is None else previous[positions]
    delta = subtract_in_dtype(current, base)
    payload = pack_kv(delta, kind=kind, format=format, group_size=group_size, axis=axis)
    return KVResidual(
        payload=payload,
        positions=positions,
        head=head,
        tail=tail,
        shape=tuple(previous.shape),
        window=window,
    )


@torch.no_grad()
def decode_residual(residual: KVResidual, previous: torch.Tensor) -> torch.Tensor:
    """Rebuild the loop: `previous` + decoded delta on the owned rows, in the input dtype.

    Rows a sparse residual does not list are `previous`'s rows, bit for bit; window rows are
    the stored raw rows, bit for bit. Returns a new tensor (`previous` is not modified).
    """
    if not isinstance(residual, KVResidual):
        raise TypeError(f"residual must be a KVResidual, got {type(residual).__name__}")
    _jax_residual.check_previous(residual, *check_values(previous, "previous"))
    delta = unpack_kv(residual.payload)
    window, positions = residual.window, residual.positions
    if positions is None:
        if window is None:
            return add_in_dtype(previous, delta)
        _, middle, _ = split_rows(previous, window)
        return torch.cat([residual.head, add_in_dtype(middle, delta), residual.tail])
    if window is None:
        return previous.index_put((positions,), add_in_dtype(previous[positions], delta))
    head_pos, mid_pos, tail_pos = split_rows(positions, window)
    out = previous.index_put((mid_pos,), add_in_dtype(previous[mid_pos], delta))
    return out.index_put((head_pos,), residual.head).index_put((tail_pos,), residual.tail)
