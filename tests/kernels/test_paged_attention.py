"""Quantized paged decode attention (kvq_jax.kernels.paged_attention).

- `PagedAttentionBase` runs per backend (subclasses: XLA, Pallas interpret mode) over
  `arg_specs.SPECS`: INT4 / NVFP4 / FP8 planes (mixed K/V and base/residual formats), GQA
  ratios 1, 2, 4 (broadcast path) and 8 (pl.dot path), loop 0 and loops 1-2 through the
  residual chain, pages of 16/32/64 tokens, D 64/128, sink rows 0/3/5, f32/bf16/f16 caches,
  B 2-3 sequences of different lengths (not multiples of the page size, partial pages in
  staging, one attending a prefix of what it stores), block tables with non-contiguous
  physical pages. Each output is held to the independent reference (`references.py`: every
  sequence's K/V rebuilt page by page from the public codec functions, staging and sink rows,
  then float64 NumPy attention), at RTOL = ATOL = 2e-5 (float32 accumulation against float64;
  measured max |diff| ~6e-7 for outputs ~1-3), and to `dense_decode_attention` on
  `gather_batch`. A planted defect in the XLA path is caught (strict xfail). Also:
  several splits per sequence (uneven lengths, empty splits), permuted seq_ids, prefixes down
  to one token (new seq_lens, same compiled kernel), loop 0 of a 3-loop cache.
- The non-interpret kernel lowers for CUDA (Triton IR) for every supported spec
  (`arg_specs.SUPPORTED_SPECS`, production shapes included) and split count: this runs on a
  CPU and proves the Triton kernel builds.
- `--run-gpu`: the compiled kernel against XLA on a real GPU (RTOL = ATOL = 1e-4: Triton's
  exp is an ex2.approx).
- Errors and dispatch: unsupported configurations (auto falls back, explicit pallas raises
  naming the argument), bad num_splits / backend, the reference's argument checks, and
  `kvq_jax.cache.paged_attention.paged_decode_attention(backend=...)`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ADAPTIVE_KERNEL_CACHES,
    adaptive_exit_cache,
    rotated_space_atol,
    unshifted_payload_positions,
)
from references import reference_attention

import kvq_jax
import kvq_jax.cache.paged_attention as public
from kvq_jax.cache.paged_attention import dense_decode_attention
from kvq_jax.cache.paged_cache import gather_batch
from kvq_jax.codecs.formats.intb import register_table
from kvq_jax.kernel_checks.arg_specs import paged_attention as arg_specs
from kvq_jax.kernels import backend as kernel_backend
from kvq_jax.kernels.jax_compat import lower_for_gpu
from kvq_jax.kernels.paged_attention import api, config_support, pallas_triton
from kvq_jax.kernels.paged_attention import xla as paged_attention_xla

ON_GPU = kernel_backend.pallas_device_support() is None
RTOL = ATOL = 2e-5
GPU_RTOL = GPU_ATOL = 1e-4
SPEC_IDS = [s.name for s in arg_specs.SPECS]
#: loops-abs-v2442's schedule (per-loop INT2 / INT4 planes, absolute loops).
PER_LOOP_SPEC = next(s for s in arg_specs.SPECS if s.name.startswith("abs-v2442"))
#: Values in HINT4 / HINT2 (attended in the rotated space).
ROTATED_SPEC = next(s for s in arg_specs.SPECS if s.name.startswith("hint4"))


@functools.cache
def inputs(spec: arg_specs.PagedAttentionSpec) -> arg_specs.Inputs:
    return arg_specs.make_inputs(spec)


@functools.cache
def reference_out(spec, loop, seq_lens: tuple, seq_ids: tuple) -> np.ndarray:
    """The independent reference (`references.reference_attention`)."""
    inp = inputs(spec)
    q, ids = _permuted(inp.q, seq_ids)
    return reference_attention(
        np.asarray(q), inp.cache, np.asarray(inp.block_tables), np.asarray(seq_lens), loop=loop,
        seq_ids=np.asarray(ids),
    )  # fmt: skip


@functools.cache
def dense_out(spec):
    """(b): dense attention on the reconstructed KV (`gather_batch`), one jitted program."""
    inp = inputs(spec)

    @jax.jit
    def dense(q, cache, tables, lens):
        k, v = gather_batch(cache, tables, lens, loop=spec.loop)
        return dense_decode_attention(q, k, v, lens)

    return dense(*inp.args())


def _permuted(q, seq_ids: tuple):
    ids = np.asarray(seq_ids, np.int32)
    return q[ids], jnp.asarray(ids)


def assert_close(out, expected, what, rtol=RTOL, atol=ATOL):
    out, expected = np.asarray(out), np.asarray(expected)
    assert out.shape == expected.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=rtol, atol=atol, err_msg=what)


class PagedAttentionBase:
    backend: str

    def run(self, spec, *, loop=None, seq_lens=None, seq_ids=None, num_splits=None):
        inp = inputs(spec)
        loop = spec.loop if loop is None else loop
        ids = tuple(range(spec.batch)) if seq_ids is None else seq_ids
        lens = np.asarray(inp.seq_lens)[list(ids)] if seq_lens is None else seq_lens
        q, id_array = _permuted(inp.q, ids)
        out = api.paged_decode_attention(
            q, inp.cache, inp.block_tables, jnp.asarray(lens, jnp.int32), loop=loop,
            seq_ids=None if seq_ids is None else id_array, backend=self.backend,
            num_splits=num_splits,
        )  # fmt: skip
        return out, reference_out(spec, loop, tuple(int(n) for n in lens), ids)

    @pytest.mark.parametrize("spec", arg_specs.SPECS, ids=SPEC_IDS)
    def test_matches_reference_and_dense(self, spec):
        out, ref = self.run(spec)
        assert_close(out, ref, "vs the independent reference")
        assert_close(out, dense_out(spec), "vs dense attention on gather_batch")
        assert np.all(np.isfinite(np.asarray(out)))

    @pytest.mark.parametrize("spec", arg_specs.SPECS, ids=SPEC_IDS)
    def test_splits_permuted_slots_and_prefixes(self, spec):
        """3 splits of every sequence's pages (uneven lengths: the shorter sequences leave
        splits empty), slots in reverse order, then prefixes of the stored lengths (down to
        one token, a page boundary, one token past it) through the same compiled call."""
        ids = tuple(range(spec.batch))[::-1]
        out, ref = self.run(spec, seq_ids=ids, num_splits=3)
        assert_close(out, ref, "3 splits, reversed slots")
        _, stored = spec.lengths()
        ps = spec.page_size
        for lens in (np.ones(spec.batch), np.minimum(stored, ps), np.minimum(stored, ps + 1)):
            lens = lens.astype(np.int32)[list(ids)]
            out, ref = self.run(spec, seq_ids=ids, seq_lens=lens, num_splits=3)
            assert_close(out, ref, f"prefix {lens.tolist()}")

    def test_loop0_of_a_multi_loop_cache(self):
        spec = arg_specs.SPECS[1]  # 3 loops, sink rows, GQA 4, bf16
        out, ref = self.run(spec, loop=0)
        assert_close(out, ref, "loop 0")
        assert not np.allclose(np.asarray(out), np.asarray(self.run(spec)[1]), atol=1e-3)

    def test_every_loop_of_a_per_loop_cache(self):
        """loops-abs-v2442's schedule: INT2 and INT4 planes, loops stored absolute, a delta
        after an absolute loop; each loop against the independent reference."""
        spec = PER_LOOP_SPEC
        for loop in range(spec.num_loops):
            out, ref = self.run(spec, loop=loop, num_splits=2)
            assert_close(out, ref, f"loop {loop}")


class TestXLA(PagedAttentionBase):
    backend = "xla"


def _drop_last_page(q, cache, block_tables, seq_lens, seq_ids, *, loop, **knobs):
    """A planted defect in the XLA path: each sequence attends one page less."""
    lens = jnp.maximum(seq_lens - cache.config.page_size, 1)
    return _XLA_ATTENTION(q, cache, block_tables, lens, seq_ids, loop=loop, **knobs)


_XLA_ATTENTION = paged_attention_xla.paged_decode_attention


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_reference_catches_a_planted_defect(monkeypatch):
    monkeypatch.setattr(paged_attention_xla, "paged_decode_attention", _drop_last_page)
    jax.clear_caches()
    try:
        out, ref = TestXLA().run(arg_specs.SPECS[0])
        assert_close(out, ref, "planted defect")
    finally:
        jax.clear_caches()


# -- the blockwise XLA path against reconstruct-then-attend -----------------------------------


@pytest.mark.thin(2)
@pytest.mark.parametrize("block_pages", [1, 2, 64])
@pytest.mark.parametrize("spec", arg_specs.SPECS, ids=SPEC_IDS)
def test_blockwise_xla_equals_reconstruct_then_attend(spec, block_pages):
    """The blockwise online softmax (blocks of 1, 2 and more pages than a table holds) equals
    `paged_decode_attention_reference` (every page reconstructed, then dense attention) on
    sequences with partial pages in staging, sink rows, a prefix of what is stored and
    permuted slots, within the tests' tolerance."""
    inp = inputs(spec)
    ids = jnp.asarray(np.arange(spec.batch)[::-1].copy(), jnp.int32)
    lens = np.asarray(inp.seq_lens)[::-1].copy()
    lens[0] = max(1, lens[0] - 3)  # a prefix of what this slot stores
    args = (inp.q, inp.cache, inp.block_tables, jnp.asarray(lens, jnp.int32), ids)
    ref = jax.jit(
        functools.partial(paged_attention_xla.paged_decode_attention_reference, loop=spec.loop)
    )(*args)
    out = jax.jit(
        functools.partial(
            paged_attention_xla.paged_decode_attention, loop=spec.loop, block_pages=block_pages
        )
    )(*args)
    assert_close(out, ref, f"blockwise ({block_pages} pages) vs reconstruct-then-attend")


