"""The JAX codec interface every storage format implements.

A codec turns a [T, H, D] bf16/fp16/fp32 tensor into a `PackedKV` and back. Its `pack` and
`unpack` are the *reference* (XLA) paths: `unpack` materializes the dequantized tensor, which a
serving attention kernel never does (it dequantizes in registers). Any kernel is held to these
paths, and to the scalar oracle, byte for byte (`kvq conformance`).
"""

from __future__ import annotations

import numpy as np

from kvq_jax.codecs.packed import PackedKV
from kvq_jax.core.codec_base import CodecBase


class Codec(CodecBase):
    """A storage format implemented in JAX: a `kvq_jax.core.layouts.FormatLayout` (names, group-size
    rules, array shapes) plus `encode` ([T, H, D] values -> {field: jnp array}) and `unpack`
    (`PackedKV` -> values, materialized). Subclass a layout and this class, implement the two
    data paths, and add an instance with `kvq_jax.register_codec`; `pack` comes from
    `kvq_jax.core.codec_base.CodecBase`.

    costly_decode: each decoded element costs many operations (INTB's word picks), so XLA
    paths should not let it be recomputed inside a transposition (decode attention then takes
    its scores key row by key row, `OnlineSoftmax(keys_by_row=True)`).
    """

    costly_decode = False

    def _packed(self, arrays: dict, *, kind, axis, group_size, shape, dtype) -> PackedKV:
        return PackedKV(
            **arrays,
            format=self.name,
            kind=kind,
            axis=axis,
            group_size=group_size,
            shape=tuple(shape),
            dtype=np.dtype(dtype),
        )
