"""Keys coded in a per-(layer, KV head) PCA basis (transform coding: INTB-style per-channel
widths on the rotated channels) against the identity basis, before and after RoPE: decode-like
attention error with V raw (K's share only), the same bits."""
import sys
import numpy as np
from kvq_jax.report import capture as cap
from kvq_jax.core.calibration import allocate_bits
from _common import GT, LAYERS, Tally, decode_k, f32, rope_turn
LAYERS = [int(x) for x in sys.argv[4].split(",")] if len(sys.argv) > 4 else LAYERS
EVAL, CALIB = sys.argv[1:3]
MEAN_BITS = float(sys.argv[3])
ev, ca = cap.load_capture(EVAL), cap.load_capture(CALIB)
T, D = ev.k.shape[3], ev.k.shape[5]
turn = rope_turn(T, D)
def spans(k):  # k [N, T, H, D] -> mean squared group span [H, D]
    g = k.reshape(k.shape[0], -1, GT, *k.shape[2:])
    return np.mean((g.max(2) - g.min(2)) ** 2, axis=(0, 1))
def quant(k, bits):  # k [T, H, D], bits [H, D]
    g = k.reshape(-1, GT, *k.shape[1:])
    mn, mx = g.min(1, keepdims=True), g.max(1, keepdims=True)
    L = 2.0 ** bits - 1
    sc = np.where(mx > mn, (mx - mn) / L, 1.0)
    return (np.clip(np.round((g - mn) / sc), 0, L) * sc + mn).reshape(k.shape)
METHODS = ["post-id", "post-pca", "pre-id", "pre-pca"]
tally = Tally(METHODS)
for li in LAYERS:
    kc = f32(ca.k[:, 0, li]).astype(np.float64)  # [N, T, H, D] post-RoPE
    qc = f32(ca.q[:, 0, li]).astype(np.float64)  # [N, T, Hq, D]
    H, Hq = kc.shape[2], qc.shape[2]
    setup = {}
    for space in ("post", "pre"):
        k_s = kc if space == "post" else turn(kc, -1)
        q_s = qc if space == "post" else turn(qc, -1)
        for basis in ("id", "pca"):
            U = np.zeros((H, D, D))
            for h in range(H):
                if basis == "id":
                    U[h] = np.eye(D)
                else:
                    x = k_s[:, :, h].reshape(-1, GT, D)
                    x = (x - x.mean(1, keepdims=True)).reshape(-1, D)
                    w, vec = np.linalg.eigh(x.T @ x)
                    U[h] = vec[:, ::-1]
            kr = np.einsum("nthd,hde->nthe", k_s, U)
            qr = np.einsum("nthd,hde->nthe", q_s, np.repeat(U, Hq // H, axis=0))
            energy = np.mean(qr**2, axis=(0, 1)).reshape(H, Hq // H, D).sum(1)
            bits = np.array(allocate_bits(energy * spans(kr), mean_bits=MEAN_BITS))
            setup[f"{space}-{basis}"] = (U, bits)
    for w in range(ev.k.shape[0]):
        k = f32(ev.k[w, 0, li]); v = f32(ev.v[w, 0, li]); q = f32(ev.q[w, 0, li])
        ref = np.asarray(decode_k(q, k, v, k))
        for m in METHODS:
            U, bits = setup[m]
            space = m.split("-")[0]
            ks = k.astype(np.float64) if space == "post" else turn(k.astype(np.float64), -1)
            kr = np.einsum("thd,hde->the", ks, U)
            kh = np.einsum("the,hde->thd", quant(kr, bits), U)
            if space == "pre":
                kh = turn(kh, 1)
            o = np.asarray(decode_k(q, k, v, kh.astype(np.float32)))
            tally.add(m, o, ref)
    tally.end_layer(li)
tally.report()
