"""Assertions shared by the test modules: byte equality of arrays and packed tensors."""

from __future__ import annotations

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
