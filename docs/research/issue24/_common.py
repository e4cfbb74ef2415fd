"""Pieces the issue-24 research scripts share: the report's seven layers, decode-like attention
with one kind quantized, RoPE on NumPy rows, rows normalized to their [min, max], k-means on
2-D points, and Hadamard-rotated rows rounded on HINT4's grid with error feedback."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kvq_jax.core.rope import rope_tables
from kvq_jax.report.metrics import decode_attention

LAYERS = [0, 5, 10, 15, 20, 25, 29]
GT, THETA, PAGE = 64, 100000.0, 64


def f32(x):
    return np.asarray(x, np.float32)


# decode-like attention (sink 4, recent 16, the last 64 queries) with K or V alone quantized
decode_k = jax.jit(lambda q, k, v, kh: decode_attention(q, k, v, kh, v, sink=4, recent=16,
                                                        num_queries=64))
decode_v = jax.jit(lambda q, k, v, vh: decode_attention(q, k, v, k, vh, sink=4, recent=16,
                                                        num_queries=64))


def rope_turn(t, d, theta=THETA):
    """turn(x [T, H, D], sign): RoPE at positions 0 .. T-1 in float64 (sign -1 takes it off)."""
    cos, sin = (np.asarray(a, np.float64) for a in rope_tables(t, d, theta))

    def turn(x, sign):
        h = d // 2
        rot = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
        return x * cos + sign * rot * sin

    return turn


def normalize(x, axis):
    """x -> (z in [-1, 1], mid, half) over `axis` (its [min, max] mapped to -1, 1)."""
    mn, mx = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    mid, half = (mx + mn) / 2, (mx - mn) / 2
    return np.where(half > 0, (x - mid) / np.where(half > 0, half, 1), 0.0), mid, half


_RNG = np.random.default_rng(0)  # one subsampling stream per process


def kmeans(x, init, iters, cap):
    """Lloyd's k-means of 2-D points x [N, 2] from `init` [K, 2] (at most `cap` points, drawn
    from the process's one stream)."""
    rng = _RNG
    if len(x) > cap:
        x = x[rng.choice(len(x), cap, replace=False)]
    c = init.copy()
    for _ in range(iters):
        a = nearest(x, c)
        cnt = np.bincount(a, minlength=len(c))
        s = np.stack([np.bincount(a, x[:, j], minlength=len(c)) for j in range(2)], 1)
        c = np.where(cnt[:, None] > 0, s / np.maximum(cnt, 1)[:, None], c)
    return c


def nearest(x, c):
    """Index of the nearest of centroids c [K, 2] for each point of x [N, 2]."""
    out = np.empty(len(x), int)
    for s in range(0, len(x), 8192):
        xs = x[s : s + 8192]
        out[s : s + 8192] = ((xs**2).sum(1)[:, None] - 2 * xs @ c.T + (c**2).sum(1)[None]).argmin(1)
    return out


def feedback_rows(y, alpha, reset):
    """Rotated rows y float32 [T, ..., D] rounded in order on HINT4's grid (INT4 over each row's
    [min, max]) with `alpha` times the previous row's rounding error added first; the carry
    restarts where reset [T] is True. Returns (x, q): the rows as rounded (with the carry) and
    their grid values."""

    def step(carry, a):
        yt, r = a
        x = yt + alpha * jnp.where(r, 0.0, carry)
        mn, mx = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
        sc = jnp.where(mx > mn, (mx - mn) / 15, 1.0)
        q = jnp.clip(jnp.round((x - mn) / sc), 0, 15) * sc + mn
        return jnp.where(jnp.isfinite(x - q), x - q, 0.0), (x, q)

    _, (x, q) = lax.scan(step, jnp.zeros_like(y[0]), (y, reset))
    return x, q


def key_groups(k):
    """Keys k [T, H, D] -> (z, mid, half): each (group of GT tokens, head, channel) normalized
    to [-1, 1] (INTB's groups), z [T / GT, GT, H, D]."""
    return normalize(k.reshape(-1, GT, *k.shape[1:]), 1)


def from_groups(z, mid, half):
    """`key_groups` undone: [T, H, D]."""
    return (z * half + mid).reshape(-1, *z.shape[2:])


def grid(z, bits):
    """z in [-1, 1] on the uniform grid of 2^bits levels (INTB's / INT4's rounding; bits an
    int or an array broadcasting against z)."""
    levels = 2.0 ** np.asarray(bits) - 1
    return np.round((z + 1) / 2 * levels) / levels * 2 - 1


class Tally:
    """Relative L2 errors of several methods: pooled over everything, and per layer."""

    def __init__(self, methods):
        self.total = {m: [0.0, 0.0] for m in methods}
        self.per_layer = {m: [] for m in methods}
        self.layer = None

    def add(self, method, out, ref):
        if self.layer is None:
            self.layer = {m: [0.0, 0.0] for m in self.total}
        e, r = float(np.sum((out - ref) ** 2)), float(np.sum(ref**2))
        for acc in (self.total, self.layer):
            acc[method][0] += e
            acc[method][1] += r

    def end_layer(self, name):
        for m, (e, r) in self.layer.items():
            self.per_layer[m].append(np.sqrt(e / r))
        self.layer = None
        print(name, {m: "%.3f%%" % (100 * x[-1]) for m, x in self.per_layer.items()}, flush=True)

    def report(self):
        print("pooled", {m: "%.3f%%" % (100 * np.sqrt(e / r)) for m, (e, r) in self.total.items()},
              "layer mean", {m: "%.3f%%" % (100 * np.mean(x)) for m, x in self.per_layer.items()})
