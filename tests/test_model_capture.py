"""`kvq_jax.models.capture.attention_inputs_per_layer` (one lax.scan per loop) against the
per-layer pieces run one layer at a time in Python (`layer_params`, `attention_inputs`,
`decoder_layer`, `final_norm`), on a seeded random Ouro (4 layers x 4 loops)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvq_jax.models import load_model
from kvq_jax.models.capture import attention_inputs_per_layer


@pytest.fixture(scope="module")
def model():
    return load_model("random:ouro-tiny", "float32")


def test_every_loop_and_layer_equals_the_pieces(model):
    arch, cfg, params = model.module, model.config, model.params
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 19)))
    q, k, v = attention_inputs_per_layer(params, cfg, tokens)
    n, l_ = cfg.num_loops, cfg.num_layers
    assert q.shape == (n, l_, 2, 19, cfg.num_heads, cfg.head_dim)
    assert k.shape == v.shape == (n, l_, 2, 19, cfg.num_kv_heads, cfg.head_dim)
    h = arch.embed(params, tokens)
    positions = jnp.arange(19, dtype=jnp.int32)
    for loop in range(n):
        for i in range(l_):
            layer = arch.layer_params(params, i)
            want = arch.attention_inputs(layer, h, positions, cfg)
            for got, w in zip((q, k, v), want, strict=True):
                np.testing.assert_allclose(got[loop, i], w, rtol=1e-5, atol=1e-5)
            h = arch.decoder_layer(layer, h, positions, cfg)
        h = arch.final_norm(params, h, cfg)
    # fewer loops: a prefix of the same rows
    _q2, k2, _ = attention_inputs_per_layer(params, cfg, tokens, loops=2)
    np.testing.assert_array_equal(k2, k[:2])


def test_bad_arguments(model):
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="loops must be an int >= 1"):
        attention_inputs_per_layer(model.params, model.config, tokens, loops=0)
    with pytest.raises(ValueError, match="tokens must be"):
        attention_inputs_per_layer(model.params, model.config, tokens[0])
