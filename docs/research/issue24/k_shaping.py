"""Pre-RoPE keys on INTB's grids (a table's widths, groups of 64 tokens per channel) rounded
with error feedback along the tokens of each group (noise shaping, alpha 0.25 / 0.5 / 1)
against plain rounding: decode-like attention error with V raw (K's share only).

    python k_shaping.py topics.npz calib.npz pr3.75.npz"""
import sys
import numpy as np
from kvq_jax.report import capture as cap
from _common import GT, LAYERS, Tally, decode_k, f32, from_groups, grid, key_groups, rope_turn
EVAL, CALIB, TABLE = sys.argv[1:4]
BITS = np.load(TABLE)["bits"].astype(int)  # [L, H, D]
ev = cap.load_capture(EVAL)
T, D = ev.k.shape[3], ev.k.shape[5]
turn = rope_turn(T, D)
ALPHAS = [0.25, 0.5, 1.0]
tally = Tally(["grid"] + [f"sd{a}" for a in ALPHAS])
for li in LAYERS:
    B = BITS[li]  # [H, D]
    H = B.shape[0]
    for w in range(ev.k.shape[0]):
        k = f32(ev.k[w, 0, li]); v = f32(ev.v[w, 0, li]); q = f32(ev.q[w, 0, li])
        kp = turn(k.astype(np.float64), -1)
        z, mid, half = key_groups(kp)
        zg = grid(z, B)
        outs = [("grid", zg)]
        Lv = 2.0 ** B[None, :, :] - 1  # [1, H, D]
        for al in ALPHAS:
            zs = np.empty_like(z); carry = np.zeros_like(z[:, 0])
            for t in range(GT):
                x = np.clip(z[:, t] + al * carry, -1, 1)
                qv = np.round((x + 1) / 2 * Lv) / Lv * 2 - 1
                zs[:, t] = qv; carry = x - qv
            outs.append((f"sd{al}", zs))
        ref = np.asarray(decode_k(q, k, v, k))
        for m, zz in outs:
            kh = turn(from_groups(zz, mid, half), 1).astype(np.float32)
            o = np.asarray(decode_k(q, k, v, kh))
            tally.add(m, o, ref)
    tally.end_layer(li)
tally.report()
