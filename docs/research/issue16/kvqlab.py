"""Issue-16 research lab: numpy quantize->dequantize simulators + decode-like attention error.

All quantizers take X [T, H, D] float32 (the *middle* rows to be packed: rows SINK..T-1 of a
(window, layer); token groups start at the first middle row) and `kind` in {"key","value"} and
return (Xhat [T,H,D] float32, bits_per_element) where bits count codes + all metadata for
complete groups.
"""
from __future__ import annotations

import json

import ml_dtypes
import numpy as np

F32 = np.float32
SINK, RECENT, NQ = 4, 16, 64
CTX = {}


# ---------------------------------------------------------------- captures
def load(path, loop=0):
    f = np.load(path, allow_pickle=False)
    k, v, q = (f[n].astype(F32) for n in ("k", "v", "q"))
    meta = json.loads(str(f["meta"])) if "meta" in f.files else {}
    if "dtype" in f.files and str(f["dtype"]) == "bfloat16":  # embedded uint16 bf16 bits
        k, v, q = (f[n].view(ml_dtypes.bfloat16).astype(F32) for n in ("k", "v", "q"))
    if loop is None:
        return k, v, q, meta
    return k[:, loop], v[:, loop], q[:, loop], meta  # [W, N, T, H, D]


# ---------------------------------------------------------------- grouping helpers
def to_groups(X, axis, G):
    """X [T,H,D] -> (groups [..., G] with NaN padding, inverse fn)."""
    T, H, D = X.shape
    if axis == "tokens":
        nG = -(-T // G)
        P = np.full((nG * G, H, D), np.nan, F32)
        P[:T] = X
        g = P.reshape(nG, G, H, D).transpose(0, 2, 3, 1)  # [nG,H,D,G]

        def inv(g2):
            return g2.transpose(0, 3, 1, 2).reshape(nG * G, H, D)[:T]
    else:
        nG = -(-D // G)
        P = np.full((T, H, nG * G), np.nan, F32)
        P[..., :D] = X
        g = P.reshape(T, H, nG, G)

        def inv(g2):
            return g2.reshape(T, H, nG * G)[..., :D]
    return np.ascontiguousarray(g), inv


def f16(x):
    return np.asarray(x, F32).astype(np.float16).astype(F32)


def bf16(x):
    return np.asarray(x, F32).astype(ml_dtypes.bfloat16).astype(F32)


def e4m3(x):
    return np.asarray(x, F32).astype(ml_dtypes.float8_e4m3fn).astype(F32)


def e5m2(x):
    return np.asarray(x, F32).astype(ml_dtypes.float8_e5m2).astype(F32)


def default_axis(kind):
    return "tokens" if kind == "key" else "channels"


# ---------------------------------------------------------------- INT-N affine
def affine_core(g, bits=4, meta="f16", clip=None, levels=None):
    """g [..., G] (NaN pad). Returns dequantized g.
    clip: None or list of (lo_frac, hi_frac) candidate trims of [mn,mx]; per group the MSE-best.
    levels: None (uniform) or array of 2^bits levels in [0,1] (non-uniform, 0 and 1 included).
    meta: 'f16' (min,scale fp16) | 'bf16' | 'f32'."""
    nl = 2 ** bits - 1
    mn = np.nanmin(g, -1, keepdims=True)
    mx = np.nanmax(g, -1, keepdims=True)
    rnd = {"f16": f16, "bf16": bf16, "f32": lambda x: np.asarray(x, F32)}[meta]
    cands = clip if clip else [(0.0, 0.0)]
    best, besterr = None, None
    for lo, hi in cands:
        span0 = mx - mn
        a = mn + F32(lo) * span0
        b = mx - F32(hi) * span0
        span = (b - a).astype(F32)
        scale = np.where(span > 0, span / F32(nl), F32(1)).astype(F32)
        if levels is None:
            code = np.clip(np.rint((g - a) / scale), 0, nl)
            deq = code * rnd(scale) + rnd(a)
        else:
            u = np.clip((g - a) / np.where(span > 0, span, 1), 0, 1)
            mids = (levels[1:] + levels[:-1]) / 2
            idx = np.searchsorted(mids, u)
            deq = levels[idx].astype(F32) * rnd(span) + rnd(a)
        if len(cands) == 1:
            return deq.astype(F32)
        err = np.nansum((deq - g) ** 2, -1, keepdims=True)
        if best is None:
            best, besterr = deq, err
        else:
            m = err < besterr
            best = np.where(m, deq, best)
            besterr = np.where(m, err, besterr)
    return best.astype(F32)


def int_affine(X, kind, G=64, bits=4, axis=None, meta="f16", clip=None, levels=None,
               extra_meta_bits=0):
    axis = axis or default_axis(kind)
    g, inv = to_groups(X, axis, G)
    out = inv(affine_core(g, bits, meta, clip, levels))
    mbits = {"f16": 32, "bf16": 32, "f32": 64}[meta] + extra_meta_bits
    return out, bits + mbits / G


# ---------------------------------------------------------------- INT4 with 8-bit metadata
def ceil_log8(x, ref):
    """8-bit log scale: smallest ref * 2^(-e/16), e in 0..255, that is >= x (x <= ref)."""
    e = np.floor(-16 * np.log2(np.maximum(x, 1e-38) / ref))
    e = np.clip(e, 0, 255)
    return (ref * np.exp2(-e / 16)).astype(F32)


def ceil_fp8(x, fmt="e4m3"):
    """smallest fp8 value >= x (x >= 0)."""
    dt = ml_dtypes.float8_e4m3fn if fmt == "e4m3" else ml_dtypes.float8_e5m2
    r = np.asarray(x, F32).astype(dt)
    rf = r.astype(F32)
    low = rf < x
    nxt = (r.view(np.uint8) + 1).view(dt).astype(F32)
    return np.where(low, nxt, rf).astype(F32)


def int_meta8(X, kind, G=32, bits=4, axis=None, scale_fmt="e4m3", zp_bits=8, clipsearch=False):
    """Affine with 8-bit metadata: scale in FP8 (times a per-(tensor-head) f32 global), integer
    zero point zp (int8): x ~ (code - zp) * s. Bits: bits + (8 + zp_bits)/G (+ global: ignored,
    one f32 per head per page)."""
    axis = axis or default_axis(kind)
    g, inv = to_groups(X, axis, G)
    nl = 2 ** bits - 1
    mn = np.nanmin(g, -1, keepdims=True)
    mx = np.nanmax(g, -1, keepdims=True)
    span = mx - mn
    fmax = 448.0 if scale_fmt == "e4m3" else 57344.0
    smax = np.nanmax(span) / nl
    gs = F32(fmax / smax) if smax > 0 else F32(1)  # global encode scale
    s_raw = span / F32(nl)
    best = None
    for infl in ([1.0] if not clipsearch else [1.0, 0.95, 0.9, 0.85]):
        if scale_fmt == "log8":
            s = ceil_log8(s_raw * F32(infl), F32(smax))
        else:
            s = ceil_fp8(s_raw * F32(infl) * gs, scale_fmt) / gs
        s = np.where(s > 0, s, F32(1e-30))
        zlo, zhi = -(2 ** (zp_bits - 1)), 2 ** (zp_bits - 1) - 1
        # center the grid on the group's center
        zp = np.clip(np.rint(-(mn + mx) / 2 / s + nl / 2), zlo, zhi)
        code = np.clip(np.rint(g / s + zp), 0, nl)
        deq = ((code - zp) * s).astype(F32)
        if best is None:
            best, be = deq, np.nansum((deq - g) ** 2, -1, keepdims=True)
        else:
            e = np.nansum((deq - g) ** 2, -1, keepdims=True)
            m = e < be
            best = np.where(m, deq, best)
            be = np.where(m, e, be)
    return inv(best), bits + (8 + zp_bits) / G


def int_twolevel(X, kind, G=32, SG=128, bits=4, axis=None, sub_bits=8, clipsearch=False):
    """Two-level: per super-group (SG elements, along the same axis) FP16 min and FP16 scale
    (of the super-group); per G-subgroup an unsigned sub_bits min offset and log-ish scale:
    sub_min = smin + a * (sspan / (2^sub_bits-1)) ... implemented as: sub-group min and max are
    quantized *outward* onto a uniform grid of the super range with 2^sub_bits levels.
    bits = bits + 2*sub_bits/G + 32/SG."""
    axis = axis or default_axis(kind)
    g, inv = to_groups(X, axis, SG)
    nl = 2 ** bits - 1
    L = 2 ** sub_bits - 1
    smn = f16(np.nanmin(g, -1, keepdims=True))
    smx = np.nanmax(g, -1, keepdims=True)
    sstep = f16(np.maximum((smx - smn) / L, 1e-30) * F32(1.0 + 2 ** -9))  # step covers range
    sh = g.shape[:-1] + (SG // G, G)
    gg = g.reshape(sh)
    mn = np.nanmin(gg, -1, keepdims=True)
    mx = np.nanmax(gg, -1, keepdims=True)
    s1 = sstep[..., None, :]
    m1 = smn[..., None, :]
    a = np.clip(np.floor((mn - m1) / s1), 0, L)
    b = np.clip(np.ceil((mx - m1) / s1), 0, L)
    lo = m1 + a * s1
    hi = m1 + b * s1
    sp = hi - lo
    sc = np.where(sp > 0, sp / nl, 1)
    code = np.clip(np.rint((gg - lo) / sc), 0, nl)
    deq = (code * sc + lo).reshape(g.shape).astype(F32)
    return inv(deq), bits + 2 * sub_bits / G + 32 / SG


# ---------------------------------------------------------------- NVFP4
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F32)


def e2m1_round(y):
    a = np.abs(y)
    # nearest with ties to even code index
    mids = (E2M1[1:] + E2M1[:-1]) / 2
    idx = np.searchsorted(mids, a, side="left")  # a==mid -> lower index
    # ties: choose even index
    tie = np.isin(a, mids)
    idx_t = np.searchsorted(mids, a, side="left")
    idx = np.where(tie & (idx_t % 2 == 1), idx_t + 1, idx_t)
    return np.sign(y) * E2M1[np.clip(idx, 0, 7)]


def nvfp4(X, kind, axis=None, G=16, four_over_six=False, scale_fmt="e4m3"):
    axis = axis or default_axis(kind)
    g, inv = to_groups(X, axis, G)
    amax = np.nanmax(np.abs(X))
    gsc = F32(2688.0 / amax) if amax > 0 else F32(1)
    vmax = np.nanmax(np.abs(g), -1, keepdims=True)
    best, be = None, None
    for tgt in ([6.0, 4.0] if four_over_six else [6.0]):
        s = np.minimum(gsc * (vmax * F32(1 / tgt)), 448)
        sf = e4m3(s)
        v = sf / gsc
        y = np.where(v > 0, g / np.where(v > 0, v, 1), 0)
        y = np.clip(y, -6, 6)
        deq = (e2m1_round(y) * v).astype(F32)
        e = np.nansum((deq - g) ** 2, -1, keepdims=True)
        if best is None:
            best, be = deq, e
        else:
            m = e < be
            best = np.where(m, deq, best)
            be = np.where(m, e, be)
    return inv(best), 4 + 8 / G


def fp8(X, kind):
    s = np.max(np.abs(X), -1, keepdims=True) / F32(448)
    y = np.where(s > 0, X / np.where(s > 0, s, 1), 0)
    return (e4m3(np.clip(y, -448, 448)) * s).astype(F32), 8 + 32 / X.shape[-1]


def identity(X, kind):
    return X.copy(), 16.0


# ---------------------------------------------------------------- decode-like attention error
def attn_out(q, Kr, Kq, Vr, Vq, p0, scale):
    """q [Hq,NQ,D] queries at positions p0..p0+NQ-1, K/V raw & dequantized [T,H,D] (H kv heads).
    Returns (out_ref [Hq,NQ,D], out_mix [Hq,NQ,D])."""
    T, H, D = Kr.shape
    Hq = q.shape[0]
    rep = Hq // H
    pos = np.arange(p0, p0 + q.shape[1])
    j = np.arange(T)
    causal = j[None, :] <= pos[:, None]
    raw = (j[None, :] < SINK) | (j[None, :] > pos[:, None] - RECENT)  # newest 16 incl. itself
    outs_r, outs_m = [], []
    for hq in range(Hq):
        h = hq // rep
        qq = q[hq]
        sr = qq @ Kr[:, h].T * scale
        sq = qq @ Kq[:, h].T * scale
        sm = np.where(raw, sr, sq)
        for s, out in ((sr, outs_r), (sm, outs_m)):
            s = np.where(causal, s, -np.inf)
            s = s - s.max(-1, keepdims=True)
            pr = np.exp(s)
            pr /= pr.sum(-1, keepdims=True)
            out.append(pr)
        pr_r, pr_m = outs_r[-1], outs_m[-1]
        outs_r[-1] = pr_r @ Vr[:, h]
        outs_m[-1] = (pr_m * raw) @ Vr[:, h] + (pr_m * ~raw) @ Vq[:, h]
    return np.stack(outs_r), np.stack(outs_m)


def quantize_full(X, kind, fn):
    """Quantize the middle rows [SINK:] of X [T,H,D] (the recent raw rows are handled per query)."""
    Xq = X.copy()
    mid, bits = fn(X[SINK:], kind)
    Xq[SINK:] = mid
    return Xq, bits


def evaluate(cap, kfn, vfn, scale=None, which="both", layers=None):
    """cap = (k, v, q) each [W, N, T, H, D]. kfn / vfn: quantizer fns (X, kind)->(Xhat,bits)
    or None (raw). Returns dict: err (mean over W,N,Hq of per-block rel L2), bits_k, bits_v."""
    k, v, q = cap[:3]
    W, N, T, H, D = k.shape
    scale = scale or 1.0 / np.sqrt(D)
    errs = np.zeros((W, N, q.shape[3]))
    bk = bv = 16.0
    for w in range(W):
        for n in (layers if layers is not None else range(N)):
            K, V = k[w, n], v[w, n]
            Kq, bk = quantize_full(K, "key", kfn) if kfn else (K, 16.0)
            Vq, bv = quantize_full(V, "value", vfn) if vfn else (V, 16.0)
            qq = q[w, n, T - NQ:].transpose(1, 0, 2)  # [Hq, NQ, D]
            o_r, o_m = attn_out(qq, K, Kq, V, Vq, T - NQ, scale)
            errs[w, n] = np.sqrt(((o_m - o_r) ** 2).sum((1, 2)) / (o_r ** 2).sum((1, 2)))
    if layers is not None:
        errs = errs[:, layers]
    return dict(err=float(errs.mean()), bits_k=bk, bits_v=bv, bits=(bk + bv) / 2,
                per_layer=errs.mean((0, 2)).tolist())
