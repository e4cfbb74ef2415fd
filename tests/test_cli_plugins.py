"""The `kvq` command reports a JAX backend plugin that does not start in one line (the plugin,
the reason, the commands that fix it), not JAX's traceback: on its own (a record logged as JAX
logs it) and end to end (a `kvq` run where the CUDA plugin of the `cuda-compile` extra is
installed: CI's machine has no GPU, so the plugin fails there as on a user's laptop)."""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import subprocess
import sys

import pytest

from kvq_jax.cli import plugins


def _log_through_jax_logger(message, *args, error=None) -> str:
    """What a handler with the default formatter writes for a record logged on JAX's plugin
    logger the way `jax._src.xla_bridge.discover_pjrt_plugins` logs it (`logger.exception`)."""
    logger = logging.getLogger(plugins.JAX_PLUGIN_LOGGER)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        try:
            raise error if error is not None else RuntimeError("no plugin error")
        except RuntimeError:
            logger.exception(message, *args)
    finally:
        logger.removeHandler(handler)
    return stream.getvalue()


@pytest.fixture
def installed():
    logger = logging.getLogger(plugins.JAX_PLUGIN_LOGGER)
    before = list(logger.filters)
    plugins.install()
    plugins.install()  # once only
    yield logger
    logger.filters[:] = before


def test_a_plugin_error_is_one_line_with_the_fix(installed):
    assert sum(isinstance(f, plugins.PluginErrorLine) for f in installed.filters) == 1
    error = RuntimeError("Unable to load cuDNN. Is it installed?")
    text = _log_through_jax_logger(
        "Jax plugin configuration error: Exception when calling %s.initialize()",
        "jax_plugins.xla_cuda13", error=error,
    )  # fmt: skip
    assert text.count("\n") == 1 and "Traceback" not in text, text
    assert "jax_plugins.xla_cuda13" in text
    assert "RuntimeError: Unable to load cuDNN. Is it installed?" in text
    assert "export JAX_PLATFORMS=cpu" in text and "pip install -U 'jax[cuda13]'" in text


def test_other_records_keep_their_traceback(installed):
    text = _log_through_jax_logger("something else failed: %s", "x")
    assert "something else failed: x" in text and "Traceback" in text


def test_without_the_filter_jax_logs_a_traceback(monkeypatch):
    """The planted defect: the same record without `install` (what every `kvq` run printed;
    an in-process `kvq` call of another test may have installed the filter: set aside)."""
    monkeypatch.setattr(logging.getLogger(plugins.JAX_PLUGIN_LOGGER), "filters", [])
    text = _log_through_jax_logger(
        "Jax plugin configuration error: Exception when calling %s.initialize()",
        "jax_plugins.xla_cuda13", error=RuntimeError("Unable to load cuDNN. Is it installed?"),
    )  # fmt: skip
    assert "Traceback" in text


@pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
    reason="the CUDA plugin (the cuda-compile extra) is not installed: no plugin to fail",
)
def test_kvq_prints_no_traceback_for_the_cuda_plugin():
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # conftest sets cpu
    proc = subprocess.run(
        [sys.executable, "-m", "kvq_jax.cli.commands", "demo", "--repeats", "1"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    if "xla_cuda13" in proc.stderr:  # no GPU here: the plugin failed, in one line
        assert proc.stderr.count("xla_cuda13") == 1 and "JAX_PLATFORMS=cpu" in proc.stderr
