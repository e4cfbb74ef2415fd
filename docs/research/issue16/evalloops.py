"""4-loop evaluation: per-loop decode-like attention error of residual-chain reconstructions.

cap4 = (k, v, q) [W, L, N, T, H, D]. schedule: list per loop of (kfn, vfn, mode) where mode is
'abs' (loop packed whole) or 'delta' (residual against the reconstruction of the previous loop).
Raw window rows are always the current loop's rows. Returns per-loop errors and bits.
"""
import kvqlab
import numpy as np
from kvqlab import F32, NQ, RECENT, SINK


def _probs(s, causal):
    s = np.where(causal, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(-1, keepdims=True)


def block_err(q, K, Kq, V, Vq, T):
    """q [T,Hq,D]; K/Kq/V/Vq [T,H,D] -> (both, k, v) mean over q heads."""
    H, D = K.shape[1], K.shape[2]
    Hq = q.shape[1]
    rep = Hq // H
    pos = np.arange(T - NQ, T)
    j = np.arange(T)
    causal = j[None] <= pos[:, None]
    raw = (j[None] < SINK) | (j[None] > pos[:, None] - RECENT)
    rawf = raw.astype(F32)
    qrf = 1 - rawf
    out = np.zeros((3, Hq))
    for hq in range(Hq):
        h = hq // rep
        qq = np.ascontiguousarray(q[T - NQ:, hq])
        Kh, Kqh = np.ascontiguousarray(K[:, h].T), np.ascontiguousarray(Kq[:, h].T)
        Vh, Vqh = np.ascontiguousarray(V[:, h]), np.ascontiguousarray(Vq[:, h])
        sr = qq @ Kh / np.sqrt(D)
        sq = qq @ Kqh / np.sqrt(D)
        pr = _probs(sr, causal)
        pm = _probs(np.where(raw, sr, sq), causal)
        o_r = pr @ Vh
        den = (o_r ** 2).sum()
        o_b = (pm * rawf) @ Vh + (pm * qrf) @ Vqh
        o_k = pm @ Vh
        o_v = (pr * rawf) @ Vh + (pr * qrf) @ Vqh
        for i, o in enumerate((o_b, o_k, o_v)):
            out[i, hq] = np.sqrt(((o - o_r) ** 2).sum() / den)
    return out.mean(1)


def eval_loops(cap4, schedule):
    k, v, q = cap4[:3]
    W, L, N, T, H, D = k.shape
    errs = np.zeros((L, W, N, 3))
    bits = np.zeros((L, 2))
    for w in range(W):
        for n in range(N):
            Rk = Rv = None
            for l in range(L):
                kfn, vfn, mode = schedule[l]
                K, V = k[w, l, n], v[w, l, n]
                kvqlab.CTX.update(w=w, n=n, q=q[w, l, n], K=K, V=V, loop=l)
                Kq, Vq = K.copy(), V.copy()
                if mode == "abs" or Rk is None:
                    Km, bk = kfn(K[SINK:], "key")
                    Vm, bv = vfn(V[SINK:], "value")
                else:
                    dK, bk = kfn((K[SINK:] - Rk[SINK:]).astype(F32), "key")
                    dV, bv = vfn((V[SINK:] - Rv[SINK:]).astype(F32), "value")
                    Km, Vm = Rk[SINK:] + dK, Rv[SINK:] + dV
                Kq[SINK:], Vq[SINK:] = Km, Vm
                Rk, Rv = Kq, Vq
                errs[l, w, n] = block_err(q[w, l, n], K, Kq, V, Vq, T)
                bits[l] = (bk, bv)
    per_loop = errs.mean((1, 2))  # [L, 3]
    return dict(per_loop=per_loop.tolist(), mean=per_loop.mean(0).tolist(),
                bits=bits.tolist(), avg_bits=float(bits.mean()))
