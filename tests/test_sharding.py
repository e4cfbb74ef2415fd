"""Sharding over KV heads: the codecs run per head on a 4-device CPU mesh.

The checks run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4 (the
rest of the suite keeps one device). Inputs [T, H, D] (H = 8) are sharded
P(None, "heads", None) and pages [P, page_size, H, D] P(None, None, "heads", None). For
`pack_kv`, `unpack_kv`, `encode_loops` / `decode_loops` and `pack_paged` / `unpack_paged`:
  * every per-head output (codes and metadata) stays sharded over its H axis,
  * the bytes equal the unsharded run,
  * the compiled HLO holds no collective (all-reduce, all-gather, all-to-all,
    collective-permute, reduce-scatter) for INT4 and FP8 E4M3, whose groups live in one head.
NVFP4 is the exception, by format: its global scale is a max of |x| over the whole tensor (per
page for paged caches) and its finite check a max of the magnitude bits over the whole
tensor (an unsigned integer: >= the exponent-all-ones pattern unless every element is finite),
both across heads. Its packing HLO must hold exactly those two all-reduces (one float32 max,
one uint32 max, each of the global-scale shape: [] per tensor, [P] per page) and nothing else;
its global_scale is replicated. Unpacking is collective-free
for every format.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

DEVICES = 4

COMMON = r"""
import functools, json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import kvq_jax
from helpers import assert_same_bytes, assert_trees_same_bytes

