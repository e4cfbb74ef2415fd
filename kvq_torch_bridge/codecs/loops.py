"""Loop stacks in torch (mirrors kvq_jax.codecs.loops, same bytes): loop 0 packed whole (the base),
loop l >= 1 a `KVResidual` against the reconstruction of loop l - 1 (or, listed in
`absolute`, packed on its own), 0-based loops.

Torch runs the loops as a plain Python loop (kvq_jax uses `lax.scan` for dense stacks); the
bytes are the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils import _pytree as pytree

from kvq_jax.core import checks
from kvq_jax.core.containers import LoopCodeBase
from kvq_jax.core.window import Window
from kvq_torch_bridge.codecs._dtypes import meta
from kvq_torch_bridge.codecs.api import pack_kv, unpack_kv
from kvq_torch_bridge.codecs.registry import get_codec
from kvq_torch_bridge.codecs.residual import decode_residual, encode_residual

__all__ = ["LoopCode", "decode_loop", "decode_loops", "encode_loops"]


class LoopCode(LoopCodeBase):
    """A packed loop stack of torch tensors: `base` (loop 0) and one `KVResidual` per later
    loop."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return self.base.torch_dtype


pytree.register_pytree_node(
    LoopCode,
    lambda code: ([code.base, code.residuals], None),
    lambda children, _: LoopCode(base=children[0], residuals=tuple(children[1])),
    serialized_type_name=f"{LoopCode.__module__}.LoopCode",
    flatten_with_keys_fn=lambda code: (
        [(pytree.GetAttrKey("base"), code.base), (pytree.GetAttrKey("residuals"), code.residuals)],
        None,
    ),
)


@torch.no_grad()
def encode_loops(
    loops: torch.Tensor,
    *,
    kind: str,
    base_format: str = "int4",
    residual_format: str | Sequence[str] | None = None,
    group_size: int | None = None,
    residual_group_size: int | None = None,
    axis: str | None = None,
    positions=None,
    window: Window | None = None,
    absolute: Sequence[int] | None = None,
) -> LoopCode:
    """Pack a loop stack `loops` [L, T, H, D] (L >= 1) as a base plus L - 1 residuals.

    Arguments as for `kvq_jax.encode_loops` (`residual_format`: one name, or one per later
    loop; `absolute`: the later loops packed on their own); `positions` entries are None or
    int32 [N_l]
    torch tensors / numpy arrays.
    """
    if not isinstance(loops, torch.Tensor):
        raise TypeError(f"loops must be a torch.Tensor, got {type(loops).__name__}")
    checks.check_loop_stack(meta(loops))
    streams, positions, window = checks.resolve_loop_streams(
        loops.shape,
        base_format,
        residual_format,
        group_size,
        residual_group_size,
        positions,
        window,
        get_codec,
    )
    flags = checks.absolute_flags(absolute, loops.shape[0])

    base = pack_kv(
        loops[0], kind=kind, format=base_format, group_size=group_size, axis=axis, window=window
    )
    recon = unpack_kv(base)
    residuals = []
    for current, pos, (fmt, group), flag in zip(loops[1:], positions, streams, flags, strict=True):
        if pos is not None and not isinstance(pos, torch.Tensor):
            pos = torch.from_numpy(np.array(pos, copy=True)).to(loops.device)
        rows = current if pos is None else current[pos]
        residual = encode_residual(
            rows,
            recon,
            kind=kind,
            format=fmt,
            group_size=group,
            axis=axis,
            positions=pos,
            window=window,
            absolute=flag,
        )
        recon = decode_residual(residual, recon)
        residuals.append(residual)
    return LoopCode(base=base, residuals=tuple(residuals))


def _check_code(code):
    if not isinstance(code, LoopCode):
        raise TypeError(f"code must be a LoopCode, got {type(code).__name__}")


@torch.no_grad()
def decode_loops(code: LoopCode) -> torch.Tensor:
    """Every loop reconstructed: [L, T, H, D] in the input dtype."""
    _check_code(code)
    recon = unpack_kv(code.base)
    out = [recon]
    for residual in code.residuals:
        recon = decode_residual(residual, recon)
        out.append(recon)
    return torch.stack(out)


@torch.no_grad()
def decode_loop(code: LoopCode, *, loop: int) -> torch.Tensor:
    """Loop `loop` (0-based) reconstructed, [T, H, D], carrying one running reconstruction
    through the residuals instead of materializing every loop (from the last dense absolute
    loop at or before `loop`, which needs no predecessor)."""
    _check_code(code)
    loop = checks.check_loop_index(loop, code.num_loops)
    dense_absolute = [
        i + 1 for i, r in enumerate(code.residuals[:loop]) if r.absolute and r.positions is None
    ]
    start = max(dense_absolute, default=0)
    if start:
        first = code.residuals[start - 1]
        zeros = torch.zeros(first.shape, dtype=first.torch_dtype, device=first.payload.device)
        recon = decode_residual(first, zeros)
    else:
        recon = unpack_kv(code.base)
    for residual in code.residuals[start:loop]:
        recon = decode_residual(residual, recon)
    return recon
