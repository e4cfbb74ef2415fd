"""The `kvq` command reports a JAX backend plugin that does not start in one line (the plugin,
the reason, the commands that fix it), not JAX's traceback: on its own (a record logged as JAX
logs it) and end to end (a `kvq` run where the CUDA plugin of the `cuda-compile` extra is
installed: CI's machine has no GPU, so the plugin fails there as on a user's laptop)."""

from __future__ import annotations

import importlib.util
import io
import logging
import os
import pathlib
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


PLUGIN_ERROR = "Jax plugin configuration error: Exception when calling %s.initialize()"


def test_a_plugin_error_is_one_line_with_the_fix(installed):
    assert sum(isinstance(f, plugins.PluginErrorLine) for f in installed.filters) == 1
    error = RuntimeError("Unable to load cuDNN. Is it installed?")
    text = _log_through_jax_logger(PLUGIN_ERROR, "jax_plugins.xla_cuda13", error=error)
    assert text.count("\n") == 1 and "Traceback" not in text, text
    assert "jax_plugins.xla_cuda13" in text
    assert "RuntimeError: Unable to load cuDNN. Is it installed?" in text
    assert "export JAX_PLATFORMS=cpu" in text and "pip install -U 'jax[cuda13]'" in text


def test_a_reason_of_several_lines_and_another_plugin(installed):
    """An error text with line breaks (the CUDA plugin's version report has them) stays on
    one line; a plugin that is not CUDA's gets no CUDA install line."""
    error = RuntimeError("Outdated cuDNN installation found.\nVersion 9.1 needed,\n  found 8.9")
    text = _log_through_jax_logger(PLUGIN_ERROR, "jax_plugins.xla_cuda13", error=error)
    assert text.count("\n") == 1, text
    assert "Outdated cuDNN installation found. Version 9.1 needed, found 8.9" in text
    text = _log_through_jax_logger(PLUGIN_ERROR, "jax_plugins.xla_rocm7", error=error)
    assert text.count("\n") == 1 and "xla_rocm7" in text, text
    assert "export JAX_PLATFORMS=cpu" in text and "cuda13" not in text


def test_other_records_keep_their_traceback(installed):
    text = _log_through_jax_logger("something else failed: %s", "x")
    assert "something else failed: x" in text and "Traceback" in text


def test_without_the_filter_jax_logs_a_traceback(monkeypatch):
    """Control: the same record without `install` has its traceback (an in-process `kvq`
    call of another test may have installed the filter: set aside)."""
    monkeypatch.setattr(logging.getLogger(plugins.JAX_PLUGIN_LOGGER), "filters", [])
    error = RuntimeError("Unable to load cuDNN. Is it installed?")
    assert "Traceback" in _log_through_jax_logger(PLUGIN_ERROR, "jax_plugins.xla_cuda13",
                                                  error=error)  # fmt: skip


@pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda13") is None,
    reason="the CUDA plugin (the cuda-compile extra) is not installed: no plugin to fail",
)
def test_kvq_and_a_benchmark_print_one_line_where_jax_prints_a_traceback(tmp_path):
    """End to end, against jax itself: where a bare `jax.devices()` logs the CUDA plugin's
    failure with a traceback (CI's machine: the plugin, no GPU), `kvq demo` and a benchmark
    (through `bench/_timing.py`) print the one line instead; where the plugin starts, neither
    prints anything about it. Run without the variables that keep the plugin from failing
    (conftest's JAX_PLATFORMS=cpu; the `cuda_compile` harness's
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK, set once a worker imports it)."""
    skip = ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK")
    env = {k: v for k, v in os.environ.items() if k not in skip}

    def run(*argv):
        proc = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    bare = run("-c", "import jax; jax.devices()")
    bench = pathlib.Path(__file__).resolve().parents[1] / "bench" / "codec_speed.py"
    quick = ("--quick", "--shapes", "128,2,64", "--json", str(tmp_path / "rows.json"))
    runs = {
        "kvq": run("-m", "kvq_jax.cli.commands", "demo", "--repeats", "1"),
        "bench": run(str(bench), *quick),
    }
    failed = "Jax plugin configuration error" in bare and "xla_cuda13" in bare
    if failed:
        assert "Traceback" in bare  # what kvq replaces
    for name, err in runs.items():
        assert "Traceback" not in err, (name, err)
        if failed:
            lines = [line for line in err.splitlines() if "xla_cuda13" in line]
            assert len(lines) == 1 and lines[0].startswith("kvq: "), (name, err)
            assert "JAX_PLATFORMS=cpu" in lines[0], (name, err)
        else:
            assert "xla_cuda13" not in err, (name, err)
