import sys

import jax
import numpy as np

sys.path[:0]=['/work/wt-kbits/docs/research/issue16','/tmp/research16']
import evalfast
import intb_eval as ie
import kvqlab

import kvq_jax

caps = {n: kvqlab.load(f"/tmp/research16/cap_{n}.npz") for n in ("smol_main", "smol_other")}
def vfn(G):
    def f(x, kind):
        p = kvq_jax.pack_kv(jax.numpy.asarray(x), kind=kind, format="int4", group_size=G)
        return np.asarray(kvq_jax.unpack_kv(p), np.float32), p.bits_per_element
    return f
for mb, gv in ((3.5, 32), (4.0, 64)):
    for name, src in (("smol_main","smol_other"),("smol_other","smol_main")):
        names = ie.register(ie.tables(caps[src], mean_bits=mb))
        r = evalfast.eval3(caps[name], ie.kvq_fn(lambda n: names[n]), vfn(gv))
        print(mb, gv, name, {k: round(v*100,3) if k in ("both","k","v") else round(v,3) for k,v in r.items()}, flush=True)
