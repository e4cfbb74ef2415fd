"""Rendering of `kvq report` results: the fixed-width table, the JSON document, the header.

Errors are printed in percent (relative L2 x 100); bits are bits per stored element, K and V
together, from the actual storage bytes.
"""

from __future__ import annotations

import json
import math

from kvq_jax.core.policies import serving_support
from kvq_jax.report.capture import Capture
from kvq_jax.report.evaluate import PolicyResult

#: (header, width) of every table column after the policy name.
COLUMNS = (
    ("bits/el", 7),
    ("K err", 7),
    ("V err", 7),
    ("attn mean", 9),
    ("attn max", 8),
    ("attn dec", 8),
    ("K base", 7),
    ("K res", 7),
    ("V base", 7),
    ("V res", 7),
)


def capture_info(capture: Capture, source: str, windows=None, layers=None) -> dict:
    """JSON-ready description of the capture evaluated (shape, dtype, subsets, meta);
    `windows` / `layers`: the indices selected from the file (None: all)."""
    shape = dict(
        zip(
            ("windows", "loops", "layers", "tokens", "kv_heads", "head_dim"),
            capture.k.shape,
            strict=True,
        )
    )
    return {
        "source": source,
        "dtype": str(capture.dtype),
        **shape,
        "q_heads": None if capture.q is None else int(capture.q.shape[4]),
        "selected_windows": windows,
        "selected_layers": layers,
        "meta": capture.meta,
    }


def _text_sources(text) -> str:
    """meta["text"]: a string, or a list of per-window dicts with a "source"."""
    if isinstance(text, str):
        return text
    if isinstance(text, list):
        names = [t.get("source") for t in text if isinstance(t, dict) and t.get("source")]
        return ", ".join(dict.fromkeys(str(n) for n in names))
    return ""


def describe(info: dict) -> str:
    """Two header lines naming the capture: source and model, then its shape."""
    meta = info["meta"]
    what = str(meta.get("model") or "unknown model")
    text = _text_sources(meta.get("text"))
    if text:
        what += f" on {text}"
    layers = f"{info['layers']} layers"
    ids = meta.get("layers")
    if isinstance(ids, list) and len(ids) >= info["layers"]:  # the selection's (`select`)
        layers += f" ({', '.join(str(i) for i in ids[: info['layers']])}"
        total = meta.get("num_model_layers")
        layers += f" of {total})" if total else ")"
    loops = f"{info['loops']} loops"
    if meta.get("emulated") or meta.get("loops_emulated"):
        loops += " (emulated)"
    q = f", {info['q_heads']} q heads" if info["q_heads"] else ", no queries"
    shape = (
        f"{info['windows']} windows x {loops} x {layers} x {info['tokens']} tokens, "
        f"{info['kv_heads']} KV heads{q}, head dim {info['head_dim']}, {info['dtype']}"
    )
    return f"kvq report: {info['source']}: {what}\n{shape}"


def _pct(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:.3f}%"


def _cells(r: PolicyResult) -> list[str]:
    k_res = r.k_residual_rel_l2[-1] if r.k_residual_rel_l2 else None
    v_res = r.v_residual_rel_l2[-1] if r.v_residual_rel_l2 else None
    return [
        f"{r.bits_per_element:.3f}",
        _pct(r.k_rel_l2),
        _pct(r.v_rel_l2),
        _pct(r.attention_mean),
        _pct(r.attention_max),
        _pct(r.attention_decode_mean),
        _pct(r.k_base_rel_l2),
        _pct(k_res),
        _pct(r.v_base_rel_l2),
        _pct(v_res),
    ]


def not_served(policies, num_loops: int) -> dict[str, str]:
    """{name: reason} of the policies `serving_support` refuses at `num_loops` loops."""
    out = {}
    for policy in policies:
        support = serving_support(policy, num_loops=num_loops)
        if not support:
            out[policy.name] = support.reason
    return out


def format_table(results: list[PolicyResult], not_served: dict[str, str] | None = None) -> str:
    """One row per policy, fixed width; '-' where a column does not apply; the name of a
    policy in `not_served` ends in '*'."""
    marked = not_served or {}
    names = [r.name + ("*" if r.name in marked else "") for r in results]
    name_w = max([6, *map(len, names)])
    header = f"{'policy':<{name_w}}" + "".join(f" {h:>{w}}" for h, w in COLUMNS)
    lines = [header, "-" * len(header)]
    for name, r in zip(names, results, strict=True):
        cells = "".join(f" {c:>{w}}" for c, (_, w) in zip(_cells(r), COLUMNS, strict=True))
        lines.append(f"{name:<{name_w}}{cells}")
    return "\n".join(lines)


def format_not_served(not_served: dict[str, str], num_loops: int) -> str:
    """The footnote of the '*' rows: each policy's reason (`serving_support`)."""
    lines = [f"*: not served at {num_loops} loop(s) (kvq_jax.core.policies.serving_support):"]
    lines += [f"  {reason}" for reason in not_served.values()]
    return "\n".join(lines)


LEGEND = (
    "bits/el: storage bits per K/V element (codes + metadata + raw window rows, all loops).\n"
    "K err, V err: relative L2 of the decoded cache, every loop, layer, head and token.\n"
    "attn: relative L2 of causal attention output (captured queries, GQA, float32), per\n"
    "  layer and query head; mean and max over them. attn dec: the same, mean, for the last\n"
    "  64 queries of each window attending as in decode: the window rows relative to each\n"
    "  query raw (first 4, its own 16 newest) for +win policies, every other row decoded.\n"
    "K/V base, res: payload errors on the quantized rows: loop 0, and the last residual\n"
    "  (decoded delta vs X_l - R_(l-1); a loop stored absolute: vs X_l). +win keeps the\n"
    "  first 4 and last 16 tokens in bf16."
)


def to_json(results: list[PolicyResult], info: dict) -> str:
    """The machine-readable report: {"capture": info, "policies": [result dicts]}."""
    doc = {"capture": info, "policies": [r.to_dict() for r in results]}
    return json.dumps(doc, indent=2, allow_nan=True)
