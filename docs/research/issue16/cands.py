"""Candidate quantizers built on kvqlab (each: fn(X, kind) -> (Xhat, bits))."""
import numpy as np
from kvqlab import *

NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], F32)


def hadamard(n):
    Hm = np.array([[1.0]])
    while Hm.shape[0] < n:
        Hm = np.block([[Hm, Hm], [Hm, -Hm]])
    return (Hm / np.sqrt(n)).astype(F32)


def rotated(fn, R):
    """Quantize X R, return (Q(X R)) R^T (q rotated too / V un-rotated after attention)."""
    def f(X, kind):
        Y, b = fn(X @ R, kind)
        return (Y @ R.T).astype(F32), b
    return f


def absmax_levels(X, kind, G=32, levels=NF4, axis=None, scale="f16"):
    """Symmetric absmax with a 16-entry level table in [-1,1]; scale FP16 -> 4 + 16/G bits."""
    axis = axis or default_axis(kind)
    g, inv = to_groups(X, axis, G)
    am = np.nanmax(np.abs(g), -1, keepdims=True)
    am = np.where(am > 0, am, 1)
    u = g / am
    mids = (levels[1:] + levels[:-1]) / 2
    idx = np.searchsorted(mids, u)
    deq = levels[np.clip(idx, 0, 15)] * f16(am)
    return inv(deq.astype(F32)), 4 + 16 / G


def lloyd_unit(samples, n=16, iters=60, fixed_ends=True):
    """Lloyd-Max levels for samples in [0,1] with 0 and 1 kept as levels."""
    lv = np.linspace(0, 1, n)
    s = np.sort(samples)
    for _ in range(iters):
        mids = (lv[1:] + lv[:-1]) / 2
        idx = np.searchsorted(mids, s)
        for i in range(n):
            if fixed_ends and i in (0, n - 1):
                continue
            m = idx == i
            if m.any():
                lv[i] = s[m].mean()
    return lv.astype(F32)


def unit_samples(Xs, kind, G=64, axis=None, max_n=2_000_000):
    out = []
    for X in Xs:
        axis_ = axis or default_axis(kind)
        g, _ = to_groups(X, axis_, G)
        mn = np.nanmin(g, -1, keepdims=True)
        mx = np.nanmax(g, -1, keepdims=True)
        u = (g - mn) / np.where(mx > mn, mx - mn, 1)
        u = u[np.isfinite(u)]
        out.append(u.ravel())
    u = np.concatenate(out)
    if len(u) > max_n:
        u = np.random.default_rng(0).choice(u, max_n, replace=False)
    return u


def with_outliers(fn, frac=0.01, idx_bits=16, val_bits=16, axis=None):
    """Dense-and-sparse: top `frac` |x - median-ish| per tensor kept raw (bf16/fp16 value +
    idx_bits position), the rest quantized by fn with outliers replaced by the group median.
    Outlier selection: per channel (keys: channel mean removed) largest |x| globally."""
    def f(X, kind):
        if kind == "key":
            c = X.mean(0, keepdims=True)
        else:
            c = 0
        dev = np.abs(X - c)
        thr = np.quantile(dev, 1 - frac)
        m = dev > thr
        Xi = np.where(m, c + np.zeros_like(X), X).astype(F32)
        Y, b = fn(Xi, kind)
        Y = np.where(m, bf16(X), Y)
        return Y.astype(F32), b + frac * (idx_bits + val_bits)
    return f


def mix_bits(fns_by_channel_class):
    pass


def rope_cs(T, D=64, theta=100000.0, offset=SINK):
    inv = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(offset, offset + T)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], 1)
    return np.cos(ang).astype(F32)[:, None, :], np.sin(ang).astype(F32)[:, None, :]


def rot_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], -1)


