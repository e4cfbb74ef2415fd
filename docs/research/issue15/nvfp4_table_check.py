"""NVFP4 decode by 16-entry table (library, CPU) vs the arithmetic decode, in the chains that
use the codec's unpack: `decode_loop` (residual stacks) and `decode_pages` (XLA path).

    PYTHONPATH=. JAX_PLATFORMS=cpu python docs/research/issue15/nvfp4_table_check.py

The arithmetic variant is the previous library code, restored by patching the name the codec
looks up at trace time; each variant is jitted fresh. Prints ms (min of N) and bit equality.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "bench"))
import page_reconstruct as pr
import residual_speed as rs

import kvq_jax
from kvq_jax.codecs import _numerics as nm
from kvq_jax.codecs.formats import nvfp4
from kvq_jax.kernel_checks.arg_specs import page_reconstruct as arg_specs
from kvq_jax.kernels.page_reconstruct import decode_pages

N = 7


def tmin(f, *a):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(N):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return 1e3 * min(ts)


def variants(make, args):
    out = {}
    for name, dec in (("arith", nm.e2m1_decode), ("table", nm.e2m1_decode_xla)):
        nvfp4.e2m1_decode_xla = dec
        jax.clear_caches()  # unpack_kv is itself jitted: its trace would be reused
        try:
            f = make()
            out[name] = (tmin(f, *args), np.asarray(f(*args)))
        finally:
            nvfp4.e2m1_decode_xla = nm.e2m1_decode_xla
            jax.clear_caches()
    same = np.array_equal(out["arith"][1].view(np.uint16), out["table"][1].view(np.uint16))
    return out["arith"][0], out["table"][0], same


def main():
    loops = rs.loop_stack()
    print("decode_loop, bf16 [4, 2048, 16, 128] stack; ms arith -> table, same bits")
    for base, res in (("nvfp4", "nvfp4"), ("int4", "nvfp4"), ("nvfp4", "int4")):
        for kind in ("key", "value"):
            code = kvq_jax.encode_loops(loops, kind=kind, base_format=base, residual_format=res)
            print(f"  base {code.base.format} axis {code.base.axis} G {code.base.group_size}")
            for loop in (0, 3):
                a, t, s = variants(
                    lambda loop=loop: jax.jit(functools.partial(kvq_jax.decode_loop, loop=loop)),
                    (code,),
                )
                print(f"  {base}+{res} {kind} loop {loop}: {a:8.2f} -> {t:8.2f}  {s}")
    print("decode_pages (XLA), B 2 x 1024 tokens, K and V; ms arith -> table, same bits")
    for spec in arg_specs.BENCH_SPECS:
        if spec.page_size != 16 or "nvfp4" not in (
            spec.k_base_format,
            spec.k_residual_format,
            spec.v_base_format,
            spec.v_residual_format,
        ):
            continue
        spec = dataclasses.replace(spec, num_pages=2 * 1024 // spec.page_size)
        cache = pr.random_cache(spec)
        pages = jnp.asarray(np.random.default_rng(0).permutation(spec.num_pages).astype(np.int32))

        def make(spec=spec):
            return jax.jit(
                lambda c, p: jnp.stack(
                    [decode_pages(c, k, p, loop=spec.loop, backend="xla") for k in arg_specs.KINDS]
                )
            )

        a, t, s = variants(make, (cache, pages))
        print(
            f"  {spec.k_base_format}+{spec.k_residual_format} page {spec.page_size} "
            f"loop {spec.loop}: {a:8.2f} -> {t:8.2f}  {s}"
        )


if __name__ == "__main__":
    main()
