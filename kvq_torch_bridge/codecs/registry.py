"""The Torch format registry: `CODECS[name]` is the Torch `Codec` for that storage format.

One `kvq_jax.core.registry.Registry` per stack (`kvq_jax.codecs.registry` holds the JAX one): same
names, defaults and errors. A codec registered here works in every Torch entry point
(`pack_kv`, residuals, loop stacks, `pack_paged`, the paged cache and attention).
"""

from __future__ import annotations

from kvq_jax.core.registry import Registry
from kvq_torch_bridge.codecs.codec import Codec
from kvq_torch_bridge.codecs.formats import fp8_e4m3, hadamard, int2, int4, nvfp4

__all__ = ["CODECS", "get_codec", "register_codec", "unregister_codec"]

CODECS = Registry(Codec, "kvq_torch_bridge Codec")


#: The registry's methods under their public names (see `Registry` for the contracts).
register_codec = CODECS.register
unregister_codec = CODECS.unregister
get_codec = CODECS.get_codec


for _codec in (int4.CODEC, nvfp4.CODEC, fp8_e4m3.CODEC, int2.CODEC, hadamard.HINT4, hadamard.HINT2):
    register_codec(_codec)
