"""kvq scalar oracle: the reference every kvq implementation is judged against, bit for bit.

The oracle implements the storage formats of docs/FORMAT.md (``int4``, ``nvfp4``,
``fp8_e4m3``, ``int2``, the rotated ``hint4`` and ``hint2``, and the ``intb`` family, one
format per bit table) one element at a
time in plain Python. It shares no code with the JAX codecs, the Torch codec or the GPU
kernels, does not import JAX, and does no numpy arithmetic and no ml_dtypes conversion:
numpy is only the container for input and output. Every float32
operation is a Python binary64 operation rounded to float32 with ``struct`` and flushed
(`kvq_jax.oracle.scalar`); E2M1 and E4M3 encodings are nearest-value searches over tables
written out by hand (`e2m1`) or decoded from every bit pattern (`e4m3`). It is slow (a few
microseconds per element) and meant to be read.

    from kvq_jax import oracle
    enc = oracle.pack(values, format="nvfp4", kind="key")    # values: numpy [T, H, D]
    enc.arrays                # {"codes": uint8, "block_scale": float8_e4m3fn, "global_scale": f32}
    out = oracle.unpack(enc)  # numpy [T, H, D] in the input dtype (or dtype=...)

INTB (section 2b) takes its static bit table, ``bits[h][c]`` in 1..8 with equal row sums
``8 * W``; it groups over tokens only, and the table travels in ``OraclePacked.bits``::

    enc = oracle.pack(values, format="intb", kind="key", bits=((3, 5, 8),), group_size=2)
    enc.arrays                # {"codes": uint8 [T, H, W], "minimum": f16, "scale": f16}

Checking an outside kernel (CUDA, Triton, Pallas, ...): feed the same numpy input to the kernel
and to `pack`, and compare every array field as raw bytes; `mismatches` does that and names
the first differing elements::

    expected = oracle.pack(x, format="int4", kind="value", group_size=32)
    assert not oracle.mismatches(expected.arrays, my_kernel_pack(x))   # dict name -> array

To judge a decode kernel, wrap the kernel's (or the oracle's) arrays in an `OraclePacked` and
compare ``oracle.unpack(...)`` with the kernel's output, with ``nan_equal=True`` (a decoded
NaN's sign and payload depend on the device; stored metadata NaNs are canonical and compared
as bytes). See docs/ORACLE.md.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from kvq_jax.oracle import (
    e2m1,
    e4m3,
    fp8_e4m3,
    hadamard,
    heavy,
    int2,
    int4,
    intb,
    layout,
    nvfp4,
    rope,
    scalar,
)

__all__ = [
    "AXES",
    "DEFAULT_AXIS",
    "FORMATS",
    "KINDS",
    "ROTATED_FORMATS",
    "TABLE_FORMATS",
    "OracleHeavy",
    "OraclePacked",
    "apply_rope",
    "array_spec",
    "e2m1",
    "e4m3",
    "invert_rope",
    "layout",
    "mismatches",
    "pack",
    "pack_heavy",
    "scalar",
    "select_heavy",
    "unpack",
    "unpack_heavy",
    "widen",
]

#: Format names that need nothing but the tensor (and kind, axis, group size).
FORMATS = ("int4", "nvfp4", "fp8_e4m3", "int2")
#: Format families that also need a bit table (``bits=``); kept out of `FORMATS` so that
#: code looping over `FORMATS` without a table keeps working.
TABLE_FORMATS = ("intb",)
#: Hadamard-rotated formats (section 2c): the base format on rotated rows; D a power of two.
#: Kept out of `FORMATS` for the same reason.
ROTATED_FORMATS = ("hint4", "hint2")
_ALL_FORMATS = FORMATS + ROTATED_FORMATS + TABLE_FORMATS
#: Tensor kinds.
KINDS = ("key", "value")
#: Grouping axes.
AXES = layout.AXES
#: Grouping axis used when `axis` is None (FP8 is always "channels").
DEFAULT_AXIS = {"key": "tokens", "value": "channels"}

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_U8 = np.dtype(np.uint8)
#: Supported value dtypes -> the unsigned integer dtype of the same width (to read/write bits).
_BITS_DTYPE = {_F32: np.dtype(np.uint32), _F16: np.dtype(np.uint16), _BF16: np.dtype(np.uint16)}
_BITS_DTYPE.update({_U8: _U8, _E4M3: _U8})
_VALUE_DTYPES = (_F32, _F16, _BF16)

_CODECS = {
    "int4": int4,
    "nvfp4": nvfp4,
    "fp8_e4m3": fp8_e4m3,
    "int2": int2,
    "hint4": hadamard.HINT4,
    "hint2": hadamard.HINT2,
    "intb": intb,
}
#: The base format whose payload a rotated format stores.
_ROTATED_BASE = {"hint4": "int4", "hint2": "int2"}


@dataclasses.dataclass(frozen=True, eq=False)
class OraclePacked:
    """A tensor packed by the oracle: static description plus the stored arrays.

    arrays, by format (metadata shape: ``[ceil(T/G), H, D]`` for axis "tokens",
    ``[T, H, ceil(D/G)]`` for axis "channels"):
      int4:     codes uint8 [T, H, ceil(D/2)], minimum float16, scale float16 [metadata]
      int2:     codes uint8 [T, H, ceil(D/4)], minimum float16, scale float16 [metadata]
      hint4, hint2: as int4, int2 (of the rotated rows)
      nvfp4:    codes uint8 [T, H, ceil(D/2)], block_scale float8_e4m3fn [metadata],
                global_scale float32 []
      fp8_e4m3: codes float8_e4m3fn [T, H, D], scale float32 [T, H]
      intb:     codes uint8 [T, H, W], minimum float16, scale float16 [metadata] (axis
                "tokens"; W = the table's row sum / 8)

    bits: the INTB bit table as a tuple of H tuples of D ints; None for the other formats.
    """

    format: str
    kind: str
    axis: str
    group_size: int
    shape: tuple[int, int, int]
    dtype: np.dtype
    arrays: dict[str, np.ndarray]
    bits: tuple[tuple[int, ...], ...] | None = None


# --------------------------------------------------------------------------- validation


def _check_choice(name: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _resolve(format, kind, axis, group_size, n_channels: int) -> tuple[str, int]:
    """Validate the static arguments; return (axis, group_size) with defaults applied."""
    _check_choice("format", format, _ALL_FORMATS)
    _check_choice("kind", kind, KINDS)
    if axis is not None:
        _check_choice("axis", axis, AXES)
    if group_size is not None and (
        isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral)
    ):
        raise TypeError(f"group_size must be an int or None, got {group_size!r}")
    if format == "fp8_e4m3":
        if axis not in (None, "channels"):
            raise ValueError(f"axis: fp8_e4m3 always groups over 'channels', got {axis!r}")
        if group_size is not None and group_size != n_channels:
            raise ValueError(
                f"group_size: fp8_e4m3 always uses one group of D={n_channels} channels, "
                f"got {group_size!r}"
            )
        return "channels", n_channels
    if format == "intb":
        if axis not in (None, "tokens"):
            raise ValueError(f"axis: intb always groups over 'tokens', got {axis!r}")
        axis = "tokens"
    if format in ROTATED_FORMATS and not hadamard.is_power_of_two(n_channels):
        raise ValueError(f"values: {format} needs D (channels) a power of two, got D={n_channels}")
    axis = DEFAULT_AXIS[kind] if axis is None else axis
    if format == "nvfp4":
        if group_size is not None and group_size != nvfp4.GROUP_SIZE:
            raise ValueError(f"group_size must be 16 for nvfp4, got {group_size!r}")
        return axis, nvfp4.GROUP_SIZE
    if group_size is None:
        return axis, 64
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1 for {format}, got {group_size!r}")
    return axis, int(group_size)


def _resolve_bits(format, bits, shape):
    """The checked bit table for intb (required), None for the other formats (refused)."""
    if format in TABLE_FORMATS:
        if bits is None:
            raise TypeError(f"bits: {format} needs a bit table (H rows of D ints), got None")
        return intb.check_table(bits, shape)
    if bits is not None:
        raise ValueError(f"bits: only {TABLE_FORMATS} take a bit table, not {format!r}")
    return None


def array_spec(format: str, shape, axis: str, group_size: int, bits=None) -> dict[str, tuple]:
    """The stored arrays of a format: ``{name: (numpy dtype, shape)}``.

    `bits`: intb's bit table (required for intb, which has W code bytes per row; refused
    for the other formats).
    """
    _check_choice("format", format, _ALL_FORMATS)
    shape = tuple(shape)
    table = _resolve_bits(format, bits, shape)
    format = _ROTATED_BASE.get(format, format)
    if format == "intb":
        if axis != "tokens":
            raise ValueError(f"axis: intb always groups over 'tokens', got {axis!r}")
        meta = layout.metadata_shape(shape, axis, group_size)
        codes = (_U8, intb.packed_shape(shape, table))
        return {"codes": codes, "minimum": (_F16, meta), "scale": (_F16, meta)}
    if format == "fp8_e4m3":
        return {"codes": (_E4M3, shape), "scale": (_F32, shape[:2])}
    meta = layout.metadata_shape(shape, axis, group_size)
    if format == "int2":
        codes = (_U8, layout.packed_shape_2bit(shape))
        return {"codes": codes, "minimum": (_F16, meta), "scale": (_F16, meta)}
    codes = (_U8, layout.packed_shape(shape))
    if format == "int4":
        return {"codes": codes, "minimum": (_F16, meta), "scale": (_F16, meta)}
    return {"codes": codes, "block_scale": (_E4M3, meta), "global_scale": (_F32, ())}


# --------------------------------------------------------------------------- bits <-> numpy


def widen(values: np.ndarray) -> list[float]:
    """float32 / float16 / bfloat16 array -> flat row-major list of flushed float32 values.

    Reads raw bits only: float32 via a uint32 view, float16 via a uint16 view decoded with
    ``struct`` format "e", bfloat16 via a uint16 view shifted into the float32 high half.
    """
    dtype = np.dtype(values.dtype)
    if dtype not in _VALUE_DTYPES:
        raise TypeError(f"values dtype must be float32, float16 or bfloat16, got {dtype}")
    bits = np.ascontiguousarray(values).reshape(-1).view(_BITS_DTYPE[dtype]).tolist()
    if dtype == _F32:
        to_float = scalar.bits_to_f32
    elif dtype == _F16:
        to_float = scalar.bits_to_f16
    else:
        to_float = scalar.bits_to_bf16
    return [scalar.ftz(to_float(b)) for b in bits]


def _from_bits(bits: list[int], dtype: np.dtype, shape) -> np.ndarray:
    """Raw bit patterns -> numpy array of `dtype` (a view of an unsigned integer array)."""
    return np.array(bits, dtype=_BITS_DTYPE[dtype]).reshape(shape).view(dtype)


def _to_bits(array: np.ndarray) -> list[int]:
    """numpy array -> flat row-major list of its raw bit patterns."""
    return np.ascontiguousarray(array).reshape(-1).view(_BITS_DTYPE[array.dtype]).tolist()


#: Per value dtype: (mask without the sign bit, infinity pattern). NaN: masked bits > inf.
_NAN_TEST = {_F32: (0x7FFFFFFF, 0x7F800000), _F16: (0x7FFF, 0x7C00), _BF16: (0x7FFF, 0x7F80)}


def _is_nan_bits(bits: int, dtype: np.dtype) -> bool:
    """True if `bits` is a NaN pattern of the float dtype `dtype` (False for other dtypes)."""
    if dtype not in _NAN_TEST:
        return False
    mask, inf = _NAN_TEST[dtype]
    return (bits & mask) > inf


def _cast_out_bits(xs: list[float], dtype: np.dtype) -> list[int]:
    """cast_out: float32 values -> bit patterns of `dtype` (round to nearest even)."""
    if dtype == _F32:
        return [scalar.f32_to_bits(x) for x in xs]
    if dtype == _F16:
        return [scalar.f16_bits(x) for x in xs]
    return [scalar.bf16_bits(x) for x in xs]


# --------------------------------------------------------------------------- public API


def pack(values: np.ndarray, *, format: str, kind: str, group_size=None, axis=None, bits=None):
    """Encode numpy ``values[T, H, D]`` (float32, float16 or bfloat16) -> `OraclePacked`.

    `axis` defaults to "tokens" for keys and "channels" for values; FP8 is always
    "channels" with one group of D; intb is always "tokens". `group_size`: int4, int2, hint4,
    hint2 and intb any int >= 1 (default 64), nvfp4 16, fp8_e4m3 D; hint4 and hint2 need D a
    power of two. `bits`: intb's bit table
    ``bits[h][c]`` (H rows of D ints in 1..8, equal row sums that are multiples of 8);
    required for intb, refused for the other formats. Raises ValueError / TypeError naming
    the offending argument.
    """
    if not isinstance(values, np.ndarray):
        raise TypeError(f"values must be a numpy.ndarray, got {type(values).__name__}")
    if np.dtype(values.dtype) not in _VALUE_DTYPES:
        raise TypeError(f"values dtype must be float32, float16 or bfloat16, got {values.dtype}")
    if values.ndim != 3:
        raise ValueError(f"values must have rank 3 [T, H, D], got shape {values.shape}")
    shape = tuple(int(n) for n in values.shape)
    axis, group_size = _resolve(format, kind, axis, group_size, shape[2])
    table = _resolve_bits(format, bits, shape)
    if format == "intb":
        raw = intb.encode(widen(values), shape, group_size, table)
    else:
        raw = _CODECS[format].encode(widen(values), shape, axis, group_size)
    spec = array_spec(format, shape, axis, group_size, bits=table)
    arrays = {name: _from_bits(raw[name], dt, shp) for name, (dt, shp) in spec.items()}
    return OraclePacked(
        format=format,
        kind=kind,
        axis=axis,
        group_size=group_size,
        shape=shape,
        dtype=np.dtype(values.dtype),
        arrays=arrays,
        bits=table,
    )


def unpack(enc: OraclePacked, dtype=None) -> np.ndarray:
    """Decode `enc` -> numpy ``[T, H, D]`` in `dtype` (default ``enc.dtype``).

    The arrays are validated against the format (names, dtypes, shapes, zero padding
    nibbles; intb: ``enc.bits`` against the shape), so an `OraclePacked` wrapping a
    kernel's arrays decodes the same way.
    """
    if not isinstance(enc, OraclePacked):
        raise TypeError(f"enc must be an OraclePacked, got {type(enc).__name__}")
    try:
        out_dtype = np.dtype(enc.dtype if dtype is None else dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}") from None
    if out_dtype not in _VALUE_DTYPES:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {out_dtype}")
    shape = tuple(enc.shape)
    if len(shape) != 3:
        raise ValueError(f"enc.shape must be [T, H, D], got {enc.shape!r}")
    axis, group_size = _resolve(enc.format, enc.kind, enc.axis, enc.group_size, shape[2])
    table = _resolve_bits(enc.format, enc.bits, shape)
    spec = array_spec(enc.format, shape, axis, group_size, bits=table)
    if set(enc.arrays) != set(spec):
        raise ValueError(f"enc.arrays must hold exactly {sorted(spec)}, got {sorted(enc.arrays)}")
    bits = {}
    for name, (dt, shp) in spec.items():
        array = enc.arrays[name]
        if not isinstance(array, np.ndarray) or array.dtype != dt or array.shape != shp:
            got = (getattr(array, "dtype", None), getattr(array, "shape", None))
            raise ValueError(f"enc.arrays[{name!r}] must be {dt} {shp}, got {got}")
        bits[name] = _to_bits(array)
    if enc.format == "intb":
        xs = intb.decode(bits, shape, group_size, table)
    else:
        xs = _CODECS[enc.format].decode(bits, shape, axis, group_size)
    return _from_bits(_cast_out_bits(xs, out_dtype), out_dtype, shape)


def mismatches(expected, actual, *, nan_equal: bool = False, limit: int = 5) -> list[str]:
    """Compare arrays as raw bytes; return human-readable differences (empty if identical).

    `expected` / `actual`: one numpy array each, or mappings name -> array (e.g.
    ``enc.arrays`` and a kernel's outputs). dtype, shape and every element's bit pattern
    must agree. With ``nan_equal=True`` two NaNs of any sign/payload count as equal (use it
    for decoded values, never for stored arrays). At most `limit` elements are listed per
    array.
    """
    if not isinstance(expected, Mapping):
        expected, actual = {"array": expected}, {"array": actual}
    problems = []
    if set(expected) != set(actual):
        problems.append(f"fields differ: expected {sorted(expected)}, got {sorted(actual)}")
    for name in sorted(set(expected) & set(actual)):
        want = expected[name]
        got = np.asarray(actual[name])
        if got.dtype != want.dtype or got.shape != want.shape:
            problems.append(
                f"{name}: expected {want.dtype} {want.shape}, got {got.dtype} {got.shape}"
            )
            continue
        want_bits = _to_bits(want)
        got_bits = _to_bits(got)
        unsigned = _BITS_DTYPE[want.dtype]
        shown = 0
        for i, (w, g) in enumerate(zip(want_bits, got_bits, strict=True)):
            if w == g:
                continue
            if nan_equal and _is_nan_bits(w, want.dtype) and _is_nan_bits(g, want.dtype):
                continue
            if shown < limit:
                index = [int(k) for k in np.unravel_index(i, want.shape)] if want.ndim else []
                width = 2 * unsigned.itemsize
                problems.append(f"{name}{index}: expected 0x{w:0{width}x}, got 0x{g:0{width}x}")
            shown += 1
        if shown > limit:
            problems.append(f"{name}: {shown - limit} more differing elements")
    return problems


# --------------------------------------------------------------------------- heavy rows

OracleHeavy = heavy.OracleHeavy


def _check_values(values, name: str = "values") -> tuple[int, int, int]:
    if not isinstance(values, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(values).__name__}")
    if np.dtype(values.dtype) not in _VALUE_DTYPES:
        raise TypeError(f"{name} dtype must be float32, float16 or bfloat16, got {values.dtype}")
    if values.ndim != 3:
        raise ValueError(f"{name} must have rank 3 [T, H, D], got shape {values.shape}")
    return tuple(int(n) for n in values.shape)


def select_heavy(keys: np.ndarray, table: np.ndarray, *, group_size: int = 64) -> np.ndarray:
    """FORMAT.md 5a selection: keys [T, H, D] (D a power of two) and a bfloat16 mean-query
    table [H, R, D] -> rows uint8 [ceil(T/G), H], the heavy row of each token group."""
    shape = _check_values(keys, "keys")
    rows = heavy.select(widen(keys), shape, table, group_size)
    return np.array(rows, dtype=np.uint8).reshape(len(rows), shape[1])


def pack_heavy(
    values: np.ndarray,
    rows: np.ndarray,
    *,
    format: str,
    kind: str,
    group_size: int = 64,
    base_group_size=None,
    axis=None,
    bits=None,
) -> OracleHeavy:
    """FORMAT.md 5a storage: values [T, H, D] with `rows` [ceil(T/G), H] (clamped to each
    group) -> `OracleHeavy`: the heavy rows INT8 and the other rows packed in `format`
    (`base_group_size` defaults to G - 1 on axis tokens, the format's default otherwise)."""
    shape = _check_values(values)
    t, h, d = shape
    g = heavy._check_group_size(group_size)
    rows = np.asarray(rows)
    if rows.shape != (heavy.num_groups(t, g), h) or rows.dtype.kind not in "iu":
        raise ValueError(
            f"rows must be an int array [{heavy.num_groups(t, g)}, {h}], got {rows.dtype} "
            f"{rows.shape}"
        )
    axis, _ = _resolve(format, kind, axis, base_group_size, d)
    if base_group_size is None and axis == "tokens":
        base_group_size = g - 1
    picked = heavy.clamp_rows(rows.tolist(), t, g)
    source = heavy.rest_index(picked, t, h, g)
    raw = _to_bits(np.ascontiguousarray(values))
    rest = [
        raw[(src * h + head) * d + c]
        for row in source
        for head, src in enumerate(row)
        for c in range(d)
    ]
    rest_values = _from_bits(rest, np.dtype(values.dtype), (len(source), h, d))
    payload = pack(
        rest_values, format=format, kind=kind, group_size=base_group_size, axis=axis, bits=bits
    )
    codes, minimum, scale = heavy.encode_rows(widen(values), shape, picked, g)
    n = len(picked)
    arrays = {
        "rows": np.array([r for row in picked for r in row], np.uint8).reshape(n, h),
        "codes": np.array(codes, np.uint8).reshape(n, h, d),
        "minimum": _from_bits(minimum, _F16, (n, h)),
        "scale": _from_bits(scale, _F16, (n, h)),
    }
    return OracleHeavy(payload, arrays, g, shape, np.dtype(values.dtype))


def unpack_heavy(enc: OracleHeavy, dtype=None) -> np.ndarray:
    """Decode an `OracleHeavy` -> numpy [T, H, D] in `dtype` (default: the input dtype)."""
    if not isinstance(enc, OracleHeavy):
        raise TypeError(f"enc must be an OracleHeavy, got {type(enc).__name__}")
    out_dtype = np.dtype(enc.dtype if dtype is None else dtype)
    if out_dtype not in _VALUE_DTYPES:
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {out_dtype}")
    t, h, d = enc.shape
    g = enc.group_size
    picked = enc.arrays["rows"].tolist()
    rest = _to_bits(unpack(enc.payload, out_dtype))
    rows_f32 = heavy.decode_rows(
        enc.arrays["codes"].reshape(-1).tolist(),
        _to_bits(enc.arrays["minimum"]),
        _to_bits(enc.arrays["scale"]),
        d,
    )
    rows_bits = _cast_out_bits(rows_f32, out_dtype)
    out = [0] * (t * h * d)
    for tok in range(t):
        grp, i = divmod(tok, g)
        for head in range(h):
            r = picked[grp][head]
            dst = (tok * h + head) * d
            if i == r:
                src = (grp * h + head) * d
                out[dst : dst + d] = rows_bits[src : src + d]
            else:
                p = grp * (g - 1) + i - (i > r)
                src = (p * h + head) * d
                out[dst : dst + d] = rest[src : src + d]
    return _from_bits(out, out_dtype, (t, h, d))


# --------------------------------------------------------------------------- keys before RoPE


def _rope(values: np.ndarray, theta: float, offset: int, sign: float) -> np.ndarray:
    shape = _check_values(values)
    if shape[2] % 2:
        raise ValueError(f"values: RoPE needs an even head dim, got D={shape[2]}")
    xs = rope.rotate(widen(values), shape, theta, sign, offset)
    return _from_bits([scalar.f32_to_bits(x) for x in xs], _F32, shape)


def apply_rope(values: np.ndarray, theta: float, *, offset: int = 0) -> np.ndarray:
    """FORMAT.md 5b: float32 [T, H, D] RoPE of positions offset .. offset + T - 1."""
    return _rope(values, theta, offset, 1.0)


def invert_rope(values: np.ndarray, theta: float, *, offset: int = 0) -> np.ndarray:
    """FORMAT.md 5b: the inverse rotation (what a pre-RoPE policy packs), float32."""
    return _rope(values, theta, offset, -1.0)
