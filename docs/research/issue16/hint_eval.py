"""Decode-like error on the issue-16 captures: K INT4 / INTB, V INT4 / HINT4 (kvq codecs)."""
import json
import sys

sys.path[:0]=["/tmp/research16","/work/main"]
import evalfast
import jax
import kvqlab
import numpy as np
from intb_eval import register, tables

import kvq_jax

F32=np.float32
def fn(kfmt, vfmt, g=64):
    def f(x, kind):
        fmt = (kfmt(kvqlab.CTX["n"]) if callable(kfmt) else kfmt) if kind=="key" else vfmt
        p = kvq_jax.pack_kv(jax.numpy.asarray(x), kind=kind, format=fmt, group_size=g)
        return np.asarray(kvq_jax.unpack_kv(p), F32), p.bits_per_element
    return f

def main(root):
    caps = {n: kvqlab.load(f"{root}/cap_{n}.npz") for n in ("smol_main", "smol_other", "gemma")}
    out = {}
    def run(tag, name, kf, vf, g=64, sub=None):
        cap = caps[name] if sub is None else sub
        r = evalfast.eval3(cap, fn(kf, vf, g), fn(kf, vf, g))
        r = {k: v for k, v in r.items() if k != "per_layer"}
        out[f"{name}/{tag}"] = r
        print(name, tag, json.dumps(r), flush=True)
    for name in caps:
        run("K int4 / V int4", name, "int4", "int4")
        run("K int4 / V hint4", name, "int4", "hint4")
        run("K hint4 / V hint4", name, "hint4", "hint4")
        run("K int4 / V int4 G32 (5.0 b)", name, "int4", "int4", g=32)
        run("K int4 / V hint4 G32 (5.0 b)", name, "int4", "hint4", g=32)
    pairs = {"smol_main": "smol_other", "smol_other": "smol_main"}
    for name, src in pairs.items():
        names = register(tables(caps[src]))
        run("K intb(cal other) / V int4", name, lambda n: names[n], "int4")
        run("K intb(cal other) / V hint4", name, lambda n: names[n], "hint4")
    g = caps["gemma"]
    for cal, ev in ((slice(0, 2), slice(2, 4)), (slice(2, 4), slice(0, 2))):
        names = register(tables(g, cal))
        sub = tuple(a[ev] for a in g[:3]) + tuple(g[3:])
        run(f"K intb(cal half {cal.start}) / V int4", "gemma", lambda n: names[n], "int4", sub=sub)
        run(f"K intb(cal half {cal.start}) / V hint4", "gemma", lambda n: names[n], "hint4", sub=sub)
    json.dump(out, open(f"{root}/hint_eval.json", "w"), indent=1)

if __name__ == "__main__":
    main(sys.argv[1])
