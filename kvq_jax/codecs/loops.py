"""Loop stacks: the KV of one layer across all loops of a looped LM, in one jitted call.

Loop 0 is packed whole (the base); loop l >= 1 is a `KVResidual` against the reconstruction of
loop l - 1, each later loop in one residual format or in its own (per-loop bit choices), or,
for the loops listed in `absolute`, packed on its own (a `KVResidual` with `absolute=True`: no
delta, its reconstruction does not add loop l - 1's).
Dense residual loops in one format run as one `lax.scan` whose carry is the running
reconstruction; sparse loops (their own position maps, e.g. 25% of tokens in loop 2 and a
10% subset in loop 3, 0-based) and per-loop formats run as unrolled steps inside the same jit
with static shapes.
Loops are numbered from 0: `decode_loop(code, loop=l) == decode_loops(code)[l]`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from kvq_jax.codecs.api import pack_kv, unpack_kv
from kvq_jax.codecs.registry import get_codec
from kvq_jax.codecs.residual import decode_residual, encode_residual, gather_rows
from kvq_jax.core import checks
from kvq_jax.core.containers import LoopCodeBase
from kvq_jax.core.window import Window


class LoopCode(LoopCodeBase):
    """A packed loop stack of jax arrays: `base` (loop 0) and one `KVResidual` per later
    loop."""


jax.tree_util.register_dataclass(LoopCode, data_fields=["base", "residuals"], meta_fields=[])


def encode_loops(
    loops,
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

    Args:
      kind, axis: as for `pack_kv`, for every loop.
      base_format / residual_format: formats of loop 0 and of the deltas (default: the same);
        residual_format may also name one format per later loop (a sequence of L - 1 names,
        e.g. FlashLoop's values at 4/4/2/2 bits: base "int4", ("int4", "int2", "int2")).
      group_size: group size of the base (and of the residuals when they share its format).
      residual_group_size: group size of the residuals (default: `group_size` for a loop in
        the base's format, else that loop's format's default).
      positions: None (every later loop dense) or a sequence of L - 1 entries, each None
        (dense) or int32 [N_l] rows of that loop (see `validate_positions`).
      window: raw window rows for the base and every residual.
      absolute: None or the later loops (0-based, in [1, L)) stored absolute: packed on their
        own, encoded against zero instead of the reconstructed previous loop (for loops that
        do not converge). Loop 0 or an index out of range is a ValueError naming `absolute`.
    """
    if positions is not None and isinstance(positions, Sequence) and not isinstance(positions, str):
        for i, p in enumerate(positions):
            checks.check_positions_dtype(p, f"positions[{i}]")
    if isinstance(residual_format, list):
        residual_format = tuple(residual_format)  # a static jit argument must be hashable
    if absolute is not None:
        if isinstance(absolute, str) or not isinstance(absolute, Sequence):
            raise TypeError(
                "absolute must be None or a sequence of loop indices (0-based, in [1, L)), "
                f"got {type(absolute).__name__}"
            )
        absolute = tuple(absolute)  # a static jit argument must be hashable
    return _encode_loops(
        loops,
        kind=kind,
        base_format=base_format,
        residual_format=residual_format,
        group_size=group_size,
        residual_group_size=residual_group_size,
        axis=axis,
        positions=positions,
        window=window,
        absolute=absolute,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "kind",
        "base_format",
        "residual_format",
        "group_size",
        "residual_group_size",
        "axis",
        "window",
        "absolute",
    ),
)
def _encode_loops(
    loops,
    *,
    kind: str,
    base_format: str = "int4",
    residual_format: str | tuple[str, ...] | None = None,
    group_size: int | None = None,
    residual_group_size: int | None = None,
    axis: str | None = None,
    positions=None,
    window: Window | None = None,
    absolute: tuple[int, ...] | None = None,
) -> LoopCode:
    """Jitted body of `encode_loops` (position dtypes already checked)."""
    loops = jnp.asarray(loops)
    checks.check_loop_stack(loops)
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
    encode = functools.partial(encode_residual, kind=kind, axis=axis, window=window)

    if all(p is None for p in positions) and len(set(streams)) == 1 and not any(flags):
        fmt, group = streams[0]  # one format for every later loop: one scan

        def step(previous, current):
            residual = encode(current, previous, format=fmt, group_size=group)
            return decode_residual(residual, previous), residual

        _, stacked = jax.lax.scan(step, recon, loops[1:])
        residuals = tuple(
            jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(loops.shape[0] - 1)
        )
        return LoopCode(base=base, residuals=residuals)

    residuals = []
    for current, pos, (fmt, group), flag in zip(loops[1:], positions, streams, flags, strict=True):
        rows = current if pos is None else gather_rows(current, jnp.asarray(pos))
        residual = encode(rows, recon, format=fmt, group_size=group, positions=pos, absolute=flag)
        recon = decode_residual(residual, recon)
        residuals.append(residual)
    return LoopCode(base=base, residuals=tuple(residuals))


def _check_code(code):
    if not isinstance(code, LoopCode):
        raise TypeError(f"code must be a LoopCode, got {type(code).__name__}")


@jax.jit
def decode_loops(code: LoopCode) -> jnp.ndarray:
    """Every loop reconstructed: [L, T, H, D] in the input dtype."""
    _check_code(code)
    recon = unpack_kv(code.base)
    out = [recon]
    for residual in code.residuals:
        recon = decode_residual(residual, recon)
        out.append(recon)
    return jnp.stack(out)


@functools.partial(jax.jit, static_argnames=("loop",))
def decode_loop(code: LoopCode, *, loop: int) -> jnp.ndarray:
    """Loop `loop` (0-based) reconstructed, [T, H, D], carrying one running reconstruction
    through the residuals instead of materializing every loop (from the last dense absolute
    loop at or before `loop`, which needs no predecessor)."""
    _check_code(code)
    loop = checks.check_loop_index(loop, code.num_loops)
    start = _last_dense_absolute(code.residuals[:loop])
    if start:
        first = code.residuals[start - 1]
        recon = decode_residual(first, jnp.zeros(first.shape, first.dtype))
    else:
        recon = unpack_kv(code.base)
    for residual in code.residuals[start:loop]:
        recon = decode_residual(residual, recon)
    return recon


def _last_dense_absolute(residuals) -> int:
    """The loop (1-based residual count) of the last dense absolute residual, else 0."""
    return max(
        (i + 1 for i, r in enumerate(residuals) if r.absolute and r.positions is None), default=0
    )
