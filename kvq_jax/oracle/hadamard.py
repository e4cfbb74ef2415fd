"""HINT4 and HINT2 (docs/FORMAT.md section 2c), element by element: INT4 / INT2 of every
(token, head) row after a Hadamard rotation along the channels.

    R(x)    = butterfly(x) * 2**-floor(n/2)      (n = log2 D)
    Rinv(y) = butterfly(y) * 2**-ceil(n/2)

The butterfly runs stages s = 0 .. n-1 (h = 2**s), each replacing the pair (y[i], y[i + h]),
bit s of i clear, by (y[i] + y[i + h], y[i] - y[i + h]); every operation through `scalar`
(rounded and flushed). Encode packs R(x) with the base format's oracle; decode rotates the
base format's float32 decode back.
"""

from __future__ import annotations

from kvq_jax.oracle import int2, int4
from kvq_jax.oracle.scalar import add, mul, sub


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def butterfly(row: list[float]) -> list[float]:
    """The unnormalized Sylvester-Hadamard transform of one row (len a power of two)."""
    y = list(row)
    h = 1
    while h < len(y):
        for i in range(len(y)):
            if not i & h:
                y[i], y[i + h] = add(y[i], y[i + h]), sub(y[i], y[i + h])
        h *= 2
    return y


def _rotate_rows(xs: list[float], d: int, inverse: bool) -> list[float]:
    n = d.bit_length() - 1
    factor = 2.0 ** -((n + 1) // 2 if inverse else n // 2)
    out = []
    for start in range(0, len(xs), d):
        out.extend(mul(y, factor) for y in butterfly(xs[start : start + d]))
    return out


def rotate(xs: list[float], shape) -> list[float]:
    """R applied to every (token, head) row of the flat row-major float32 values of `shape`."""
    return _rotate_rows(xs, shape[2], inverse=False)


def unrotate(xs: list[float], shape) -> list[float]:
    """Rinv applied to every (token, head) row."""
    return _rotate_rows(xs, shape[2], inverse=True)


class Rotated:
    """The oracle of a rotated format: `base` (an oracle module, int4 or int2) on R(x)."""

    def __init__(self, base):
        self.base = base

    def encode(self, xs, shape, axis: str, group_size: int) -> dict[str, list[int]]:
        return self.base.encode(rotate(xs, shape), shape, axis, group_size)

    def decode(self, bits, shape, axis: str, group_size: int) -> list[float]:
        return unrotate(self.base.decode(bits, shape, axis, group_size), shape)


HINT4 = Rotated(int4)
HINT2 = Rotated(int2)
