"""The Torch format registry: `CODECS[name]` is the Torch `Codec` for that storage format.

Same names, defaults and errors as `kvq_jax.registry`; the two registries are separate (a
Torch codec cannot be registered with kvq_jax, nor the reverse).
"""

from __future__ import annotations

from kvq_torch_bridge.codec import Codec
from kvq_torch_bridge.formats import fp8_e4m3, int4, nvfp4

__all__ = ["CODECS", "get_codec", "register_codec", "unregister_codec"]

CODECS: dict[str, Codec] = {}


def register_codec(codec: Codec, *, replace: bool = False) -> Codec:
    """Add `codec` under `codec.name`. Refuses to shadow an existing name unless `replace`."""
    if not isinstance(codec, Codec):
        raise TypeError(f"codec must be a kvq_torch_bridge Codec, got {type(codec).__name__}")
    if codec.name in CODECS and not replace:
        raise ValueError(f"format {codec.name!r} is already registered (pass replace=True)")
    CODECS[codec.name] = codec
    return codec


def unregister_codec(format: str) -> Codec:
    """Remove and return the codec registered as `format`."""
    codec = get_codec(format)
    del CODECS[format]
    return codec


def get_codec(format: str) -> Codec:
    """The codec registered as `format`, or a ValueError listing the known formats."""
    try:
        return CODECS[format]
    except (KeyError, TypeError):
        raise ValueError(f"format must be one of {sorted(CODECS)}, got {format!r}") from None


for _codec in (int4.CODEC, nvfp4.CODEC, fp8_e4m3.CODEC):
    register_codec(_codec)
