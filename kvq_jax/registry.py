"""The format registry: `CODECS[name]` is the `Codec` for that storage format."""

from __future__ import annotations

import jax

from kvq_jax.codec import Codec
from kvq_jax.formats import fp8_e4m3, int4, nvfp4

CODECS: dict[str, Codec] = {}


def register_codec(codec: Codec, *, replace: bool = False) -> Codec:
    """Add `codec` under `codec.name`. Refuses to shadow an existing name unless `replace`."""
    if not isinstance(codec, Codec):
        raise TypeError(f"codec must be a kvq_jax.Codec, got {type(codec).__name__}")
    if codec.name in CODECS and not replace:
        raise ValueError(f"format {codec.name!r} is already registered (pass replace=True)")
    replacing = codec.name in CODECS
    CODECS[codec.name] = codec
    if replacing:
        _forget_compiled()
    return codec


def unregister_codec(format: str) -> Codec:
    """Remove and return the codec registered as `format`."""
    codec = get_codec(format)
    del CODECS[format]
    _forget_compiled()
    return codec


def _forget_compiled() -> None:
    # The jitted entry points take the format *name* as a static argument and look the codec
    # up while tracing: a replaced or removed codec must not keep running from a compiled
    # cache, so every cache is dropped (a rare, administrative operation).
    jax.clear_caches()


def get_codec(format: str) -> Codec:
    """The codec registered as `format`, or a ValueError listing the known formats."""
    try:
        return CODECS[format]
    except (KeyError, TypeError):
        raise ValueError(f"format must be one of {sorted(CODECS)}, got {format!r}") from None


for _codec in (int4.CODEC, nvfp4.CODEC, fp8_e4m3.CODEC):
    register_codec(_codec)
