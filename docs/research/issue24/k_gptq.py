"""Key rounding aware of the query second moment (GPTQ's update on each key row), measured
against round-to-nearest on the same per-channel grids: decode-like attention error, V raw."""
import sys
import numpy as np
from kvq_jax.report import capture as cap
from _common import LAYERS, decode_k as dec, f32
# argv: capture judged, capture of the calibration text, then "4" (uniform INT4 grids) or
# "intb" (the shipped post-RoPE heavy table's bits per layer, head and channel)
EVAL, CALIB, MODE = sys.argv[1:4]
TAB = None
if MODE == "intb":
    from kvq_jax.data import __file__ as data
    TAB = np.load(data.replace("__init__.py", "intb_smollm2_heavy.npz"))["bits"].astype(np.float64)
BITS = None if TAB is not None else int(MODE)
GT = 64
ev = cap.load_capture(EVAL)
ca = cap.load_capture(CALIB)
print(ev.k.shape, ev.q.shape, ca.q.shape)
def grid(k):  # k [T, H, D] -> mn, sc [T/GT, H, D]
    t, h, d = k.shape
    g = k.reshape(t // GT, GT, h, d)
    mn, mx = g.min(1), g.max(1)
    sc = np.maximum(mx - mn, 1e-8) / (2**BITS - 1)
    return mn, sc
def rtn(k, mn, sc):
    t, h, d = k.shape
    g = k.reshape(t // GT, GT, h, d)
    c = np.clip(np.round((g - mn[:, None]) / sc[:, None]), 0, 2**BITS - 1)
    return (c * sc[:, None] + mn[:, None]).reshape(t, h, d)
def gptq(k, mn, sc, Hs, damp=0.01):
    t, h, d = k.shape
    out = np.empty_like(k)
    rep = lambda a: np.repeat(a, GT, axis=0)  # [T, H, D]
    MN, SC = rep(mn), rep(sc)
    for hh in range(h):
        H = Hs[hh].astype(np.float64)
        H = H + damp * np.mean(np.diag(H)) * np.eye(d)
        U = np.linalg.cholesky(np.linalg.inv(H)).T  # upper: GPTQ's Hinv
        W = k[:, hh].astype(np.float64).copy()
        for c in range(d):
            w = W[:, c]
            top = 2**BITS - 1 if np.ndim(BITS) == 0 else 2 ** BITS[hh, c] - 1
            qv = np.clip(np.round((w - MN[:, hh, c]) / SC[:, hh, c]), 0, top) * SC[:, hh, c] + MN[:, hh, c]
            err = (w - qv) / U[c, c]
            W[:, c + 1:] -= err[:, None] * U[c, c + 1:][None, :]
            out[:, hh, c] = qv
    return out
tot = {"rtn": [0, 0], "gptq": [0, 0], "rtn_k": [0, 0], "gptq_k": [0, 0]}
for li in LAYERS:
    qc = f32(ca.q[:, 0, li])  # [W, T, Hq, D]
    w_, t_, hq, d = qc.shape
    h = ev.k.shape[-2]
    g = hq // h
    qg = qc.reshape(-1, h, g, d)
    Hs = np.einsum("nhgd,nhge->hde", qg, qg) / (qg.shape[0] * g)
    for wi in range(ev.k.shape[0]):
        k = f32(ev.k[wi, 0, li]); v = f32(ev.v[wi, 0, li]); q = f32(ev.q[wi, 0, li])
        if TAB is not None:
            BITS = TAB[li]
        mn, sc = grid(k)
        ref = np.asarray(dec(q, k, v, k))
        for name, kh in (("rtn", rtn(k, mn, sc)), ("gptq", gptq(k, mn, sc, Hs))):
            o = np.asarray(dec(q, k, v, kh))
            tot[name][0] += float(np.sum((o - ref) ** 2)); tot[name][1] += float(np.sum(ref ** 2))
            tot[name + "_k"][0] += float(np.sum((kh - k) ** 2)); tot[name + "_k"][1] += float(np.sum(k ** 2))
    print(li, {n: "%.3f%%" % (100 * np.sqrt(a / b)) for n, (a, b) in tot.items()}, flush=True)
