"""One module per storage format; each defines a `Codec` subclass and its `CODEC` instance."""
