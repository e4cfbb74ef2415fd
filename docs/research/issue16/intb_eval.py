"""Decode-like attention error of kvq's INTB keys (real codec, FORMAT.md 2b) on the issue-16
captures, with bit tables calibrated on a different capture (or window half) than evaluated.

    PYTHONPATH=<worktree>:<dir of kvqlab.py> python intb_eval.py CAPTURES_DIR

Values are kvq INT4 G64 (over channels) in every row; keys vary. Uses evalfast.eval3 (the
decode-like error of the README: rows 0-3 and each query's 16 newest keys raw).
"""

from __future__ import annotations

import json
import sys

import evalfast
import jax
import kvqlab
import numpy as np

import kvq_jax
from kvq_jax.codecs.formats.intb import IntBCodec
from kvq_jax.core.calibration import intb_bit_table

F32 = np.float32


def kvq_fn(fmt_for_layer, group_size=64):
    """(X [T, H, D] middle rows, kind) -> (decoded, bits/element) through kvq's JAX codec."""

    def f(x, kind):
        fmt = fmt_for_layer(kvqlab.CTX["n"]) if kind == "key" else "int4"
        packed = kvq_jax.pack_kv(jax.numpy.asarray(x), kind=kind, format=fmt, group_size=group_size)
        return np.asarray(kvq_jax.unpack_kv(packed), F32), packed.bits_per_element

    return f


def tables(cap, windows=slice(None), mean_bits=4.0):
    k, _, q = cap[:3]
    return [
        intb_bit_table(k[windows, n], q[windows, n], mean_bits=mean_bits) for n in range(k.shape[1])
    ]


def register(tabs):
    names = []
    for t in tabs:
        codec = IntBCodec(t)
        kvq_jax.register_codec(codec, replace=True)
        names.append(codec.name)
    return names


def run(cap, names):
    return evalfast.eval3(cap, kvq_fn(lambda n: names[n]), kvq_fn(None))


def main(root):
    caps = {n: kvqlab.load(f"{root}/cap_{n}.npz") for n in ("smol_main", "smol_other", "gemma")}
    out = {}
    for name, cap in caps.items():
        out[f"{name}/int4-g64"] = evalfast.eval3(cap, kvq_fn(lambda n: "int4"), kvq_fn(None))
        print(name, "int4", out[f"{name}/int4-g64"], flush=True)
    # SmolLM2: tables from the other capture (other text); Gemma: from the other window half.
    pairs = {"smol_main": ("smol_other", None), "smol_other": ("smol_main", None)}
    for name, (src, _) in pairs.items():
        names = register(tables(caps[src]))
        out[f"{name}/intb(cal {src})"] = run(caps[name], names)
        print(name, "intb cal", src, out[f"{name}/intb(cal {src})"], flush=True)
        names = register(tables(caps[name]))
        out[f"{name}/intb(cal in-sample)"] = run(caps[name], names)
        print(name, "intb in-sample", out[f"{name}/intb(cal in-sample)"], flush=True)
    g = caps["gemma"]
    errs = []
    for cal, ev in ((slice(0, 2), slice(2, 4)), (slice(2, 4), slice(0, 2))):
        names = register(tables(g, cal))
        sub = tuple(a[ev] for a in g[:3]) + tuple(g[3:])
        errs.append(run(sub, names))
    out["gemma/intb(cal other windows)"] = {
        k: float(np.mean([e[k] for e in errs])) for k in errs[0] if k != "per_layer"
    }
    print("gemma intb cal other half", out["gemma/intb(cal other windows)"], flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
