"""Launch parameters of the Triton kernels: `Launch` (frozen, hashable: a static argument) and
the rule that picks one per kernel and configuration. `backend="auto"` and the other Pallas
backends fill it in; pass `launch=Launch(...)` to a kernel's public function to override it.

The rules keep every configuration the kernels take free of register spills on sm_80,
sm_90a and sm_120a (ptxas 13.5; `kvq_jax.kernel_checks.cuda_compile`, docs/kernel_resources.md):

  page pack        1 stage: each program handles one tile (INT4/FP8) or two passes over a
                   page's heads (NVFP4), so there is nothing to prefetch. 4 warps below
                   page_size * head_dim = 4096 elements; from there 8 (INT4, FP8) or 16
                   (NVFP4). Under the Triton of jax 0.11 / 0.12, 4 warps spilled the NVFP4 key
                   pack of float32 [64, 128] pages (255 registers, 4-12 bytes) and the NVFP4
                   value pack of float16 [64, 64] pages (8-16 bytes at 128 registers), and 8
                   warps the NVFP4 key pack of bfloat16 [32, 128] pages on sm_80 (8 bytes);
                   16 warps: every NVFP4 configuration 0 spills (jax 0.12.0.1, 3 targets).
  page reconstruct page_size * head_dim / 1024 warps (32 tile elements per thread), at least
                   4; 1 stage (one tile per program). 2 warps spilled up to 26 KB.
  paged attention  group G = Hq / H < 8 (scores as a broadcast multiply-sum): 4 warps, 2
                   stages; 8 warps above page_size * head_dim = 4096 (4 warps reached 255
                   registers and spilled 4 bytes on sm_80 for [64, 128] HINT4 tiles). G >= 8
                   (scores with FMA dots at HIGHEST precision): 1 stage and 8 warps at
                   head_dim <= 64, 16 at 128 and more (4 warps reached 255 registers and
                   spilled; 2 stages sent ptxas into 32-register allocations, ~20 KB of
                   spills). The split count does not change registers. With a second value
                   accumulator (heavy rows over HINT values) or keys turned by RoPE in the
                   kernel, broadcast scores take 8 warps from 2048 tile elements and 16 above
                   4096: at 4 warps [32, 64] tiles spilled 64 bytes on sm_90a and [64, 64]
                   ones 428-520 bytes; at 8 warps [64, 128] tiles reached 255 registers on
                   sm_80 (0 spills; 16 warps: 128 registers on every target).
"""

from __future__ import annotations

import dataclasses

from kvq_jax.core.checks import is_int

#: Query heads per KV head from which attention scores use FMA dots.
DOT_MIN_GROUP = 8
#: Page-reconstruction tile elements per thread, and the fewest warps.
RECONSTRUCT_ELEMENTS_PER_THREAD = 32
RECONSTRUCT_MIN_WARPS = 4
#: Page-pack tiles of at least this many elements (page_size * head_dim) take 8 warps.
PACK_WIDE_TILE = 4096
#: Attention tiles (page_size * head_dim) above this many elements take 8 warps with
#: broadcast scores.
ATTENTION_WIDE_TILE = 4096


@dataclasses.dataclass(frozen=True)
class Launch:
    """`pltriton.CompilerParams(num_warps, num_stages)` of one kernel call."""

    num_warps: int
    num_stages: int

    def __post_init__(self):
        if not is_int(self.num_warps) or self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"Launch.num_warps must be a power of two in [1, 32], got "
                             f"{self.num_warps!r}")  # fmt: skip
        if not is_int(self.num_stages) or self.num_stages < 1:
            raise ValueError(f"Launch.num_stages must be an int >= 1, got {self.num_stages!r}")


def check_launch(launch) -> Launch | None:
    """None or a Launch, else a TypeError naming the argument."""
    if launch is not None and not isinstance(launch, Launch):
        raise TypeError(f"launch must be a kvq_jax.kernels.launch.Launch or None, got "
                        f"{type(launch).__name__}")  # fmt: skip
    return launch


def page_pack(page_size: int, head_dim: int, format: str = "int4") -> Launch:
    """The page-pack kernel's launch for pages of page_size x head_dim (per head) in
    `format`."""
    if page_size * head_dim < PACK_WIDE_TILE:
        return Launch(num_warps=4, num_stages=1)
    return Launch(num_warps=16 if format == "nvfp4" else 8, num_stages=1)


def page_reconstruct(page_size: int, head_dim: int) -> Launch:
    """The page-reconstruction kernel's launch for [page_size, head_dim] tiles."""
    warps = page_size * head_dim // (32 * RECONSTRUCT_ELEMENTS_PER_THREAD)
    return Launch(num_warps=max(RECONSTRUCT_MIN_WARPS, min(warps, 32)), num_stages=1)


def paged_attention(group: int, head_dim: int, page_size: int, *,
                    more_tiles: bool = False) -> Launch:  # fmt: skip
    """The attention kernel's launch for `group` query heads per KV head of `head_dim` and
    pages of `page_size` tokens. Broadcast scores (G < DOT_MIN_GROUP) on tiles of more than
    ATTENTION_WIDE_TILE elements take 8 warps: at 4 warps a [64, 128] tile reached 255
    registers and spilled 4 bytes on sm_80 (HINT4 values, 4 loops). more_tiles: the kernel
    keeps a second value accumulator or RoPE's key halves (see the module doc)."""
    if group >= DOT_MIN_GROUP:
        return Launch(num_warps=8 if head_dim <= 64 else 16, num_stages=1)
    tile = page_size * head_dim
    if more_tiles and tile >= ATTENTION_WIDE_TILE // 2:
        return Launch(num_warps=16 if tile > ATTENTION_WIDE_TILE else 8, num_stages=2)
    if tile > ATTENTION_WIDE_TILE:
        return Launch(num_warps=8, num_stages=2)
    return Launch(num_warps=4, num_stages=2)
