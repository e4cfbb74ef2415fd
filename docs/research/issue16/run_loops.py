import sys

import numpy as np

exec(open("loops1.py").read().split("I = lambda")[0].split("for cn,c in caps4")[0])
R64=hadamard(64)
had = lambda ctx,H,kind: np.broadcast_to(R64,(H,64,64))
def qmean_self_perq(ctx,H):
    qq=ctx["q"][:ctx["q"].shape[0]-64]; return qq.mean(0)
def imp_self(ctx,H):  # q-importance from the same loop's prefill queries (before the evaluated ones)
    T=ctx["q"].shape[0]; return q_importance(ctx["q"],H,pre=True,tokens=slice(0,T-64))
def Kal(code, meta="f16"): return pre_rope(imp_alloc_key(imp_self, budget=code, meta=meta))
def Vh(bits, G=32): return headrot(lambda X,k: int_meta8(X,k,G,bits=bits), had)
def HV(fn, frac=0.02, keep="int8"): return heavy2(fn,"qmean_lse",frac=frac,keep=keep,qmean_fn=qmean_self_perq)
ours = lambda kc, vb, fr=0.02: (HV(Kal(kc),fr), HV(Vh(vb),fr))
I = lambda bits, G=64, **kw: (lambda X, kd: int_affine(X, kd, G, bits=bits, **kw))
S = {
 "FlashLoop legacy (K int2 x4, V int4/int4/int2/int2, deltas)": [(I(2), I(4), "delta"), (I(2), I(4), "delta"), (I(2), I(2), "delta"), (I(2), I(2), "delta")],
 "legacy bits, absolute every loop": [(I(2), I(4), "abs")] * 2 + [(I(2), I(2), "abs")] * 2,
 "kivi2 (all int2, deltas)": [(I(2), I(2), "delta")] * 4,
 "int4-g64 every loop, deltas (4.5 b)": [(I(4), I(4), "delta")] * 4,
 "int4-g64 every loop, absolute (4.5 b)": [(I(4), I(4), "abs")] * 4,
 "OURS-LOOP: K preRoPE q-alloc 1.75 / V had int3 m8g32, 2% int8 heavy, absolute": [(*ours(1.75,3),"abs")]*4,
 "same, K as deltas for loops 1-3": [(*ours(1.75,3),"kdelta")]*4,
 "same, no heavy rows": [(Kal(1.75), Vh(3), "abs")]*4,
 "K preRoPE q-alloc 2.0 / V int2 m8g32 had, 2% heavy (2.7 b)": [(*ours(2.0,2),"abs")]*4,
 "L0 BEST 4.5-b policy, L1-3 K alloc 1.875/V int2 (3.0 b)": [(*ours(3.8125,4),"abs")]+[(*ours(1.875,2),"abs")]*3,
}
import evalloops

# support K-delta / V-abs mode
_orig = evalloops.eval_loops
def eval_loops2(cap4, schedule):
    k, v, q = cap4[:3]
    W, L, N, T, H, D = k.shape
    errs = np.zeros((L, W, N, 3)); bits = np.zeros((L, 2))
    for w in range(W):
        for n in range(N):
            Rk = Rv = None
            for l in range(L):
                kfn, vfn, mode = schedule[l]
                K, V = k[w, l, n], v[w, l, n]
                kvqlab.CTX.update(w=w, n=n, q=q[w, l, n], K=K, V=V, loop=l)
                Kq, Vq = K.copy(), V.copy()
                kd = mode in ("delta", "kdelta") and Rk is not None
                vd = mode == "delta" and Rv is not None
                if kd:
                    dK, bk = kfn((K[SINK:] - Rk[SINK:]).astype(F32), "key"); Kq[SINK:] = Rk[SINK:] + dK
                else:
                    Kq[SINK:], bk = kfn(K[SINK:], "key")
                if vd:
                    dV, bv = vfn((V[SINK:] - Rv[SINK:]).astype(F32), "value"); Vq[SINK:] = Rv[SINK:] + dV
                else:
                    Vq[SINK:], bv = vfn(V[SINK:], "value")
                Rk, Rv = Kq, Vq
                errs[l, w, n] = evalloops.block_err(q[w, l, n], K, Kq, V, Vq, T)
                bits[l] = (bk, bv)
    pl = errs.mean((1, 2))
    return dict(per_loop=pl.tolist(), mean=pl.mean(0).tolist(), bits=bits.tolist(), avg_bits=float(bits.mean()))
print("| schedule | avg bits | per-loop bits (K,V) | " + " | ".join(f"{c} mean both (K / V) ; per-loop both" for c in caps4) + " |")
for name in (sys.argv[1:] or S):
    out=[]
    for cn,c in caps4.items():
        r=eval_loops2(c,S[name]); out.append(f"{cn}: mean {100*r['mean'][0]:.2f} (K {100*r['mean'][1]:.2f} V {100*r['mean'][2]:.2f}) per-loop " + "/".join(f"{100*x[0]:.2f}" for x in r['per_loop']))
    print(f"| {name} | {r['avg_bits']:.3f} | {np.round(r['bits'],3).tolist()} |", " | ".join(out), "|", flush=True)
