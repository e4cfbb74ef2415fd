"""One line instead of a traceback when one of JAX's backend plugins does not start.

JAX loads every installed PJRT plugin when it first needs a device; a plugin that fails
(the CUDA plugin of the `cuda-compile` extra on a machine with no GPU or no cuDNN) is logged
with its whole traceback on every run, and JAX goes on with the other backends. The `kvq`
command owns its process, so it turns that record into one line: which plugin, why, and the
commands that fix it. A library import changes nothing (`install` is called by the CLI only).
"""

from __future__ import annotations

import logging

#: The logger JAX reports plugin failures on, and how those records begin.
JAX_PLUGIN_LOGGER = "jax._src.xla_bridge"
_PREFIX = "Jax plugin configuration error"

#: The fix printed for a CUDA plugin, and for any other.
CUDA_FIX = (
    "No GPU here: export JAX_PLATFORMS=cpu (JAX then skips the plugin). "
    "A GPU: pip install -U 'jax[cuda13]' (CUDA and cuDNN from the package registry)."
)
OTHER_FIX = "To run on the CPU without it: export JAX_PLATFORMS=cpu."


class PluginErrorLine(logging.Filter):
    """Rewrites JAX's "plugin configuration error" records (message and traceback) into one
    line naming the plugin, the reason and the fix (`CUDA_FIX` for a CUDA plugin, else
    `OTHER_FIX`); other records pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(_PREFIX) or not record.exc_info:
            return True
        # (a module that fails to import is logged without its name)
        plugin = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        error = record.exc_info[1]
        reason = f"{type(error).__name__}: {error}" if error is not None else "unknown error"
        reason = " ".join(reason.split())  # one line, whatever the error's text
        fix = CUDA_FIX if "cuda" in str(plugin).lower() else OTHER_FIX
        record.msg = "kvq: JAX's backend plugin %s did not start (%s); JAX goes on without it. %s"
        record.args = (plugin, reason, fix)
        record.exc_info, record.exc_text = None, None
        return True


def install() -> None:
    """Adds `PluginErrorLine` to JAX's plugin logger once (before JAX's first device use)."""
    logger = logging.getLogger(JAX_PLUGIN_LOGGER)
    if not any(isinstance(f, PluginErrorLine) for f in logger.filters):
        logger.addFilter(PluginErrorLine())
