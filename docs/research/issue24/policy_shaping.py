"""The served best policy with values packed by error feedback along the tokens (noise
shaping; the same HINT4 bytes format, another encoder; one alpha for every layer): the
decode-like error of each report layer.

    python policy_shaping.py topics.npz pr3.75.npz out.json 0,0.25,0.5,0.75,1"""
import sys, json
import numpy as np
import jax, jax.numpy as jnp
from kvq_jax.core.policies import POLICIES
from kvq_jax.core.calibration import with_key_tables
from kvq_jax.report import capture as cap, evaluate as ev
from kvq_jax.codecs.formats import hadamard
from _common import LAYERS, PAGE, feedback_rows
CAPTURE, TABLES, OUT = sys.argv[1:4]
ALPHAS = [float(a) for a in sys.argv[4].split(",")]
orig = ev.heavy_kv
ALPHA = [0.0]

def shaped(values, alpha, start):
    """values [T, H, D] -> rows whose HINT4 codes are those of error feedback with `alpha`
    along the tokens (carry reset at each page, pages at positions start + 64 n)."""
    y = hadamard.rotate(values.astype(jnp.float32))
    x, _ = feedback_rows(y, alpha, (start + jnp.arange(y.shape[0])) % PAGE == 0)
    return hadamard.unrotate(x).astype(values.dtype)

def patched(keys, values, table, *, window=None, **kw):
    if ALPHA[0]:
        h, m, _ = window.split_sizes(keys.shape[0])
        values = values.at[h:h + m].set(shaped(values[h:h + m], ALPHA[0], h))
    return orig(keys, values, table, window=window, **kw)
ev.heavy_kv = patched
c = cap.select(cap.load_capture(CAPTURE), layers=LAYERS)
p = with_key_tables(POLICIES["intb-prerope-hint4-heavy-smollm2+win"], TABLES)
res = {}
for a in ALPHAS:
    ALPHA[0] = a
    jax.clear_caches()
    (r,) = ev.evaluate(c, [p], show_progress=False)
    lh = np.array(r.attention_decode_layer_head)
    res[a] = dict(layer=lh.mean(1).tolist(), dec=r.attention_decode_mean, verr=r.v_rel_l2)
    print(a, f"dec {100*r.attention_decode_mean:.3f}% Verr {100*r.v_rel_l2:.2f}%", np.round(100 * lh.mean(1), 3), flush=True)
json.dump(res, open(OUT, "w"))
