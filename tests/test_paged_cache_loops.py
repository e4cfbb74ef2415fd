"""Per-loop formats and absolute loops in the paged cache (issue 24): FlashLoop's profile and
the `loops-abs-*` policies at 4 loops.

Every expectation is built page by page from the public codec functions (`pack_kv`,
`encode_residual(absolute=...)`, `decode_residual`) with each loop's format written out by hand
below, not from the cache's own plane bookkeeping: the stored bytes of every loop, what
`gather` and decode attention read, the Torch cache's bytes after the same appends, a swap
through host memory and disk, adaptive exits across an absolute loop; the read-side kernels
take these chains (page reconstruction declines rotated ones with the reason).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_same_bytes, assert_same_values, rotated_space_atol

import kvq_jax
from kvq_jax.cache.paged import resolve_paged
from kvq_jax.cache.paged_attention import dense_decode_attention, paged_decode_attention
from kvq_jax.cache.paged_cache import (
    PagedCacheConfig,
    append,
    decode_pages,
    gather,
    init_cache,
    swap_in,
    swap_out,
)
from kvq_jax.codecs.cache_state import codec_view
from kvq_jax.core.offload import load_sequence, save_sequence
from kvq_jax.kernels.page_reconstruct import config_support
from kvq_jax.kernels.paged_attention import config_support as attention_support

H, D, T, L, S = 2, 16, 21, 4, 2
PS = 8

#: name -> (config keywords, K formats per loop, V formats per loop, K absolute, V absolute)
CASES = {
    # FlashLoop legacy: keys INT2 every loop, values INT4 / INT4 / INT2 / INT2 (deltas).
    "legacy": (
        dict(
            k_base_format="int2",
            k_residual_format="int2",
            v_base_format="int4",
            v_residual_format=("int4", "int2", "int2"),
        ),
        ("int2",) * 4,
        ("int4", "int4", "int2", "int2"),
        (),
        (),
    ),
    # loops-abs-v2442: keys INT2 absolute in every loop, values 2/4/4/2 bits, 1-2 absolute.
    "abs-v2442": (
        dict(
            k_base_format="int2",
            k_residual_format="int2",
            v_base_format="int2",
            v_residual_format=("int4", "int4", "int2"),
            k_absolute=(1, 2, 3),
            v_absolute=(2, 1),
        ),
        ("int2",) * 4,
        ("int2", "int4", "int4", "int2"),
        (1, 2, 3),
        (1, 2),
    ),
    # Rotated values (loops-abs-v2442-h) and FP8 key deltas after an absolute loop 2.
    "abs-hint-fp8": (
        dict(
            k_base_format="int4",
            k_residual_format=("fp8_e4m3", "int4", "fp8_e4m3"),
            v_base_format="hint2",
            v_residual_format=("hint4", "hint4", "hint2"),
            k_absolute=(2,),
            v_absolute=(1, 2),
        ),
        ("int4", "fp8_e4m3", "int4", "fp8_e4m3"),
        ("hint2", "hint4", "hint4", "hint2"),
        (2,),
        (1, 2),
    ),
}


def make_config(name: str, **extra) -> PagedCacheConfig:
    pages_per_seq = -(-T // PS) + 1
    return PagedCacheConfig(
        num_pages=S * pages_per_seq + 1, page_size=PS, num_heads=H, head_dim=D, num_loops=L,
        max_seqs=S, sink=1, dtype=ml_dtypes.bfloat16, **CASES[name][0], **extra,
    )  # fmt: skip


def make_tables(config) -> np.ndarray:
    per_seq = (config.num_pages - 1) // S
    ids = 1 + np.arange(S * per_seq)[::-1]
    return ids.reshape(per_seq, S).T.astype(np.int32).copy()


def make_kv(seed: int = 0):
    """K, V [L, S, T, H, D] bfloat16, each loop a perturbation of the previous."""
    rng = np.random.default_rng(seed)
    steps = (
        rng.standard_normal((2, L, S, T, H, D))
        * np.array([1.0, 0.3, 0.3, 0.3])[None, :, None, None, None, None]
    )
    k, v = np.cumsum(steps, axis=1).astype(ml_dtypes.bfloat16)
    return k, 3 * v


def fill(config, k, v, chunks, exited=None):
    cache, tables = init_cache(config), jnp.asarray(make_tables(config))
    ids = jnp.arange(S, dtype=jnp.int32)
    start = 0
    for n in chunks:
        for loop in range(L):
            kw = dict(block_tables=tables, seq_ids=ids, loop=loop)
            if exited is not None and loop:
                kw["exited"] = exited[loop, :, start : start + n]
            kk, vv = k[loop, :, start : start + n], v[loop, :, start : start + n]
            cache = append(cache, kk, vv, **kw)
        start += n
    return cache


@functools.cache
def filled(name: str, mode: str = "prefill"):
    config = make_config(name)
    k, v = make_kv()
    chunks = {"prefill": [T], "decode": [1] * T, "chunked": [5, 3, 8, 5]}[mode]
    return config, k, v, fill(config, k, v, chunks)


def spec(kind, fmt, base_fmt):
    """pack_kv arguments of one loop: the page-local group rule of `resolve_paged`."""
    del base_fmt  # no group size is given: every format takes its paged default
    axis, group = resolve_paged(fmt, kind, (PS, H, D), None, None)
    return dict(kind=kind, format=fmt, axis=axis, group_size=group)


def page_chain(kind, formats, absolute, pages):
    """One page stack [L, PS, H, D] -> (payload PackedKV, reconstruction) per loop, from the
    public codec functions."""
    out = []
    packed = kvq_jax.pack_kv(pages[0], **spec(kind, formats[0], formats[0]))
    recon = kvq_jax.unpack_kv(packed)
    out.append((packed, recon))
    for loop in range(1, L):
        args = spec(kind, formats[loop], formats[0])
        res = kvq_jax.encode_residual(pages[loop], recon, **args, absolute=loop in absolute)
        recon = kvq_jax.decode_residual(res, recon)
        out.append((res.payload, recon))
    return out


def runs(formats):
    """Later loops grouped by consecutive equal formats, written independently of the cache."""
    groups = []
    for loop in range(1, L):
        if groups and formats[groups[-1][0]] == formats[loop]:
            groups[-1].append(loop)
        else:
            groups.append([loop])
    return groups


def stored(cache, kind, loop, formats, phys):
    """Pages `phys` of loop `loop` as stored: the base, or the run plane that holds the loop
    (a tuple of runs when the later loops' formats differ)."""
    prefix = "k" if kind == "key" else "v"
    if loop == 0:
        plane = getattr(cache, f"{prefix}_base")
        return codec_view(jax.tree.map(lambda a: a[phys], plane))
    groups = runs(formats)
    delta = getattr(cache, f"{prefix}_delta")
    for r, group in enumerate(groups):
        if loop in group:
            plane = delta if len(groups) == 1 else delta[r]
            level = group.index(loop)
            return codec_view(jax.tree.map(lambda a, r=level: a[r, phys], plane))
    raise AssertionError(loop)


@pytest.mark.parametrize("name", CASES)
def test_pages_equal_the_codec_chain(name):
    """Every complete page of every loop holds the public chain's payload bytes (loop 0
    packed, a delta loop the delta against the reconstructed previous loop, an absolute loop
    the page itself in that loop's format); gather reads the chain's reconstruction."""
    config, k, v, cache = filled(name)
    _, k_formats, v_formats, k_abs, v_abs = CASES[name]
    full = T // PS
    tables = make_tables(config)
    for kind, x, formats, absolute in (("key", k, k_formats, k_abs),
                                       ("value", v, v_formats, v_abs)):  # fmt: skip
        for s in range(S):
            phys = tables[s, :full]
            for j in range(full):
                chain = page_chain(kind, formats, absolute, x[:, s, j * PS : (j + 1) * PS])
                for loop, (payload, _) in enumerate(chain):
                    got = stored(cache, kind, loop, formats, phys[j])
                    assert got.format == formats[loop]
                    for field, a in payload.arrays.items():
                        assert_same_bytes(got.arrays[field], a, f"{kind} loop {loop} {field}")
    for loop in range(L):
        for s in range(S):
            got_k, got_v = gather(cache, seq_id=s, seq_len=T, block_table=tables[s], loop=loop)
            reads = ((got_k, k, k_formats, k_abs, "key"), (got_v, v, v_formats, v_abs, "value"))
            for got, x, formats, absolute, kind in reads:
                want = np.array(x[loop, s])
                for j in range(full):
                    chain = page_chain(kind, formats, absolute, x[:, s, j * PS : (j + 1) * PS])
                    want[j * PS : (j + 1) * PS] = np.asarray(chain[loop][1])
                want[: config.sink] = x[loop, s, : config.sink]
                assert_same_values(got, want, f"{name} {kind} loop {loop} seq {s}")


@pytest.mark.parametrize("name", CASES)
def test_append_order_and_torch_bytes(name):
    """Token-by-token appends leave the prefill's bytes; the Torch cache after the same
    appends (two chunks) holds the same bytes in every array."""
    torch = pytest.importorskip("torch")
    from kvq_torch_bridge.cache import paged_cache as tpc

    config, k, v, expected = filled(name)
    _, _, _, decoded = filled(name, "decode")
    jax.tree.map(lambda a, b: assert_same_bytes(a, b, "decode vs prefill"), decoded, expected)
    cache = tpc.init_cache(config)
    tables = torch.from_numpy(make_tables(config))
    ids = torch.arange(S, dtype=torch.int32)

    def bf16(x):
        return torch.from_numpy(np.ascontiguousarray(x).view(np.uint16)).view(torch.bfloat16)

    for start, n in ((0, 13), (13, T - 13)):
        for loop in range(L):
            kk, vv = (bf16(x[loop, :, start : start + n]) for x in (k, v))
            tpc.append(cache, kk, vv, block_tables=tables, seq_ids=ids, loop=loop)
    want = {n: a for n, _, a in expected.page_arrays()}
    got = {n: a for n, _, a in cache.page_arrays()}
    assert list(got) == list(want)
    for field, a in got.items():
        assert_same_bytes(_bytes(a), _bytes(want[field]), f"torch {field}")
    for field in ("k_stage", "v_stage", "k_sink", "v_sink", "seq_lens"):
        assert_same_bytes(_bytes(getattr(cache, field)), _bytes(getattr(expected, field)), field)


def _bytes(a) -> np.ndarray:
    """The raw bytes of a JAX array or a torch tensor, uint8 [n]."""
    if hasattr(a, "untyped_storage"):
        import torch

        return a.contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("name", ["legacy", "abs-v2442"])
def test_swap_and_disk_round_trip(name, tmp_path):
    """A sequence swapped out, saved, loaded and swapped into other pages and another slot
    reads back what it held (every loop), and the file's arrays name each run's plane."""
    config, _, _, cache = filled(name)
    tables = make_tables(config)
    full = -(-T // PS)
    seq = swap_out(cache, slot=0, pages=tables[0, :full])
    # keys: one plane of loops 1-3; values: two runs of formats (INT4 / INT2 loops)
    assert {n.rsplit(".", 1)[0] for n in seq.arrays if "delta" in n} == {
        "k_delta", "v_delta.0", "v_delta.1"
    }  # fmt: skip
    save_sequence(tmp_path / "seq.safetensors", seq)
    loaded = load_sequence(tmp_path / "seq.safetensors", config)
    fresh = init_cache(config)
    moved = np.asarray(tables[1, :full])
    fresh = swap_in(fresh, loaded, slot=1, pages=moved)
    for loop in range(L):
        want = gather(cache, seq_id=0, seq_len=T, block_table=tables[0], loop=loop)
        got = gather(fresh, seq_id=1, seq_len=T, block_table=tables[1], loop=loop)
        for a, b in zip(got, want, strict=True):
            assert_same_bytes(a, b, f"loop {loop}")


@pytest.mark.parametrize("name", CASES)
def test_decode_attention_and_the_kernels(name):
    """Decode attention over the cache equals dense attention over gather's rows (XLA path);
    at a geometry the kernels take (D 64, pages of 16) both read-side kernels accept these
    chains, Hadamard-rotated ones included (their values: tests/kernels, specs abs-v2442-*,
    per-loop-*, hint4-*)."""
    config, _, _, cache = filled(name)
    tables = jnp.asarray(make_tables(config))
    kernel_config = dataclasses.replace(config, head_dim=64, page_size=16)
    for kind in ("key", "value"):
        assert config_support(kernel_config, kind) is None
    q64 = jax.ShapeDtypeStruct((S, 2 * H, 64), jnp.float32)
    kernel_cache = jax.eval_shape(lambda: init_cache(kernel_config))
    for loop in range(L):
        assert attention_support(q64, kernel_cache, tables, loop=loop) is None
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((S, 2 * H, D)), jnp.float32)
    lens = jnp.asarray([T, T - 6], jnp.int32)
    for loop in range(L):
        ks, vs = zip(*(gather(cache, seq_id=s, seq_len=T, block_table=tables[s], loop=loop)
                       for s in range(S)), strict=True)  # fmt: skip
        want = dense_decode_attention(q, jnp.stack(ks), jnp.stack(vs), lens)
        atol = rotated_space_atol(cache, loop, jnp.stack(vs), base=2e-5)
        got = paged_decode_attention(q, cache, tables, lens, loop=loop)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=atol)


