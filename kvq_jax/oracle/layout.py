"""Group membership and nibble packing (docs/FORMAT.md section 1), with plain index lists.

Values are handled as flat Python lists in row-major (C) order of ``[T, H, D]``: element
``(t, h, d)`` sits at ``(t * H + h) * D + d``. Metadata arrays are flat lists in row-major
order of their own shape.

axis "tokens":   a group is G consecutive token rows of one (head, channel);
                 metadata shape ``[ceil(T/G), H, D]``.
axis "channels": a group is G consecutive channels of one (token, head);
                 metadata shape ``[T, H, ceil(D/G)]``.
The last group may be partial; it simply has fewer members (nothing is padded).
"""

from __future__ import annotations

AXES = ("tokens", "channels")

Shape = tuple[int, int, int]


def ceil_div(n: int, d: int) -> int:
    """ceil(n / d) for n >= 0, d >= 1."""
    return -(-n // d)


def element_index(shape: Shape, t: int, h: int, d: int) -> int:
    """Flat row-major index of element (t, h, d)."""
    _, n_heads, n_channels = shape
    return (t * n_heads + h) * n_channels + d


def metadata_shape(shape: Shape, axis: str, group_size: int) -> Shape:
    """Shape of one per-group metadata array."""
    n_tokens, n_heads, n_channels = shape
    if axis == "tokens":
        return (ceil_div(n_tokens, group_size), n_heads, n_channels)
    if axis == "channels":
        return (n_tokens, n_heads, ceil_div(n_channels, group_size))
    raise ValueError(f"axis must be one of {AXES}, got {axis!r}")


def groups(shape: Shape, axis: str, group_size: int) -> list[list[int]]:
    """Members of every group: ``result[m]`` lists the flat element indices of the group
    whose metadata sits at flat index ``m`` (row-major over `metadata_shape`)."""
    n_tokens, n_heads, n_channels = shape
    g = group_size
    result = []
    if axis == "tokens":
        for i in range(ceil_div(n_tokens, g)):
            for h in range(n_heads):
                for d in range(n_channels):
                    tokens = range(i * g, min(n_tokens, (i + 1) * g))
                    result.append([element_index(shape, t, h, d) for t in tokens])
    elif axis == "channels":
        for t in range(n_tokens):
            for h in range(n_heads):
                for j in range(ceil_div(n_channels, g)):
                    channels = range(j * g, min(n_channels, (j + 1) * g))
                    result.append([element_index(shape, t, h, d) for d in channels])
    else:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    return result


def group_of_elements(shape: Shape, axis: str, group_size: int) -> list[int]:
    """For every flat element index, the flat metadata index of its group."""
    n_tokens, n_heads, n_channels = shape
    owner = [-1] * (n_tokens * n_heads * n_channels)
    for m, members in enumerate(groups(shape, axis, group_size)):
        for e in members:
            owner[e] = m
    return owner


def rows(shape: Shape) -> list[list[int]]:
    """Members of every (token, head) row, in row-major order of ``[T, H]`` (FP8's groups;
    unlike ``groups(shape, "channels", D)`` this also has one (empty) row per (t, h) when
    D == 0)."""
    n_tokens, n_heads, n_channels = shape
    return [
        [element_index(shape, t, h, d) for d in range(n_channels)]
        for t in range(n_tokens)
        for h in range(n_heads)
    ]


def packed_shape(shape: Shape) -> Shape:
    """Shape of the nibble payload: ``[T, H, ceil(D/2)]``."""
    n_tokens, n_heads, n_channels = shape
    return (n_tokens, n_heads, ceil_div(n_channels, 2))


def pack_nibbles(codes: list[int], shape: Shape) -> list[int]:
    """Flat 4-bit codes of ``[T, H, D]`` -> flat bytes of ``[T, H, ceil(D/2)]``.

    Byte j of a (t, h) row holds channel 2j in bits 0-3 and channel 2j+1 in bits 4-7; for
    odd D the last high nibble is 0.
    """
    n_tokens, n_heads, n_channels = shape
    out = []
    for t in range(n_tokens):
        for h in range(n_heads):
            for j in range(ceil_div(n_channels, 2)):
                low = codes[element_index(shape, t, h, 2 * j)]
                high = codes[element_index(shape, t, h, 2 * j + 1)] if 2 * j + 1 < n_channels else 0
                if not (0 <= low <= 0xF and 0 <= high <= 0xF):
                    raise ValueError("nibble codes must be in 0..15")
                out.append(low | (high << 4))
    return out


def unpack_nibbles(payload: list[int], shape: Shape) -> list[int]:
    """Flat bytes of ``[T, H, ceil(D/2)]`` -> flat 4-bit codes of ``[T, H, D]``.

    Raises ValueError if an odd-D padding nibble is not 0 (that is not a valid payload).
    """
    n_tokens, n_heads, n_channels = shape
    n_bytes = ceil_div(n_channels, 2)
    codes = []
    for t in range(n_tokens):
        for h in range(n_heads):
            for j in range(n_bytes):
                byte = payload[(t * n_heads + h) * n_bytes + j]
                codes.append(byte & 0xF)
                if 2 * j + 1 < n_channels:
                    codes.append(byte >> 4)
                elif byte >> 4:
                    raise ValueError(
                        f"codes: padding nibble of (t={t}, h={h}) is {byte >> 4:#x}, not 0"
                    )
    return codes


def packed_shape_2bit(shape: Shape) -> Shape:
    """Shape of a 2-bit payload: ``[T, H, ceil(D/4)]``."""
    n_tokens, n_heads, n_channels = shape
    return (n_tokens, n_heads, ceil_div(n_channels, 4))


def pack_2bit(codes: list[int], shape: Shape) -> list[int]:
    """Flat 2-bit codes of ``[T, H, D]`` -> flat bytes of ``[T, H, ceil(D/4)]``.

    Byte j of a (t, h) row holds channel 4j + i in bits 2i .. 2i + 1 (i = 0..3: channel 4j
    in bits 0-1, 4j + 3 in bits 6-7); channels past D are 0.
    """
    n_tokens, n_heads, n_channels = shape
    out = []
    for t in range(n_tokens):
        for h in range(n_heads):
            for j in range(ceil_div(n_channels, 4)):
                byte = 0
                for i in range(4):
                    d = 4 * j + i
                    code = codes[element_index(shape, t, h, d)] if d < n_channels else 0
                    if not 0 <= code <= 3:
                        raise ValueError("2-bit codes must be in 0..3")
                    byte |= code << (2 * i)
                out.append(byte)
    return out


def unpack_2bit(payload: list[int], shape: Shape) -> list[int]:
    """Flat bytes of ``[T, H, ceil(D/4)]`` -> flat 2-bit codes of ``[T, H, D]``.

    Raises ValueError if a padding code (a channel past D) is not 0.
    """
    n_tokens, n_heads, n_channels = shape
    n_bytes = ceil_div(n_channels, 4)
    codes = []
    for t in range(n_tokens):
        for h in range(n_heads):
            for j in range(n_bytes):
                byte = payload[(t * n_heads + h) * n_bytes + j]
                for i in range(4):
                    code = (byte >> (2 * i)) & 0x3
                    if 4 * j + i < n_channels:
                        codes.append(code)
                    elif code:
                        raise ValueError(
                            f"codes: padding code of (t={t}, h={h}, channel {4 * j + i}) is "
                            f"{code}, not 0"
                        )
    return codes