assert jax.device_count() == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("heads",))
COLLECTIVE = re.compile(
    r"=\s*(\([^)]*\)|\S+)\s+(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
    r"(?:-start)?\(.*?op_name=\"[^\"]*?(\w+)\""
)
ANY_COLLECTIVE = re.compile(
    r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(-start)?\("
)


def collectives(f, *args):
    hlo = f.lower(*args).compile().as_text()
    # (result shape without layout, collective, reducer op_name)
    found = [(re.sub(r"\{[^}]*\}", "", m[1]), m[2], m[3]) for m in COLLECTIVE.finditer(hlo)]
    assert len(found) == len(ANY_COLLECTIVE.findall(hlo)), hlo  # every one parsed
    return sorted(found)


def head_sharded(a, head_axis, what):
    spec = tuple(a.sharding.spec) + (None,) * (a.ndim - len(a.sharding.spec))
    expected = tuple("heads" if i == head_axis else None for i in range(a.ndim))
    assert spec == expected, f"{what}: {a.sharding.spec}, expected {expected}"


def check_packed(packed, head_axis, what):
    for name, a in packed.arrays.items():
        if name == "global_scale":  # one per tensor / page: replicated, no head axis
            assert a.sharding.is_fully_replicated, f"{what}.{name}: {a.sharding}"
        else:
            head_sharded(a, head_axis, f"{what}.{name}")


def expected(fmt, shape):
    if fmt != "nvfp4":
        return []
    return [
        (f"f32{shape}", "all-reduce", "reduce_max"),  # the global scale: max |x|
        (f"u32{shape}", "all-reduce", "reduce_max"),  # all finite: max of magnitude bits
    ]

"""

SCRIPT = (
    COMMON
    + r"""
rng = np.random.default_rng(0)
x = rng.standard_normal((32, 8, 64)).astype(np.float32)
loops = rng.standard_normal((3, 32, 8, 64)).astype(np.float32)
pages = rng.standard_normal((3, 16, 8, 64)).astype(np.float32)
pages *= np.float32([1, 100, 0]).reshape(3, 1, 1, 1)  # per-page global scales differ
shard3 = NamedSharding(mesh, P(None, "heads", None))
shard4 = NamedSharding(mesh, P(None, None, "heads", None))
xs = jax.device_put(x, shard3)
loops_s, pages_s = jax.device_put(loops, shard4), jax.device_put(pages, shard4)
report = {}
for fmt in ("int4", "nvfp4", "fp8_e4m3"):
    for kind in ("key", "value"):
        tag = f"{fmt}/{kind}"
        # pack_kv / unpack_kv
        pack = jax.jit(functools.partial(kvq_jax.pack_kv, kind=kind, format=fmt))
        packed = pack(xs)
        check_packed(packed, 1, tag)
        assert_trees_same_bytes(packed, kvq_jax.pack_kv(jnp.asarray(x), kind=kind, format=fmt), tag)
        found = collectives(pack, xs)
        assert sorted(found) == sorted(expected(fmt, "[]")), (tag, found)
        report[f"pack_kv {tag}"] = found
        unpack = jax.jit(kvq_jax.unpack_kv)
        out = unpack(packed)
        head_sharded(out, 1, f"unpack {tag}")
        ref = kvq_jax.pack_kv(jnp.asarray(x), kind=kind, format=fmt)
        assert_same_bytes(out, kvq_jax.unpack_kv(ref))
        assert collectives(unpack, packed) == [], tag
        # encode_loops / decode_loops (dense)
        enc = jax.jit(functools.partial(kvq_jax.encode_loops, kind=kind, base_format=fmt))
        code = enc(loops_s)
        check_packed(code.base, 1, f"loops base {tag}")
        for r in code.residuals:
            check_packed(r.payload, 1, f"loops residual {tag}")
        ref = kvq_jax.encode_loops(jnp.asarray(loops), kind=kind, base_format=fmt)
        assert_trees_same_bytes(code, ref, f"loops {tag}")
        found = collectives(enc, loops_s)
        n = len(code.residuals) + 1
        if fmt == "nvfp4":  # a float and an integer max per packed loop (maybe batched)
            kinds = {(t[:3], f[2]) for f in found for t in f[0].strip("()").split(", ")}
            assert kinds == {("f32", "reduce_max"), ("u32", "reduce_max")}, (tag, found)
            assert all(f[1] == "all-reduce" for f in found) and len(found) <= 2 * n, found
        else:
            assert found == [], (tag, found)
        report[f"encode_loops {tag}"] = found
        dec = jax.jit(kvq_jax.decode_loops)
        recon = dec(code)
        head_sharded(recon, 2, f"decode_loops {tag}")
        assert_same_bytes(recon, kvq_jax.decode_loops(ref))
        assert collectives(dec, code) == [], tag
        # pack_paged / unpack_paged
        ppack = jax.jit(functools.partial(kvq_jax.pack_paged, kind=kind, format=fmt))
        ppacked = ppack(pages_s)
        check_packed(ppacked, 2, f"paged {tag}")
        pref = kvq_jax.pack_paged(jnp.asarray(pages), kind=kind, format=fmt)
        assert_trees_same_bytes(ppacked, pref, f"paged {tag}")
        found = collectives(ppack, pages_s)
        assert sorted(found) == sorted(expected(fmt, "[3]")), (tag, found)
        report[f"pack_paged {tag}"] = found
        punpack = jax.jit(kvq_jax.unpack_paged)
        pout = punpack(ppacked)
        head_sharded(pout, 2, f"unpack_paged {tag}")
        assert_same_bytes(pout, kvq_jax.unpack_paged(pref))
        assert collectives(punpack, ppacked) == [], tag
print("REPORT " + json.dumps(report))
"""
)


PAGED_SCRIPT = (
    COMMON
    + r"""
import dataclasses
from kvq_jax.cache.paged_attention import paged_decode_attention
from kvq_jax.cache.paged_cache import PagedCacheConfig, append, init_cache

B, H, HQ, D, PS = 2, 8, 16, 64, 16
rng = np.random.default_rng(1)
tables = np.array([[5, 0, 3], [1, 6, 2]], np.int32)  # non-contiguous physical pages
ids = np.arange(B, dtype=np.int32)
prompt = rng.standard_normal((2, 2, B, 20, H, D)).astype(np.float32)  # [loop, k/v, B, n, H, D]
prompt[:, :, 1] *= 50  # per-page global scales differ
token = rng.standard_normal((2, 2, B, 1, H, D)).astype(np.float32)
q = rng.standard_normal((B, HQ, D)).astype(np.float32)
lens = np.array([21, 17], np.int32)
rep = NamedSharding(mesh, P())


def leaf_sharding(a, batch):
    # A PackedKV array with `batch` leading axes: the global scale (rank == batch) is
    # replicated, every other array has its head axis right after the page's first axis.
    if a.ndim == batch:
        return rep
    return NamedSharding(mesh, P(*([None] * (batch + 1)), "heads"))


def cache_shardings(cache):
    nl = NamedSharding(mesh, P(None, None, None, "heads"))  # staging / sink [L, S, n, H, D]
    return dataclasses.replace(
        cache,
        k_base=jax.tree.map(lambda a: leaf_sharding(a, 1), cache.k_base),
        v_base=jax.tree.map(lambda a: leaf_sharding(a, 1), cache.v_base),
        k_delta=jax.tree.map(lambda a: leaf_sharding(a, 2), cache.k_delta),
        v_delta=jax.tree.map(lambda a: leaf_sharding(a, 2), cache.v_delta),
        k_stage=nl, v_stage=nl, k_sink=nl, v_sink=nl, seq_lens=rep,
    )


def check_cache(cache, what):
    want = cache_shardings(cache)
    for (path, a), s in zip(jax.tree_util.tree_leaves_with_path(cache), jax.tree.leaves(want)):
        if s is rep:
            assert a.sharding.is_fully_replicated, (what, path, a.sharding)
        else:
            head_sharded(a, list(s.spec).index("heads"), f"{what}{jax.tree_util.keystr(path)}")


def flat(found):
    # XLA may combine all-reduces into one over a tuple "(f32[4], f32[4])": one entry each.
    return sorted((s, c, r) for shape, c, r in found for s in shape.strip("()").split(", "))


report = {}
for fmt in ("int4", "nvfp4"):
    config = PagedCacheConfig(
        num_pages=8, page_size=PS, num_heads=H, head_dim=D, num_loops=2, sink=2, max_seqs=B,
        k_base_format=fmt, k_residual_format=fmt, v_base_format=fmt, v_residual_format=fmt,
    )
    empty = init_cache(config)
    cache_s = jax.device_put(empty, cache_shardings(empty))
    cache_u = empty
    kv_s = NamedSharding(mesh, P(None, None, "heads", None))
    for step, data in (("prefill", prompt), ("decode", token)):
        n = data.shape[3]
        for loop in (0, 1):
            tag = f"append {fmt} {step} loop {loop}"
            f = jax.jit(
                lambda c, k, v, bt, i, loop=loop: append(
                    c, k, v, block_tables=bt, seq_ids=i, loop=loop
                )
            )
            k, v = data[loop]
            args_s = (cache_s, jax.device_put(k, kv_s), jax.device_put(v, kv_s), tables, ids)
            cache_s = f(*args_s)
            cache_u = f(cache_u, k, v, tables, ids)
            check_cache(cache_s, tag)
            assert_trees_same_bytes(cache_s, cache_u, tag)
            found = flat(collectives(f, *args_s))
            # NVFP4: for K and for V, one float32 max and one uint32 max over the pages this
            # call may complete (B x ceil(n / PS)); for loop 1 nothing more (decoding loop 0's
            # pages is collective-free).
            pages = B * -(-n // PS)
            want = sorted(2 * expected(fmt, f"[{pages}]"))
            assert found == want, (tag, found)
            report[tag] = found
    qs = jax.device_put(q, NamedSharding(mesh, P(None, "heads", None)))
    for loop in (0, 1):
        tag = f"paged_decode_attention {fmt} loop {loop}"
        g = jax.jit(lambda q, c, bt, sl, loop=loop: paged_decode_attention(q, c, bt, sl, loop=loop))
        out = g(qs, cache_s, tables, lens)
        head_sharded(out, 1, tag)
        # float32 round-off: the blockwise online softmax may fuse differently when sharded
        np.testing.assert_allclose(out, g(q, cache_u, tables, lens), rtol=1e-6, atol=1e-6)
        found = collectives(g, qs, cache_s, tables, lens)
        assert found == [], (tag, found)
        report[tag] = found
print("REPORT " + json.dumps(report))
"""
)


def _run(script: str) -> dict:
    """Run `script` on 4 virtual CPU devices; return its REPORT line's JSON."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (tests_dir, os.path.dirname(tests_dir), env.get("PYTHONPATH")) if p
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-10000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("REPORT "))
    return json.loads(line.removeprefix("REPORT "))


def test_head_sharding_is_collective_free_except_nvfp4_global_scale():
    report = _run(SCRIPT)
    for name, found in report.items():
        if "nvfp4" in name:  # the format's own cross-head reductions, and nothing else
            assert found and all(f[1] == "all-reduce" for f in found), (name, found)
        else:
            assert found == [], (name, found)


@pytest.mark.slow  # 85 s on 2 cores
def test_paged_cache_append_and_attention_are_head_sharded():
    """`append` (prefill and decode, loops 0 and 1) and `paged_decode_attention` with every
    page / staging / sink array of the cache sharded over its head axis: outputs stay sharded,
    cache bytes equal the unsharded run (attention to float32 round-off), and the only
    collectives are NVFP4's per-page global-scale all-reduces (asserted exactly in the
    subprocess)."""
    report = _run(PAGED_SCRIPT)
    assert len(report) == 2 * (4 + 2), sorted(report)
    for name, found in report.items():
        if "nvfp4" in name and name.startswith("append"):
            assert found and all(f[1] == "all-reduce" for f in found), (name, found)
        else:
            assert found == [], (name, found)


ENGINE_SCRIPT = r"""
import json
import jax, numpy as np
from jax.sharding import Mesh
from kvq_jax.engine import Engine
from tiny_models import tiny_model

assert jax.device_count() == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("heads",))
found = {}
prompts = [np.random.default_rng(s).integers(0, 97, n).tolist() for s, n in ((1, 24), (2, 8))]
for arch, loops, policies in (("llama", 1, ("bf16", "int4-g16+win")), ("ouro", 2, ("nvfp4",))):
    model = tiny_model(arch, seed=5, heads=8, kv_heads=4, head_dim=32, loops=loops)
    for policy in policies:
        runs = {}
        for name, kw in (("unsharded", {}), ("sharded", {"mesh": mesh})):
            engine = Engine(model, policy, num_pages=16, page_size=16, max_seqs=2,
                            max_pages_per_seq=4, prefill_chunk=8, **kw)
            reqs = engine.generate(prompts, max_new_tokens=5, stop_ids=[], keep_logits=True)
            leaves = jax.tree.leaves(engine.stores)
            specs = sorted({str(a.sharding.spec) for a in leaves if hasattr(a.sharding, "spec")})
            runs[name] = ([r.tokens for r in reqs], [np.stack(r.logits) for r in reqs], specs)
        (tu, lu, _), (ts, ls, specs) = runs["unsharded"], runs["sharded"]
        diff = max(float(np.abs(a - b).max()) for a, b in zip(lu, ls))
        found[f"{arch}/{policy}"] = dict(same_tokens=tu == ts, logit_diff=diff, specs=specs)
try:
    Engine(tiny_model("llama", kv_heads=2), "int4-g16", num_pages=4, page_size=16, max_seqs=1,
           max_pages_per_seq=4, mesh=mesh)
    found["bad_mesh"] = "accepted"
except ValueError as e:
    found["bad_mesh"] = str(e)
print("REPORT " + json.dumps(found))
"""


@pytest.mark.slow  # 110 s on 2 cores
def test_engine_sharded_over_kv_heads_gives_the_same_tokens():
    """The engine with every cache split over 4 devices along its KV heads (parameters
    replicated) produces the unsharded engine's tokens (greedy, two sequences, Llama and a
    2-loop Ouro; raw, INT4 with sink rows and NVFP4 caches); the caches stay head-sharded; a mesh
    axis that does not divide the KV heads is refused, naming the mesh."""
    found = _run(ENGINE_SCRIPT)
    bad = found.pop("bad_mesh")
    assert bad.startswith("mesh: axis 'heads' of size 4 must divide the 2 KV heads"), bad
    for key, r in found.items():
        assert r["same_tokens"], key
        assert r["logit_diff"] < 1e-4, (key, r["logit_diff"])  # float32, reduction order only
        assert any("'heads'" in s for s in r["specs"]), (key, r["specs"])