def test_adaptive_exits_across_absolute_loops():
    """Rows that exit before an absolute loop read back their exit loop's reconstruction at
    every later loop, bit for bit (the depth map; the chain runs from loop 0)."""
    config = make_config("abs-v2442", adaptive_exit=True)
    k, v = make_kv(seed=2)
    rng = np.random.default_rng(3)
    exit_loop = rng.integers(0, L, size=(S, T))  # each token's last loop with its own K/V
    exited = np.arange(L)[:, None, None] > exit_loop[None]  # [L, S, T]
    # an exited token's later loops are appended as its exit loop's K/V
    idx = np.minimum(np.arange(L)[:, None, None], exit_loop[None])
    k_in = np.take_along_axis(k, idx[..., None, None], axis=0)
    v_in = np.take_along_axis(v, idx[..., None, None], axis=0)
    cache = fill(config, k_in, v_in, [T], exited=jnp.asarray(exited))
    tables = make_tables(config)
    full = T // PS
    for kind, x, formats, absolute in (("key", k_in, *CASES["abs-v2442"][1::2]),
                                       ("value", v_in, CASES["abs-v2442"][2],
                                        CASES["abs-v2442"][4])):  # fmt: skip
        for s in range(S):
            for j in range(full):
                rows = slice(j * PS, (j + 1) * PS)
                # the engine reference's rule: an exited row packs its previous reconstruction
                recon = []
                pages = x[:, s, rows]
                packed = kvq_jax.pack_kv(pages[0], **spec(kind, formats[0], formats[0]))
                recon.append(np.asarray(kvq_jax.unpack_kv(packed)))
                for loop in range(1, L):
                    gone = exited[loop, s, rows][:, None, None]
                    prev = recon[-1]
                    current = np.where(gone, prev, pages[loop])
                    res = kvq_jax.encode_residual(
                        jnp.asarray(current), jnp.asarray(prev),
                        **spec(kind, formats[loop], formats[0]), absolute=loop in absolute,
                    )  # fmt: skip
                    out = np.asarray(kvq_jax.decode_residual(res, jnp.asarray(prev)))
                    recon.append(np.where(gone, prev, out))
                for loop in range(L):
                    got = decode_pages(cache, kind, jnp.asarray([tables[s, j]]), loop=loop)
                    assert_same_values(got[0], recon[loop], f"{kind} seq {s} page {j} loop {loop}")