@pytest.mark.parametrize("block_pages", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_blockwise_xla_honours_adaptive_exits(block_pages):
    cache, tables = adaptive_exit_cache()
    assert cache.depth is not None and int(jnp.min(cache.depth[tables[0, :3]])) < 2
    q = jax.random.normal(jax.random.key(3), (2, 4, 32), jnp.float32)
    ids = jnp.arange(2, dtype=jnp.int32)
    for loop in range(3):
        for lens in ([45, 21], [20, 5]):
            args = (q, cache, tables, jnp.asarray(lens, jnp.int32), ids)
            ref = paged_attention_xla.paged_decode_attention_reference(*args, loop=loop)
            out = paged_attention_xla.paged_decode_attention(
                *args, loop=loop, block_pages=block_pages
            )
            assert_close(out, ref, f"adaptive exits, loop {loop}, lens {lens}")
            dense = jax.jit(gather_batch, static_argnames="loop")(
                cache, tables, jnp.asarray(lens, jnp.int32), loop=loop
            )
            assert_close(out, dense_decode_attention(q, *dense, jnp.asarray(lens)), "dense")


@pytest.mark.parametrize("variant", ADAPTIVE_KERNEL_CACHES)
def test_kernel_honours_adaptive_exits(variant):
    """The kernel (interpret mode) on adaptive-exit caches (each row's chain stops at its exit
    loop: the depth map; loops stored absolute mid-chain; HINT values attended rotated)
    equals the XLA path and dense attention over `gather_batch`, every loop."""
    cache, tables = adaptive_exit_cache(**ADAPTIVE_KERNEL_CACHES[variant])
    assert config_support(jnp.zeros((2, 4, 64)), cache, tables, loop=2) is None
    q = jax.random.normal(jax.random.key(3), (2, 4, 64), jnp.float32)
    ids = jnp.arange(2, dtype=jnp.int32)
    for loop in range(3):
        lens = jnp.asarray([45, 21], jnp.int32)
        args = (q, cache, tables, lens)
        out = api.paged_decode_attention(*args, loop=loop, seq_ids=ids, backend="pallas_interpret")
        ref = api.paged_decode_attention(*args, loop=loop, seq_ids=ids, backend="xla")
        assert_close(out, ref, f"{variant}: kernel vs XLA, loop {loop}")
        k, v = jax.jit(gather_batch, static_argnames="loop")(cache, tables, lens, loop=loop)
        atol = rotated_space_atol(cache, loop, v, base=ATOL)  # HINT values: attended rotated
        assert_close(out, dense_decode_attention(q, k, v, lens), f"{variant}: dense, loop {loop}",
                     atol=atol)  # fmt: skip


def test_block_pages_argument():
    spec = arg_specs.SPECS[0]
    inp = inputs(spec)
    with pytest.raises(ValueError, match="block_pages must be >= 1"):
        api.paged_decode_attention(*inp.args(), loop=0, backend="xla", block_pages=0)
    with pytest.raises(TypeError, match="block_pages"):
        api.paged_decode_attention(*inp.args(), loop=0, backend="xla", block_pages=1.5)
    out = api.paged_decode_attention(*inp.args(), loop=0, backend="xla", block_pages=1)
    assert_close(out, dense_out(spec), "block_pages=1 through the api")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_per_loop_comparison_catches_a_kernel_ignoring_absolute_loops(monkeypatch):
    """The interpret-mode comparison fails when the kernel reconstructs loop 2 of the values
    (stored absolute) as a delta chain from loop 0."""
    from kvq_jax.kernels._tile_decode import chain_steps

    def as_deltas(cache, kind, loop):
        config = dataclasses.replace(cache.config, k_absolute=(), v_absolute=())
        return chain_steps(dataclasses.replace(cache, config=config), kind, loop)

    monkeypatch.setattr(pallas_triton, "chain_steps", as_deltas)
    _run_planted(PER_LOOP_SPEC, loop=2)


#: The best policy's shape: heavy rows over INTB keys and HINT4 values, keys before RoPE.
HEAVY_ROPE_SPEC = next(s for s in arg_specs.SPECS if s.name.startswith("heavy-intb-hint4-rope"))


def _run_planted(spec, loop=None):
    """The interpret-mode kernel (a defect planted by the caller) against the reference, with
    no program traced before or after the plant."""
    jax.clear_caches()
    try:
        out, ref = TestPallasInterpret().run(spec, loop=loop)
        assert_close(out, ref, "planted defect")
    finally:
        jax.clear_caches()


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_rope_comparison_catches_keys_left_before_rope(monkeypatch):
    """The comparison fails when the kernel attends keys stored before RoPE as stored."""
    from kvq_jax.codecs import cache_state

    def no_turn(config, positions):
        cos, sin = cache_state.rope_at(positions, config.head_dim, config.rope_theta)
        return jnp.ones_like(cos), jnp.zeros_like(sin)

    monkeypatch.setattr(pallas_triton.cache_state, "key_rope", no_turn)
    _run_planted(HEAVY_ROPE_SPEC)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_xla_heavy_rope_comparison_catches_payload_rows_turned_at_their_stored_place(
    monkeypatch,
):
    """The XLA path reads heavy pages unmerged and turns each payload row at its position;
    positions that forget the heavy row before a row (its place among the payload rows)
    turn the rows after it by the wrong angle, and the comparison fails."""

    monkeypatch.setattr(paged_attention_xla, "payload_positions", unshifted_payload_positions)
    jax.clear_caches()
    try:
        out, ref = TestXLA().run(HEAVY_ROPE_SPEC)
        assert_close(out, ref, "planted defect")
    finally:
        jax.clear_caches()


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_heavy_comparison_catches_the_plain_heavy_share_dropped(monkeypatch):
    """The comparison fails when the kernel's second accumulator (the heavy value rows,
    plain) is left out of the output."""
    real = pallas_triton.combine
    calls = []

    def combine(acc, m, l_sum):
        calls.append(None)
        out = real(acc, m, l_sum)
        return jnp.zeros_like(out) if len(calls) == 2 else out

    monkeypatch.setattr(pallas_triton, "combine", combine)
    _run_planted(HEAVY_ROPE_SPEC)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_interpret_mode_comparison_catches_tiles_left_unrounded(monkeypatch):
    """With the tiles' bfloat16 rounding left to `astype` (XLA:CPU drops a float32 ->
    bfloat16 -> float32 round trip in one program), the interpret-mode kernel attends
    unrounded keys and the comparison fails (5e-4 off at 64-token pages)."""
    from kvq_jax.kernels import _exact

    monkeypatch.setattr(_exact, "round_to", lambda x, dtype, *, interpret: x.astype(dtype))
    _run_planted(next(s for s in arg_specs.SPECS if s.name == "heavy-int4-int2-p64-d64-bf16"))


def test_rotated_values_of_a_bfloat16_cache():
    """A bfloat16 HINT cache: the kernel attends in the rotated space as the XLA path does
    (equal to float32 round-off); the reference rounds each un-rotated row to bfloat16
    first, so it differs by that rounding only."""
    spec = dataclasses.replace(ROTATED_SPEC, name=ROTATED_SPEC.name + "-bf16", dtype="bfloat16")
    inp = inputs(spec)
    outs = {
        backend: api.paged_decode_attention(*inp.args(), loop=spec.loop, backend=backend)
        for backend in ("pallas_interpret", "xla")
    }
    assert_close(outs["pallas_interpret"], outs["xla"], "kernel vs XLA path")
    ref = reference_out(spec, spec.loop, tuple(np.asarray(inp.seq_lens).tolist()),
                        tuple(range(spec.batch)))  # fmt: skip
    assert_close(outs["pallas_interpret"], ref, "vs the reference", rtol=1e-2, atol=1e-2)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_rotated_comparison_catches_an_output_left_rotated(monkeypatch):
    """The comparison fails when the kernel's output is not un-rotated."""
    monkeypatch.setattr(pallas_triton, "unrotate", lambda x: x)
    _run_planted(ROTATED_SPEC)


class TestPallasInterpret(PagedAttentionBase):
    backend = "pallas_interpret"


def test_one_token_is_its_value_row():
    """A one-token sequence attends only to it: the output is its V row (the raw sink row
    here) for every query head."""
    spec = arg_specs.SPECS[1]
    inp = inputs(spec)
    lens = jnp.ones(spec.batch, jnp.int32)
    out = api.paged_decode_attention(
        inp.q, inp.cache, inp.block_tables, lens, loop=spec.loop, backend="pallas_interpret",
        num_splits=3,
    )  # fmt: skip
    v0 = np.asarray(inp.cache.v_sink[spec.loop, :, 0], np.float32)  # [B, H, D]
    expect = np.repeat(v0, spec.group, axis=1)
    np.testing.assert_array_equal(np.asarray(out), expect)


# -- Triton lowering --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", arg_specs.SUPPORTED_SPECS, ids=lambda s: s.name)
def test_kernel_lowers_for_cuda(spec):
    shapes = arg_specs.input_shapes(spec)
    assert config_support(shapes.q, shapes.cache, shapes.block_tables, loop=spec.loop) is None

    def kernel(q, cache, tables, lens, ids):
        return pallas_triton.paged_decode_attention(
            q, cache, tables, lens, ids, loop=spec.loop, num_splits=3, interpret=False
        )

    lowered = lower_for_gpu(
        kernel, shapes.q, shapes.cache, shapes.block_tables, shapes.seq_lens, shapes.seq_ids
    )
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text and "kvq_paged_decode_attention" in text


@pytest.mark.parametrize("spec", [arg_specs.SPECS[2], arg_specs.SPECS[3]], ids=lambda s: s.name)
def test_uint16_view_of_large_uint8_arrays(spec, monkeypatch):
    """uint8 arrays of >= 2**31 bytes reach the kernel as uint16 pairs (Triton's int32
    offsets); forced here for every uint8 array (threshold 1 byte): same output in interpret
    mode, and the Triton lowering takes the uint16 tiles."""
    monkeypatch.setattr(pallas_triton, "WIDE_INDEX_BYTES", 1)
    inp = inputs(spec)

    def kernel(q, cache, tables, lens, ids, interpret):
        return pallas_triton.paged_decode_attention(
            q, cache, tables, lens, ids, loop=spec.loop, num_splits=2, interpret=interpret
        )

    args = (*inp.args(), inp.seq_ids)
    out = jax.jit(functools.partial(kernel, interpret=True))(*args)
    assert_close(out, reference_out(spec, spec.loop, tuple(np.asarray(inp.seq_lens).tolist()),
                                    tuple(range(spec.batch))), "uint16 view")  # fmt: skip
    text = lower_for_gpu(functools.partial(kernel, interpret=False), *args).as_text()
    assert "__gpu$xla.gpu.triton" in text and "ui16>" in text  # the uint16 operands


# -- real GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("spec", arg_specs.SPECS, ids=SPEC_IDS)
def test_compiled_kernel_on_gpu(spec):
    if not ON_GPU:
        pytest.skip(kernel_backend.pallas_device_support())
    inp = inputs(spec)
    for num_splits in (None, 3):
        out = api.paged_decode_attention(
            *inp.args(), loop=spec.loop, backend="pallas", num_splits=num_splits
        )
        ref = reference_out(spec, spec.loop, tuple(np.asarray(inp.seq_lens).tolist()),
                            tuple(range(spec.batch)))  # fmt: skip
        assert_close(out, ref, f"GPU, {num_splits} splits", GPU_RTOL, GPU_ATOL)
    assert api.choose_backend(inp.q, inp.cache, inp.block_tables, loop=spec.loop,
                              backend="auto") == "pallas"  # fmt: skip


# -- dispatch and errors ----------------------------------------------------------------------


def _small_page_inputs():
    spec = dataclasses.replace(arg_specs.SPECS[0], name="p8", page_size=8, context=12)
    return spec, inputs(spec)


def test_unsupported_config_falls_back_or_raises():
    spec, inp = _small_page_inputs()
    reason = config_support(inp.q, inp.cache, inp.block_tables)
    assert reason is not None and "page_size = 8" in reason
    assert api.choose_backend(inp.q, inp.cache, inp.block_tables, loop=0, backend="auto") == "xla"
    auto = api.paged_decode_attention(*inp.args(), loop=0, backend="auto")
    assert_close(auto, reference_out(spec, 0, tuple(np.asarray(inp.seq_lens).tolist()),
                                     tuple(range(spec.batch))), "auto falls back")  # fmt: skip
    for backend in ("pallas", "pallas_interpret"):
        with pytest.raises(ValueError, match="page_size"):
            api.paged_decode_attention(*inp.args(), loop=0, backend=backend)


def test_config_support_reasons():
    def reason(loop=0, **kw):
        spec = dataclasses.replace(arg_specs.SPECS[0], name="x", **kw)
        s = arg_specs.input_shapes(spec)
        return config_support(s.q, s.cache, s.block_tables, loop=loop)

    assert "head_dim = 48" in reason(head_dim=48)
    assert "head_dim = 16" in reason(head_dim=16)
    assert "page_size = 24" in reason(page_size=24)
    assert "group size 48" in reason(v_group_size=48)  # channel groups must divide D
    assert "query heads per KV head" in reason(q_heads=256, kv_heads=2)
    assert reason(head_dim=128, page_size=64) is None
    assert "key loop 0 format 'hint4'" in reason(k_base_format="hint4")
    mixed = dict(num_loops=3, v_base_format="hint4", v_residual_format=("hint4", "int4"))
    assert reason(loop=1, **mixed) is None  # loops 0-1: rotated only
    assert "mix Hadamard-rotated and plain" in reason(loop=2, **mixed)
    assert "mix Hadamard-rotated and plain" in reason(loop=np.int64(2), **mixed)
    assert reason(loop=2, v_absolute=(2,), **mixed) is None  # loop 2 read alone
    name = register_table(np.full((2, 64), 4))
    try:
        assert reason(k_base_format=name) is None  # INTB keys
    finally:
        kvq_jax.unregister_codec(name)


def test_backend_selection_on_this_device():
    spec = arg_specs.SPECS[0]
    inp = inputs(spec)
    if ON_GPU:
        pytest.skip("CPU-only dispatch checks")
    # auto on CPU: the XLA path.
    assert api.choose_backend(inp.q, inp.cache, inp.block_tables, loop=0, backend="auto") == "xla"
    with pytest.raises(ValueError, match="CUDA GPU"):
        api.paged_decode_attention(*inp.args(), loop=0, backend="pallas")
    with pytest.raises(ValueError, match="backend must be one of"):
        api.paged_decode_attention(*inp.args(), loop=0, backend="triton")


def test_public_module_is_the_api():
    """kvq_jax.cache.paged_attention and the package re-export the one dispatching function."""
    assert public.paged_decode_attention is api.paged_decode_attention
    assert kvq_jax.paged_decode_attention is api.paged_decode_attention


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
def test_argument_errors(backend):
    spec = arg_specs.SPECS[0]
    inp = inputs(spec)
    q, cache, tables, lens = inp.args()
    call = functools.partial(api.paged_decode_attention, backend=backend)
    with pytest.raises(ValueError, match="num_splits must be >= 1"):
        call(q, cache, tables, lens, loop=0, num_splits=0)
    with pytest.raises(TypeError, match="num_splits"):
        call(q, cache, tables, lens, loop=0, num_splits=2.0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        call(q[:, :1].repeat(3, 1), cache, tables, lens, loop=0)
    with pytest.raises(ValueError, match="D = 8"):
        call(q[..., :8], cache, tables, lens, loop=0)
    with pytest.raises(TypeError, match="int32"):
        call(q, cache, tables, lens.astype(jnp.float32), loop=0)
    with pytest.raises(ValueError, match="loop must be in"):
        call(q, cache, tables, lens, loop=1)
    with pytest.raises(ValueError, match="block_tables"):
        call(q, cache, tables[:1], lens, loop=0)
    with pytest.raises(ValueError, match="seq_ids has 1 entries"):
        call(q, cache, tables, lens, loop=0, seq_ids=jnp.zeros(1, jnp.int32))
    with pytest.raises(ValueError, match="q has B"):
        call(q[:1], cache, tables, lens, loop=0)
    with pytest.raises(TypeError, match="PagedKVCache"):
        call(q, {"not": "a cache"}, tables, lens, loop=0)
