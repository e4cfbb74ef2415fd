"""Launch parameters (`kvq_jax.kernels.launch`): the rule `auto` uses, user overrides that reach
the lowered Triton kernel, and refused values."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from kvq_jax.core.cache_config import resolve_paged
from kvq_jax.kernel_checks.arg_specs import page_pack as pack_specs
from kvq_jax.kernel_checks.arg_specs import page_reconstruct as reconstruct_specs
from kvq_jax.kernels import launch
from kvq_jax.kernels._tile_decode import chain_steps
from kvq_jax.kernels.jax_compat import lower_for_gpu
from kvq_jax.kernels.launch import Launch
from kvq_jax.kernels.page_pack import api as pack_api
from kvq_jax.kernels.page_pack import pallas_triton
from kvq_jax.kernels.page_reconstruct import api as reconstruct_api
from kvq_jax.kernels.page_reconstruct import pallas_triton as reconstruct_kernel


def _lowered_params(text: str) -> tuple[int, int]:
    warps = re.findall(r"num_warps = (\d+) : i32", text)
    stages = re.findall(r"num_stages = (\d+) : i32", text)
    assert warps and stages, "no Triton launch parameters in the lowered module"
    return int(warps[0]), int(stages[0])


def _lower_reconstruct(spec, launch_):
    steps, planes = chain_steps(spec.abstract_cache(), "key", spec.loop)
    fn = functools.partial(
        reconstruct_kernel.decode_pages, steps=steps, interpret=False, launch=launch_
    )
    return lower_for_gpu(fn, tuple(planes), spec.page_ids(8)).as_text()


def test_rules():
    """The measured spill-free rules (docs/kernel_resources.md)."""
    assert launch.page_pack(64, 64) == Launch(8, 1) and launch.page_pack(16, 128) == Launch(4, 1)
    assert launch.page_pack(32, 128, "nvfp4") == Launch(16, 1)
    assert launch.page_reconstruct(16, 64) == Launch(4, 1)  # at least 4 warps
    assert launch.page_reconstruct(64, 128) == Launch(8, 1)  # 32 tile elements per thread
    assert launch.paged_attention(1, 128, 32) == Launch(4, 2)  # broadcast scores (Ouro: G = 1)
    assert launch.paged_attention(1, 128, 64) == Launch(8, 2)  # wide tiles
    assert launch.paged_attention(8, 64, 64) == Launch(8, 1)  # dot path
    assert launch.paged_attention(16, 128, 16) == Launch(16, 1)
    # a second value accumulator or RoPE's key halves (more_tiles)
    assert launch.paged_attention(3, 64, 16, more_tiles=True) == Launch(4, 2)
    assert launch.paged_attention(3, 64, 32, more_tiles=True) == Launch(8, 2)
    assert launch.paged_attention(1, 128, 64, more_tiles=True) == Launch(16, 2)
    assert launch.paged_attention(8, 128, 16, more_tiles=True) == Launch(16, 1)  # dot path


def test_attention_launch_follows_the_cache():
    """The kernel's default launch takes more warps for heavy rows over HINT values and for
    keys stored before RoPE (`pallas_triton.more_tiles`), not for heavy INT4 / INT2 pages."""
    from kvq_jax.kernel_checks.arg_specs import paged_attention as specs
    from kvq_jax.kernels.paged_attention import pallas_triton

    by_name = {s.name: s for s in specs.SUPPORTED_SPECS}
    for name, more in (("heavy-intb-hint4-rope-gqa3-p32-d64-sink3", True),
                       ("heavy-int4-int2-p64-d64-bf16", False), ("int4-g1-p16-d64", False),
                       ("rope-int4-gqa8-p16-d128-loop1-sink2-bf16", True)):  # fmt: skip
        spec = by_name[name]
        assert pallas_triton.more_tiles(spec.config(), spec.loop) is more, name


def test_auto_launch_and_override_reach_the_kernel():
    spec = reconstruct_specs.SUPPORTED_SPECS[0]
    rule = launch.page_reconstruct(spec.page_size, spec.head_dim)
    assert _lowered_params(_lower_reconstruct(spec, None)) == (rule.num_warps, rule.num_stages)
    assert _lowered_params(_lower_reconstruct(spec, Launch(16, 1))) == (16, 1)


def test_page_pack_override_reaches_the_kernel():
    spec = pack_specs.SPECS[0]
    axis, group = (spec.kind == "key" and "tokens") or "channels", None
    kwargs = dict(kind=spec.kind, format=spec.format, interpret=False)

    axis, group = resolve_paged(spec.format, spec.kind, spec.shape(1)[1:], spec.axis,
                                spec.group_size)  # fmt: skip
    for launch_, want in ((None, (4, 1)), (Launch(8, 2), (8, 2))):
        fn = functools.partial(pallas_triton.pack_paged, axis=axis, group_size=group,
                               launch=launch_, **kwargs)  # fmt: skip
        text = lower_for_gpu(fn, spec.shape_dtype_struct(3))
        assert _lowered_params(text.as_text()) == want


@pytest.mark.parametrize("bad", [dict(num_warps=3, num_stages=1), dict(num_warps=4, num_stages=0),
                                 dict(num_warps=64, num_stages=1)])  # fmt: skip
def test_bad_launch_values(bad):
    with pytest.raises(ValueError, match="Launch"):
        Launch(**bad)


def test_public_functions_refuse_a_non_launch():
    pages = jnp.zeros((2, 16, 1, 64), jnp.float32)
    with pytest.raises(TypeError, match="launch must be"):
        pack_api.pack_paged(pages, kind="key", launch=(4, 1))
    spec = reconstruct_specs.TEST_SPECS[0]
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), spec.abstract_cache())
    with pytest.raises(TypeError, match="launch must be"):
        reconstruct_api.decode_pages(cache, "key", jnp.zeros(1, jnp.int32), loop=0, launch=4)
