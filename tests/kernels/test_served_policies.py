"""Which served policies the fused kernels take: every stored plane of the engine's caches,
every loop, through `config_support` of decode attention, page reconstruction and page packing
(shapes and static metadata only, so this runs without a GPU; the kernels' arithmetic is
checked against the references in test_paged_attention.py / test_page_reconstruct.py /
test_page_pack.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from kvq_jax.engine import Engine, QuantizedStore
from kvq_jax.kernels import page_pack, page_reconstruct
from kvq_jax.kernels._tile_decode import heavy_layout
from kvq_jax.kernels.paged_attention import config_support
from kvq_jax.models import load_model
from kvq_jax.models.loading import MissingPackages

#: (model, policy, loops): served by the fused kernels on a GPU.
KERNEL_SERVED = [
    ("smollm2", "int4-g64", 1),
    ("smollm2", "int4-hint4", 1),
    ("smollm2", "intb-hint4-smollm2", 1),
    ("smollm2", "intb-hint4-heavy-smollm2", 1),
    ("smollm2", "intb-prerope-hint4-heavy-smollm2", 1),
    ("random:ouro-tiny", "flashloop-legacy", 4),
    ("random:ouro-tiny", "flashloop-kivi", 4),
    ("random:ouro-tiny", "loops-abs-v2442", 4),
    ("random:ouro-tiny", "loops-abs-v2442-h", 4),
]


@functools.cache
def _model(name):
    return load_model(name, dtype=jnp.float32)


def _caches(model_name, policy, loops, threshold=None):
    try:
        model = _model(model_name)
    except MissingPackages as e:  # the jax 0.12 CI stage installs no model packages
        pytest.skip(str(e))
    if threshold is not None:
        config = dataclasses.replace(model.config, early_exit_threshold=threshold)
        model = dataclasses.replace(model, config=config)
    engine = Engine(model, policy, num_pages=8, page_size=64, max_seqs=2, max_pages_per_seq=4,
                    loops=loops, prefill_batch=1)  # fmt: skip
    caches = [s.cache for s in engine.stores if isinstance(s, QuantizedStore)]
    assert caches, "no quantized store"
    c = model.config
    q = jax.ShapeDtypeStruct((2, c.num_heads, c.head_dim), jnp.float32)
    tables = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    return caches, q, tables


@pytest.mark.parametrize("model_name, policy, loops", KERNEL_SERVED)
def test_policy_attends_through_the_kernels(model_name, policy, loops):
    """Decode attention's kernel takes every loop; page reconstruction's every plane (HINT and
    heavy rows over HINT un-rotated in the tile); page packing's every plane of every loop
    (INT4, INT2, HINT4, HINT2, INTB, heavy rows with the rows the keys chose)."""
    caches, q, tables = _caches(model_name, policy, loops)
    for cache in caches:
        c = cache.config
        for loop in range(loops):
            assert config_support(q, cache, tables, loop=loop) is None, (policy, loop)
        for kind in ("key", "value"):
            reason = page_reconstruct.config_support(c, kind)
            assert reason is None, (policy, kind, reason)
            for loop in range(loops):
                args = c.loop_pack_args(kind, loop)
                fmt = args["format"]
                heavy = heavy_layout(fmt)
                reason = page_pack.config_support(
                    (1, c.page_size, c.num_heads, c.head_dim), c.dtype, kind=kind, format=fmt,
                    group_size=args["group_size"], axis=args["axis"], rows=heavy is not None,
                )  # fmt: skip
                assert reason is None, (policy, kind, loop, fmt, reason)


def test_adaptive_exits_take_the_kernels():
    """An Ouro engine whose tokens exit early (threshold < 1) stores a depth map: decode
    attention and page reconstruction take it (each row's chain stops at its exit loop)."""
    caches, q, tables = _caches("random:ouro-tiny", "loops-abs-v2442", 4, threshold=0.5)
    for cache in caches:
        assert cache.config.adaptive_exit and cache.depth is not None
        for loop in range(4):
            assert config_support(q, cache, tables, loop=loop) is None, loop
        for kind in ("key", "value"):
            assert page_reconstruct.config_support(cache.config, kind) is None, kind
