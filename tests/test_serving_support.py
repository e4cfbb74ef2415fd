"""`serving_support`: the one answer to "can this policy be served, and if not, why".

The expected sets below are written from the policy table by hand, not computed by the
function under test. Absolute loops, per-loop residual formats, heavy rows and keys before
RoPE are served (issue 24; their pages are checked in tests/test_paged_cache_loops.py,
tests/test_heavy_pages.py and tests/test_pre_rope_pages.py). Every refusal (the engine,
`cache_config_for`, `kvq generate`, `kvq report`) quotes it.
"""

from __future__ import annotations

import pytest

from kvq_jax.core.policies import (
    DEFAULT_REPORT,
    POLICIES,
    cache_config_for,
    serving_support,
)

PRE_ROPE = {"intb-prerope-hint4-heavy-smollm2"}
SHAPE = dict(num_pages=4, page_size=64, num_heads=2, head_dim=64, dtype="bfloat16", max_seqs=1)


def _with_win(names):
    return set(names) | {f"{n}+win" for n in names}


def test_which_policies_are_served():
    """Every policy of the table is served (keys before RoPE too, since issue 24)."""
    for loops in (1, 4, 6, None):
        refused = {name for name, p in POLICIES.items() if not serving_support(p, num_loops=loops)}
        assert refused == set(), loops


def test_pre_rope_policies_carry_their_base_into_the_cache_config():
    """A pre-RoPE policy as served (`with_heavy_formats`) stores its keys before RoPE with its
    tables' base (`PagedCacheConfig.rope_theta`); it needs that base, and a RoPE'd policy
    refuses one."""
    for name in _with_win(PRE_ROPE):
        policy = POLICIES[name]
        served = policy.with_heavy_formats("int4", "int4", 4, rope_theta=1e5)
        assert not served.pre_rope and served.rope_theta == 1e5 and served.heavy is None
        config = cache_config_for(served, num_loops=4, **SHAPE)
        assert config.rope_theta == 1e5 and config.k_absolute == (1, 2, 3)
        with pytest.raises(ValueError, match="before RoPE: its tables must give a RoPE base"):
            policy.with_heavy_formats("int4", "int4", 4)
    plain = POLICIES["intb-hint4-heavy-smollm2"]
    assert cache_config_for(plain.with_heavy_formats("int4", "int4", 1), num_loops=1,
                            **SHAPE).rope_theta is None  # fmt: skip
    with pytest.raises(ValueError, match="RoPE'd keys: its tables must not be calibrated for"):
        plain.with_heavy_formats("int4", "int4", 1, rope_theta=1e5)


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


def test_served_policies_get_a_cache_config():
    for name, policy in POLICIES.items():
        if policy.quantized and policy.key_tables is None and serving_support(policy):
            config = cache_config_for(policy, num_loops=4, **SHAPE)
            assert config.k_base_format == policy.loop_formats("key", 1)[0], name


@pytest.mark.parametrize(
    ("name", "k_formats", "v_formats", "k_absolute", "v_absolute"),
    [  # written from the policy table by hand
        ("flashloop-legacy", ("int2",) * 4, ("int4", "int4", "int2", "int2"), (), ()),
        ("loops-abs-keys", ("int2",) * 4, ("int4", "int4", "int2", "int2"), (1, 2, 3), ()),
        ("loops-abs-v2442", ("int2",) * 4, ("int2", "int4", "int4", "int2"), (1, 2, 3), (1, 2)),
        (
            "loops-abs-v2442-h",
            ("int2",) * 4,
            ("hint2", "hint4", "hint4", "hint2"),
            (1, 2, 3),
            (1, 2),
        ),
    ],
)
def test_per_loop_policies_get_their_loops(name, k_formats, v_formats, k_absolute, v_absolute):
    for suffix in ("", "+win"):
        config = cache_config_for(POLICIES[name + suffix], num_loops=4, **SHAPE)
        assert config.loop_formats("key") == k_formats
        assert config.loop_formats("value") == v_formats
        assert (config.k_absolute, config.v_absolute) == (k_absolute, v_absolute)
