"""INTB affine format family (docs/FORMAT.md section 2b), element by element.

One format per **bit table** ``bits[h][c]`` (h < H, c < D): ints in 1..8, every head's row
summing to the same ``8 * W`` (W >= 1 code bytes per (token, head) row). Groups are G
consecutive token rows of one (head, channel) (axis "tokens" only). Per group of channel
(h, c), in float32 (every operation through `scalar`: rounded and flushed), with
``L = 2**bits[h][c] - 1`` levels::

    mn    = min(group)                 (a zero minimum is +0.0)
    mx    = max(group)
    span  = mx - mn
    scale = span / L  if span > 0 else 1.0       (IEEE division by the float32 value L)
    code  = clamp(round_half_even((x - mn) / scale), 0, L)    (NaN -> 0)
    stored: minimum = f16(mn), scale = f16(scale)

A group that holds inf or NaN stores minimum = scale = NaN (0x7E00) and codes 0.
Decode: ``f32(code) * scale16 + minimum16``.

Payload ``codes: uint8[T, H, W]``: each (token, head) row is a bit stream, least
significant bit first (stream bit k is bit ``k % 8`` of byte ``k // 8``); channel c's code
bit i sits at stream bit ``o[h][c] + i`` with ``o[h][c] = sum(bits[h][:c])`` (codes may
straddle bytes). `pack_stream` / `unpack_stream` move one bit at a time, as written.

Inputs to `encode` are flat lists of float32 values that were already flushed on entry
(see `kvq_jax.oracle.widen`); outputs are flat lists of raw bit patterns.
"""

from __future__ import annotations

import numbers

from kvq_jax.oracle import affine, layout

#: Smallest and largest bit width of one channel.
MIN_WIDTH = 1
MAX_WIDTH = 8

Table = tuple[tuple[int, ...], ...]


# --------------------------------------------------------------------------- the bit table


def check_table(bits, shape=None) -> Table:
    """Validate a bit table; return it as a tuple of H tuples of D Python ints.

    `bits`: a tuple / list (or a numpy integer array, read with ``tolist``) of rows, each a
    tuple / list of ints in 1..8; every row has the same length D and the same sum, a
    positive multiple of 8. With `shape` (``[T, H, D]``) the table must be ``H x D``.
    Raises TypeError / ValueError naming `bits`.
    """
    if hasattr(bits, "tolist") and hasattr(bits, "ndim"):  # numpy array: a container only
        if bits.ndim != 2:
            raise ValueError(f"bits must be a 2-D table [H, D], got an array of rank {bits.ndim}")
        bits = bits.tolist()
    if not isinstance(bits, tuple | list):
        raise TypeError(f"bits must be a tuple of rows (tuples of ints), got {type(bits).__name__}")
    if not bits:
        raise ValueError("bits must have at least one row (one per KV head), got an empty table")
    rows = []
    for h, row in enumerate(bits):
        if not isinstance(row, tuple | list):
            raise TypeError(f"bits[{h}] must be a tuple of ints, got {type(row).__name__}")
        for c, width in enumerate(row):
            if isinstance(width, bool) or not isinstance(width, numbers.Integral):
                raise TypeError(f"bits[{h}][{c}] must be an int, got {width!r}")
            if not MIN_WIDTH <= width <= MAX_WIDTH:
                raise ValueError(
                    f"bits[{h}][{c}] must be in {MIN_WIDTH}..{MAX_WIDTH}, got {int(width)}"
                )
        rows.append(tuple(int(width) for width in row))
    n_channels = len(rows[0])
    for h, row in enumerate(rows):
        if len(row) != n_channels:
            raise ValueError(
                f"bits: every row must have the same length, row 0 has {n_channels} "
                f"and row {h} has {len(row)}"
            )
    total = sum(rows[0])
    for h, row in enumerate(rows):
        if sum(row) != total:
            raise ValueError(
                f"bits: every row must have the same sum, row 0 sums to {total} "
                f"and row {h} to {sum(row)}"
            )
    if total % 8:
        raise ValueError(f"bits: the row sum must be a multiple of 8, got {total}")
    if shape is not None:
        _, n_heads, n_chan = shape
        if (len(rows), n_channels) != (n_heads, n_chan):
            raise ValueError(
                f"bits must be an [H, D] = [{n_heads}, {n_chan}] table for values of shape "
                f"{tuple(shape)}, got [{len(rows)}, {n_channels}]"
            )
    return tuple(rows)


