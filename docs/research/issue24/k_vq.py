"""Coupled channel pairs (2-D vector codebooks) for pre-RoPE keys against INTB's scalar grids
at the same bits: decode-like attention error with V raw (K's share only). Pairs: RoPE's
partners (c, c + D/2) or adjacent channels; a pair's codebook has 2^(b_c + b_c') entries
(k-means on the calibration capture's pairs normalized to their groups' [min, max], each
coordinate scaled by 2^b, started from the scalar grid), pairs over MAXB bits stay scalar.

    python k_vq.py topics.npz calib.npz pr3.75.npz rope|adjacent [MAXB=10]"""
import sys, numpy as np, jax
from kvq_jax.report import capture as cap
from kvq_jax.report.metrics import decode_attention
from kvq_jax.core.rope import rope_tables
LAYERS = [0, 5, 10, 15, 20, 25, 29]
EVAL, CALIB, TABLE, PAIRING = sys.argv[1:5]
MAXB = int(sys.argv[5]) if len(sys.argv) > 5 else 10
BITS = np.load(TABLE)["bits"].astype(int)  # [L, H, D]
GT, THETA = 64, 100000.0
ev, ca = cap.load_capture(EVAL), cap.load_capture(CALIB)
f32 = lambda x: np.asarray(x, np.float32)
dec = jax.jit(lambda q, k, v, kh: decode_attention(q, k, v, kh, v, sink=4, recent=16, num_queries=64))
T, D = ev.k.shape[3], ev.k.shape[5]
cos, sin = (np.asarray(a, np.float64) for a in rope_tables(T, D, THETA))
def turn(x, sign):  # x [T, H, D]
    h = D // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos + sign * rot * sin
def norm(k):  # k [T, H, D] -> z in [-1, 1], mid, half per group
    g = k.reshape(T // GT, GT, *k.shape[1:])
    mn, mx = g.min(1, keepdims=True), g.max(1, keepdims=True)
    mid, half = (mx + mn) / 2, (mx - mn) / 2
    z = np.where(half > 0, (g - mid) / np.where(half > 0, half, 1), 0.0)
    return z, mid, half
def denorm(z, mid, half): return (z * half + mid).reshape(T, *z.shape[2:])
def grid_q(z, b):  # scalar uniform grid with 2^b levels over [-1, 1] (INTB's RTN)
    L = 2**b - 1
    return np.round((z + 1) / 2 * L) / L * 2 - 1
if PAIRING == "rope":
    PAIRS = [(c, c + D // 2) for c in range(D // 2)]
else:
    PAIRS = [(2 * c, 2 * c + 1) for c in range(D // 2)]
def kmeans(x, init, iters=20, rng=np.random.default_rng(0)):
    if len(x) > 40000:
        x = x[rng.choice(len(x), 40000, replace=False)]
    c = init.copy()
    for _ in range(iters):
        d = (x**2).sum(1)[:, None] - 2 * x @ c.T + (c**2).sum(1)[None]
        a = d.argmin(1)
        cnt = np.bincount(a, minlength=len(c))
        s = np.stack([np.bincount(a, x[:, j], minlength=len(c)) for j in range(2)], 1)
        c = np.where(cnt[:, None] > 0, s / np.maximum(cnt, 1)[:, None], c)
    return c
def nearest(x, c):
    out = np.empty(len(x), int)
    for s in range(0, len(x), 8192):
        xs = x[s:s + 8192]
        out[s:s + 8192] = ((xs**2).sum(1)[:, None] - 2 * xs @ c.T + (c**2).sum(1)[None]).argmin(1)
    return out
tot = {m: [0.0, 0.0] for m in ("grid", "vq")}
per_layer = {m: [] for m in tot}
for li in LAYERS:
    B = BITS[li]  # [H, D]
    H = B.shape[0]
    # codebooks per (head, pair bits), fitted on the calibration capture's normalized pairs
    books = {}
    zc = [norm(turn(f32(ca.k[w, 0, li]).astype(np.float64), -1))[0] for w in range(ca.k.shape[0])]
    for h in range(H):
        by_bits = {}
        for (a, b2) in PAIRS:
            if B[h, a] + B[h, b2] <= MAXB:
                by_bits.setdefault((B[h, a], B[h, b2]), []).append((a, b2))
        for (ba, bb), pairs in by_bits.items():
            scale = np.array([2.0**ba, 2.0**bb])
            pts = np.concatenate([np.stack([z[:, :, h, a], z[:, :, h, b2]], -1).reshape(-1, 2)
                                  for z in zc for (a, b2) in pairs]) * scale
            la, lb = (np.linspace(-1, 1, 2**x) for x in (ba, bb))
            init = np.stack(np.meshgrid(la, lb, indexing="ij"), -1).reshape(-1, 2) * scale
            books[h, ba, bb] = (kmeans(pts, init), scale)
    le = {m: [0.0, 0.0] for m in tot}
    for w in range(ev.k.shape[0]):
        k = f32(ev.k[w, 0, li]); v = f32(ev.v[w, 0, li]); q = f32(ev.q[w, 0, li])
        kp = turn(k.astype(np.float64), -1)
        z, mid, half = norm(kp)
        zg = np.empty_like(z)
        for h in range(H):
            for c in range(D):
                zg[:, :, h, c] = grid_q(z[:, :, h, c], B[h, c])
        zv = zg.copy()
        for h in range(H):
            for (a, b2) in PAIRS:
                key = (h, B[h, a], B[h, b2])
                if key in books:
                    cb, scale = books[key]
                    x = np.stack([z[:, :, h, a], z[:, :, h, b2]], -1).reshape(-1, 2) * scale
                    y = cb[nearest(x, cb)] / scale
                    zv[:, :, h, a] = y[:, 0].reshape(z.shape[:2]); zv[:, :, h, b2] = y[:, 1].reshape(z.shape[:2])
        ref = np.asarray(dec(q, k, v, k))
        for m, zz in (("grid", zg), ("vq", zv)):
            kh = turn(denorm(zz, mid, half), 1).astype(np.float32)
            o = np.asarray(dec(q, k, v, kh))
            e, r = float(np.sum((o - ref) ** 2)), float(np.sum(ref ** 2))
            tot[m][0] += e; tot[m][1] += r; le[m][0] += e; le[m][1] += r
    for m in tot:
        per_layer[m].append(np.sqrt(le[m][0] / le[m][1]))
    print(li, {m: "%.3f%%" % (100 * per_layer[m][-1]) for m in tot}, flush=True)
print("pooled", {m: "%.3f%%" % (100 * np.sqrt(a / b)) for m, (a, b) in tot.items()},
      "layer mean", {m: "%.3f%%" % (100 * np.mean(x)) for m, x in per_layer.items()})
