"""Dump and summarize the optimized XLA:CPU HLO of kvq's pack/unpack and the peers'.

    PYTHONPATH=. JAX_PLATFORMS=cpu python docs/research/issue15/pack_hlo.py [--dump DIR]

For each function: the ENTRY instructions that are not parameters/bitcasts/tuples (each one is
a loop or a library call over memory: a materialized intermediate), and per fusion the number
of element-wise instructions in its fused computation by opcode.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "bench"))
import codec_speed as cs

import kvq_jax

SKIP = {"parameter", "bitcast", "tuple", "get-tuple-element", "constant"}


def parse(text):
    comps, cur, name = {}, None, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            name = "ENTRY" if m.group(1) else m.group(2)
            cur = comps.setdefault(name, [])
            continue
        m = re.match(r"^\s+(ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\(", line)
        if m and cur is not None:
            cur.append((m.group(2), m.group(3), m.group(4), line.strip()))
    return comps


def summarize(label, text, out):
    comps = parse(text)
    entry = [i for i in comps.get("ENTRY", []) if i[2] not in SKIP]
    print(f"\n== {label}: {len(entry)} ENTRY ops", file=out)
    for _name, shape, op, line in entry:
        extra = ""
        m = re.search(r"calls=%?([\w.\-]+)", line)
        if op == "fusion" and m:
            ops = collections.Counter(
                i[2] for i in comps.get(m.group(1), []) if i[2] not in ("parameter",)
            )
            extra = f"  [{sum(ops.values())} ops] " + " ".join(
                f"{k}:{v}" for k, v in sorted(ops.items())
            )
        elif op in ("call", "conditional"):
            extra = "  " + line[line.find(op) :][:160]
        print(f"  {op:12s} {shape:40s}{extra}", file=out)


def functions(shape):
    x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    fns = {}
    for fmt, kind in (("int4", "key"), ("int4", "value"), ("nvfp4", "key"), ("nvfp4", "value")):
        pk = jax.jit(lambda v, k=kind, f=fmt: kvq_jax.pack_kv(v, kind=k, format=f))
        packed = pk(x)
        fns[f"kvq {fmt} {kind} pack"] = (pk, (x,))
        fns[f"kvq {fmt} {kind} unpack"] = (jax.jit(kvq_jax.unpack_kv), (packed,))
        peers = cs.peer_codecs(fmt, packed.axis, packed.group_size)
        pp, pu, _ = peers["jax.jit"]
        fns[f"peer {fmt} {kind} pack"] = (jax.jit(pp), (x,))
        fns[f"peer {fmt} {kind} unpack"] = (jax.jit(pu), tuple(pp(x)))
    return fns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default="/tmp/pack/hlo")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    d = pathlib.Path(args.dump)
    d.mkdir(parents=True, exist_ok=True)
    for label, (f, a) in functions((2048, 16, 128)).items():
        if args.only and args.only not in label:
            continue
        text = f.lower(*a).compile().as_text()
        (d / (label.replace(" ", "_") + ".hlo")).write_text(text)
        summarize(label, text, sys.stdout)


if __name__ == "__main__":
    main()
