"""Coupled channel pairs (2-D vector codebooks) for pre-RoPE keys against INTB's scalar grids
at the same bits: decode-like attention error with V raw (K's share only). Pairs: RoPE's
partners (c, c + D/2) or adjacent channels; a pair's codebook has 2^(b_c + b_c') entries
(k-means on the calibration capture's pairs normalized to their groups' [min, max], each
coordinate scaled by 2^b, started from the scalar grid), pairs over MAXB bits stay scalar.

    python k_vq.py topics.npz calib.npz pr3.75.npz rope|adjacent [MAXB=10]"""
import sys
import numpy as np
from kvq_jax.report import capture as cap
from _common import LAYERS, Tally, decode_k, f32, from_groups, grid, key_groups, kmeans, nearest, rope_turn
EVAL, CALIB, TABLE, PAIRING = sys.argv[1:5]
MAXB = int(sys.argv[5]) if len(sys.argv) > 5 else 10
BITS = np.load(TABLE)["bits"].astype(int)  # [L, H, D]
ev, ca = cap.load_capture(EVAL), cap.load_capture(CALIB)
T, D = ev.k.shape[3], ev.k.shape[5]
turn = rope_turn(T, D)
if PAIRING == "rope":
    PAIRS = [(c, c + D // 2) for c in range(D // 2)]
else:
    PAIRS = [(2 * c, 2 * c + 1) for c in range(D // 2)]
tally = Tally(("grid", "vq"))
for li in LAYERS:
    B = BITS[li]  # [H, D]
    H = B.shape[0]
    # codebooks per (head, pair bits), fitted on the calibration capture's normalized pairs
    books = {}
    zc = [key_groups(turn(f32(ca.k[w, 0, li]).astype(np.float64), -1))[0] for w in range(ca.k.shape[0])]
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
            books[h, ba, bb] = (kmeans(pts, init, 20, 40000), scale)
    for w in range(ev.k.shape[0]):
        k = f32(ev.k[w, 0, li]); v = f32(ev.v[w, 0, li]); q = f32(ev.q[w, 0, li])
        kp = turn(k.astype(np.float64), -1)
        z, mid, half = key_groups(kp)
        zg = grid(z, B)
        zv = zg.copy()
        for h in range(H):
            for (a, b2) in PAIRS:
                key = (h, B[h, a], B[h, b2])
                if key in books:
                    cb, scale = books[key]
                    x = np.stack([z[:, :, h, a], z[:, :, h, b2]], -1).reshape(-1, 2) * scale
                    y = cb[nearest(x, cb)] / scale
                    zv[:, :, h, a] = y[:, 0].reshape(z.shape[:2]); zv[:, :, h, b2] = y[:, 1].reshape(z.shape[:2])
        ref = np.asarray(decode_k(q, k, v, k))
        for m, zz in (("grid", zg), ("vq", zv)):
            kh = turn(from_groups(zz, mid, half), 1).astype(np.float32)
            o = np.asarray(decode_k(q, k, v, kh))
            tally.add(m, o, ref)
    tally.end_layer(li)
tally.report()
