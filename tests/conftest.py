"""Shared pytest options: --run-gpu runs CUDA cases, --run-slow runs long ones.

`@pytest.mark.thin(n)` on a parametrized test: the default run takes one case in n (in
collection order, case i where i % n == (i // n) % n: the kept cases step through the inner
parameters instead of repeating one value; collection fails where a value of a parameter
would be left out entirely), the others run with --run-slow or when named by id (CI time: the
variants of one check differ in shapes and dtypes, not in code path).

Without --run-gpu the suite runs on the CPU (JAX_PLATFORMS=cpu unless set): with the CUDA
plugin installed (the `cuda-compile` extra, for the deviceless `cuda_compile` tests) JAX would
otherwise try, and fail, to start a CUDA backend on a machine without a GPU. It also compiles
with JAX_DISABLE_MOST_OPTIMIZATIONS=1 unless set (XLA's LLVM backend at -O0, its expensive
passes off; XLA's own passes, fusion and buffer assignment included, run as always): the
cases are small, so compiling is most of their time (CI time). The `cuda_compile` checks pin
the default level for the GPU code they measure (`cuda_compile.DEFAULT_OPTIMIZATION`); the
codec and oracle tests run at the default level too in CI's second environment (.ci/run).
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--run-gpu", action="store_true", help="run tests that need a CUDA GPU")
    parser.addoption("--run-slow", action="store_true", help="run slow tests")


def pytest_configure(config):
    if not config.getoption("--run-gpu"):
        # before any test module imports jax
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


def pytest_collection_modifyitems(config, items):
    # (before -k deselects: conftest hooks run first, so the kept cases do not depend on -k)
    named = any("[" in arg for arg in config.args)  # cases asked for by id run as asked
    if not config.getoption("--run-slow") and not named:
        thin_out(items)
    for marker, option in (("gpu", "--run-gpu"), ("slow", "--run-slow")):
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"needs {option}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


def thin_out(items) -> None:
    """Mark slow the cases `@pytest.mark.thin(n)` leaves out of the default run; raise
    pytest.UsageError naming the test where a value of one of its parameters would be left
    out entirely (choose another n)."""
    families: dict[str, list] = {}
    for item in items:
        thin = item.get_closest_marker("thin")
        if thin is None or not hasattr(item, "callspec"):
            continue
        family = families.setdefault(item.nodeid.split("[")[0], [])
        n, i = thin.args[0], len(family)
        family.append(item)
        if i % n != (i // n) % n:  # a diagonal: not always the same inner value
            item.add_marker(pytest.mark.slow)
    for name, family in families.items():
        kept = [item for item in family if "slow" not in item.keywords]
        for param in family[0].callspec.params:
            lost = {repr(i.callspec.params[param]) for i in family} - {
                repr(i.callspec.params[param]) for i in kept
            }
            if lost:
                raise pytest.UsageError(
                    f"@pytest.mark.thin leaves {param}={', '.join(sorted(lost))} of {name} "
                    "out of the default run: choose another n"
                )


# -- tiny models (tests/tiny_models.py; imported in the fixture: jax only after configure) ----


@pytest.fixture(scope="module")
def tiny_llama():
    from tiny_models import tiny_model

    return tiny_model("llama")


@pytest.fixture(scope="module")
def tiny_ouro():
    from tiny_models import tiny_model

    return tiny_model("ouro", seed=3, loops=2)


# -- the process-wide codec registry: synthetic formats of the kernels' argument specs -------


@pytest.fixture(autouse=True, scope="module")
def _unregister_synthetic_formats():
    """After each module, take the argument specs' synthetic INTB formats out of the JAX
    registry (a spec's config() registers them on demand), so no other module sees them."""
    import sys

    yield
    formats = sys.modules.get("kvq_jax.kernel_checks.arg_specs.formats")
    if formats is not None:
        formats.unregister_synthetic()