def pre_rope(fn, theta=None):
    """Keys: undo RoPE (positions SINK..), quantize with fn, re-apply RoPE."""
    def f(X, kind):
        if kind != "key":
            return fn(X, kind)
        th = theta or kvqlab.CTX.get("theta", 100000.0)
        c, s = rope_cs(X.shape[0], X.shape[-1], th)
        pre = X * c - rot_half(X) * s
        Y, b = fn(pre.astype(F32), kind)
        return (Y * c + rot_half(Y) * s).astype(F32), b
    return f


import kvqlab


def alloc_bits(w, budget_mean=4.0, bmax=8, bmin=0):
    """w [..., D] weights (importance * span^2). Greedy marginal allocation with uniform-quant
    error model e(b) = 1/(2^b-1)^2 (b=0: ~ 1/3 of span^2 -> use 4/12 ratio ~ 1.0 treat as 1)."""
    D = w.shape[-1]
    e = lambda b: np.where(b == 0, 3.0, 1.0 / (2.0 ** b - 1) ** 2)  # relative to span^2/12
    b = np.full(w.shape, bmin, np.int64)
    total = int(round(budget_mean * D)) - bmin * D
    flat_w = w.reshape(-1, D)
    flat_b = b.reshape(-1, D)
    for r in range(flat_w.shape[0]):
        for _ in range(total):
            gain = flat_w[r] * (e(flat_b[r]) - e(flat_b[r] + 1))
            gain[flat_b[r] >= bmax] = -1
            flat_b[r, np.argmax(gain)] += 1
    return flat_b.reshape(w.shape)


def int_perchan_bits(X, kind, bits_hd, G=64, meta_bits=32, meta="f16"):
    """Keys over tokens with per-(head, channel) bit widths bits_hd [H, D] (0: group mean).
    meta f16: FP16 min + scale (32 bits/group); meta8: E4M3 scale (rounded up, one f32 global
    per tensor) + int8 zero point (16 bits/group)."""
    g, inv = to_groups(X, "tokens", G)  # [nG,H,D,G]
    mn = np.nanmin(g, -1, keepdims=True)
    mx = np.nanmax(g, -1, keepdims=True)
    nl = (2.0 ** bits_hd[None, :, :, None] - 1).astype(F32)
    span = mx - mn
    scale = np.where((span > 0) & (nl > 0), span / np.maximum(nl, 1), 1).astype(F32)
    if meta == "meta8":
        meta_bits = 16
        smax = np.nanmax(np.where(nl > 0, scale, 0))
        s = ceil_log8(scale, F32(smax))
        s = np.where(s > 0, s, F32(1e-30))
        zp = np.clip(np.rint(-(mn + mx) / 2 / s + nl / 2), -128, 127)
        code = np.clip(np.rint(g / s + zp), 0, nl)
        deq = (code - zp) * s
    else:
        code = np.clip(np.rint((g - mn) / scale), 0, nl)
        deq = code * f16(scale) + f16(mn)
    mean = np.nanmean(g, -1, keepdims=True)
    deq = np.where(nl > 0, deq, f16(mean))
    return inv(deq.astype(F32)), float(bits_hd.mean()) + meta_bits / G


