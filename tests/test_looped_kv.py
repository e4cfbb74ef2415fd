"""bench/looped_kv.py (looped-tiny's real 4-loop capture, loop-to-loop deltas, absolute twins)
and bench/engine_accuracy.py's loop_kv / threshold options, against independent references:
the capture against the model's own attention inputs recomputed from `kvq_jax.models.ouro`'s
public functions, the delta ratios against a stack whose ratios are known in closed form, an
absolute twin's loops against each loop packed on its own."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kvq_jax
from kvq_jax.core.policies import POLICIES
from kvq_jax.report.capture import load_capture, save_capture

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def _bench(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


looped_kv = _bench("looped_kv")


@pytest.fixture(scope="module")
def model():
    from kvq_jax.models import load_model

    return load_model("looped-tiny", "float32")


def test_capture_is_each_loops_attention_input(model, tmp_path):
    from kvq_jax.models import ouro

    ids = np.random.default_rng(0).integers(1, model.config.vocab_size, (2, 24)).astype(np.int32)
    cap = looped_kv.capture(model, ids, meta={"model": "looped-tiny"})
    n, c = model.config.num_loops, model.config
    assert cap.k.shape == (2, n, 1, 24, c.num_kv_heads, c.head_dim)
    assert cap.q.shape == (2, n, 1, 24, c.num_heads, c.head_dim)
    assert cap.dtype == np.dtype(ml_dtypes.bfloat16)
    # the recurrence by hand: loop l's layer reads the final-normed output of loop l - 1
    params, positions = model.params, jnp.arange(24, dtype=jnp.int32)
    h = ouro.embed(params, jnp.asarray(ids))
    layer = ouro.layer_params(params, 0)
    for loop in range(n):
        q, k, v = ouro.attention_inputs(layer, h, positions, c)
        for got, want in ((cap.q, q), (cap.k, k), (cap.v, v)):
            want = np.asarray(want).astype(ml_dtypes.bfloat16).astype(np.float32)
            np.testing.assert_allclose(got[:, loop, 0].astype(np.float32), want,
                                       rtol=2e-2, atol=2e-2)  # fmt: skip
        h = ouro.final_norm(params, ouro.decoder_layer(layer, h, positions, c), c)
    # the loops differ (the recurrence is not a fixed point yet) and survive the file format
    assert np.abs(cap.k[:, 1].astype(np.float32) - cap.k[:, 0].astype(np.float32)).max() > 0.1
    save_capture(tmp_path / "c.npz", cap)
    again = load_capture(tmp_path / "c.npz")
    np.testing.assert_array_equal(again.k.view(np.uint16), cap.k.view(np.uint16))
    assert again.meta["model"] == "looped-tiny" and again.meta["loops"] == n


def test_delta_ratios_closed_form():
    # X_l = (l + 1) X_0: ||X_l - X_(l-1)|| / ||X_l|| = 1 / (l + 1), whatever X_0
    x0 = np.random.default_rng(1).normal(size=(3, 1, 2, 16, 2, 8))  # windows, 1, layers, ...
    scale = np.array([1.0, 2.0, 3.0, 4.0])[None, :, None, None, None, None]
    x = (x0 * scale).astype(np.float32)
    x[:, :, 1] *= 5.0  # a second layer: scale-free, the same ratios
    want = np.array([1 / 2, 1 / 3, 1 / 4])
    np.testing.assert_allclose(looped_kv.delta_ratios(x), [want, want], rtol=1e-5)
    # a loop that does not move: ratio 0
    x[:, 2] = x[:, 1]
    assert looped_kv.delta_ratios(x)[0, 1] == 0.0


@pytest.mark.parametrize(("name", "kind"), [("int4-g64", "key"), ("flashloop-kivi", "value")])
def test_absolute_twin_packs_each_loop_on_its_own(name, kind):
    policy = POLICIES[name]
    twin = looped_kv.absolute_twin(policy, 4)
    rng = np.random.default_rng(2)
    base = rng.normal(size=(64, 2, 16))
    stack = jnp.asarray(np.stack([base * (1 + 0.1 * i) + 0.05 * i for i in range(4)]),
                        jnp.bfloat16)  # fmt: skip
    got = kvq_jax.decode_loops(kvq_jax.encode_loops(stack, **twin.loop_kwargs(kind, 4)))
    fmt, group = policy.base_format, policy.group_size
    for loop in range(4):
        alone = kvq_jax.unpack_kv(kvq_jax.pack_kv(stack[loop], kind=kind, format=fmt,
                                                  group_size=group))  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got[loop]), np.asarray(alone))
    residual = kvq_jax.decode_loops(kvq_jax.encode_loops(stack, **policy.loop_kwargs(kind, 4)))
    assert not np.array_equal(np.asarray(residual[3]), np.asarray(got[3]))


@pytest.mark.slow
def test_engine_accuracy_loop_kv_and_thresholds(tmp_path):
    """A tiny run of bench/engine_accuracy.py on looped-tiny (about 2 minutes)."""
    engine_accuracy = _bench("engine_accuracy")
    out = tmp_path / "rows.json"
    engine_accuracy.main(["--model", "looped-tiny", "--dtype", "float32", "--loops", "4",
                          "--windows", "2", "--prefix", "15", "--predictions", "4",
                          "--policies", "int4-g64", "--loop-kv", "all", "last",
                          "--thresholds", "1.0", "0.3", "--json", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    key = {(r["threshold"], r["loop_kv"], r["policy"]): r for r in rows}
    assert len(rows) == 8 and len(key) == 8
    ref = key[(1.0, "all", "bf16")]
    assert ref["kl"] == 0.0 and ref["bitwise_equal"] and ref["exit_loop"] == 4.0
    assert ref["loops_per_step"] == 4.0
    # one shared plane instead of four: a quarter of the bytes per token
    assert key[(1.0, "last", "bf16")]["kv_bytes_per_token"] * 4 == ref["kv_bytes_per_token"]
    assert key[(1.0, "last", "bf16")]["kl"] > 0
    # a threshold of 0.3 exits before the last loop somewhere (the gate's exits at 0.5 are
    # mostly loop 3; kvq loops)
    assert key[(0.3, "all", "bf16")]["exit_loop"] < 4.0


def test_quantized_loop_logits(model):
    """Unquantized: ouro.loop_outputs' last loop. Loop 0 alone under int4-g64: attention reads
    exactly pack/unpack of its K and V (a one-loop model recomputed from the public pieces)."""
    import dataclasses

    from kvq_jax.models import ouro

    ids = np.random.default_rng(3).integers(1, model.config.vocab_size, (1, 64)).astype(np.int32)
    tokens = jnp.asarray(ids)
    params, c = model.params, model.config
    got = looped_kv.quantized_loop_logits(params, c, tokens, None)
    loop_logits, _ = ouro.loop_outputs(params, c, tokens)
    np.testing.assert_allclose(got, loop_logits[-1], rtol=1e-4, atol=1e-4)
    one = dataclasses.replace(c, num_loops=1)
    got = looped_kv.quantized_loop_logits(params, one, tokens, POLICIES["int4-g64"])
    h = ouro.embed(params, tokens)
    layer, positions = ouro.layer_params(params, 0), jnp.arange(64, dtype=jnp.int32)
    q, k, v = ouro.attention_inputs(layer, h, positions, c)
    k, v = (kvq_jax.unpack_kv(kvq_jax.pack_kv(x[0], kind=kind, format="int4", group_size=64))
            for x, kind in ((k, "key"), (v, "value")))  # fmt: skip
    attn = ouro.causal_attention(q, k[None], v[None])
    h = ouro.final_norm(params, ouro.attention_output(layer, h, attn, c), c)
    np.testing.assert_allclose(got, ouro.logits(params, h, c), rtol=1e-4, atol=1e-4)
    assert np.abs(np.asarray(got) - np.asarray(loop_logits[0])).max() > 1e-3  # it quantized
