"""2-D vector codebooks for HINT4's rotated value rows against its scalar grid at the same
bits: decode-like attention error with K raw (V's share only). Rows normalized to their
[min, max] (HINT4 G64's metadata); 256 centroids per (layer, KV head) by k-means on the
calibration capture, started from the 16 x 16 grid.

    python v_vq.py topics.npz calib.npz"""
import sys
import numpy as np
import jax, jax.numpy as jnp
from kvq_jax.report import capture as cap
from kvq_jax.codecs.formats import hadamard
from _common import LAYERS, Tally, decode_v, f32, grid, kmeans, nearest, normalize
EVAL, CALIB = sys.argv[1:3]
BITS = int(sys.argv[3]) if len(sys.argv) > 3 else 4
ev, ca = cap.load_capture(EVAL), cap.load_capture(CALIB)
rot = jax.jit(hadamard.rotate)
T, D = ev.v.shape[3], ev.v.shape[5]
L = 2**BITS - 1
lv = np.linspace(-1, 1, L + 1)
init = np.stack(np.meshgrid(lv, lv, indexing="ij"), -1).reshape(-1, 2)
tally = Tally(("grid", "vq"))
for li in LAYERS:
    zc = normalize(np.asarray(rot(jnp.asarray(f32(ca.v[:, 0, li])))).astype(np.float64), -1)[0]  # [W, T, H, D]
    H = zc.shape[2]
    books = [kmeans(zc[:, :, h].reshape(-1, 2), init, 25, 60000) for h in range(H)]
    for w in range(ev.v.shape[0]):
        k = f32(ev.k[w, 0, li]); v = f32(ev.v[w, 0, li]); q = f32(ev.q[w, 0, li])
        y = np.asarray(rot(jnp.asarray(v))).astype(np.float64)
        z, mid, half = normalize(y, -1)
        zv = np.stack([books[h][nearest(z[:, h].reshape(-1, 2), books[h])].reshape(T, D) for h in range(H)], 1)
        ref = np.asarray(decode_v(q, k, v, v))
        for m, zz in (("grid", grid(z, BITS)), ("vq", zv)):
            vh = np.asarray(hadamard.unrotate(jnp.asarray((zz * half + mid).astype(np.float32))))
            o = np.asarray(decode_v(q, k, v, vh))
            tally.add(m, o, ref)
    tally.end_layer(li)
tally.report()
