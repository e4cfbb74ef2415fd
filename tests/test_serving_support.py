"""`serving_support`: the one answer to "can this policy be served, and if not, why".

The expected sets below are written from the policy table by hand (which policies store heavy
rows, absolute loops or per-loop residual formats), not computed by the function under test.
Every refusal (the engine, `cache_config_for`, `kvq generate`, `kvq report`) quotes it.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvq_jax.core.policies import (
    DEFAULT_REPORT,
    POLICIES,
    ServingSupport,
    cache_config_for,
    serving_support,
)

HEAVY = {"intb-hint4-heavy-smollm2", "intb-prerope-hint4-heavy-smollm2"}
ABSOLUTE = {"loops-abs-v2442", "loops-abs-keys", "loops-abs-v2442-h"}
PER_LOOP = {"flashloop-legacy"}  # values INT4 / INT2 / INT2 over loops 1-3


def _with_win(names):
    return set(names) | {f"{n}+win" for n in names}


def test_which_policies_are_served():
    at_four = {name for name, p in POLICIES.items() if not serving_support(p, num_loops=4)}
    assert at_four == _with_win(HEAVY | ABSOLUTE | PER_LOOP)
    # one loop: no later loop, so absolute loops and per-loop formats mean nothing
    at_one = {name for name, p in POLICIES.items() if not serving_support(p, num_loops=1)}
    assert at_one == _with_win(HEAVY)
    # default: judged at the loop counts the policy's features need
    default = {name for name, p in POLICIES.items() if not serving_support(p)}
    assert default == at_four


@pytest.mark.parametrize(
    ("names", "words"),
    [(HEAVY, "heavy rows"), (ABSOLUTE, "absolute"), (PER_LOOP, "different formats")],
)
def test_reasons_name_the_policy_and_the_feature(names, words):
    for name in _with_win(names):
        support = serving_support(POLICIES[name], num_loops=4)
        assert not support and support.served is False
        assert f"policy {name!r} is not served" in support.reason and words in support.reason
        with pytest.raises(ValueError) as info:
            support.check()
        assert str(info.value) == support.reason


def test_a_feature_past_four_loops_is_judged_where_it_shows():
    """A policy whose only absolute loop is loop 5 is served at 4 loops, refused at 6 and
    by default (the planted case a fixed judging depth of 4 would miss)."""
    late = dataclasses.replace(POLICIES["int4-g64"], name="late-abs", absolute=(5,))
    assert serving_support(late, num_loops=4) == ServingSupport(True)
    assert not serving_support(late, num_loops=6)
    assert not serving_support(late)


def test_bad_num_loops():
    with pytest.raises(TypeError, match="num_loops"):
        serving_support(POLICIES["int4-g64"], num_loops=True)
    with pytest.raises(ValueError, match="num_loops"):
        serving_support(POLICIES["int4-g64"], num_loops=0)


def test_default_report_rows_are_served_and_few():
    assert DEFAULT_REPORT[0] == "bf16" and len(DEFAULT_REPORT) <= 12
    for name in DEFAULT_REPORT:
        for loops in (1, 4):
            assert serving_support(POLICIES[name], num_loops=loops), name


SHAPE = dict(num_pages=4, page_size=64, num_heads=2, head_dim=64, dtype="bfloat16", max_seqs=1)


@pytest.mark.parametrize("name", sorted(HEAVY | ABSOLUTE | PER_LOOP))
def test_cache_config_and_engine_refuse_with_the_same_reason(name):
    from kvq_jax.engine import engine

    policy = POLICIES[name]
    reason = serving_support(policy, num_loops=4).reason
    with pytest.raises(ValueError) as info:
        cache_config_for(policy, num_loops=4, **SHAPE)
    assert str(info.value) == reason
    with pytest.raises(ValueError) as info:
        engine.layer_policies(policy, model=None, num_loops=4)
    assert str(info.value) == reason


def test_served_policies_get_a_cache_config():
    for name, policy in POLICIES.items():
        if policy.quantized and policy.key_tables is None and serving_support(policy):
            config = cache_config_for(policy, num_loops=4, **SHAPE)
            assert config.k_base_format == policy.loop_formats("key", 1)[0], name
