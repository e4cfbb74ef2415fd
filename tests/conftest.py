"""Shared pytest options: --run-gpu runs CUDA cases, --run-slow runs long ones.

Without --run-gpu the suite runs on the CPU (JAX_PLATFORMS=cpu unless set): with the CUDA
plugin installed (the `cuda-compile` extra, for the deviceless `cuda_compile` tests) JAX would
otherwise try, and fail, to start a CUDA backend on a machine without a GPU.
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--run-gpu", action="store_true", help="run tests that need a CUDA GPU")
    parser.addoption("--run-slow", action="store_true", help="run slow tests")


def pytest_configure(config):
    if not config.getoption("--run-gpu"):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before any test module imports jax


def pytest_collection_modifyitems(config, items):
    for marker, option in (("gpu", "--run-gpu"), ("slow", "--run-slow")):
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"needs {option}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)


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
