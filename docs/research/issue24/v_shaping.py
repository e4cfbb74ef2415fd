"""V-only decode-like error per (layer, KV head) with values packed by error feedback
(HINT4 G64 grid, carry reset per 64-row page) for several alphas. Saves err/ref sums; with
two saved files, alphas chosen per layer (or per head) on the first are judged on the second.

    python v_shaping.py calib.npz vh_calib.npz; python v_shaping.py topics.npz vh_topics.npz
    python v_shaping.py --choose vh_calib.npz vh_topics.npz"""
import sys
import numpy as np
import jax, jax.numpy as jnp
from kvq_jax.report import capture as cap
from kvq_jax.report.metrics import decode_attention
from kvq_jax.codecs.formats import hadamard
from _common import LAYERS, PAGE, feedback_rows
if sys.argv[1] == "--choose":
    c, t = (np.load(f) for f in sys.argv[2:4])
    rel = lambda e, r: np.sqrt(e / r)
    for name, layers in (("7 layers", LAYERS), ("30 layers", list(range(30)))):
        Ec, Rc, Et, Rt = c["E"][:, layers], c["R"][layers], t["E"][:, layers], t["R"][layers]
        base = rel(Et[0].sum(-1), Rt.sum(-1)).mean()
        pick = rel(Ec.sum(-1), Rc.sum(-1)).argmin(0)  # per layer
        per_l = rel(np.take_along_axis(Et.sum(-1), pick[None], 0)[0], Rt.sum(-1)).mean()
        eh = np.take_along_axis(Et, (Ec / Rc).argmin(0)[None], 0)[0]  # per (layer, head)
        per_h = rel(eh.sum(-1), Rt.sum(-1)).mean()
        print(f"{name}: V-only decode-like, mean over layers: alpha 0 {100 * base:.3f}%, per "
              f"layer {100 * per_l:.3f}% ({per_l / base:.3f}x), per head {100 * per_h:.3f}% "
              f"({per_h / base:.3f}x); alphas per layer {[float(a) for a in c['alphas'][pick]]}")
    sys.exit()
CAPTURE, OUT = sys.argv[1:3]
ALPHAS = [0.0, 0.25, 0.5, 0.75, 1.0]
SINK, RECENT = 4, 16
c = cap.load_capture(CAPTURE)
def shaped_hat(values, alpha):
    y = hadamard.rotate(values.astype(jnp.float32))
    _, q = feedback_rows(y, alpha, jnp.arange(y.shape[0]) % PAGE == 0)
    return hadamard.unrotate(q)
@jax.jit
def sums(q, k, v, alpha):
    vh = shaped_hat(v, alpha)
    ref = decode_attention(q, k, v, k, v, sink=SINK, recent=RECENT, num_queries=64)
    o = decode_attention(q, k, v, k, vh, sink=SINK, recent=RECENT, num_queries=64)
    h = k.shape[1]
    e = ((o - ref) ** 2).reshape(64, h, -1, q.shape[-1]).sum((0, 2, 3))
    r = (ref ** 2).reshape(64, h, -1, q.shape[-1]).sum((0, 2, 3))
    return e, r
W, _, L = c.k.shape[:3]
H = c.k.shape[4]
E = np.zeros((len(ALPHAS), L, H)); R = np.zeros((L, H))
for li in range(L):
    for w in range(W):
        q, k, v = (jnp.asarray(np.asarray(a[w, 0, li], np.float32)) for a in (c.q, c.k, c.v))
        for ai, a in enumerate(ALPHAS):
            e, r = sums(q, k, v, jnp.float32(a))
            E[ai, li] += np.asarray(e)
            if ai == 0:
                R[li] += np.asarray(r)
    print(li, np.round(100 * np.sqrt(E[:, li].sum(1) / R[li].sum()), 3), flush=True)
np.savez(OUT, E=E, R=R, alphas=np.array(ALPHAS))