def q_importance(qwn, H, pre=False, theta=None, tokens=slice(None)):
    """qwn [T, Hq, D] -> [H, D] mean q_c^2 over the q heads of each kv head."""
    qq = qwn[tokens]
    if pre:
        theta = theta or kvqlab.CTX.get("theta", 100000.0)
        c, s = rope_cs(qwn.shape[0], qwn.shape[-1], theta, offset=0)
        c, s = c[tokens], s[tokens]
        qq = qq * c - rot_half(qq) * s
    Hq, D = qq.shape[1], qq.shape[2]
    I = (qq ** 2).mean(0).reshape(H, Hq // H, D).mean(1)
    if pre:  # RoPE couples channels i and i+D/2 between query and key positions:
        # importance_i = a_i I_i + (1-a_i) I_partner, a_i = mean_{d in [16,T)} cos^2(theta_i d)
        th = theta * 1.0
        inv = th ** (-np.arange(0, D, 2, dtype=np.float64) / D)
        d = np.arange(RECENT, qwn.shape[0], dtype=np.float64)
        a = (np.cos(inv[:, None] * d[None]) ** 2).mean(1)
        a = np.concatenate([a, a]).astype(F32)
        partner = np.concatenate([I[:, D // 2:], I[:, : D // 2]], -1)
        I = a * I + (1 - a) * partner
    return I


def imp_alloc_key(imp_fn, budget=4.0, bmax=8, G=64, use_span=True, meta="f16"):
    """imp_fn(ctx) -> [H,D] importance. Allocation weights = importance * mean group span^2."""
    def f(X, kind):
        H, D = X.shape[1], X.shape[2]
        I = imp_fn(kvqlab.CTX, H)
        if use_span:
            g, _ = to_groups(X, "tokens", G)
            sp = np.nanmean((np.nanmax(g, -1) - np.nanmin(g, -1)) ** 2, 0)  # [H,D]
        else:
            sp = np.ones((H, D))
        b = alloc_bits(I * sp, budget, bmax)
        return int_perchan_bits(X, kind, b, G, meta=meta)
    return f


def span_alloc(budget=4.0, bmax=8, G=64, imp_fn=None, meta_bits=32):
    """Over-tokens grouping, per-(head,channel) bits water-filled on mean group span^2
    (times importance if imp_fn). Allocation from the tensor itself (per layer & window)."""
    def f(X, kind):
        H, D = X.shape[1], X.shape[2]
        g, _ = to_groups(X, "tokens", G)
        sp = np.nanmean((np.nanmax(g, -1) - np.nanmin(g, -1)) ** 2, 0)
        I = imp_fn(kvqlab.CTX, H) if imp_fn else 1.0
        b = alloc_bits(I * sp, budget, bmax)
        return int_perchan_bits(X, kind, b, G, meta_bits)
    return f


def headrot(fn, rot_fn):
    """Per-kv-head rotation R_h [H,D,D] from rot_fn(ctx, H, kind): quantize X_h R_h, undo."""
    def f(X, kind):
        R = rot_fn(kvqlab.CTX, X.shape[1], kind)
        Y = np.einsum("thd,hde->the", X, R).astype(F32)
        kvqlab.CTX["R"] = R
        Z, b = fn(Y, kind)
        return np.einsum("the,hde->thd", Z, R).astype(F32), b
    return f


def pca_basis(Xs):
    """Xs list of [T,H,D] -> [H,D,D] eigenvectors (columns) sorted by decreasing variance."""
    H, D = Xs[0].shape[1], Xs[0].shape[2]
    R = np.zeros((H, D, D), F32)
    for h in range(H):
        A = np.concatenate([x[:, h] for x in Xs], 0).astype(np.float64)
        A = A - A.mean(0)
        C = A.T @ A / len(A)
        ev, U = np.linalg.eigh(C)
        R[h] = U[:, ::-1]
    return R


def _probs_full(qh, kh, scale):
    T = kh.shape[0]
    s = qh @ kh.T * scale
    s = np.where(np.arange(T)[None] <= np.arange(qh.shape[0])[:, None], s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    return p / p.sum(-1, keepdims=True)


def pred_scores(kind_pred, ctx, H, window=16, qmean_fn=None):
    """[T, H] heavy-token scores over all rows of the (window, layer)."""
    K, q = ctx["K"], ctx["q"]
    T, Hq, D = q.shape
    rep = Hq // H
    out = np.zeros((T, H), F32)
    if kind_pred == "knorm":
        return np.linalg.norm(K, axis=-1)
    if kind_pred == "qmean":
        mu = qmean_fn(ctx, H)  # [H, D]
        return np.einsum("thd,hd->th", K, mu)
    if kind_pred == "qmean_lse":  # per q head mean query, logsumexp over the q heads of a kv head
        mu = qmean_fn(ctx, H)  # [Hq, D]
        s = np.einsum("thd,hqd->thq", K, mu.reshape(H, Hq // H, D)) / np.sqrt(D)
        return np.log(np.exp(s - s.max()).sum(-1)) + s.max()
    for hq in range(Hq):
        h = hq // rep
        P = _probs_full(q[:, hq], K[:, h], 1 / np.sqrt(D))
        if kind_pred == "oracle":
            out[:, h] += (P[T - NQ:] ** 2).sum(0)
        elif kind_pred == "h2o":  # accumulated attention from all queries before the evaluated ones
            out[:, h] += P[: T - NQ].sum(0)
        elif kind_pred == "next16":
            # mean attention from queries t..t+window-1 (known before row t leaves the window)
            idx = np.arange(T)
            acc = np.zeros(T)
            for d in range(window):
                r = np.minimum(idx + d, T - 1)
                acc += P[r, idx]
            out[:, h] += acc / window
    return out


def heavy(fn, pred="next16", frac=0.02, keep="bf16", qmean_fn=None):
    """Rows (token, head) with the top `frac` scores among the packed rows kept in `keep`
    (bf16 raw: 16 bits/el, or fp8 row: 8+32/D), the rest by fn. Extra bits: frac * (keep_bits -
    base) + 16-bit index per kept row / D."""
    def f(X, kind):
        H, D = X.shape[1], X.shape[2]
        sc = pred_scores(pred, kvqlab.CTX, H, qmean_fn=qmean_fn)[SINK:SINK + X.shape[0]]
        # rows that are never evaluated as quantized (last RECENT rows) excluded from choice
        sc = sc.copy()
        sc[-RECENT:] = -np.inf
        n = int(round(frac * X.shape[0]))
        Y, b = fn(X, kind)
        if n == 0:
            return Y, b
        top = np.argsort(-sc, 0)[:n]  # [n, H]
        m = np.zeros(X.shape[:2], bool)
        for h in range(H):
            m[top[:, h], h] = True
        if keep == "bf16":
            rep, kb = bf16(X), 16.0
        else:
            rep, kb = fp8(X, kind)
        Y = np.where(m[..., None], rep, Y)
        return Y.astype(F32), b + frac * (kb - b) + frac * 16 / D
    return f


def heavy2(fn, pred="qmean", m=1, G=64, keep="bf16", qmean_fn=None, frac=None, exclude=True):
    """Fixed count: per G-row token group (groups from the first packed row) per kv head, the m
    rows with the highest score are kept in `keep` (bf16 or fp8) and excluded (NaN) from the
    packed groups' statistics. frac: instead, a global top fraction per head.
    Bits: ((G-m)*b_base + m*keep_bits)/G + m*ceil(log2 G)/(G*D)."""
    def f(X, kind):
        T, H, D = X.shape
        sc = pred_scores(pred, kvqlab.CTX, H, qmean_fn=qmean_fn)[SINK:SINK + T].copy()
        sel = np.zeros((T, H), bool)
        if frac is not None:
            n = int(round(frac * T))
            top = np.argsort(-sc, 0)[:n]
            for h in range(H):
                sel[top[:, h], h] = True
            mfrac = n / T
        else:
            for g0 in range(0, T, G):
                blk = sc[g0:g0 + G]
                top = np.argsort(-blk, 0)[:m]
                for h in range(H):
                    sel[g0 + top[:, h], h] = True
            mfrac = m / G
        Xn = np.where(sel[..., None], np.nan, X).astype(F32) if exclude else X
        Y, b = fn(Xn, kind)
        if keep == "bf16":
            rep, kb = bf16(X), 16.0
        elif keep == "int8":
            rep, kb = int_affine(X, "value", X.shape[-1], bits=8, axis="channels")
        else:
            rep, kb = fp8(X, kind)
        Y = np.where(sel[..., None], rep, Y)
        ib = 16 if frac is not None else np.ceil(np.log2(G))
        return Y.astype(F32), (1 - mfrac) * b + mfrac * kb + mfrac * ib / D
    return f
