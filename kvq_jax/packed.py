"""`PackedKV`: one quantized [T, H, D] tensor as a pytree (arrays) with static metadata."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

#: Array fields a PackedKV may hold; each format uses a subset (see its codec's array_fields).
ARRAY_FIELDS = ("codes", "minimum", "scale", "block_scale", "global_scale")
#: Static (hashable) metadata fields.
META_FIELDS = ("format", "kind", "axis", "group_size", "shape", "dtype")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedKV:
    """A packed KV tensor of logical shape `shape` = (T, H, D) and input dtype `dtype`.

    Array fields by format (docs/FORMAT.md); unused ones are None:
      int4:     codes uint8 [T, H, ceil(D/2)], minimum / scale float16 [metadata shape]
      nvfp4:    codes uint8 [T, H, ceil(D/2)], block_scale float8_e4m3fn [metadata shape],
                global_scale float32 []
      fp8_e4m3: codes float8_e4m3fn [T, H, D], scale float32 [T, H]
    metadata shape: [ceil(T/G), H, D] for axis "tokens", [T, H, ceil(D/G)] for "channels".

    Under `jax.vmap` the arrays gain leading batch axes; the static metadata stays per example.
    """

    codes: Any
    minimum: Any = None
    scale: Any = None
    block_scale: Any = None
    global_scale: Any = None
    format: str
    kind: str
    axis: str
    group_size: int
    shape: tuple[int, int, int]
    dtype: np.dtype

    @property
    def arrays(self) -> dict[str, Any]:
        """The array fields this format uses, by name."""
        return {
            name: getattr(self, name) for name in ARRAY_FIELDS if getattr(self, name) is not None
        }

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """Leading axes added by vmap/stacking (empty for one tensor)."""
        return tuple(self.codes.shape[: self.codes.ndim - 3])

    @property
    def num_elements(self) -> int:
        """Logical elements represented, batch axes included."""
        return math.prod(self.batch_shape) * math.prod(self.shape)

    @property
    def storage_bytes(self) -> int:
        """Exactly the bytes of the arrays held (codes and every metadata array)."""
        return sum(a.size * np.dtype(a.dtype).itemsize for a in self.arrays.values())

    @property
    def bits_per_element(self) -> float:
        """storage_bytes * 8 / num_elements (nan for an empty tensor)."""
        n = self.num_elements
        return self.storage_bytes * 8 / n if n else float("nan")


jax.tree_util.register_dataclass(
    PackedKV, data_fields=list(ARRAY_FIELDS), meta_fields=list(META_FIELDS)
)
