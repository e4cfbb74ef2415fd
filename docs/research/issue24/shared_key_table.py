"""One INTB key table for every layer: each layer's calibration weights (as intb_bit_table
weighs pre-RoPE channels) normalized to sum 1 and summed, then one allocation; written as
a tables file beside pr3.75.npz (its mean-query tables kept).

    python shared_key_table.py 3.75    # then the policy on /tmp/s5/shared3.75.npz"""
import sys, numpy as np, dataclasses
from kvq_jax.core import calibration as cal
from kvq_jax.report.capture import load_capture
from kvq_jax.core.rope import rope_aware_weights, rope_tables
c = load_capture("/tmp/s5/calib.npz")

k_all = np.asarray(c.k[:, 0], np.float32); q_all = np.asarray(c.q[:, 0], np.float32)
theta = 100000.0
W = 0
for n in range(k_all.shape[1]):
    k = cal._as_4d(k_all[:, n], "k"); q = cal._as_4d(q_all[:, n], "q")
    cos, sin = rope_tables(k.shape[1], k.shape[3], theta)
    k = cal._unrope(k, cos, sin)
    energy = cal.query_energy(cal._unrope(q, cos, sin), k.shape[2])
    a = rope_aware_weights(k.shape[3], theta, k.shape[1])
    d2 = k.shape[3] // 2
    partner = np.concatenate([energy[:, d2:], energy[:, :d2]], axis=1)
    energy = a * energy + (1 - a) * partner
    w = energy * cal.group_span_power(k, 64)
    W = W + w / w.sum()
table = cal.allocate_bits(W, mean_bits=float(sys.argv[1]))
print(np.array(table))
z = dict(np.load("/tmp/s5/pr3.75.npz", allow_pickle=True))
z["bits"] = np.repeat(np.array(table, np.uint8)[None], z["bits"].shape[0], 0).astype(z["bits"].dtype)
np.savez(f"/tmp/s5/shared{sys.argv[1]}.npz", **z)
