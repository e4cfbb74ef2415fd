"""bench/engine_accuracy.py with the values of heavy-row pages packed by error feedback along
the tokens (alpha per model layer: KVQ_ALPHAS, comma separated; empty: off). The shaped
rows are handed to the unchanged pack (cast to the cache dtype); run from the repository root:

    KVQ_ALPHAS=0.75,0.25,0,... python docs/research/issue24/engine_shaping.py --model smollm2 \
        --dtype bfloat16 --loops 1 --policies intb-prerope-hint4-heavy-smollm2+win \
        --windows 4 --prefix 256 --predictions 32 --text .../pydoc_data/topics.py"""
import os, sys
sys.path.insert(0, "bench")
import jax, jax.numpy as jnp
from jax import lax
from kvq_jax.kernels.page_pack import xla as px
from kvq_jax.codecs.formats import hadamard
ALPHAS = [float(a) for a in os.environ.get("KVQ_ALPHAS", "").split(",") if a]
orig = px.pack_paged
def shaped(pages, alpha):  # [P, T, H, D] -> same dtype
    y = hadamard.rotate(pages.astype(jnp.float32))
    def step(carry, yt):
        x = yt + alpha * carry
        mn, mx = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
        sc = jnp.where(mx > mn, (mx - mn) / 15, 1.0)
        q = jnp.clip(jnp.round((x - mn) / sc), 0, 15) * sc + mn
        return jnp.where(jnp.isfinite(x - q), x - q, 0.0), x
    _, xs = lax.scan(step, jnp.zeros_like(y[:, 0]), jnp.swapaxes(y, 0, 1))
    return hadamard.unrotate(jnp.swapaxes(xs, 0, 1)).astype(pages.dtype)
def patched(pages, *, kind, layer=None, rows=None, **kw):
    if ALPHAS and kind == "value" and rows is not None:
        alpha = jnp.asarray(ALPHAS, jnp.float32)[layer]
        pages = shaped(pages, alpha)
    return orig(pages, kind=kind, layer=layer, rows=rows, **kw)
px.pack_paged = patched
import engine_accuracy
engine_accuracy.main()
