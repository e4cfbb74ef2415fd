"""Framework-neutral constants of the kvq formats (docs/FORMAT.md), shared by every stack.

No JAX or Torch here: names, defaults, layout arithmetic and the numeric constants that the
JAX codecs, the Torch codec and kernels all use.
"""

from __future__ import annotations

import numpy as np

#: Tensor kinds and the grouping axis each uses unless told otherwise (KIVI: keys per
#: channel over tokens, values per token over channels).
KINDS = ("key", "value")
AXES = ("tokens", "channels")
DEFAULT_AXIS = {"key": "tokens", "value": "channels"}
#: Format names in registry order, and their default group sizes (fp8: D, resolved per call).
FORMATS = ("int4", "nvfp4", "fp8_e4m3", "int2")
#: Hadamard-rotated formats (FORMAT.md section 2c), registered after FORMATS: the base
#: format's payload on rotated rows, D a power of two.
ROTATED_FORMATS = ("hint4", "hint2")
INT4_DEFAULT_GROUP_SIZE = 64
INT2_DEFAULT_GROUP_SIZE = 64
INTB_DEFAULT_GROUP_SIZE = 64
NVFP4_GROUP_SIZE = 16

#: Smallest positive normal float32, 2**-126: smaller magnitudes are flushed to zero.
F32_MIN_NORMAL = np.float32(np.finfo(np.float32).tiny)
#: Largest finite float32 (NVFP4's tiny-tensor rule clamps the global scale to it).
F32_MAX = np.float32(np.finfo(np.float32).max)
#: Largest finite float8_e4m3fn value and largest E2M1 magnitude.
E4M3_MAX = np.float32(448.0)
E2M1_MAX = np.float32(6.0)
#: NVFP4: 448 * 6 maps the tensor amax onto the largest block scale times the largest code,
#: and the float32 nearest to 1/6 (vLLM's order of operations).
NVFP4_GLOBAL_NUMERATOR = np.float32(2688.0)
NVFP4_ONE_SIXTH = np.float32(1.0 / 6.0)
#: INT4 levels: codes 0..15, scale = span / 15.
INT4_LEVELS = np.float32(15.0)
#: INT2 levels (FlashLoop's 2-bit stream): codes 0..3, scale = span / 3.
INT2_LEVELS = np.float32(3.0)

#: E2M1 magnitudes by 3-bit code, and signed values by 4-bit code (code 8 is -0.0).
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)
#: Midpoints between consecutive E2M1 magnitudes, and whether an exact tie rounds up (to the
#: even code above) rather than down: the code of |y| is the number of midpoints below it.
E2M1_MIDPOINTS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def num_groups(length: int, group_size: int) -> int:
    """ceil(length / group_size)."""
    return -(-length // group_size)


def packed_width(channels: int) -> int:
    """Bytes per row of 4-bit codes: ceil(channels / 2)."""
    return (channels + 1) // 2


def packed_width_2bit(channels: int) -> int:
    """Bytes per row of 2-bit codes: ceil(channels / 4)."""
    return (channels + 3) // 4


def metadata_shape(shape, axis: str, group_size: int) -> tuple[int, int, int]:
    """Shape of one per-group metadata array for values of `shape` = (T, H, D)."""
    t, h, d = shape
    if axis == "tokens":
        return (num_groups(t, group_size), h, d)
    return (t, h, num_groups(d, group_size))
