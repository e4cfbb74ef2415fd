"""Assertions shared by the test modules (byte equality of arrays and packed tensors) and a
few builders (an adaptive-exit cache, serving rows)."""

from __future__ import annotations

import functools

import numpy as np


def raw_bytes(array) -> np.ndarray:
    """Any array (jax, numpy, ml_dtypes) -> its raw bytes as a flat uint8 numpy array."""
    a = np.ascontiguousarray(np.asarray(array))
    return a.reshape(-1).view(np.uint8)


def assert_same_bytes(actual, expected, what: str = "array") -> None:
    """Same dtype, same shape, same bytes (NaN payloads and signed zeros included)."""
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    ab, eb = raw_bytes(a), raw_bytes(e)
    if not np.array_equal(ab, eb):
        itemsize = a.dtype.itemsize
        first = int(np.flatnonzero(ab != eb)[0]) // itemsize
        index = np.unravel_index(first, a.shape) if a.shape else ()
        raise AssertionError(
            f"{what}: bytes differ first at {index}: {a.reshape(-1)[first]!r} != "
            f"{e.reshape(-1)[first]!r} ({int(np.sum(ab != eb))} bytes differ)"
        )


def assert_same_values(actual, expected, what: str = "values") -> None:
    """Decoded values: same dtype, shape and bytes, except that a NaN matches any NaN.

    A decoded NaN's sign and payload come from the device's arithmetic (docs/ORACLE.md), so
    NaN positions must agree but their bits need not. Compare stored arrays (whose NaNs are
    canonical) with `assert_same_bytes` instead.
    """
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    a_nan, e_nan = np.isnan(a.astype(np.float32)), np.isnan(e.astype(np.float32))
    if not np.array_equal(a_nan, e_nan):
        index = tuple(int(i) for i in np.argwhere(a_nan != e_nan)[0])
        raise AssertionError(
            f"{what}: NaN positions differ first at {index}: {a[index]!r} != {e[index]!r} "
            f"({int(np.sum(a_nan != e_nan))} elements differ)"
        )
    zero = np.zeros((), a.dtype)
    assert_same_bytes(np.where(a_nan, zero, a), np.where(e_nan, zero, e), what)


def assert_packed_equal(actual, expected_arrays: dict, what: str = "packed") -> None:
    """A PackedKV's arrays equal `expected_arrays` (e.g. an OraclePacked's .arrays) bytewise."""
    assert set(actual.arrays) == set(expected_arrays), (
        f"{what}: fields {sorted(actual.arrays)} != {sorted(expected_arrays)}"
    )
    for name, array in expected_arrays.items():
        assert_same_bytes(actual.arrays[name], array, f"{what}.{name}")


def assert_trees_same_bytes(a, b, what: str = "tree") -> None:
    """Two pytrees with the same structure and byte-identical leaves."""
    import jax

    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, f"{what}: tree structure differs:\n{ta}\n{tb}"
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        assert_same_bytes(x, y, f"{what} leaf {i}")


def torch_to_numpy(tensor) -> np.ndarray:
    """A torch tensor (any device, any layout) -> numpy array of the same dtype and bytes."""
    from kvq_torch_bridge.codecs._dtypes import to_numpy

    return to_numpy(tensor)


def numpy_to_torch(array, device="cpu"):
    """A numpy array (ml_dtypes bfloat16 / float8 included) -> torch tensor with its bytes."""
    from kvq_torch_bridge.codecs._dtypes import from_numpy

    return from_numpy(np.asarray(array), device)


def serving_rows(cache, rows, kind: str):
    """What a `kvq_torch_bridge.serving` cache should hold for a sequence's K or V `rows`
    [T, H, D]: each complete block through the public Torch codec (pack_kv + unpack_kv with
    the cache's base arguments), the open block raw; bfloat16. A raw cache: the rows as they
    are."""
    import torch

    import kvq_torch_bridge as kt

    bs, parts = cache.block_size, []
    for start in range(0, rows.shape[0], bs):
        page = rows[start : start + bs]
        if page.shape[0] == bs and cache.config is not None:
            page = kt.unpack_kv(kt.pack_kv(page, **cache.config.pack_args(kind, "base")))
        parts.append(page.to(torch.bfloat16))
    return torch.cat(parts)


