"""bench/engine_accuracy.py with the values of heavy-row pages packed by error feedback along
the tokens (alpha per model layer: KVQ_ALPHAS, comma separated; empty: off). The shaped
rows are handed to the unchanged pack (cast to the cache dtype); run from the repository root:

    KVQ_ALPHAS=0.75,0.25,0,... python docs/research/issue24/engine_shaping.py --model smollm2 \
        --dtype bfloat16 --loops 1 --policies intb-prerope-hint4-heavy-smollm2+win \
        --windows 4 --prefix 256 --predictions 32 --text .../pydoc_data/topics.py"""
import os, sys
sys.path.insert(0, "bench")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax.numpy as jnp
from kvq_jax.kernels.page_pack import xla as px
from kvq_jax.codecs.formats import hadamard
from _common import feedback_rows
ALPHAS = [float(a) for a in os.environ.get("KVQ_ALPHAS", "").split(",") if a]
orig = px.pack_paged
def shaped(pages, alpha):  # [P, T, H, D] -> same dtype, the carry restarting on each page
    y = jnp.swapaxes(hadamard.rotate(pages.astype(jnp.float32)), 0, 1)  # [T, P, H, D]
    x, _ = feedback_rows(y, alpha, jnp.arange(y.shape[0]) == 0)
    return hadamard.unrotate(jnp.swapaxes(x, 0, 1)).astype(pages.dtype)
def patched(pages, *, kind, layer=None, rows=None, **kw):
    if ALPHAS and kind == "value" and rows is not None:
        alpha = jnp.asarray(ALPHAS, jnp.float32)[layer]
        pages = shaped(pages, alpha)
    return orig(pages, kind=kind, layer=layer, rows=rows, **kw)
px.pack_paged = patched
import engine_accuracy
engine_accuracy.main()
