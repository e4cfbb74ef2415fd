"""2-D vector codebooks for HINT4's rotated value rows against its scalar grid at the same
bits: decode-like attention error with K raw (V's share only). Rows normalized to their
[min, max] (HINT4 G64's metadata); 256 centroids per (layer, KV head) by k-means on the
calibration capture, started from the 16 x 16 grid.

    python v_vq.py topics.npz calib.npz"""
import sys, numpy as np, jax, jax.numpy as jnp
from kvq_jax.report import capture as cap
from kvq_jax.report.metrics import decode_attention
from kvq_jax.codecs.formats import hadamard
LAYERS = [0, 5, 10, 15, 20, 25, 29]
EVAL, CALIB = sys.argv[1:3]
BITS = int(sys.argv[3]) if len(sys.argv) > 3 else 4
ev, ca = cap.load_capture(EVAL), cap.load_capture(CALIB)
f32 = lambda x: np.asarray(x, np.float32)
dec = jax.jit(lambda q, k, v, vh: decode_attention(q, k, v, k, vh, sink=4, recent=16, num_queries=64))
rot = jax.jit(hadamard.rotate)
T, D = ev.v.shape[3], ev.v.shape[5]
def norm(y):  # rows [..., D]
    mn, mx = y.min(-1, keepdims=True), y.max(-1, keepdims=True)
    mid, half = (mx + mn) / 2, (mx - mn) / 2
    return np.where(half > 0, (y - mid) / np.where(half > 0, half, 1), 0.0), mid, half
L = 2**BITS - 1
grid = lambda z: np.round((z + 1) / 2 * L) / L * 2 - 1
def kmeans(x, init, iters=25, rng=np.random.default_rng(0)):
    if len(x) > 60000:
        x = x[rng.choice(len(x), 60000, replace=False)]
    c = init.copy()
    for _ in range(iters):
        a = ((x**2).sum(1)[:, None] - 2 * x @ c.T + (c**2).sum(1)[None]).argmin(1)
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
lv = np.linspace(-1, 1, L + 1)
init = np.stack(np.meshgrid(lv, lv, indexing="ij"), -1).reshape(-1, 2)
tot = {m: [0.0, 0.0] for m in ("grid", "vq")}
per_layer = {m: [] for m in tot}
for li in LAYERS:
    zc = norm(np.asarray(rot(jnp.asarray(f32(ca.v[:, 0, li])))).astype(np.float64))[0]  # [W, T, H, D]
    H = zc.shape[2]
    books = [kmeans(zc[:, :, h].reshape(-1, 2), init) for h in range(H)]
    le = {m: [0.0, 0.0] for m in tot}
    for w in range(ev.v.shape[0]):
        k = f32(ev.k[w, 0, li]); v = f32(ev.v[w, 0, li]); q = f32(ev.q[w, 0, li])
        y = np.asarray(rot(jnp.asarray(v))).astype(np.float64)
        z, mid, half = norm(y)
        zv = np.stack([books[h][nearest(z[:, h].reshape(-1, 2), books[h])].reshape(T, D) for h in range(H)], 1)
        ref = np.asarray(dec(q, k, v, v))
        for m, zz in (("grid", grid(z)), ("vq", zv)):
            vh = np.asarray(hadamard.unrotate(jnp.asarray((zz * half + mid).astype(np.float32))))
            o = np.asarray(dec(q, k, v, vh))
            e, r = float(np.sum((o - ref) ** 2)), float(np.sum(ref ** 2))
            tot[m][0] += e; tot[m][1] += r; le[m][0] += e; le[m][1] += r
    for m in tot:
        per_layer[m].append(np.sqrt(le[m][0] / le[m][1]))
    print(li, {m: "%.3f%%" % (100 * per_layer[m][-1]) for m in tot}, flush=True)
print("pooled", {m: "%.3f%%" % (100 * np.sqrt(a / b)) for m, (a, b) in tot.items()},
      "layer mean", {m: "%.3f%%" % (100 * np.mean(x)) for m, x in per_layer.items()})