def test_config_checks():
    base = dict(num_pages=4, page_size=8, num_heads=1, head_dim=16, num_loops=4)
    with pytest.raises(ValueError, match="v_residual_format: 2 formats for 3 later loops"):
        PagedCacheConfig(**base, v_residual_format=("int4", "int2"))
    with pytest.raises(ValueError, match=r"k_absolute: loops stored absolute are ints in \[1, 4\)"):
        PagedCacheConfig(**base, k_absolute=(0,))
    with pytest.raises(ValueError, match="k_absolute"):
        PagedCacheConfig(**base, k_absolute=(4,))
    with pytest.raises(ValueError, match=r"v_residual_format: format must be one of .*got 'nope'"):
        PagedCacheConfig(**base, v_residual_format=("int4", "nope", "int4"))
    one = PagedCacheConfig(**base, v_residual_format=["int2", "int2", "int2"])
    assert one.v_residual_format == "int2" and one.delta_runs("value") == ((1, 2, 3),)
    mixed = PagedCacheConfig(**base, v_residual_format=("int4", "int2", "int2"))
    with pytest.raises(ValueError, match="loop_pack_args"):
        mixed.pack_args("value", "residual")
    assert mixed.delta_runs("value") == ((1,), (2, 3)) and mixed.per_loop("value")
    assert not mixed.per_loop("key")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_chain_check_catches_an_absolute_loop_read_as_a_delta(monkeypatch):
    """Reading an absolute loop as a delta (added to the previous loop) must fail the chain
    comparison (xfail strict: the suite fails if this ever passes)."""
    monkeypatch.setattr(PagedCacheConfig, "absolute_loops", lambda self, kind: ())
    filled.cache_clear()
    jax.clear_caches()
    try:
        test_pages_equal_the_codec_chain("abs-v2442")
    finally:
        monkeypatch.undo()
        filled.cache_clear()
        jax.clear_caches()
