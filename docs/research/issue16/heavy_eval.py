"""Heavy rows through kvq's real heavy-row storage (kvq_jax.codecs.heavy: exact selection, INT8 rows,
INTB keys over 63-row groups, HINT4 values) on the issue-16 captures, decode-like error.
Mean-query and INTB 3.75 tables from the other SmolLM2 capture (Gemma: other window half)."""
import json
import sys

sys.path[:0] = ["/tmp/research16", "/work/main"]
import evalfast
import jax.numpy as jnp
import kvqlab
import numpy as np
from intb_eval import register, tables

from kvq_jax.codecs.heavy import pack_heavy, select_heavy, unpack_heavy
from kvq_jax.core.calibration import mean_query_table

F32 = np.float32

def fn(knames, tabs, vfmt="hint4", G=64):
    cache = {}
    def f(X, kind):
        n, w = kvqlab.CTX["n"], kvqlab.CTX["w"]
        key = (w, n)
        if key not in cache:
            K = kvqlab.CTX["K"][4:]; V = kvqlab.CTX["V"][4:]
            rows = select_heavy(jnp.asarray(K), jnp.asarray(tabs[n]), group_size=G)
            hk = pack_heavy(jnp.asarray(K), rows, kind="key", format=knames[n], group_size=G)
            hv = pack_heavy(jnp.asarray(V), rows, kind="value", format=vfmt, group_size=G)
            cache.clear()
            cache[key] = {"key": (np.asarray(unpack_heavy(hk), F32), hk.bits_per_element),
                          "value": (np.asarray(unpack_heavy(hv), F32), hv.bits_per_element)}
        return cache[key][kind]
    return f

def main(root):
    caps = {n: kvqlab.load(f"{root}/cap_{n}.npz") for n in ("smol_main", "smol_other", "gemma")}
    out = {}
    def run(tag, name, cap, f):
        r = evalfast.eval3(cap, f, f)
        r = {k: v for k, v in r.items() if k != "per_layer"}
        out[f"{name}/{tag}"] = r
        print(name, tag, json.dumps({k: round(v, 5) for k, v in r.items()}), flush=True)
    for name, src in (("smol_main", "smol_other"), ("smol_other", "smol_main")):
        k, _, q = caps[src][:3]
        tabs = [mean_query_table(q[:, n], k.shape[3]) for n in range(k.shape[1])]
        names = register(tables(caps[src], mean_bits=3.75))
        run("intb3.75/hint4 heavy (kvq)", name, caps[name], fn(names, tabs))
    g = caps["gemma"]
    for cal, ev in ((slice(0, 2), slice(2, 4)), (slice(2, 4), slice(0, 2))):
        k, _, q = (a[cal] for a in g[:3])
        tabs = [mean_query_table(q[:, n], k.shape[3]) for n in range(k.shape[1])]
        names = register(tables(g, cal, mean_bits=3.75))
        sub = tuple(a[ev] for a in g[:3]) + tuple(g[3:])
        run(f"intb3.75/hint4 heavy (kvq, cal {cal.start})", "gemma", sub, fn(names, tabs))
    json.dump(out, open(f"{root}/heavy_eval.json", "w"), indent=1)

if __name__ == "__main__":
    main(sys.argv[1])
