"""Codebooks for the values at 4.5 bits, on Hadamard-rotated rows (issue 24; not built).

    python docs/research/issue24/v_codebooks.py CAPTURE.npz

CAPTURE.npz: a SmolLM2 capture (README.md says how it was made). Each candidate quantizes the
values' rows rotated as FORMAT.md 2c rotates them (kvq's own `hadamard.rotate`), decodes and
un-rotates; printed: V relative L2 (pooled) and the causal attention-output error with V alone
quantized (captured post-RoPE queries, raw keys, every query over its prefix, GQA), averaged
over (window, loop, layer). Layers 0, 5, 10, 15, 20, 25, 29, as `kvq report --layers`.
"""
import sys
import numpy as np
import jax, jax.numpy as jnp
from kvq_jax.report.capture import load_capture
from kvq_jax.codecs.api import pack_kv, unpack_kv
from kvq_jax.codecs.formats import hadamard

cap = load_capture(sys.argv[1])
LAYERS = [0, 5, 10, 15, 20, 25, 29]
k, v, q = (np.asarray(a, np.float32)[:, :, LAYERS] for a in (cap.k, cap.v, cap.q))
W, L, N, T, H, D = v.shape
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982251167297, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)

def f16(x):
    return x.astype(np.float16).astype(np.float32)

def codebook(y, g, levels, scale_fn):
    """y [..., D] -> decoded; per group of g channels, scale = scale_fn(group) (fp16), nearest level."""
    s = y.reshape(*y.shape[:-1], D // g, g)
    sc = f16(scale_fn(s))
    sc = np.where(sc == 0, 1, sc)
    u = s / sc
    idx = np.abs(u[..., None] - levels).argmin(-1)
    return (levels[idx] * sc).reshape(y.shape)

def affine(y, g, levels=15):
    s = y.reshape(*y.shape[:-1], D // g, g)
    mn, mx = s.min(-1, keepdims=True), s.max(-1, keepdims=True)
    sc = (mx - mn) / levels; sc = np.where(sc > 0, sc, 1)
    c = np.clip(np.round((s - mn) / sc), 0, levels)
    return (c * f16(sc) + f16(mn)).reshape(y.shape)

def lloyd(levels, samples, iters=60):
    c = levels.copy()
    for _ in range(iters):
        idx = np.abs(samples[:, None] - c).argmin(-1)
        c = np.array([samples[idx == i].mean() if (idx == i).any() else c[i] for i in range(len(c))], np.float32)
    return np.sort(c)

rot = np.asarray(jax.jit(hadamard.rotate)(jnp.asarray(v)))  # rotated rows (FORMAT.md 2c)
rng = np.random.default_rng(0)
flat = rot.reshape(-1, D)
sample_rows = flat[rng.choice(len(flat), 4000, replace=False)]
# Lloyd-Max levels for rows normalized by their group's absmax (g = 32) / RMS
s32 = sample_rows.reshape(-1, 32)
lm_abs = lloyd(NF4, (s32 / np.abs(s32).max(-1, keepdims=True)).ravel())
rms = np.sqrt((s32 ** 2).mean(-1, keepdims=True)); rms = np.where(rms == 0, 1, rms)
lm_rms = lloyd(NF4 * 2.5, (s32 / rms).ravel())

cands = {
    "hint4 affine G64 (4.50)": lambda y: affine(y, 64),
    "hint4 affine G32 (5.00)": lambda y: affine(y, 32),
    "nf4 absmax G32 (4.50)": lambda y: codebook(y, 32, NF4, lambda s: np.abs(s).max(-1, keepdims=True)),
    "nf4 absmax G64 (4.25)": lambda y: codebook(y, 64, NF4, lambda s: np.abs(s).max(-1, keepdims=True)),
    "lloyd-abs G32 (4.50)": lambda y: codebook(y, 32, lm_abs, lambda s: np.abs(s).max(-1, keepdims=True)),
    "lloyd-rms G32 (4.50)": lambda y: codebook(y, 32, lm_rms, lambda s: np.sqrt((s ** 2).mean(-1, keepdims=True))),
    "sym int4 absmax G32 (4.50)": lambda y: codebook(y, 32, np.arange(-7, 8, dtype=np.float32) / 7, lambda s: np.abs(s).max(-1, keepdims=True)),
}

def nvfp4_rot(y):
    p = pack_kv(jnp.asarray(y.reshape(-1, H, D)), kind="value", format="nvfp4")
    return np.asarray(unpack_kv(p, jnp.float32)).reshape(y.shape)
cands["nvfp4 rotated G16 (4.50+)"] = nvfp4_rot

def attn_err(vq):
    """decode-like attention error with V alone quantized: per (w, l, n), causal softmax of q k^T."""
    errs = []
    G = q.shape[4] // H
    for w in range(W):
        for l in range(L):
            for n in range(N):
                qq = q[w, l, n].transpose(1, 0, 2)  # [Hq, T, D]
                kk = np.repeat(k[w, l, n].transpose(1, 0, 2), G, 0)
                s = qq @ kk.transpose(0, 2, 1) / np.sqrt(D)
                s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
                p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
                vr = np.repeat(v[w, l, n].transpose(1, 0, 2), G, 0)
                vd = np.repeat(vq[w, l, n].transpose(1, 0, 2), G, 0)
                o, od = p @ vr, p @ vd
                errs.append(np.linalg.norm(od - o) / np.linalg.norm(o))
    return float(np.mean(errs))

for name, fn in cands.items():
    dec_rot = fn(rot)
    dec = np.asarray(jax.jit(hadamard.unrotate)(jnp.asarray(dec_rot)))
    rel = np.linalg.norm(dec - v) / np.linalg.norm(v)
    print(f"{name:30s} V relL2 {100*rel:6.3f}%  attn(V only) {100*attn_err(dec):6.3f}%", flush=True)
