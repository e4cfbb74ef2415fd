import sys

sys.path[:0] = ["/tmp/research16", "/work/main"]
import evalfast
import jax
import kvqlab
import numpy as np
from heavy_sim import int8_rows, qmeans

import kvq_jax

F32 = np.float32; G = 64
def sel_by(score):
    T, H = score.shape
    sel = np.zeros((T, H), bool)
    for g0 in range(0, T, G):
        sel[g0 + np.argmax(score[g0:g0 + G], 0), np.arange(H)] = True
    return sel
def vfn(how, mus):
    def f(X, kind):
        n = kvqlab.CTX["n"]; K = kvqlab.CTX["K"][4:]; V = kvqlab.CTX["V"][4:]
        H, D = X.shape[1:]
        if how == "muk":
            s = np.einsum("thd,hqd->thq", K, mus[n].reshape(H, -1, D)).max(-1)
        elif how == "vmin": s = -np.linalg.norm(V, axis=-1)
        elif how == "vmax": s = np.linalg.norm(V, axis=-1)
        elif how == "vrange": s = V.max(-1) - V.min(-1)
        elif how == "kmax": s = np.linalg.norm(K, axis=-1)
        sel = sel_by(s)
        prev = np.concatenate([X[1:2], X[:-1]])
        p = kvq_jax.pack_kv(jax.numpy.asarray(np.where(sel[..., None], prev, X)), kind=kind, format="hint4")
        Y = np.where(sel[..., None], int8_rows(X), np.asarray(kvq_jax.unpack_kv(p), F32))
        return Y, 4.56
    return f
caps = {n: kvqlab.load(f"/tmp/research16/cap_{n}.npz") for n in ("smol_main", "smol_other")}
mus = qmeans(caps["smol_other"])
for how in ("muk", "vmin", "vmax", "vrange", "kmax"):
    r = evalfast.eval3(caps["smol_main"], None, vfn(how, mus))
    print(how, round(r["v"], 5), flush=True)
