"""Framework-neutral behaviour of the packed containers, shared by the JAX and Torch classes.

Each stack defines its own frozen dataclasses (JAX pytrees of jax.Arrays, torch pytrees of
tensors) with the same field names and static metadata; the accounting below only reads
shapes and dtypes, so one implementation serves both.
"""

from __future__ import annotations

import math

#: Array fields a PackedKV may hold; each format uses a subset (its layout's array_fields).
ARRAY_FIELDS = ("codes", "minimum", "scale", "block_scale", "global_scale")
#: Static (hashable) metadata fields of a PackedKV.
META_FIELDS = ("format", "kind", "axis", "group_size", "shape", "dtype")


def nbytes(array) -> int:
    """Bytes of one array (jax.Array, tracer, numpy or torch); 0 for None."""
    if array is None:
        return 0
    return math.prod(array.shape) * array.dtype.itemsize


def _bits(storage_bytes: int, num_elements: int) -> float:
    return storage_bytes * 8 / num_elements if num_elements else float("nan")


class PackedKVMixin:
    """Accounting of one packed [T, H, D] tensor (arrays may carry leading batch axes)."""

    @property
    def arrays(self) -> dict:
        """The array fields this format uses, by name."""
        fields = ((name, getattr(self, name)) for name in ARRAY_FIELDS)
        return {name: array for name, array in fields if array is not None}

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """Leading axes added by vmap, stacking or paging (empty for one tensor)."""
        return tuple(self.codes.shape[: self.codes.ndim - 3])

    @property
    def num_elements(self) -> int:
        """Logical elements represented, batch axes included."""
        return math.prod(self.batch_shape) * math.prod(self.shape)

    @property
    def storage_bytes(self) -> int:
        """Exactly the bytes of the arrays held (codes and every metadata array)."""
        return sum(nbytes(a) for a in self.arrays.values())

    @property
    def bits_per_element(self) -> float:
        """storage_bytes * 8 / num_elements (nan for an empty tensor)."""
        return _bits(self.storage_bytes, self.num_elements)


class _Derived:
    """Containers whose dtype, format and batch come from one inner PackedKV (`_inner`)."""

    @property
    def dtype(self):
        return self._inner.dtype

    @property
    def format(self) -> str:
        return self._inner.format

    @property
    def num_elements(self) -> int:
        """Elements of the full [T, H, D] tensor (batch axes included)."""
        return math.prod(self._inner.batch_shape) * math.prod(self.shape)

    @property
    def bits_per_element(self) -> float:
        return _bits(self.storage_bytes, self.num_elements)


class WindowedKVMixin(_Derived):
    """Raw window rows (head, tail) plus a packed middle."""

    @property
    def _inner(self):
        return self.middle

    @property
    def storage_bytes(self) -> int:
        """Bytes of every array held: raw window rows plus the packed middle."""
        return nbytes(self.head) + nbytes(self.tail) + self.middle.storage_bytes


class KVResidualMixin(_Derived):
    """A packed delta plus its position map and raw window rows."""

    @property
    def _inner(self):
        return self.payload

    @property
    def storage_bytes(self) -> int:
        """Bytes of every array held: packed delta, position map and raw window rows."""
        extra = nbytes(self.positions) + nbytes(self.head) + nbytes(self.tail)
        return self.payload.storage_bytes + extra


class LoopCodeMixin:
    """A base plus one residual per later loop."""

    @property
    def num_loops(self) -> int:
        return 1 + len(self.residuals)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(T, H, D) of one loop."""
        return self.base.shape

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def storage_bytes(self) -> int:
        """Bytes of every array held, over all loops (positions and window rows included)."""
        return self.base.storage_bytes + sum(r.storage_bytes for r in self.residuals)

    @property
    def num_elements(self) -> int:
        return self.base.num_elements * self.num_loops

    @property
    def bits_per_element(self) -> float:
        return _bits(self.storage_bytes, self.num_elements)
