"""The XLA:CPU codec levers of issue 15 give the same bits as the code they replace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvq_jax.codecs import _numerics
from kvq_jax.codecs.formats.nvfp4 import all_finite


def test_e2m1_table_equals_arithmetic_decode():
    codes = jnp.arange(16, dtype=jnp.uint8).reshape(2, 8)
    arith = np.asarray(_numerics.e2m1_decode(codes)).view(np.uint32)
    table = np.asarray(jax.jit(_numerics.e2m1_decode_table)(codes)).view(np.uint32)
    xla = np.asarray(jax.jit(_numerics.e2m1_decode_xla)(codes)).view(np.uint32)
    np.testing.assert_array_equal(table, arith)
    np.testing.assert_array_equal(xla, arith)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize(
    "special", [None, np.inf, -np.inf, np.nan, -np.nan, "max", "-max", "subnormal"]
)
def test_all_finite_matches_isfinite(dtype, special):
    x = jnp.asarray([[1.0, -2.0, 0.0], [-0.0, 3.5, 7.0]], dtype)
    if special == "max":
        x = x.at[1, 1].set(jnp.finfo(dtype).max)
    elif special == "-max":
        x = x.at[1, 1].set(-jnp.finfo(dtype).max)
    elif special == "subnormal":
        x = x.at[1, 1].set(jnp.finfo(dtype).smallest_subnormal)
    elif special is not None:
        x = x.at[1, 1].set(special)
    expected = bool(jnp.all(jnp.isfinite(x)))
    assert bool(all_finite(x)) == expected
    assert bool(jax.jit(all_finite)(x)) == expected
