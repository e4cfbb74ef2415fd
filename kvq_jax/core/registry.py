"""Format registries: one implementation, one instance per stack.

Each stack (kvq_jax, kvq_torch_bridge) holds a `Registry` of its codecs, keyed by format name;
a codec is a `kvq_jax.core.layouts.FormatLayout` (names, group-size rules, array shapes) with
that stack's data paths. Framework-neutral code that only needs the layout of a format (the
paged-cache configuration, group-size resolution) asks `layout()`, which finds the format in
any stack's registry, so a codec registered in either stack is known everywhere it is used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from kvq_jax.core.layouts import BUILTIN_LAYOUTS, FormatLayout

#: Every stack's registry, in creation order (module-level registries live for the process).
_REGISTRIES: list[Registry] = []


class Registry(Mapping):
    """name -> codec of one stack. Read it like a dict; change it with `register` /
    `unregister` (refused names and types raise, leaving it unchanged).

    codec_type: the class every codec of this stack derives from.
    type_name: how messages name that class ("kvq_jax.Codec", ...).
    on_change: called after a codec is replaced or removed (JAX drops compiled programs that
      looked the old codec up while tracing).
    """

    def __init__(
        self, codec_type: type, type_name: str, on_change: Callable[[], None] | None = None
    ):
        self._codecs: dict[str, FormatLayout] = {}
        self.codec_type = codec_type
        self.type_name = type_name
        self._on_change = on_change
        _REGISTRIES.append(self)

    def __getitem__(self, format: str):
        return self._codecs[format]

    def __iter__(self) -> Iterator[str]:
        return iter(self._codecs)

    def __len__(self) -> int:
        return len(self._codecs)

    def register(self, codec, *, replace: bool = False):
        """Add `codec` under `codec.name`; refuses to shadow a name unless `replace`."""
        if not isinstance(codec, self.codec_type):
            raise TypeError(f"codec must be a {self.type_name}, got {type(codec).__name__}")
        name = getattr(codec, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"codec.name must be a non-empty str, got {name!r}")
        if name == "bf16":
            raise ValueError("format name 'bf16' is reserved for the unquantized policy")
        replacing = name in self._codecs
        if replacing and not replace:
            raise ValueError(f"format {name!r} is already registered (pass replace=True)")
        self._codecs[name] = codec
        if replacing and self._on_change is not None:
            self._on_change()
        return codec

    def unregister(self, format: str):
        """Remove and return the codec registered as `format`."""
        codec = self.get_codec(format)
        del self._codecs[format]
        if self._on_change is not None:
            self._on_change()
        return codec

    def get_codec(self, format: str):
        """The codec registered as `format`, or a ValueError listing the known formats."""
        try:
            return self._codecs[format]
        except (KeyError, TypeError):
            raise ValueError(
                f"format must be one of {sorted(self._codecs)}, got {format!r}"
            ) from None


def known_formats() -> list[str]:
    """Every format name registered in any stack (the built-in ones always), sorted."""
    return sorted({*BUILTIN_LAYOUTS, *(name for registry in _REGISTRIES for name in registry)})


def layout(format: str) -> FormatLayout:
    """The layout of `format` from whichever stack registered it (the first that has it; a
    built-in format's layout when no stack is loaded), or a ValueError listing the known
    formats. Each stack still checks its own registry when it runs a format."""
    for registry in _REGISTRIES:
        if format in registry:
            return registry[format]
    if isinstance(format, str) and format in BUILTIN_LAYOUTS:
        return BUILTIN_LAYOUTS[format]
    raise ValueError(f"format must be one of {known_formats()}, got {format!r}")
