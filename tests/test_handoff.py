"""Disaggregated prefill and decode across the stacks (`kvq_torch_bridge.bridge.handoff`): the
JAX engine prefills and a transformers model decodes through a Torch serving cache laid over
the engine's buffers (DLPack, no copy), and the reverse; each gives the greedy tokens of the
JAX engine alone. The model is a tiny random transformers LlamaForCausalLM, loaded into JAX
from its saved directory (two independent implementations of the same weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvq_jax.engine import Engine
from kvq_jax.models.loading import load_model
from kvq_torch_bridge.bridge import handoff

POLICIES = ["int4-g64", "nvfp4", "kvq:fp8", "bf16"]
PROMPT_LEN, NEW = 100, 40  # the prompt leaves block 1 open; decoding completes it (row 128)
# stop ids are off (stop_ids=()) so every policy decodes all NEW tokens across the block edge


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).float().eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(path)
    return hf, load_model(str(path), "float32", tokenizer=False)


def make_engine(model, policy):
    return Engine(model, policy.removeprefix("kvq:"), num_pages=8, page_size=64, max_seqs=2,
                  max_pages_per_seq=4)  # fmt: skip


def prompt():
    return np.random.default_rng(3).integers(0, 128, PROMPT_LEN).tolist()


@pytest.fixture(scope="module")
def reference(tiny):
    """Greedy tokens of the JAX engine alone, per policy."""
    _, model = tiny
    out = {}
    for policy in POLICIES:
        (request,) = make_engine(model, policy).generate([prompt()], max_new_tokens=NEW,
                                                         stop_ids=())  # fmt: skip
        assert len(request.tokens) == NEW
        out[policy] = request.tokens
    return out


def engine_pointers(engine) -> set[int]:
    return {a.unsafe_buffer_pointer() for a in __import__("jax").tree.leaves(engine.stores)}


@pytest.mark.parametrize("policy", POLICIES)
def test_jax_prefill_torch_decode(tiny, reference, policy):
    hf, model = tiny
    engine = make_engine(model, policy)
    tokens, view = handoff.jax_prefill_torch_decode(engine, hf, prompt(), NEW, stop_ids=())
    # every page array and staging row of the Torch cache is an engine buffer, not a copy
    assert view.shared_pointers
    for name, (jax_ptr, torch_ptr) in view.shared_pointers.items():
        assert jax_ptr == torch_ptr, name
    assert {p for p, _ in view.shared_pointers.values()} <= engine_pointers(engine)
    assert tokens == reference[policy]
    view.close()
    assert (
        engine.allocator.num_free_pages
        + sum(len(engine.allocator.pages(s)) for s in engine.allocator.live_slots)
        == engine.allocator.num_pages
    )


@pytest.mark.parametrize("policy", POLICIES)
def test_torch_prefill_jax_decode(tiny, reference, policy):
    hf, model = tiny
    engine = make_engine(model, policy)
    request, pointers = handoff.torch_prefill_jax_decode(
        engine, hf, prompt(), max_new_tokens=NEW, stop_ids=()
    )
    for name, (jax_ptr, torch_ptr) in pointers.items():
        assert jax_ptr == torch_ptr, name
    # the engine decodes from the very buffers Torch wrote (its pages were not copied)
    pages = {p for n, (p, _) in pointers.items() if not n.endswith("stage")}
    assert pages <= engine_pointers(engine)
    engine.run()
    assert request.tokens == reference[policy]


def test_view_refuses_what_it_cannot_share(tiny):
    _, model = tiny
    looped = Engine(model, "int4-g64", num_pages=8, page_size=64, max_seqs=2,
                    max_pages_per_seq=4, loops=2)  # fmt: skip
    with pytest.raises(ValueError, match="single-loop"):
        handoff.serving_view(looped)
    engine = make_engine(model, "int4-g64")
    view = handoff.serving_view(engine)
    with pytest.raises(ValueError, match="in use"):  # the scratch page and slot are held
        handoff.serving_view(engine)
    view.close()
    handoff.serving_view(engine).close()
    from kvq_jax.codecs.formats.intb import register_layer_tables
    from kvq_jax.core.policies import Policy

    layered = register_layer_tables([((2, 6) * 32, (4,) * 64), ((4,) * 64, (6, 2) * 32)])
    policy = Policy("layered-keys", layered, layered, group_size=64)
    with pytest.raises(ValueError, match="per-layer INTB format"):
        handoff.serving_view(
            Engine(model, policy, num_pages=8, page_size=64, max_seqs=2, max_pages_per_seq=4)
        )


def test_add_prefilled_refusal_changes_nothing(tiny):
    _, model = tiny
    engine = make_engine(model, "int4-g64")
    free = engine.allocator.num_free_pages
    with pytest.raises(ValueError, match="logits of shape"):
        engine.add_prefilled(prompt(), lambda slot, pages: np.zeros(3, np.float32))
    assert engine.allocator.num_free_pages == free and not engine.allocator.live_slots
    assert not engine.running
    with pytest.raises(RuntimeError, match="producer failed"):
        engine.add_prefilled(prompt(), lambda slot, pages: (_ for _ in ()).throw(
            RuntimeError("producer failed")))  # fmt: skip
    assert engine.allocator.num_free_pages == free and not engine.running
    # hold_page refuses a page a sequence holds, release_page one it does not hold
    slot = engine.allocator.add_sequence(10)
    page = int(engine.allocator.pages(slot)[0])
    with pytest.raises(ValueError, match="in use"):
        engine.allocator.hold_page(page)
    with pytest.raises(ValueError, match="belongs to a sequence"):
        engine.allocator.release_page(page)
    with pytest.raises(ValueError, match="in use"):
        engine.allocator.hold_slot(slot)
