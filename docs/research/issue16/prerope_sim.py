"""Pre-RoPE INTB keys (RoPE-aware tables) + HINT4 values + heavy rows, through kvq's codecs."""
import json
import sys

sys.path[:0] = ["/tmp/research16", "/work/main", "/work/main/docs/research/issue16"]
import evalfast
import jax.numpy as jnp
import kvqlab
import numpy as np
from intb_eval import register

from kvq_jax.codecs.heavy import pack_heavy, select_heavy, unpack_heavy
from kvq_jax.core.calibration import allocate_bits, group_span_power, mean_query_table

F32 = np.float32
THETA = 100000.0

def cs(T, D, offset=0):
    inv = THETA ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(offset, offset + T)[:, None] * inv[None]
    ang = np.concatenate([ang, ang], 1)
    return np.cos(ang).astype(F32)[:, None], np.sin(ang).astype(F32)[:, None]

def rot_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)

def unrope(x, offset):
    c, s = cs(x.shape[0], x.shape[-1], offset)
    return (x * c - rot_half(x) * s).astype(F32)

def rope(x, offset):
    c, s = cs(x.shape[0], x.shape[-1], offset)
    return (x * c + rot_half(x) * s).astype(F32)

def tables_pre(cap, mean_bits):
    k, _, q = cap[:3]   # [W, N, T, H, D]
    out = []
    W, N, T, H, D = k.shape
    inv = THETA ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    d = np.arange(16, T, dtype=np.float64)
    a = (np.cos(inv[:, None] * d[None]) ** 2).mean(1)
    a = np.concatenate([a, a])
    for n in range(N):
        kp = np.stack([unrope(k[w, n], 0) for w in range(W)])
        qp = np.stack([unrope(q[w, n], 0) for w in range(W)])
        I = (qp.astype(np.float64) ** 2).mean((0, 1)).reshape(H, -1, D).sum(1)
        partner = np.concatenate([I[:, D // 2:], I[:, : D // 2]], -1)
        I = a * I + (1 - a) * partner
        out.append(allocate_bits(I * group_span_power(kp, 64), mean_bits=mean_bits))
    return out

def fn(knames, tabs, pre, G=64):
    cache = {}
    def f(X, kind):
        n, w = kvqlab.CTX["n"], kvqlab.CTX["w"]
        if (w, n) not in cache:
            K = kvqlab.CTX["K"][4:]; V = kvqlab.CTX["V"][4:]
            rows = select_heavy(jnp.asarray(K), jnp.asarray(tabs[n]), group_size=G)
            Kin = unrope(K, 4) if pre else K
            hk = pack_heavy(jnp.asarray(Kin), rows, kind="key", format=knames[n], group_size=G)
            hv = pack_heavy(jnp.asarray(V), rows, kind="value", format="hint4", group_size=G)
            Kh = np.asarray(unpack_heavy(hk), F32)
            cache.clear()
            cache[(w, n)] = {"key": (rope(Kh, 4) if pre else Kh, hk.bits_per_element),
                             "value": (np.asarray(unpack_heavy(hv), F32), hv.bits_per_element)}
        return cache[(w, n)][kind]
    return f

caps = {n: kvqlab.load(f"/tmp/research16/cap_{n}.npz") for n in ("smol_main", "smol_other")}
for name, src in (("smol_main", "smol_other"), ("smol_other", "smol_main")):
    k, _, q = caps[src][:3]
    mus = [mean_query_table(q[:, n], k.shape[3]) for n in range(k.shape[1])]
    names = register(tables_pre(caps[src], 3.75))
    r = evalfast.eval3(caps[name], fn(names, mus, True), fn(names, mus, True))
    print(name, "pre-RoPE intb3.75 + hint4 + heavy", json.dumps({a: round(b, 5) for a, b in r.items()}), flush=True)
