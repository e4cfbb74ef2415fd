"""Keys coded in a per-(layer, KV head) PCA basis (transform coding: INTB-style per-channel
widths on the rotated channels) against the identity basis, before and after RoPE: decode-like
attention error with V raw (K's share only), the same bits."""
import sys, numpy as np, jax
from kvq_jax.report import capture as cap
from kvq_jax.report.metrics import decode_attention
from kvq_jax.core.rope import rope_tables
from kvq_jax.core.calibration import allocate_bits
LAYERS = [int(x) for x in sys.argv[4].split(",")] if len(sys.argv) > 4 else [0, 5, 10, 15, 20, 25, 29]
EVAL, CALIB = sys.argv[1:3]
MEAN_BITS = float(sys.argv[3])
GT, THETA = 64, 100000.0
ev, ca = cap.load_capture(EVAL), cap.load_capture(CALIB)
f32 = lambda x: np.asarray(x, np.float32)
dec = jax.jit(lambda q, k, v, kh: decode_attention(q, k, v, kh, v, sink=4, recent=16, num_queries=64))
T, D = ev.k.shape[3], ev.k.shape[5]
cos, sin = (np.asarray(a, np.float64) for a in rope_tables(T, D, THETA))
def turn(x, sign):
    h = D // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos + sign * rot * sin
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
tot = {m: [0.0, 0.0] for m in METHODS}
per_layer = {m: [] for m in METHODS}
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
    le = {m: [0.0, 0.0] for m in METHODS}
    for w in range(ev.k.shape[0]):
        k = f32(ev.k[w, 0, li]); v = f32(ev.v[w, 0, li]); q = f32(ev.q[w, 0, li])
        ref = np.asarray(dec(q, k, v, k))
        for m in METHODS:
            U, bits = setup[m]
            space = m.split("-")[0]
            ks = k.astype(np.float64) if space == "post" else turn(k.astype(np.float64), -1)
            kr = np.einsum("thd,hde->the", ks, U)
            kh = np.einsum("the,hde->thd", quant(kr, bits), U)
            if space == "pre":
                kh = turn(kh, 1)
            o = np.asarray(dec(q, k, v, kh.astype(np.float32)))
            e, r = float(np.sum((o - ref) ** 2)), float(np.sum(ref ** 2))
            tot[m][0] += e; tot[m][1] += r; le[m][0] += e; le[m][1] += r
    for m in METHODS:
        per_layer[m].append(np.sqrt(le[m][0] / le[m][1]))
    print(li, {m: "%.3f%%" % (100 * per_layer[m][-1]) for m in METHODS}, flush=True)
print("layer mean", {m: "%.3f%%" % (100 * np.mean(x)) for m, x in per_layer.items()})