def row_bytes(bits: Table) -> int:
    """W: code bytes per (token, head) row (the row sum / 8) of a checked table."""
    return sum(bits[0]) // 8


def offsets(row: tuple[int, ...]) -> list[int]:
    """``o[c] = sum(row[:c])``: the first stream bit of each channel's code."""
    result = []
    position = 0
    for width in row:
        result.append(position)
        position += width
    return result


def packed_shape(shape, bits: Table) -> tuple[int, int, int]:
    """Shape of the payload: ``[T, H, W]``."""
    n_tokens, n_heads, _ = shape
    return (n_tokens, n_heads, row_bytes(bits))


# --------------------------------------------------------------------------- bit stream


def pack_stream(codes: list[int], shape, bits: Table) -> list[int]:
    """Flat codes of ``[T, H, D]`` -> flat bytes of ``[T, H, W]``, one bit at a time.

    Bit i of channel c's code goes to stream bit ``k = o[h][c] + i``: bit ``k % 8`` of byte
    ``k // 8`` of its (token, head) row.
    """
    n_tokens, n_heads, n_channels = shape
    n_bytes = row_bytes(bits)
    starts = [offsets(row) for row in bits]
    out = []
    for t in range(n_tokens):
        for h in range(n_heads):
            row = [0] * n_bytes
            for c in range(n_channels):
                width = bits[h][c]
                code = codes[layout.element_index(shape, t, h, c)]
                if not 0 <= code < 2**width:
                    raise ValueError(f"a {width}-bit code must be in 0..{2**width - 1}")
                for i in range(width):
                    k = starts[h][c] + i
                    row[k // 8] |= ((code >> i) & 1) << (k % 8)
            out.extend(row)
    return out


def unpack_stream(payload: list[int], shape, bits: Table) -> list[int]:
    """Flat bytes of ``[T, H, W]`` -> flat codes of ``[T, H, D]`` (every stream bit belongs
    to one code: the row sum is exactly 8 W, so there is no padding to check)."""
    n_tokens, n_heads, n_channels = shape
    n_bytes = row_bytes(bits)
    starts = [offsets(row) for row in bits]
    codes = []
    for t in range(n_tokens):
        for h in range(n_heads):
            row = payload[(t * n_heads + h) * n_bytes : (t * n_heads + h + 1) * n_bytes]
            for c in range(n_channels):
                code = 0
                for i in range(bits[h][c]):
                    k = starts[h][c] + i
                    code |= ((row[k // 8] >> (k % 8)) & 1) << i
                codes.append(code)
    return codes


# --------------------------------------------------------------------------- arithmetic


def encode_group(xs: list[float], width: int) -> tuple[list[int], int, int]:
    """One group's float32 values, `width`-bit codes -> (codes 0..L, minimum f16 bits,
    scale f16 bits), ``L = 2**width - 1`` (`affine.encode_group`)."""
    return affine.encode_group(xs, 2**width - 1)


def _channel_of_group(m: int, shape) -> tuple[int, int]:
    """(h, c) of the group whose metadata sits at flat index m of ``[ceil(T/G), H, D]``."""
    _, n_heads, n_channels = shape
    return (m // n_channels) % n_heads, m % n_channels


def encode(xs: list[float], shape, group_size: int, bits: Table) -> dict[str, list[int]]:
    """Flat float32 values of `shape` -> raw bits: codes (bytes), minimum, scale (f16).

    `bits` must be a table checked against `shape` (`check_table`)."""

    def levels_of(m: int) -> int:
        h, c = _channel_of_group(m, shape)
        return 2 ** bits[h][c] - 1

    codes, minimum, scale = affine.encode_groups(xs, shape, "tokens", group_size, levels_of)
    return {"codes": pack_stream(codes, shape, bits), "minimum": minimum, "scale": scale}


def decode(bits_in: dict[str, list[int]], shape, group_size: int, bits: Table) -> list[float]:
    """Raw bits -> flat float32 values ``code * scale16 + minimum16``."""
    codes = unpack_stream(bits_in["codes"], shape, bits)
    return affine.decode_groups(codes, bits_in, shape, "tokens", group_size)
