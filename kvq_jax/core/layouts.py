"""Framework-neutral format layouts: argument checks, group-size rules and array shapes.

A layout says, for each format, which arrays a packed tensor holds and their shapes and
dtypes, how `axis` and `group_size` default and what they may be. It reads shapes only, so the
JAX codecs (`kvq_jax.codecs.formats`) and the Torch codecs (`kvq_torch_bridge.codecs.formats`)
inherit the same class and raise the same errors with the same messages.
"""

from __future__ import annotations

import hashlib
import math

import ml_dtypes
import numpy as np

from kvq_jax.core import constants

#: Input/output dtypes the codecs accept.
FLOAT_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32))
_U8, _F16, _F32 = np.dtype(np.uint8), np.dtype(np.float16), np.dtype(np.float32)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def check_float_dtype(dtype, name: str) -> np.dtype:
    """Return `dtype` as a numpy dtype, or raise TypeError naming argument `name`."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{name}: {dtype!r} is not a dtype") from e
    if dt not in FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {dt}")
    return dt


def check_kind(kind) -> str:
    if kind not in constants.KINDS:
        raise ValueError(f"kind must be one of {constants.KINDS}, got {kind!r}")
    return kind


def check_group_size(group_size) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int | np.integer):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return int(group_size)


class FormatLayout:
    """Static description of a storage format.

    Class attributes:
      name: registry key ("int4", ...).
      array_fields: the PackedKV array fields this format fills.
      default_group_size: used when the caller passes group_size=None.
      fixed_group_size: True when the format admits only its default group size.
      per_layer: True when the format holds data per model layer (`IntBLayersLayout`): its
        codec's encode / unpack take the layer (an int or a traced int32 scalar).
    """

    name: str
    array_fields: tuple[str, ...]
    default_group_size: int
    fixed_group_size: bool = False
    per_layer: bool = False

    def resolve(self, shape, kind: str, axis: str | None, group_size: int | None):
        """Validate and default (axis, group_size) for values of `shape` (trace time only)."""
        check_kind(kind)
        axis = constants.DEFAULT_AXIS[kind] if axis is None else axis
        if axis not in constants.AXES:
            raise ValueError(f"axis must be one of {constants.AXES} or None, got {axis!r}")
        group_size = self.default_group_size if group_size is None else group_size
        return axis, check_group_size(group_size)

    def array_shapes(self, shape, axis: str, group_size: int) -> dict[str, tuple[tuple, np.dtype]]:
        """{field: (shape, numpy dtype)} of every array a packed tensor of this format holds."""
        raise NotImplementedError

    def page_rows(self, page_size: int) -> int:
        """Rows of a page that this format's token groups span (`resolve_paged`: token-axis
        groups must divide it); the page itself except for heavy rows (`HeavyLayout`)."""
        return page_size

    def metadata_shapes(self, shape, axis: str, group_size: int) -> dict[str, tuple]:
        """{field: shape} of the metadata arrays (every array but codes)."""
        shapes = self.array_shapes(shape, axis, group_size)
        return {k: s for k, (s, _) in shapes.items() if k != "codes"}

    def storage_bytes(self, shape, axis: str, group_size: int) -> int:
        """Bytes a packed tensor of logical `shape` occupies (all arrays, no overhead)."""
        shapes = self.array_shapes(shape, axis, group_size).values()
        return sum(math.prod(s) * dt.itemsize for s, dt in shapes)


class Int4Layout(FormatLayout):
    """Affine INT4: nibble codes, FP16 minimum and scale per group of any size."""

    name = "int4"
    array_fields = ("codes", "minimum", "scale")
    default_group_size = constants.INT4_DEFAULT_GROUP_SIZE

    def array_shapes(self, shape, axis, group_size):
        t, h, d = shape
        meta = constants.metadata_shape(shape, axis, group_size)
        return {
            "codes": ((t, h, constants.packed_width(d)), _U8),
            "minimum": (meta, _F16),
            "scale": (meta, _F16),
        }


class Int2Layout(FormatLayout):
    """Affine INT2 (FlashLoop's 2-bit stream): four 2-bit codes per byte, FP16 minimum and
    scale per group of any size."""

    name = "int2"
    array_fields = ("codes", "minimum", "scale")
    default_group_size = constants.INT2_DEFAULT_GROUP_SIZE

    def array_shapes(self, shape, axis, group_size):
        t, h, d = shape
        meta = constants.metadata_shape(shape, axis, group_size)
        return {
            "codes": ((t, h, constants.packed_width_2bit(d)), _U8),
            "minimum": (meta, _F16),
            "scale": (meta, _F16),
        }


def check_bit_table(bits) -> tuple[tuple[int, ...], ...]:
    """An INTB bit table (FORMAT.md section 2b) as a tuple of per-head tuples of ints, or a
    TypeError/ValueError naming `bits`: H >= 1 rows of D >= 1 widths in 1..8, every row
    summing to the same multiple of 8."""
    try:
        table = np.asarray(bits)
    except (TypeError, ValueError) as e:
        raise TypeError(f"bits must be an [H, D] table of ints, got {type(bits).__name__}") from e
    if table.dtype == bool or not np.issubdtype(table.dtype, np.integer):
        raise TypeError(f"bits must be an [H, D] table of ints, got dtype {table.dtype}")
    if table.ndim != 2 or 0 in table.shape:
        raise ValueError(f"bits must be a non-empty [H, D] table, got shape {table.shape}")
    if table.min() < 1 or table.max() > 8:
        raise ValueError(
            f"bits must hold widths in 1..8, got {int(table.min())}..{int(table.max())}"
        )
    sums = table.sum(axis=1)
    if (sums != sums[0]).any() or sums[0] % 8:
        raise ValueError(
            f"bits must give every head the same multiple of 8 bits per row, got row sums "
            f"{sorted(set(int(x) for x in sums))}"
        )
    return tuple(tuple(int(b) for b in row) for row in table)


class IntBLayout(FormatLayout):
    """Affine INT with a static bit width per (head, channel) (FORMAT.md section 2b): token
    groups of one channel, FP16 minimum and scale per group, each (token, head) row's codes a
    least-significant-first bit stream of W bytes. One instance per bit table, registered
    under its own name (`intb_name` derives one from the table)."""

    array_fields = ("codes", "minimum", "scale")
    default_group_size = constants.INTB_DEFAULT_GROUP_SIZE

    def __init__(self, bits, name: str | None = None):
        self.bits = check_bit_table(bits)
        self.name = intb_name(self.bits) if name is None else name
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        self.row_bytes = sum(self.bits[0]) // 8  # W

    @property
    def table_shape(self) -> tuple[int, int]:
        """(H, D) the table is for."""
        return len(self.bits), len(self.bits[0])

    def resolve(self, shape, kind, axis, group_size):
        check_kind(kind)
        if axis not in (None, "tokens"):
            raise ValueError(f"axis must be 'tokens' (or None) for {self.name}, got {axis!r}")
        if tuple(shape[1:]) != self.table_shape:
            h, d = self.table_shape
            raise ValueError(
                f"values must have H={h} heads and D={d} channels for {self.name} (its bit "
                f"table's shape), got shape {tuple(shape)}"
            )
        group_size = self.default_group_size if group_size is None else group_size
        return "tokens", check_group_size(group_size)

    def array_shapes(self, shape, axis, group_size):
        t, h, _ = shape
        meta = constants.metadata_shape(shape, axis, group_size)
        return {
            "codes": ((t, h, self.row_bytes), _U8),
            "minimum": (meta, _F16),
            "scale": (meta, _F16),
        }

    def levels(self) -> np.ndarray:
        """float32 [H, D]: 2^b - 1 per channel (the scale's divisor and the largest code)."""
        return (np.left_shift(1, np.asarray(self.bits)) - 1).astype(np.float32)

    def stream_maps(self) -> tuple[np.ndarray, np.ndarray]:
        """int32 [H, 8W] (channel, bit of its code) that each stream bit holds (packing)."""
        h, d = self.table_shape
        channel = np.empty((h, 8 * self.row_bytes), np.int32)
        bit = np.empty_like(channel)
        for head, row in enumerate(self.bits):
            channel[head] = np.repeat(np.arange(d), row)
            bit[head] = np.concatenate([np.arange(b) for b in row])
        return channel, bit

    def code_starts(self) -> tuple[np.ndarray, np.ndarray]:
        """int32 [H, D] stream bit where each channel's code starts, and its width (unpacking
        by bytes: a code of <= 8 bits lies within two consecutive bytes)."""
        table = np.asarray(self.bits, np.int32)
        return np.cumsum(table, axis=1, dtype=np.int32) - table, table

    def table_layouts(self) -> tuple[IntBLayout, ...]:
        """One layout per bit table, in layer order (a format of one table: this one)."""
        return (self,)

    def stacked_maps(self) -> tuple[np.ndarray, ...]:
        """Every table's static maps stacked on a leading table axis [N, ...] (N = 1 for one
        table): levels, stream (channel, bit) and code (start, bits)."""
        per = self.table_layouts()
        fields = zip(*((t.levels(), *t.stream_maps(), *t.code_starts()) for t in per), strict=True)
        return tuple(np.stack(f) for f in fields)

    def code_maps(self) -> tuple[np.ndarray, np.ndarray]:
        """int32 [H, D, 8] stream bit of bit i of each channel's code (clamped to the row),
        and bool [H, D, 8] whether bit i exists (i < b) (unpacking)."""
        table = np.asarray(self.bits)
        start = np.cumsum(table, axis=1) - table
        i = np.arange(8)
        index = np.minimum(start[..., None] + i, 8 * self.row_bytes - 1).astype(np.int32)
        return index, i < table[..., None]


class IntBLayersLayout(IntBLayout):
    """INTB with one bit table per model layer, every table of the same (H, D) and row width W:
    layer l's bytes are exactly those of `IntBLayout(tables[l])` (FORMAT.md section 2b), so a
    page packed for layer l reads back with layer l's INTB codec and the oracle of its table.
    The layer is data (`per_layer`), not part of the name: a model's layers share one format,
    one cache configuration and one compiled layer step (`kvq_jax.engine`)."""

    per_layer = True

    def __init__(self, tables, name: str | None = None):
        tables = tuple(tables)
        if not tables:
            raise ValueError("tables must hold one INTB bit table per layer, got none")
        checked = []
        for layer, bits in enumerate(tables):
            try:
                checked.append(check_bit_table(bits))
            except (TypeError, ValueError) as e:
                raise type(e)(f"tables[{layer}]: {e}") from None
        shapes = {(len(t), len(t[0]), sum(t[0])) for t in checked}
        if len(shapes) > 1:
            raise ValueError(
                "tables must share one shape [H, D] and one row width (bits per head row); got "
                f"(H, D, bits) {sorted(shapes)}"
            )
        self.tables = tuple(checked)
        table = np.asarray(self.tables, np.uint8)
        if name is None:
            digest = hashlib.sha256(np.asarray(table.shape, np.int64).tobytes() + table.tobytes())
            name = "intb-layers-" + digest.hexdigest()[:12]
        super().__init__(self.tables[0], name=name)

    @property
    def num_layers(self) -> int:
        return len(self.tables)

    def table_layouts(self) -> tuple[IntBLayout, ...]:
        return tuple(IntBLayout(t, name=f"{self.name}[{i}]") for i, t in enumerate(self.tables))


def intb_name(bits) -> str:
    """The default registry name of the INTB format with table `bits`: "intb-" + the first
    12 hex digits of the SHA-256 of its shape and widths (the same table, the same name)."""
    table = np.asarray(check_bit_table(bits), np.uint8)
    digest = hashlib.sha256(np.asarray(table.shape, np.int64).tobytes() + table.tobytes())
    return "intb-" + digest.hexdigest()[:12]


class NVFP4Layout(FormatLayout):
    """NVFP4: nibble codes, an E4M3 scale per 16 elements, one float32 scale per tensor."""

    name = "nvfp4"
    array_fields = ("codes", "block_scale", "global_scale")
    default_group_size = constants.NVFP4_GROUP_SIZE
    fixed_group_size = True

    def resolve(self, shape, kind, axis, group_size):
        axis, group_size = super().resolve(shape, kind, axis, group_size)
        if group_size != constants.NVFP4_GROUP_SIZE:
            raise ValueError(
                f"group_size must be {constants.NVFP4_GROUP_SIZE} for nvfp4, got {group_size}"
            )
        return axis, group_size

    def array_shapes(self, shape, axis, group_size):
        t, h, d = shape
        return {
            "codes": ((t, h, constants.packed_width(d)), _U8),
            "block_scale": (constants.metadata_shape(shape, axis, group_size), _E4M3),
            "global_scale": ((), _F32),
        }


class FP8E4M3Layout(FormatLayout):
    """FP8 E4M3 codes with one float32 scale per (token, head): axis channels, group D."""

    name = "fp8_e4m3"
    array_fields = ("codes", "scale")
    default_group_size = 0  # resolved to D
    fixed_group_size = True

    def resolve(self, shape, kind, axis, group_size):
        check_kind(kind)
        d = shape[2]
        if axis not in (None, "channels"):
            raise ValueError(f"axis must be 'channels' (or None) for fp8_e4m3, got {axis!r}")
        if group_size is not None and check_group_size(group_size) != d:
            raise ValueError(
                f"group_size must be D={d} (or None) for fp8_e4m3: one scale per "
                f"(token, head), got {group_size}"
            )
        return "channels", d

    def array_shapes(self, shape, axis, group_size):
        t, h, d = shape
        return {"codes": ((t, h, d), _E4M3), "scale": ((t, h), _F32)}


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def rotation_shifts(head_dim: int) -> tuple[int, int]:
    """(R's, Rinv's) power-of-two shifts of FORMAT.md 2c for rows of `head_dim` channels (a
    power of two, n = log2 D): R scales the butterfly by 2^-floor(n/2), Rinv by
    2^-ceil(n/2)."""
    n = head_dim.bit_length() - 1
    return n // 2, (n + 1) // 2


class HadamardLayout(FormatLayout):
    """A base affine format (INT4, INT2) of Hadamard-rotated (token, head) rows (FORMAT.md
    section 2c): the base format's arrays, axes and group sizes; D must be a power of two."""

    def __init__(self, name: str, base: FormatLayout):
        self.name = name
        self.base = base
        self.array_fields = base.array_fields
        self.default_group_size = base.default_group_size

    def resolve(self, shape, kind, axis, group_size):
        d = shape[2]
        if not is_power_of_two(d):
            raise ValueError(f"values: {self.name} needs D (channels) a power of two, got D={d}")
        return self.base.resolve(shape, kind, axis, group_size)

    def array_shapes(self, shape, axis, group_size):
        return self.base.array_shapes(shape, axis, group_size)


class HInt4Layout(HadamardLayout):
    def __init__(self):
        super().__init__("hint4", Int4Layout())


class HInt2Layout(HadamardLayout):
    def __init__(self):
        super().__init__("hint2", Int2Layout())


#: The built-in formats' layouts (each stack registers codecs that derive from these).
#: The array fields a heavy-row format adds to its base format's (FORMAT.md 5a).
HEAVY_FIELDS = ("heavy_rows", "heavy_codes", "heavy_minimum", "heavy_scale")


class HeavyLayout(FormatLayout):
    """Heavy rows (FORMAT.md 5a) as a format: one INT8 row per group of `heavy_group` tokens
    and KV head, the other rows in the `base` format (its fields describe those T - nG rows;
    `HEAVY_FIELDS` hold the heavy rows). axis / group_size are the base's, for the payload
    (tokens: G - 1 by default, one payload group per heavy group).

    tables: None (the rows are handed in: values take the rows chosen from their keys), a
    bfloat16 mean-query table [H, R, D] or one per model layer [N, H, R, D] (`per_layer`):
    the format then chooses its rows from the values it packs (keys). The tables are part of
    the name (a SHA-256 prefix), as INTB's bit tables are.
    """

    def __init__(self, base: FormatLayout, heavy_group: int, tables=None, name: str | None = None):
        from kvq_jax.core.heavy import check_heavy_group_size

        if not isinstance(base, FormatLayout) or isinstance(base, HeavyLayout):
            raise TypeError(f"base must be a non-heavy FormatLayout, got {type(base).__name__}")
        self.base = base
        self.heavy_group = check_heavy_group_size(heavy_group)
        self.tables = None
        tag = ""
        if tables is not None:
            table = np.asarray(tables)
            if table.dtype != np.dtype(ml_dtypes.bfloat16) or table.ndim not in (3, 4):
                raise TypeError(
                    "tables must be a bfloat16 mean-query table [H, R, D] or one per layer "
                    f"[N, H, R, D], got {table.dtype} {table.shape}"
                )
            self.tables = table
            digest = hashlib.sha256(np.asarray(table.shape, np.int64).tobytes() + table.tobytes())
            tag = "-" + digest.hexdigest()[:12]
        self.name = name or f"heavy{self.heavy_group}-{base.name}{tag}"
        self.array_fields = tuple(base.array_fields) + HEAVY_FIELDS
        self.default_group_size = base.default_group_size
        self.fixed_group_size = base.fixed_group_size
        self.per_layer = base.per_layer or (self.tables is not None and self.tables.ndim == 4)

    @property
    def selects_rows(self) -> bool:
        """True when the format chooses its rows itself (it holds a mean-query table)."""
        return self.tables is not None

    def num_groups(self, tokens: int) -> int:
        return -(-tokens // self.heavy_group)

    def resolve(self, shape, kind: str, axis: str | None, group_size: int | None):
        t, h, d = shape
        if self.tables is not None and (self.tables.shape[-3], self.tables.shape[-1]) != (h, d):
            raise ValueError(
                f"values: format {self.name!r}'s mean-query tables are for H = "
                f"{self.tables.shape[-3]}, D = {self.tables.shape[-1]}; got H = {h}, D = {d}"
            )
        rest = (t - self.num_groups(t), h, d)
        axis, _ = self.base.resolve(rest, kind, axis, None)
        if group_size is None and axis == "tokens":
            group_size = self.heavy_group - 1
        return self.base.resolve(rest, kind, axis, group_size)

    def page_rows(self, page_size: int) -> int:
        if page_size % self.heavy_group:
            raise ValueError(
                f"page_size {page_size} must be a multiple of format {self.name!r}'s heavy "
                f"group {self.heavy_group} (a page holds whole heavy groups)"
            )
        return page_size - page_size // self.heavy_group

    def array_shapes(self, shape, axis, group_size):
        t, h, d = shape
        n = self.num_groups(t)
        shapes = dict(self.base.array_shapes((t - n, h, d), axis, group_size))
        shapes.update(
            heavy_rows=((n, h), _U8),
            heavy_codes=((n, h, d), _U8),
            heavy_minimum=((n, h), _F16),
            heavy_scale=((n, h), _F16),
        )
        return shapes


BUILTIN_LAYOUTS: dict[str, FormatLayout] = {
    layout.name: layout
    for layout in (
        Int4Layout(),
        NVFP4Layout(),
        FP8E4M3Layout(),
        Int2Layout(),
        HInt4Layout(),
        HInt2Layout(),
    )
}
