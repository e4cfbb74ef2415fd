"""INTB key tables shipped with kvq, and the per-layer policies of a `key_tables` policy.

A policy with `key_tables="smollm2"` stores each layer's keys in the INTB format of that
model layer's bit table (FORMAT.md section 2b). The tables come from `intb_<name>.npz` beside
the embedded capture (`kvq_jax.core.calibration.get_key_tables`), written by
`python -m kvq_jax.report.calibrate`; the formats are registered in the JAX registry under
their table-derived names when first used.
"""

from __future__ import annotations

from kvq_jax.core.calibration import get_key_tables
from kvq_jax.core.policies import Policy, per_layer_policies

__all__ = ["capture_model", "get_key_tables", "layer_policies"]


def capture_model(meta: dict) -> str | None:
    """The model a capture's meta names ("model", or "source"."model"), or None."""
    model = meta.get("model")
    if model is None and isinstance(meta.get("source"), dict):
        model = meta["source"].get("model")
    return model if isinstance(model, str) else None


def layer_policies(policy: Policy, meta: dict, shape) -> list[Policy]:
    """One policy per captured layer for a `key_tables` policy, its INTB formats registered.

    meta: the capture's meta (its model and "layers", the model layer of each captured
    layer); shape: the capture's k shape [W, L, N, T, H, D]. Raises ValueError saying why the
    tables do not fit this capture.
    """
    from kvq_jax.codecs.formats.intb import register_table

    tables = get_key_tables(policy.key_tables)
    model = capture_model(meta)
    if model not in tables.models:
        raise ValueError(
            f"policy {policy.name!r}: its key tables are for {' / '.join(tables.models)}, and "
            f"this capture's meta names the model {model!r}"
        )
    layers = meta.get("layers")
    num_layers, heads, dim = shape[2], shape[4], shape[5]
    if not isinstance(layers, list) or len(layers) != num_layers:
        raise ValueError(
            f"policy {policy.name!r}: the capture's meta must list the model layer of each of "
            f"its {num_layers} layers ('layers'), got {layers!r}"
        )
    if (policy.group_size or 64) != tables.group_size:
        raise ValueError(
            f"policy {policy.name!r}: group_size {policy.group_size} differs from its tables' "
            f"{tables.group_size}"
        )
    for layer in layers:
        table = tables.table(layer)
        if (len(table), len(table[0])) != (heads, dim):
            raise ValueError(
                f"policy {policy.name!r}: layer {layer}'s table is for "
                f"{(len(table), len(table[0]))} (heads, dim), the capture has ({heads}, {dim})"
            )
    return list(per_layer_policies(policy, tables, layers, register_table))
