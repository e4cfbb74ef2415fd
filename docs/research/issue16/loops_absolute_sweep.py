"""Sweep of 4-loop schedules at FlashLoop legacy's 3.000 bits: delta vs absolute per loop.

Two INT4 G64 slots (4.5 b) and six INT2 G64 slots (2.5 b) over K, V and 4 loops, each later
loop a delta against the reconstructed previous loop ("d") or packed on its own ("a"), on the
embedded capture (emulated loops), with the report's attention metrics (attn mean, attn dec).
The chain is written here from `pack_kv` / `unpack_kv` alone (no `encode_loops`), so it is
also an independent check of the `absolute` mode. Run from the repository root:

    PYTHONPATH=. JAX_PLATFORMS=cpu python docs/research/issue16/loops_absolute_sweep.py [win]

Output of both runs: loops_absolute_sweep.txt (next to this file).
"""

import itertools
import sys

import jax
import jax.numpy as jnp

from kvq_jax.codecs._numerics import add_in_dtype, subtract_in_dtype
from kvq_jax.codecs.api import pack_kv, unpack_kv
from kvq_jax.core.window import Window
from kvq_jax.report import capture as cap
from kvq_jax.report.evaluate import (
    attention_sums,
    decode_attention_sums,
    reference_attention,
    stacks,
    unstack,
)
from kvq_jax.report.metrics import pool

c = cap.load_capture(None)
K, V, Q = stacks(c.k), stacks(c.v), stacks(c.q)
ref = reference_attention(Q, K, V)
W = c.num_windows


def enc(x, kind, fmt, win):
    p = pack_kv(x, kind=kind, format=fmt, group_size=64, window=win)
    return unpack_kv(p), p.storage_bytes


def chain(stack, kind, sched, win):
    # sched: list of (fmt, abs) per loop; loop 0 abs
    recons, nbytes = [], 0
    prev = None
    for loop, (fmt, ab) in enumerate(sched):
        x = stack[loop]
        if loop == 0 or ab:
            r, b = enc(x, kind, fmt, win)
        else:
            d = subtract_in_dtype(x, prev)
            if win is not None:
                # window rows raw (current loop), delta on middle rows
                rd, b = enc(d, kind, fmt, win)
                h, m, _ = win.split_sizes(x.shape[0])
                r = jnp.concatenate(
                    [x[:h], add_in_dtype(prev[h : h + m], rd[h : h + m]), x[h + m :]]
                )
            else:
                rd, b = enc(d, kind, fmt, None)
                r = add_in_dtype(prev, rd)
        recons.append(r)
        nbytes += b
        prev = r
    return jnp.stack(recons), nbytes


def run(ksched, vsched, win):
    kh, kb = jax.vmap(lambda s: chain(s, "key", ksched, win))(K)
    vh, vb = jax.vmap(lambda s: chain(s, "value", vsched, win))(V)
    kb = int(kb.sum())
    vb = int(vb.sum())
    ne = K.size
    bits = 8 * (kb + vb) / (2 * ne)
    e, r = attention_sums(Q, kh, vh, ref)
    s, rr = unstack(e, W), unstack(r, W)
    mean = float(pool(s, rr, axis=(0, 1)).mean())
    sink, rec = (win.sink, win.recent) if win else (0, 0)
    e, r = decode_attention_sums(Q, K, V, kh, vh, ref, sink=sink, recent=rec)
    dec = float(pool(unstack(e, W), unstack(r, W), axis=(0, 1)).mean())
    return bits, mean, dec


def fmt(s):
    return "/".join(f + ("a" if a and i else ("" if i == 0 else "d")) for i, (f, a) in enumerate(s))


def main(win):
    A = (True,) * 4
    D = (False,) * 4
    legacy_k, legacy_v = ["int2"] * 4, ["int4", "int4", "int2", "int2"]
    cands = [
        ("legacy delta", list(zip(legacy_k, D, strict=True)), list(zip(legacy_v, D, strict=True))),
        ("legacy abs", list(zip(legacy_k, A, strict=True)), list(zip(legacy_v, A, strict=True))),
        (
            "legacy Kdelta Vabs",
            list(zip(legacy_k, D, strict=True)),
            list(zip(legacy_v, A, strict=True)),
        ),
        (
            "legacy Kabs Vdelta",
            list(zip(legacy_k, A, strict=True)),
            list(zip(legacy_v, D, strict=True)),
        ),
    ]
    slots = [("k", i) for i in range(4)] + [("v", i) for i in range(4)]
    for a, b in itertools.combinations(slots, 2):  # every placement of the two INT4 slots
        kf, vf = ["int2"] * 4, ["int2"] * 4
        for kind, i in (a, b):
            (kf if kind == "k" else vf)[i] = "int4"
        tag = f"int4@{a[0]}{a[1]},{b[0]}{b[1]}"
        cands.append((f"abs {tag}", list(zip(kf, A, strict=True)), list(zip(vf, A, strict=True))))
        cands.append(
            (f"Kdelta {tag}", list(zip(kf, D, strict=True)), list(zip(vf, A, strict=True)))
        )
    for place in [(0, 1), (2, 3), (1, 3), (0, 3), (1, 2), (0, 2)]:  # K absolute, V per loop
        vf = ["int2"] * 4
        for i in place:
            vf[i] = "int4"
        for modes in itertools.product([True, False], repeat=3):
            cands.append((f"Kabs V int4@{place}", list(zip(["int2"] * 4, A, strict=True)),
                          list(zip(vf, (True, *modes), strict=True))))  # fmt: skip
    v2244 = list(zip(["int2", "int2", "int4", "int4"], A, strict=True))
    for modes in itertools.product([True, False], repeat=3):  # keys per loop, V 2/2/4/4 abs
        cands.append(("Kmix Vbest", list(zip(["int2"] * 4, (True, *modes), strict=True)), v2244))
    for name, ks, vs in cands:
        bits, mean, dec = run(ks, vs, win)
        print(
            f"{name:26s} K {fmt(ks):24s} V {fmt(vs):24s} bits {bits:.3f} "
            f"attn {100 * mean:5.2f} dec {100 * dec:5.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main(Window(sink=4, recent=16) if sys.argv[1:] == ["win"] else None)
