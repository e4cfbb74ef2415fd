"""Shared pytest options: --run-gpu runs CUDA cases, --run-slow runs long ones."""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--run-gpu", action="store_true", help="run tests that need a CUDA GPU")
    parser.addoption("--run-slow", action="store_true", help="run slow tests")


def pytest_collection_modifyitems(config, items):
    for marker, option in (("gpu", "--run-gpu"), ("slow", "--run-slow")):
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"needs {option}")
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
