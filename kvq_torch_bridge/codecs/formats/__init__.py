"""One module per storage format; each defines a Torch `Codec` subclass and its `CODEC`."""
