"""The codec interface shared by the JAX and the Torch stack (framework-neutral).

A codec is a `FormatLayout` (names, group-size rules, array shapes) plus two data paths:
`encode` (validated [T, H, D] values -> {field: array}) and `unpack` (a `PackedKV` -> values).
`pack` wraps what `encode` returns into the stack's `PackedKV` once, here, so a format writes
only its arithmetic. A codec may override `pack` itself instead of `encode` (older codecs do).
"""

from __future__ import annotations

import abc

from kvq_jax.core.layouts import FormatLayout


def layer_arg(codec, layer) -> dict:
    """{"layer": layer} for a `per_layer` codec, else {}: codecs with one table for every
    layer (a registered codec may predate the argument) are called without it."""
    return {"layer": layer} if getattr(codec, "per_layer", False) else {}


class CodecBase(FormatLayout, abc.ABC):
    """`pack` = `encode` + the stack's `PackedKV`; subclasses give `encode`, `unpack` and
    `_packed` (the stack's wrapper, written once per stack in its `Codec`)."""

    def pack(self, values, *, kind: str, axis: str, group_size: int, layer=None):
        """Quantize validated [T, H, D] values (axis/group_size already resolved) to a
        `PackedKV` of this format. layer: the model layer of a `per_layer` format (an int or
        an int32 scalar); the other formats ignore it."""
        arrays = self.encode(values, axis=axis, group_size=group_size, **layer_arg(self, layer))
        return self._packed(
            arrays, kind=kind, axis=axis, group_size=group_size,
            shape=values.shape, dtype=values.dtype,
        )  # fmt: skip

    def encode(self, values, *, axis: str, group_size: int) -> dict:
        """{field: array} of `array_fields` for validated [T, H, D] values."""
        raise NotImplementedError(f"{type(self).__name__} implements neither encode nor pack")

    @abc.abstractmethod
    def unpack(self, packed, dtype):
        """Reference dequantization to [T, H, D] in `dtype` (a numpy dtype)."""

    @abc.abstractmethod
    def _packed(self, arrays: dict, *, kind, axis, group_size, shape, dtype):
        """The stack's `PackedKV` holding `arrays` with this format's static metadata."""