def rotated_space_atol(cache, loop: int, values, base: float = 1e-5) -> float:
    """Tolerance of attention over values attended in the Hadamard-rotated space
    (`kernels.paged_attention.xla`) against dense attention on reconstructed rows: `base`
    (float32 round-off), plus, for a 16-bit cache whose value chain is rotated, the cache
    dtype's rounding of each loop's decoded row and sum that the reference makes and the
    rotated path does not: (loop + 1) * eps * max|v| (the output is a convex combination of
    rows, each off by at most that much)."""
    from kvq_jax.kernels.page_reconstruct.xla import rotated_chain

    dtype = np.dtype(cache.config.dtype)
    if dtype == np.float32 or not rotated_chain(cache.loop_chain("value", loop)):
        return base
    return base + (loop + 1) * float(np.finfo(dtype).eps) * float(
        np.abs(np.asarray(values, np.float32)).max()
    )


def step_compiles(run) -> list[str]:
    """The engine step programs (`prefill_step`, `decode_step`) XLA compiles while `run()`
    runs, in order, from JAX's compile log."""
    import logging

    import jax

    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if "Finished XLA compilation" in text:
                seen.extend(n for n in ("prefill_step", "decode_step") if f"jit({n})" in text)

    handler, logger = Catch(), logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles(True):
            run()
    finally:
        logger.removeHandler(handler)
    return seen


#: Adaptive-exit caches the kernels take (`adaptive_exit_cache` overrides): INT4 keys with
#: NVFP4 deltas and the reverse for values; INT2 keys with an INT4 delta and loop 2 stored
#: absolute, HINT4 values (attended rotated) with loop 1 absolute in HINT2.
ADAPTIVE_KERNEL_CACHES = {
    "int4-nvfp4": dict(head_dim=64),
    "int2-hint4-absolute": dict(
        head_dim=64, k_base_format="int2", k_residual_format="int4", v_base_format="hint4",
        v_residual_format="hint2", k_absolute=(2,), v_absolute=(1,),
    ),
}  # fmt: skip


@functools.cache
def adaptive_exit_cache(**overrides):
    """A 3-loop adaptive-exit cache (page 16, sink 2): two sequences of 45 and 21 tokens whose
    tokens exit after loop 0, 1 or 2 (their K/V in later loops are the exit loop's).
    overrides: `PagedCacheConfig` fields (formats, head_dim, loops stored absolute). Built once
    per process and overrides (the arrays are immutable)."""
    import jax.numpy as jnp

    from kvq_jax.cache import paged_cache as jpc
    from kvq_jax.codecs.cache_state import PagedCacheConfig

    fields = dict(
        num_pages=12, page_size=16, num_heads=2, head_dim=32, dtype=jnp.bfloat16, num_loops=3,
        k_base_format="int4", k_residual_format="nvfp4", v_base_format="nvfp4",
        v_residual_format="int4", sink=2, max_seqs=2, adaptive_exit=True,
    )  # fmt: skip
    config = PagedCacheConfig(**{**fields, **overrides})
    d = config.head_dim
    cache = jpc.init_cache(config)
    tables = jnp.asarray(np.random.default_rng(0).permutation(12).reshape(2, 6), jnp.int32)
    rng = np.random.default_rng(1)
    for slot, n in ((0, 45), (1, 21)):
        exit_loop = rng.integers(0, 3, n)
        kv = rng.normal(size=(3, 2, n, 2, d)).cumsum(axis=0)  # loop, k/v, token, head, dim
        ids = jnp.asarray([slot], jnp.int32)
        for loop in range(3):
            rows = kv[np.minimum(loop, exit_loop), :, np.arange(n)]  # [n, 2, H, D]
            k, v = (jnp.asarray(rows[None, :, i], jnp.bfloat16) for i in range(2))
            exited = None if loop == 0 else jnp.asarray((exit_loop < loop)[None])
            cache = jpc.append(
                cache, k, v, block_tables=tables, seq_ids=ids, loop=loop, exited=exited
            )
    return cache, tables


def unshifted_payload_positions(rows, g: int, t: int):
    """A planted defect for `payload_positions` (heavy-row pages read unmerged): payload row
    g*(G-1) + j of every head at g*G + j, the heavy row before it forgotten."""
    import jax.numpy as jnp

    n, h = rows.shape
    pos = jnp.arange(n)[:, None, None] * g + jnp.arange(g - 1)[None, :, None]
    return jnp.broadcast_to(pos, (n, g - 1, h)).reshape(-1, h)[: t - n]
