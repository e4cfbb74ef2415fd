"""The row bookkeeping of a residual (docs/FORMAT.md section 5), written once for both stacks.

A residual encodes rows of the current loop against rows of the reconstructed previous loop:
all rows (dense) or the rows a position map lists (sparse), minus the window's raw head and
tail rows. Which rows, and how the decoded delta is put back, is the same in every stack; the
array operations are not, and each stack passes its own `RowOps`. Their hazards stay there:
JAX reads an out-of-range position as a NaN row (no silent clamp), Torch raises (CPU) or
faults (CUDA) on one; `validate_positions` rejects such maps before either sees them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvq_jax.core.window import split_rows


class RowOps(NamedTuple):
    """One stack's row operations on [R, H, D] arrays.

    take(x, positions) -> x[positions]; put(x, positions, rows) -> a copy of x with
    x[positions] = rows; concat([a, b, c]) joins along rows; add(a, b) -> a + b rounded once
    to a's dtype (`add_in_dtype`); own(x) -> x, or a copy that owns its storage (stored window
    rows must not alias a caller's tensor).
    """

    take: Any
    put: Any
    concat: Any
    add: Any
    own: Any


def encode_rows(current, previous, positions, window, ops: RowOps, absolute: bool = False):
    """(head, rows, tail, base): the raw window rows kept (None without a window), the rows of
    `current` to encode and the rows of `previous` they are encoded against (validated
    arguments; `current` holds the compact rows of a sparse residual). `absolute`: base is
    None, the rows are encoded on their own (against zero)."""
    head = tail = None
    if window is not None:
        head, current, tail = split_rows(current, window)
        head, tail = ops.own(head), ops.own(tail)
        if absolute:
            base = None
        elif positions is None:
            base = split_rows(previous, window)[1]
        else:
            base = ops.take(previous, split_rows(positions, window)[1])
    elif absolute:
        base = None
    else:
        base = previous if positions is None else ops.take(previous, positions)
    return head, current, tail, base


def decode_rows(previous, delta, head, tail, positions, window, ops: RowOps, absolute=False):
    """The reconstructed loop: `previous` with the decoded `delta` added on the encoded rows
    (`absolute`: the decoded rows themselves, nothing added) and the window rows replaced by
    the stored raw ones; rows a sparse residual does not list are `previous`'s, bit for
    bit."""

    def combine(prev_rows, decoded):
        return decoded if absolute else ops.add(prev_rows, decoded)

    if positions is None:
        if window is None:
            return combine(previous, delta)
        if absolute:
            return ops.concat([head, delta, tail])
        _, middle, _ = split_rows(previous, window)
        return ops.concat([head, ops.add(middle, delta), tail])
    if window is None:
        return ops.put(previous, positions, combine(ops.take(previous, positions), delta))
    head_pos, mid_pos, tail_pos = split_rows(positions, window)
    out = ops.put(previous, mid_pos, combine(ops.take(previous, mid_pos), delta))
    return ops.put(ops.put(out, head_pos, head), tail_pos, tail)
