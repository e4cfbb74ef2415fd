"""Scalar oracle for cross-loop residuals, the BF16 window and loop stacks (plain Python).

Follows kvq_jax.codecs.residual / kvq_jax.codecs.loops semantics from their definitions, sharing no
code with them: deltas and sums are one float32 operation per element (flushed) rounded to the input
dtype; rows are moved with numpy indexing (containers only, no numpy arithmetic).

    D_l = X_l - R_{l-1};  R_l = R_{l-1} + unpack(pack(D_l))      (input dtype)
    absolute loop l:      R_l = unpack(pack(X_l))               (on the rows it owns)

A window is anything with integer `sink` and `recent` attributes (e.g. kvq_jax.Window).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvq_jax import oracle
from kvq_jax.oracle import scalar


@dataclasses.dataclass(frozen=True, eq=False)
class OracleWindowed:
    """Window rows stored raw (head, tail) and the packed middle rows."""

    head: np.ndarray
    tail: np.ndarray
    middle: oracle.OraclePacked


@dataclasses.dataclass(frozen=True, eq=False)
class OracleResidual:
    """A residual: packed delta of the quantized rows (absolute: the rows themselves), owned
    positions, raw window rows."""

    payload: oracle.OraclePacked
    positions: np.ndarray | None
    head: np.ndarray | None
    tail: np.ndarray | None
    absolute: bool = False


def _elementwise(a: np.ndarray, b: np.ndarray, op) -> np.ndarray:
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"operands differ: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
    xs = [op(x, y) for x, y in zip(oracle.widen(a), oracle.widen(b), strict=True)]
    return oracle._from_bits(oracle._cast_out_bits(xs, a.dtype), a.dtype, a.shape)


def subtract(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a - b element by element: one flushed float32 subtraction, rounded to a.dtype."""
    return _elementwise(a, b, scalar.sub)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b element by element: one flushed float32 addition, rounded to a.dtype."""
    return _elementwise(a, b, scalar.add)


def split_sizes(window, rows: int) -> tuple[int, int, int]:
    """(head, middle, tail) row counts: head = min(sink, rows), tail from what is left."""
    head = min(window.sink, rows)
    tail = min(window.recent, rows - head)
    return head, rows - head - tail, tail


def _split(x: np.ndarray, window):
    head, middle, _ = split_sizes(window, x.shape[0])
    return x[:head], x[head : head + middle], x[head + middle :]


def pack_windowed(values: np.ndarray, *, window, **pack_args) -> OracleWindowed:
    """Keep the window rows raw and pack the middle rows with `oracle.pack(**pack_args)`."""
    head, middle, tail = _split(values, window)
    return OracleWindowed(
        head=head.copy(), tail=tail.copy(), middle=oracle.pack(middle, **pack_args)
    )


def unpack_any(enc) -> np.ndarray:
    """Decode an OraclePacked or an OracleWindowed in its input dtype."""
    if isinstance(enc, OracleWindowed):
        return np.concatenate([enc.head, oracle.unpack(enc.middle), enc.tail])
    return oracle.unpack(enc)


def encode_residual(
    current,
    previous,
    *,
    kind,
    format,
    group_size=None,
    axis=None,
    positions=None,
    window=None,
    absolute=False,
) -> OracleResidual:
    """Residual of `current` (dense [T,H,D] or compact [N,H,D] rows at `positions`);
    `absolute`: the rows are packed as they are, `previous` is not subtracted."""
    head = tail = None
    rows = np.arange(previous.shape[0]) if positions is None else np.asarray(positions)
    if window is not None:
        head, current, tail = (a.copy() for a in _split(current, window))
        rows = _split(rows, window)[1]
    delta = current if absolute else subtract(current, previous[rows])
    payload = oracle.pack(delta, format=format, kind=kind, group_size=group_size, axis=axis)
    pos = None if positions is None else np.asarray(positions).copy()
    return OracleResidual(payload=payload, positions=pos, head=head, tail=tail, absolute=absolute)


def decode_residual(res: OracleResidual, previous: np.ndarray, window=None) -> np.ndarray:
    """previous with the owned rows replaced: raw window rows, or previous + decoded delta
    (absolute: the decoded rows alone)."""
    out = previous.copy()
    rows = np.arange(previous.shape[0]) if res.positions is None else res.positions
    if window is not None:
        head_rows, rows, tail_rows = _split(rows, window)
        out[head_rows] = res.head
        out[tail_rows] = res.tail
    decoded = oracle.unpack(res.payload)
    out[rows] = decoded if res.absolute else add(previous[rows], decoded)
    return out


def encode_loops(
    loops,
    *,
    kind,
    base_format="int4",
    residual_format=None,
    group_size=None,
    residual_group_size=None,
    axis=None,
    positions=None,
    window=None,
    absolute=None,
):
    """Loop stack [L, T, H, D] -> (base, [residual per later loop]), closed loop.

    residual_format: None (the base's), one name, or one name per later loop. A later loop in
    the base's format takes `group_size` unless `residual_group_size` is given; another
    format its own default. absolute: None or the later loops (in [1, L)) packed on their own
    instead of as deltas."""
    n_res = loops.shape[0] - 1
    if residual_format is None or isinstance(residual_format, str):
        formats = [base_format if residual_format is None else residual_format] * n_res
    else:
        formats = list(residual_format)  # one format per later loop
        if len(formats) != n_res:
            raise ValueError(f"residual_format: expected {n_res} formats, got {len(formats)}")
    base_args = dict(format=base_format, kind=kind, group_size=group_size, axis=axis)
    if window is None:
        base = oracle.pack(loops[0], **base_args)
    else:
        base = pack_windowed(loops[0], window=window, **base_args)
    recon = unpack_any(base)
    positions = [None] * (loops.shape[0] - 1) if positions is None else list(positions)
    absolute = set() if absolute is None else set(absolute)
    if not absolute <= set(range(1, loops.shape[0])):
        raise ValueError(f"absolute: loops must lie in [1, {loops.shape[0]}), got {absolute}")
    residuals = []
    for loop, (current, pos, fmt) in enumerate(
        zip(loops[1:], positions, formats, strict=True), start=1
    ):
        rows = current if pos is None else current[np.asarray(pos)]
        group = residual_group_size
        if group is None and fmt == base_format:
            group = group_size
        res = encode_residual(
            rows,
            recon,
            kind=kind,
            format=fmt,
            group_size=group,
            axis=axis,
            positions=pos,
            window=window,
            absolute=loop in absolute,
        )
        recon = decode_residual(res, recon, window)
        residuals.append(res)
    return base, residuals


def decode_loops(base, residuals, window=None) -> np.ndarray:
    """Every loop reconstructed, [L, T, H, D]."""
    recon = unpack_any(base)
    out = [recon]
    for res in residuals:
        recon = decode_residual(res, recon, window)
        out.append(recon)
    return np.stack(out)
