"""The packed containers' fields and storage accounting, shared by the JAX and Torch classes.

Each container is one frozen dataclass here (its fields, static metadata and the accounting,
which reads shapes and dtypes only); each stack subclasses it to register it as its pytree
(JAX: `jax.tree_util.register_dataclass`; Torch: `torch.utils._pytree`) holding its arrays.
The classes of the two stacks stay distinct types (the DLPack bridge maps one onto the other).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from kvq_jax.core.window import Window

#: Array fields a PackedKV may hold; each format uses a subset (its layout's array_fields).
ARRAY_FIELDS = (
    "codes", "minimum", "scale", "block_scale", "global_scale",
    "heavy_rows", "heavy_codes", "heavy_minimum", "heavy_scale",
)  # fmt: skip
#: Static (hashable) metadata fields of a PackedKV.
META_FIELDS = ("format", "kind", "axis", "group_size", "shape", "dtype")


def nbytes(array) -> int:
    """Bytes of one array (jax.Array, tracer, numpy or torch); 0 for None."""
    if array is None:
        return 0
    return math.prod(array.shape) * array.dtype.itemsize


def rest_dtype(dtype) -> np.dtype:
    """The dtype the JAX paged cache stores an array field of `dtype` in: the uint8 bits of a
    1-byte float (E4M3 block scales, FP8 codes), else `dtype` itself. XLA:CPU widens every
    operation on a float8 array to a wider float, so a scatter into a float8 page pool
    rewrites the whole pool; into its uint8 bits it updates only the pages written."""
    dtype = np.dtype(dtype)
    # ml_dtypes' floats have kind "V"; numpy's own 1-byte types are ints and bools.
    return np.dtype(np.uint8) if dtype.itemsize == 1 and dtype.kind in "Vf" else dtype


def _bits(storage_bytes: int, num_elements: int) -> float:
    return storage_bytes * 8 / num_elements if num_elements else float("nan")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedKVBase:
    """A packed KV tensor of logical shape `shape` = (T, H, D) and input dtype `dtype`.

    Array fields by format (docs/FORMAT.md); unused ones are None:
      int4:     codes uint8 [T, H, ceil(D/2)], minimum / scale float16 [metadata shape]
      nvfp4:    codes uint8 [T, H, ceil(D/2)], block_scale float8_e4m3fn [metadata shape],
                global_scale float32 []
      fp8_e4m3: codes float8_e4m3fn [T, H, D], scale float32 [T, H]
      heavy rows (`kvq_jax.core.layouts.HeavyLayout`, FORMAT.md 5a): the base format's fields
                for the T - nG other rows, and heavy_rows uint8 [nG, H], heavy_codes uint8
                [nG, H, D], heavy_minimum / heavy_scale float16 [nG, H] (nG = ceil(T/G))
    metadata shape: [ceil(T/G), H, D] for axis "tokens", [T, H, ceil(D/G)] for "channels".
    Under `jax.vmap`, paging or stacking the arrays gain leading batch axes; the static
    metadata stays per example.
    """

    codes: Any
    minimum: Any = None
    scale: Any = None
    block_scale: Any = None
    global_scale: Any = None
    heavy_rows: Any = None
    heavy_codes: Any = None
    heavy_minimum: Any = None
    heavy_scale: Any = None
    format: str
    kind: str
    axis: str
    group_size: int
    shape: tuple[int, int, int]
    dtype: np.dtype

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowedKVBase(_Derived):
    """A [T, H, D] tensor whose window rows are stored raw and whose middle rows are packed.

    head: [h, H, D] and tail: [t, H, D] in the input dtype (h = min(sink, T),
    t = min(recent, T - h)); middle: the PackedKV of the [T - h - t, H, D] middle rows.
    """

    head: Any
    tail: Any
    middle: Any
    window: Window
    shape: tuple[int, int, int]

    @property
    def _inner(self):
        return self.middle

    @property
    def storage_bytes(self) -> int:
        """Bytes of every array held: raw window rows plus the packed middle."""
        return nbytes(self.head) + nbytes(self.tail) + self.middle.storage_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVResidualBase(_Derived):
    """One loop stored as a delta against the reconstructed previous loop, or (absolute)
    on its own.

    payload:   PackedKV of the delta of the quantized rows, [M, H, D] (absolute: of the
               rows themselves, encoded against zero).
    positions: int32 [N] rows of [0, T) this residual owns (None: dense, every row).
    head/tail: raw rows of the current loop kept by the window (None without a window),
               [h, H, D] and [t, H, D] in the input dtype.
    shape:     (T, H, D) of the full loop.
    window:    the Window, or None.
    absolute:  False (a delta: decoding adds the previous loop) or True (the owned rows
               decode from the payload alone; unlisted rows of a sparse residual still
               inherit the previous loop). Static metadata; it adds no bytes.

    Dense without window M = T; sparse M = N; a window takes h rows from the front and t rows
    from the back of the (compact) rows before the rest is packed.
    """

    payload: Any
    positions: Any = None
    head: Any = None
    tail: Any = None
    shape: tuple[int, int, int]
    window: Window | None = None
    absolute: bool = False

    @property
    def _inner(self):
        return self.payload

    @property
    def storage_bytes(self) -> int:
        """Bytes of every array held: packed delta, position map and raw window rows."""
        extra = nbytes(self.positions) + nbytes(self.head) + nbytes(self.tail)
        return self.payload.storage_bytes + extra


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopCodeBase:
    """A packed loop stack: `base` (loop 0) and one residual per later loop."""

    base: Any
    residuals: tuple

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


#: The array fields of a paged cache (`PagedCacheBase`), in pytree order.
CACHE_FIELDS = (
    "k_base",
    "v_base",
    "k_delta",
    "v_delta",
    "k_stage",
    "v_stage",
    "k_sink",
    "v_sink",
    "seq_lens",
    "depth",
    "stage_exited",
    "layer",
)


def plane_fields(stored: dict) -> dict:
    """{plane name (`PagedCacheConfig.plane_specs`): PackedKV} -> the cache's four plane
    fields: k_base, v_base, k_delta / v_delta (one plane, a tuple of runs "k_delta.0", ...,
    or None without later loops)."""
    out = {"k_base": stored["k_base"], "v_base": stored["v_base"]}
    for field in ("k_delta", "v_delta"):
        runs = [stored[n] for n in stored if n.startswith(f"{field}.")]
        out[field] = tuple(runs) if runs else stored.get(field)
    return out


#: The per-slot arrays of a paged cache ([L, S, ...]: a sequence's are `a[:, slot]`).
SLOT_FIELDS = ("k_stage", "v_stage", "k_sink", "v_sink", "seq_lens", "stage_exited")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedCacheBase:
    """A paged cache's arrays (`kvq_jax.codecs.cache_state` documents each field) and its static
    `PagedCacheConfig`."""

    k_base: Any
    v_base: Any
    k_delta: Any
    v_delta: Any
    k_stage: Any
    v_stage: Any
    k_sink: Any
    v_sink: Any
    seq_lens: Any
    depth: Any = None
    stage_exited: Any = None
    layer: Any = None
    config: Any

    def packed_planes(self):
        """(name, page axis, PackedKV) of every stored packed plane, named as
        `PagedCacheConfig.plane_specs` names them: "k_base" (axis 0), "k_delta" (axis 1: its
        batch is (loops, P)) or, when the later loops are stored in runs of different formats
        (a tuple of planes), "k_delta.0", "k_delta.1", ...; the same for "v_"."""
        for plane in ("k_base", "v_base", "k_delta", "v_delta"):
            value = getattr(self, plane)
            axis = 0 if plane.endswith("base") else 1
            if isinstance(value, tuple):
                for r, packed in enumerate(value):
                    yield f"{plane}.{r}", axis, packed
            elif value is not None:
                yield plane, axis, value

    def loop_plane(self, kind: str, loop: int):
        """The stored plane (PackedKV) holding loop `loop` of `kind`, and the loop's index on
        its loop axis (None for the base): `PagedCacheConfig.plane_of`."""
        field, run, level = self.config.plane_of(kind, loop)
        value = getattr(self, field)
        return (value if run is None else value[run]), level

    def with_loop_plane(self, kind: str, loop: int, plane) -> dict:
        """{field: value} that puts `plane` where loop `loop` of `kind` is stored (a
        `dataclasses.replace` update)."""
        field, run, _ = self.config.plane_of(kind, loop)
        if run is None:
            return {field: plane}
        value = list(getattr(self, field))
        value[run] = plane
        return {field: tuple(value)}

    def loop_chain(self, kind: str, loop: int) -> tuple[tuple, ...]:
        """What reconstructing loop `loop` of `kind` reads: ((loop_i, plane, level, absolute),
        ...) over `PagedCacheConfig.chain`: the first plane is decoded alone, each later one
        replaces the running reconstruction when `absolute` (a loop stored absolute), else is a
        delta added to it."""
        absolute = self.config.absolute_loops(kind)
        return tuple(
            (i, *self.loop_plane(kind, i), i in absolute) for i in self.config.chain(kind, loop)
        )

    def page_arrays(self):
        """(name, page axis, array) of every array indexed by physical page: the packed
        planes' fields ("k_base.codes", "k_delta.scale", ...; `packed_planes`) and the exit
        depth map."""
        for plane, axis, packed in self.packed_planes():
            for field, a in packed.arrays.items():
                yield f"{plane}.{field}", axis, a
        if self.depth is not None:
            yield "depth", 0, self.depth

    def slot_arrays(self):
        """(name, array) of every per-slot array present (`SLOT_FIELDS`)."""
        for name in SLOT_FIELDS:
            if getattr(self, name) is not None:
                yield name, getattr(self, name)

    def with_arrays(self, arrays: dict):
        """A copy with the arrays named as `page_arrays` / `slot_arrays` name them replaced
        ("k_base.codes", "seq_lens", ...; names not given stay)."""
        arrays = dict(arrays)
        planes: dict = {}
        for plane, _, packed in self.packed_planes():
            fields = {f: arrays.pop(f"{plane}.{f}") for f in packed.arrays
                      if f"{plane}.{f}" in arrays}  # fmt: skip
            planes[plane] = dataclasses.replace(packed, **fields)
        updates = {}
        for field in ("k_base", "v_base", "k_delta", "v_delta"):
            value = getattr(self, field)
            if isinstance(value, tuple):
                updates[field] = tuple(planes[f"{field}.{r}"] for r in range(len(value)))
            elif value is not None:
                updates[field] = planes[field]
        return dataclasses.replace(self, **updates, **arrays)

    @property
    def storage_bytes(self) -> int:
        """Bytes of every array held (packed pages, staging, sink rows, lengths, exits)."""
        total = 0
        for name in CACHE_FIELDS:
            value = getattr(self, name)
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, PackedKVBase):
                    total += item.storage_bytes
                else:
                    total += nbytes(item)
        return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class HeavyKVBase(_Derived):
    """A [T, H, D] tensor with one INT8 heavy row per (token group, head) and the other rows
    packed (docs/FORMAT.md section 5a).

    payload: the PackedKV of the [T - nG, H, D] other rows (nG = ceil(T/G));
    rows:    uint8 [nG, H], the heavy row of each group (index within the group);
    codes:   uint8 [nG, H, D], the heavy rows' INT8 codes;
    minimum / scale: float16 [nG, H], their affine metadata.
    group_size: G (static); shape: (T, H, D).
    """

    payload: Any
    rows: Any
    codes: Any
    minimum: Any
    scale: Any
    group_size: int
    shape: tuple[int, int, int]

    @property
    def _inner(self):
        return self.payload

    @property
    def storage_bytes(self) -> int:
        """Bytes of every array held: the payload, the rows, the heavy codes and metadata."""
        own = (self.rows, self.codes, self.minimum, self.scale)
        return self.payload.storage_bytes + sum(nbytes(a) for a in own)
