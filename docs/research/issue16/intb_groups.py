"""K INTB at 4.5 bits/element with different token group sizes (mean bits + 32/G = 4.5),
values HINT4 G64; tables calibrated on the other SmolLM2 capture."""
import json
import sys

sys.path[:0] = ["/tmp/research16", "/work/main"]
import evalfast
import jax
import kvqlab
import numpy as np
from intb_eval import register

import kvq_jax
from kvq_jax.core.calibration import intb_bit_table

F32 = np.float32

def fn(names, g):
    def f(x, kind):
        fmt, gs = (names[kvqlab.CTX["n"]], g) if kind == "key" else ("hint4", 64)
        p = kvq_jax.pack_kv(jax.numpy.asarray(x), kind=kind, format=fmt, group_size=gs)
        return np.asarray(kvq_jax.unpack_kv(p), F32), p.bits_per_element
    return f

caps = {n: kvqlab.load(f"/tmp/research16/cap_{n}.npz") for n in ("smol_main", "smol_other")}
for name, src in (("smol_main", "smol_other"), ("smol_other", "smol_main")):
    k, _, q = caps[src][:3]
    for mb, g in ((4.0, 64), (3.5, 32), (4.25, 128), (4.375, 256)):
        names = register([intb_bit_table(k[:, n], q[:, n], mean_bits=mb, group_size=g) for n in range(k.shape[1])])
        r = evalfast.eval3(caps[name], fn(names, g), fn(names, g))
        print(name, f"K intb {mb} G{g} / V hint4", json.dumps({a: round(b, 5) for a, b in r.items()}), flush=True)
