"""Faster evaluation: quantize K and V once per (window, layer), then K-only, V-only and both
decode-like attention errors (same definition as kvqlab.evaluate)."""
import kvqlab
import numpy as np
from kvqlab import F32, NQ, RECENT, SINK, quantize_full


def _probs(s, causal):
    s = np.where(causal, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(-1, keepdims=True)


def eval3(cap, kfn, vfn, scale=None, per_layer=False, thetas=None):
    k, v, q = cap[:3]
    W, N, T, H, D = k.shape
    Hq = q.shape[3]
    rep = Hq // H
    scale = scale or 1.0 / np.sqrt(D)
    pos = np.arange(T - NQ, T)
    j = np.arange(T)
    causal = j[None, :] <= pos[:, None]
    raw = (j[None, :] < SINK) | (j[None, :] > pos[:, None] - RECENT)
    rawf = raw.astype(F32)
    qrf = 1 - rawf
    errs = {c: np.zeros((W, N, Hq)) for c in ("both", "k", "v")}
    bk = bv = 16.0
    for w in range(W):
        for n in range(N):
            K, V = k[w, n], v[w, n]
            kvqlab.CTX.update(w=w, n=n, q=q[w, n], K=K, V=V, theta=thetas[n] if thetas else 100000.0)
            Kq, bk = quantize_full(K, "key", kfn) if kfn else (K, 16.0)
            Vq, bv = quantize_full(V, "value", vfn) if vfn else (V, 16.0)
            Kh = [np.ascontiguousarray(K[:, h].T) for h in range(H)]
            Kqh = [np.ascontiguousarray(Kq[:, h].T) for h in range(H)]
            Vh = [np.ascontiguousarray(V[:, h]) for h in range(H)]
            Vqh = [np.ascontiguousarray(Vq[:, h]) for h in range(H)]
            for hq in range(Hq):
                h = hq // rep
                qq = np.ascontiguousarray(q[w, n, T - NQ:, hq])
                sr = qq @ Kh[h] * scale
                sq = qq @ Kqh[h] * scale
                pr = _probs(sr, causal)
                pm = _probs(np.where(raw, sr, sq), causal)
                o_r = pr @ Vh[h]
                den = (o_r ** 2).sum()
                Vmixq = Vqh[h]
                o_k = pm @ Vh[h]
                o_v = (pr * rawf) @ Vh[h] + (pr * qrf) @ Vmixq
                o_b = (pm * rawf) @ Vh[h] + (pm * qrf) @ Vmixq
                for c, o in (("both", o_b), ("k", o_k), ("v", o_v)):
                    errs[c][w, n, hq] = np.sqrt(((o - o_r) ** 2).sum() / den)
    res = {c: float(e.mean()) for c, e in errs.items()}
    res.update(bits_k=bk, bits_v=bv, bits=(bk + bv) / 2)
    if per_layer:
        res["per_layer"] = errs["both"].mean((0, 2)).tolist()
    return res
