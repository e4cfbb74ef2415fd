"""The JAX format registry: `CODECS[name]` is the JAX `Codec` for that storage format.

One `kvq_jax.core.registry.Registry` per stack (`kvq_torch_bridge.codecs.registry` holds the Torch
one). The jitted entry points take the format *name* as a static argument and look the codec
up while tracing, so replacing or removing a codec drops every compiled program (a rare,
administrative operation).
"""

from __future__ import annotations

import jax

from kvq_jax.codecs.codec import Codec
from kvq_jax.codecs.formats import fp8_e4m3, hadamard, int2, int4, nvfp4
from kvq_jax.core.registry import Registry

__all__ = ["CODECS", "get_codec", "register_codec", "unregister_codec"]

CODECS = Registry(Codec, "kvq_jax.Codec", on_change=jax.clear_caches)


#: The registry's methods under their public names (see `Registry` for the contracts).
register_codec = CODECS.register
unregister_codec = CODECS.unregister
get_codec = CODECS.get_codec


for _codec in (int4.CODEC, nvfp4.CODEC, fp8_e4m3.CODEC, int2.CODEC, hadamard.HINT4, hadamard.HINT2):
    register_codec(_codec)
