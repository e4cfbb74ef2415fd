"""The served policy with other heavy-row choices (`select_heavy` replaced): the row of
largest mean-query score (served, "orig"), of largest query-weighted energy ("energy"), the
row whose removal shrinks its group's per-channel spans most, weighted by the mean queries'
energy ("range"), or a blend of the standardized score and range ("mix LAMBDA").

    python heavy_selection.py orig|energy|range|mix LAMBDA    (reads /tmp/s5/topics.npz, pr3.75.npz)"""
import dataclasses, sys, numpy as np, jax, jax.numpy as jnp
import kvq_jax.codecs.heavy as hv
from kvq_jax.core.policies import POLICIES
from kvq_jax.core.calibration import with_key_tables
from kvq_jax.report import capture as cap, evaluate as ev
MODE = sys.argv[1]
LAM = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
orig = hv.select_heavy
def sel(keys, table, *, group_size):
    if MODE == "orig":
        return orig(keys, table, group_size=group_size)
    k = keys.astype(jnp.float32); tb = table.astype(jnp.float32)  # [T,H,D], [H,R,D]
    s = jnp.max(jnp.einsum("thd,hrd->thr", k, tb), -1)  # [T, H]
    e = jnp.einsum("thd,hrd->th", k * k, tb * tb)  # query-energy-weighted key energy
    # range contribution: how far the row sits outside the group's other rows, weighted
    t, h, d = k.shape
    g = group_size
    n = -(-t // g)
    pad = n * g - t
    big = jnp.float32(3e38)
    kp = jnp.pad(k, ((0, pad), (0, 0), (0, 0)))
    real = (jnp.arange(n * g) < t).reshape(n, g, 1, 1)
    kg = kp.reshape(n, g, h, d)
    kmx, kmn = jnp.where(real, kg, -big), jnp.where(real, kg, big)
    mx, mn = kmx.max(1, keepdims=True), kmn.min(1, keepdims=True)
    mx2 = jnp.sort(kmx, axis=1)[:, -2:-1]
    mn2 = jnp.sort(kmn, axis=1)[:, 1:2]
    mx2 = jnp.where(mx2 < -1e38, mx, mx2); mn2 = jnp.where(mn2 > 1e38, mn, mn2)
    gain = (jnp.where(real & (kg == mx), mx - mx2, 0) + jnp.where(real & (kg == mn), mn2 - mn, 0))  # span shrink per channel
    w = jnp.sum(tb * tb, 1)[None, None]  # [1,1,H,D]
    rng = jnp.sum(gain * w, -1).reshape(n * g, h)[:t]
    if MODE == "energy":
        score = e
    elif MODE == "range":
        score = rng
    elif MODE == "mix":  # normalized blend of score (softmax-ish) and range
        sc = s / jnp.std(s, axis=0, keepdims=True)
        rc = rng / (jnp.std(rng, axis=0, keepdims=True) + 1e-9)
        score = sc + LAM * rc
    score = jnp.pad(score, ((0, n * g - score.shape[0]), (0, 0)))
    score = jnp.where(real[..., 0].reshape(n * g, 1), score, -jnp.inf).reshape(n, g, h)
    return jnp.argmax(score, axis=1).astype(jnp.uint8)
hv.select_heavy = sel
c = cap.select(cap.load_capture("/tmp/s5/topics.npz"), layers=[0, 5, 10, 15, 20, 25, 29])
p = with_key_tables(POLICIES["intb-prerope-hint4-heavy-smollm2+win"], "/tmp/s5/pr3.75.npz")
(r,) = ev.evaluate(c, [p], show_progress=False)
lh = np.array(r.attention_decode_layer_head)
print(MODE, LAM, f"Kerr {100*r.k_rel_l2:.2f}% Verr {100*r.v_rel_l2:.2f}% dec {100*r.attention_decode_mean:.3f}%", np.round(100 * lh.mean(1), 3), flush=True)
