"""`kvq demo`: pack and unpack every format on a built-in KV-like tensor and print a table."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvq_jax.codecs.api import pack_kv, unpack_kv
from kvq_jax.codecs.registry import CODECS

#: Built-in tensor: Ouro-like heads, a few thousand tokens.
DEMO_SHAPE = (2048, 8, 128)


def demo_tensor(kind: str, shape=DEMO_SHAPE, seed: int = 0) -> jnp.ndarray:
    """A deterministic bf16 [T, H, D] tensor with the structure of real KV.

    Keys get per-channel offsets and a few outlier channels (what makes per-channel grouping
    of K worthwhile); values are zero-centred with per-token scale variation.
    """
    rng = np.random.default_rng(seed + (0 if kind == "key" else 1))
    t, h, d = shape
    x = rng.standard_normal(shape, np.float32)
    if kind == "key":
        offsets = rng.standard_normal((1, h, d), np.float32) * 2.0
        outliers = np.where(rng.random((1, h, d)) < 0.03, 8.0, 1.0).astype(np.float32)
        x = x * outliers + offsets
    else:
        x = x * rng.lognormal(0.0, 0.5, (t, h, 1)).astype(np.float32)
    return jnp.asarray(x, jnp.bfloat16)


def relative_l2(reference, approx) -> float:
    """||approx - reference|| / ||reference|| in float32."""
    ref = np.asarray(reference, np.float32)
    return float(np.linalg.norm(np.asarray(approx, np.float32) - ref) / np.linalg.norm(ref))


def _median_ms(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def fits(name: str, kind: str, shape=DEMO_SHAPE) -> bool:
    """Whether format `name` packs a `kind` tensor of `shape` on its own with its default
    grouping (an INTB bit table or a heavy-row mean-query table fixes H and D to one model's;
    a format with one table per model layer needs the layer, heavy-row values their keys'
    rows)."""
    codec = CODECS[name]
    if codec.per_layer or (hasattr(codec, "heavy_group") and not codec.selects_rows):
        return False
    try:
        codec.resolve(shape, kind, None, None)
    except ValueError:
        return False
    return True


def run(repeats: int = 5) -> list[dict]:
    """One row per (format, kind) that fits the demo tensor: bits/element, relative L2 error,
    pack/unpack ms."""
    rows = []
    for kind in ("key", "value"):
        values = demo_tensor(kind)
        for name in [n for n in CODECS if fits(n, kind)]:

            def pack(v, name=name, kind=kind):
                return pack_kv(v, kind=kind, format=name)

            packed = pack(values)
            pack_ms = _median_ms(pack, values, repeats=repeats)
            unpack_ms = _median_ms(unpack_kv, packed, repeats=repeats)
            rows.append(
                {
                    "format": name,
                    "kind": kind,
                    "axis": packed.axis,
                    "group_size": packed.group_size,
                    "bits_per_element": packed.bits_per_element,
                    "relative_l2": relative_l2(values, unpack_kv(packed)),
                    "pack_ms": pack_ms,
                    "unpack_ms": unpack_ms,
                    "roundtrip_ms": pack_ms + unpack_ms,
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'format':<10} {'kind':<6} {'axis':<9} {'G':>4} {'bits/elem':>9} "
        f"{'rel L2':>8} {'pack':>9} {'unpack':>9} {'round trip':>11}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['format']:<10} {r['kind']:<6} {r['axis']:<9} {r['group_size']:>4} "
            f"{r['bits_per_element']:>9.3f} {100 * r['relative_l2']:>7.3f}% "
            f"{r['pack_ms']:>6.2f} ms {r['unpack_ms']:>6.2f} ms {r['roundtrip_ms']:>8.2f} ms"
        )
    return "\n".join(lines)


def main(args) -> int:
    t, h, d = DEMO_SHAPE
    print(f"kvq demo: bf16 [{t}, {h}, {d}] built-in KV-like tensor, device {jax.devices()[0]}")
    print(
        "pack / unpack: jitted, median of", args.repeats, "runs after warm-up; round trip = sum\n"
    )
    print(format_table(run(repeats=args.repeats)))
    print("\nbf16 = 16 bits/element. Error is ||x_hat - x|| / ||x|| over the whole tensor.")
    other = [n for n in CODECS if not fits(n, "key") and not fits(n, "value")]
    if other:
        print(f"Not run (registered for other shapes, or per layer / heavy-row values): "
              f"{', '.join(other)}")  # fmt: skip
    return 0
