"""Pre-RoPE heavy policy through kvq's real code (kvq_jax.codecs.heavy.heavy_kv with rope=...) on the
issue-16 captures; tables (kvq_jax.core.calibration.intb_bit_table(rope_theta=...)) and mean
queries calibrated on the other capture (Gemma: other window half; its RoPE base per layer)."""
import json
import sys

sys.path[:0] = ["/tmp/research16", "/work/main"]
import evalfast
import jax.numpy as jnp
import kvqlab
import numpy as np
from intb_eval import register

import kvq_jax
from kvq_jax.codecs.heavy import heavy_kv
from kvq_jax.core.calibration import intb_bit_table, mean_query_table
from kvq_jax.core.rope import rope_tables

F32 = np.float32

def fn(knames, mus, thetas, G=64):
    cache = {}
    def f(X, kind):
        n, w = kvqlab.CTX["n"], kvqlab.CTX["w"]
        if (w, n) not in cache:
            K = kvqlab.CTX["K"]; V = kvqlab.CTX["V"]
            rope = tuple(map(jnp.asarray, rope_tables(K.shape[0], K.shape[2], thetas[n])))
            kh, vh, hk, hv = heavy_kv(jnp.asarray(K), jnp.asarray(V), jnp.asarray(mus[n]),
                                      key_format=knames[n], value_format="hint4", group_size=G,
                                      window=kvq_jax.Window(sink=4, recent=0), rope=rope)
            # evalfast packs rows 4..: use the same split (sink rows raw, as in the other evals)
            cache.clear()
            cache[(w, n)] = {"key": (np.asarray(kh, F32)[4:], 4.448), "value": (np.asarray(vh, F32)[4:], 4.448)}
        return cache[(w, n)][kind]
    return f

def thetas_of(meta, n_layers):
    rp = meta.get("rope_parameters")
    import ast
    try:
        rp = ast.literal_eval(rp) if isinstance(rp, str) else rp
    except Exception:
        rp = None
    lt = meta.get("layer_types")
    out = []
    for i, layer in enumerate(meta.get("layers", range(n_layers))):
        th = 100000.0
        if isinstance(rp, dict) and "rope_theta" in rp:
            th = rp["rope_theta"]
        elif isinstance(rp, dict) and lt:
            th = rp[lt[layer]]["rope_theta"]
        out.append(float(th))
    return out

caps = {n: kvqlab.load(f"/tmp/research16/cap_{n}.npz") for n in ("smol_main", "smol_other", "gemma")}
for name, src in (("smol_main", "smol_other"), ("smol_other", "smol_main")):
    k, _, q, meta = caps[src]
    th = thetas_of(meta, k.shape[1])
    mus = [mean_query_table(q[:, n], k.shape[3]) for n in range(k.shape[1])]
    names = register([intb_bit_table(k[:, n], q[:, n], mean_bits=3.75, rope_theta=th[n]) for n in range(k.shape[1])])
    r = evalfast.eval3(caps[name], fn(names, mus, th), fn(names, mus, th))
    print(name, "prerope heavy (kvq)", json.dumps({a: round(b, 5) for a, b in r.items()}), flush=True)
g = caps["gemma"]
th = thetas_of(g[3], g[0].shape[1]); print("gemma thetas", th)
for cal, ev in ((slice(0, 2), slice(2, 4)), (slice(2, 4), slice(0, 2))):
    k, _, q = (a[cal] for a in g[:3])
    mus = [mean_query_table(q[:, n], k.shape[3]) for n in range(k.shape[1])]
    names = register([intb_bit_table(k[:, n], q[:, n], mean_bits=3.75, rope_theta=th[n]) for n in range(k.shape[1])])
    sub = tuple(a[ev] for a in g[:3]) + tuple(g[3:])
    r = evalfast.eval3(sub, fn(names, mus, th), fn(names, mus, th), scale=g[3].get("query_pre_attn_scalar") and g[3]["query_pre_attn_scalar"] ** -0.5)
    print("gemma", f"prerope heavy (kvq, cal {cal.start})", json.dumps({a: round(b, 5) for a, b in r.items()}), flush=True)
