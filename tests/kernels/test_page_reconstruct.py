"""Page reconstruction (kvq_jax.kernels.page_reconstruct): every backend returns
`paged_cache.decode_pages`' (XLA) bytes for loop l of the requested physical pages.

- `ReconstructBase` runs per backend (subclasses: XLA, Pallas interpret mode) over
  `arg_specs.TEST_SPECS` (every base/residual format pair of int4 / nvfp4 / fp8 as K or V,
  INT4 groups along tokens and channels, H 1-3, bf16 / fp16 / fp32; per-loop formats, INTB,
  heavy rows, HINT4 / HINT2 planes un-rotated in the tile). Caches are built with
  `init_cache` + `append`; their pages hold normal data, an all signed-zero base page with
  tiny (1e-30, 1e-37) and subnormal rows in later loops, a NaN in loop 1, and one page id
  never written (zeros; NVFP4 decodes 0 / 0 = NaN there). Every loop 0..L-1 of both kinds,
  through `decode_pages(backend=...)`, jit and vmap; zero pages.
- The non-interpret kernel lowers for CUDA (Triton IR) for every `arg_specs.SUPPORTED_SPECS`
  entry (runs on a CPU; proves the Triton kernel builds), and so does its vmap rule.
- `--run-gpu`: the compiled kernel against XLA on a real GPU.
- Errors: unknown backend, unsupported configurations, bad kind / pages / loop.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ADAPTIVE_KERNEL_CACHES, adaptive_exit_cache, assert_same_values
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from references import reference_pages

from kvq_jax.cache.paged_cache import PagedCacheConfig, append, decode_pages, init_cache
from kvq_jax.kernel_checks.arg_specs import page_reconstruct as arg_specs
from kvq_jax.kernels import _exact, _tile_decode
from kvq_jax.kernels import backend as kernel_backend
from kvq_jax.kernels._tile_decode import chain_steps
from kvq_jax.kernels.jax_compat import lower_for_gpu
from kvq_jax.kernels.page_reconstruct import api, config_support, pallas_triton
from kvq_jax.kernels.page_reconstruct import xla as page_reconstruct_xla

ON_GPU = kernel_backend.pallas_device_support() is None
#: The sequence's block table: logical pages 0, 1, 2 -> physical 2, 0, 3; page 1 unwritten.
TABLE = (2, 0, 3)
#: Page ids asked for: every written page, the unwritten one, a repeat.
PAGES = np.array([2, 1, 0, 3, 2], np.int32)
SPEC_IDS = [s.name for s in arg_specs.TEST_SPECS]


def make_loops(spec: arg_specs.ReconstructSpec, seed: int = 0):
    """K, V [L, 1, 3 * page_size, H, D] in the spec's dtype: logical page 0 normal data
    (each loop a perturbation of the previous), page 1 signed zeros in loop 0 and signed
    zeros / tiny / subnormal rows later, page 2 normal with one NaN in loop 1 (loop 0 if
    L = 1)."""
    rng = np.random.default_rng(seed)
    ps, h, d, nl = spec.page_size, spec.num_heads, spec.head_dim, spec.num_loops
    out = []
    for scale in (1.0, 3.0):
        steps = (
            rng.standard_normal((nl, 3, ps, h, d))
            * np.array([1.0] + [0.2] * (nl - 1))[:, None, None, None, None]
        )
        x = (scale * np.cumsum(steps, axis=0)).astype(np.float32)
        signs = np.where(rng.random((nl, ps, h, d)) < 0.5, -0.0, 0.0).astype(np.float32)
        x[:, 1] = signs
        half = ps // 2
        x[1:, 1, half:] = rng.standard_normal((nl - 1, ps - half, h, d)) * np.float32(1e-30)
        x[1:, 1, half : half + 2] *= np.float32(1e7)  # ~1e-37 rows, one below 2**-126 * 8
        x[1:, 1, -1, :, ::5] = np.float32(3e-39)  # subnormal inputs (flushed)
        x[min(1, nl - 1), 2, ps // 3, h - 1, 5] = np.nan
        out.append(x.reshape(nl, 1, 3 * ps, h, d).astype(spec.dtype))
    return out


@functools.cache
def filled(spec: arg_specs.ReconstructSpec):
    """The cache of `spec` after one append (prefill) per loop."""
    config = spec.config()
    k, v = make_loops(spec)
    tables = jnp.asarray([TABLE], jnp.int32)
    ids = jnp.zeros(1, jnp.int32)

    @jax.jit
    def fill(cache, k, v):
        for loop in range(config.num_loops):
            cache = append(cache, k[loop], v[loop], block_tables=tables, seq_ids=ids, loop=loop)
        return cache

    return fill(spec.empty_cache(), k, v)


@functools.cache
def _jitted(kind: str, loop: int, backend: str):
    return jax.jit(
        lambda cache, pages: decode_pages(cache, kind, pages, loop=loop, backend=backend)
    )


@functools.cache
def reference(spec, kind: str, loop: int) -> np.ndarray:
    return reference_pages(filled(spec), kind, loop, PAGES)


class ReconstructBase:
    backend: str

    def run(self, spec, kind, loop, pages=PAGES):
        return _jitted(kind, loop, self.backend)(filled(spec), pages)

    @pytest.mark.parametrize("kind", arg_specs.KINDS)
    @pytest.mark.parametrize("spec", arg_specs.TEST_SPECS, ids=SPEC_IDS)
    def test_every_loop_matches_decode_pages(self, spec, kind):
        for loop in range(spec.num_loops):
            ref = reference(spec, kind, loop)
            got = self.run(spec, kind, loop)
            assert got.shape == (len(PAGES), spec.page_size, spec.num_heads, spec.head_dim)
            assert_same_values(got, ref, f"{spec.name} {kind} loop {loop}")
            # The data reach the cases they are meant to: NaN in loop 1 of page 3 (carried by
            # the loops whose chain reads loop 1), exact signed zeros in the all-zero base page.
            absolute = spec.k_absolute if kind == "key" else spec.v_absolute
            start = max((a for a in absolute if a <= loop), default=0)
            if start <= 1 <= loop:
                assert np.isnan(ref[3].astype(np.float32)).any()
            if loop == 0:  # only NVFP4 keeps -0.0 (INT4 / FP8 store +0 minimum / codes)
                zeros = ref[2].astype(np.float32)
                base_format = spec.k_base_format if kind == "key" else spec.v_base_format
                assert not zeros.any()
                assert np.signbit(zeros).any() == (base_format == "nvfp4")

    def test_decode_pages_backend_and_jit(self):
        spec = arg_specs.TEST_SPECS[0]
        loop = spec.num_loops - 1
        got = _jitted("value", loop, self.backend)(filled(spec), PAGES)
        assert_same_values(got, reference(spec, "value", loop), "decode_pages(backend=...)")
        eager = decode_pages(filled(spec), "key", PAGES, loop=loop, backend=self.backend)
        assert_same_values(eager, reference(spec, "key", loop), "eager call")

    def test_vmap_over_page_ids(self):
        """Batched page ids (as `gather_batch` vmaps `reconstruct`) give per-row results."""
        spec = arg_specs.TEST_SPECS[1]
        loop = spec.num_loops - 1
        batch = np.stack([PAGES, PAGES[::-1]])
        fn = jax.jit(
            jax.vmap(
                lambda c, p: decode_pages(c, "key", p, loop=loop, backend=self.backend),
                in_axes=(None, 0),
            )
        )
        got = np.asarray(fn(filled(spec), batch))
        ref = reference(spec, "key", loop)
        assert_same_values(got[0], ref, "vmap row 0")
        assert_same_values(got[1], ref[::-1], "vmap row 1")

    def test_vmap_over_caches(self):
        """A batched cache (two copies, the second with its page order reversed) runs one
        call per batch entry."""
        spec = arg_specs.TEST_SPECS[4]
        cache = filled(spec)
        stacked = jax.tree.map(lambda a: jnp.stack([a, a]), cache)
        fn = jax.jit(
            jax.vmap(
                lambda c, p: decode_pages(c, "value", p, loop=1, backend=self.backend),
                in_axes=(0, None),
            )
        )
        got = np.asarray(fn(stacked, PAGES))
        ref = reference(spec, "value", 1)
        assert_same_values(got[0], ref, "cache 0")
        assert_same_values(got[1], ref, "cache 1")

    def test_zero_pages(self):
        spec = arg_specs.TEST_SPECS[2]
        got = decode_pages(
            filled(spec), "value", np.zeros(0, np.int32), loop=1, backend=self.backend
        )
        assert got.shape == (0, spec.page_size, spec.num_heads, spec.head_dim)
        assert got.dtype == jnp.dtype(spec.dtype)


class TestXLA(ReconstructBase):
    # half of the (spec, kind) cases by default (the kernels' classes take every one)
    pytestmark = pytest.mark.thin(2)
    backend = "xla"


@pytest.mark.parametrize("spec", arg_specs.TEST_SPECS[:2], ids=SPEC_IDS[:2])
def test_xla_page_batch_path(spec, monkeypatch):
    """The XLA path decodes the taken pages as one tensor of N * page_size rows where the
    format allows it; its per-page (vmap) fallback gives the reference's bytes as well."""
    monkeypatch.setattr(page_reconstruct_xla, "_flat_ok", lambda packed: False)
    cache = filled(spec)
    for kind in arg_specs.KINDS:
        for loop in range(spec.num_loops):
            got = jax.jit(
                lambda c, p, kind=kind, loop=loop: page_reconstruct_xla.decode_pages(
                    c.loop_chain(kind, loop), p
                )
            )(cache, jnp.asarray(PAGES))
            assert_same_values(got, reference(spec, kind, loop), f"page batch {kind} {loop}")


def test_xla_decode_fusion_reads_taken_pages():
    """On XLA:CPU the pages are taken (gathered) outside the decode chain: no computation of
    the compiled loop-2 reconstruction both gathers and computes bf16 values (a page gather
    fused into the chain is evaluated per element there, 5-10x slower per loop)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the materialized take is an XLA:CPU choice")
    spec = arg_specs.TEST_SPECS[0]
    assert spec.dtype == "bfloat16"
    text = (
        jax.jit(lambda c, p: decode_pages(c, "key", p, loop=2, backend="xla"))
        .lower(filled(spec), jnp.asarray(PAGES))
        .compile()
        .as_text()
    )
    blocks = text.split("\n\n")
    assert any(" gather(" in b for b in blocks)
    mixed = [b for b in blocks if " gather(" in b and "bf16[" in b and "ENTRY" not in b]
    assert not mixed, mixed[0]


def _skip_last_residual(chain, pages, **kwargs):
    """A planted defect in the XLA path: one residual step too few."""
    return _XLA_DECODE(chain[: max(len(chain) - 1, 1)], pages, **kwargs)


_XLA_DECODE = page_reconstruct_xla.decode_pages


def _planted(spec, kind, loop, backend="pallas_interpret"):
    """`decode_pages` of `backend` against the reference, JAX's caches cleared before and
    after (a planted function must be traced, and must not outlive the test in a jit cache)."""
    jax.clear_caches()
    try:
        got = decode_pages(filled(spec), kind, PAGES, loop=loop, backend=backend)
        assert_same_values(got, reference(spec, kind, loop), "planted defect")
    finally:
        jax.clear_caches()


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_reference_catches_a_planted_defect(monkeypatch):
    """The per-backend comparison fails when the XLA path drops the last residual step (xfail
    strict: the suite fails if this ever passes)."""
    monkeypatch.setattr(page_reconstruct_xla, "decode_pages", _skip_last_residual)
    spec = arg_specs.TEST_SPECS[0]
    _planted(spec, "key", spec.num_loops - 1, backend="xla")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_per_loop_comparison_catches_a_kernel_ignoring_absolute_loops(monkeypatch):
    """The interpret-mode comparison fails when the kernel reconstructs an absolute loop as
    a delta chain from loop 0 (the chain planned as if no loop were stored absolute)."""

    def as_deltas(cache, kind, loop):
        config = dataclasses.replace(cache.config, k_absolute=(), v_absolute=())
        return chain_steps(dataclasses.replace(cache, config=config), kind, loop)

    monkeypatch.setattr(api, "chain_steps", as_deltas)
    _planted(arg_specs.PER_LOOP_SPECS[0], "value", 2)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_intb_comparison_catches_a_kernel_reading_layer_0(monkeypatch):
    """The interpret-mode comparison fails when the kernel decodes a per-layer INTB plane
    with layer 0's table instead of the cache's layer (2)."""
    load = _tile_decode.load_intb_tile

    def layer_0(refs, lead, page, head, layer, meta):
        return load(refs, lead, page, head, 0, meta)

    monkeypatch.setattr(_tile_decode, "load_intb_tile", layer_0)
    _planted(arg_specs.INTB_SPECS[0], "key", 0)


def _unshifted(rows, group):
    """A planted heavy-row index: payload row g*(G-1) + i for every i (no shift past the
    heavy row), the heavy row still put in."""
    is_heavy, _ = _real_heavy_row_index(rows, group)
    t = jnp.arange(is_heavy.shape[0])
    payload = (t // group) * (group - 1) + jnp.minimum(t % group, group - 2)
    return is_heavy, payload


_real_heavy_row_index = _tile_decode.heavy_row_index


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
@pytest.mark.parametrize("kind", arg_specs.KINDS)
def test_heavy_comparison_catches_unshifted_payload_rows(monkeypatch, kind):
    """The interpret-mode comparison fails when the kernel reads payload row g*(G-1) + i for
    output row g*G + i past the heavy row (the heavy row's own index is never read)."""
    monkeypatch.setattr(_tile_decode, "heavy_row_index", _unshifted)
    _planted(arg_specs.HEAVY_SPECS[0], kind, 0)


def _butterfly_operands_swapped(y, *, interpret):
    r, d = y.shape
    h = 1
    while h < d:
        a, b = jnp.split(y.reshape(r, d // (2 * h), 2 * h), 2, axis=-1)
        s, t = a + b, b - a  # the planted defect: b - a for a - b
        y = jnp.stack([s, t], axis=-1).transpose(0, 1, 3, 2).reshape(r, d)
        h *= 2
    return y


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
@pytest.mark.parametrize("spec", arg_specs.ROTATED_SPECS, ids=lambda s: s.name)
def test_rotated_comparison_catches_a_swapped_butterfly(monkeypatch, spec):
    """The interpret-mode comparison fails when the kernel's butterfly takes b - a for a - b
    (HINT values, and heavy rows over them)."""
    monkeypatch.setattr(_tile_decode, "butterfly_tile", _butterfly_operands_swapped)
    _planted(spec, "value", 0)


class TestPallasInterpret(ReconstructBase):
    backend = "pallas_interpret"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with compute capability >= 8.0")
class TestPallasGPU(ReconstructBase):
    backend = "pallas"

    def test_bench_sized_pages(self):
        """Ouro-sized pages (H 16, D 128), every loop, random page order: int4 and the best
        served policy's pages (heavy-rope; interpret mode passes this too, 14 s on 2 CPU cores:
        not in the CPU suite)."""
        for spec in [*arg_specs.BENCH_SPECS[:4], arg_specs.bench_specs("heavy-rope")[0]]:
            small = dataclasses.replace(spec, num_pages=4)
            pages = jnp.asarray(PAGES)
            for kind in arg_specs.KINDS:
                for loop in range(small.num_loops):
                    got = _jitted(kind, loop, "pallas")(filled(small), pages)
                    ref = _jitted(kind, loop, "xla")(filled(small), pages)
                    assert_same_values(got, ref, f"{small.name} {kind} loop {loop}")


# -- GPU lowering (CPU-only check that the Triton kernel builds) -----------------------------


def plain_float_ops(lowered_text: str) -> set[str]:
    """Which of arith.divf / arith.addf the Triton IR of a CUDA-lowered module holds.

    The IR (MLIR bytecode in the `__gpu$xla.gpu.triton` custom call) names each op kind once
    in its string table. Triton's divf is div.full.f32 (not IEEE) and a plain addf after a
    multiply may be contracted to an FMA: the kernels route both through `_exact`."""
    ir = lowered_text[lowered_text.index("__gpu$xla.gpu.triton") :]
    return {op for op in ("divf", "addf") if op in ir}


def _lower_control(fn):
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = fn(x_ref[...], y_ref[...])

    def call(x, y):
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        )(x, y)  # fmt: skip

    x = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    return lower_for_gpu(call, x, x).as_text()


def test_plain_float_op_check_has_a_positive_control():
    """The IR check sees a plain `/` and `+` in a control kernel, and none when the same
    arithmetic goes through `_exact` (as the kernels' does)."""
    assert plain_float_ops(_lower_control(lambda x, y: x / y + x)) == {"divf", "addf"}
    exact = _lower_control(
        lambda x, y: _exact.add(_exact.divide(x, y, interpret=False), x, interpret=False)
    )
    assert plain_float_ops(exact) == set()


def lower_for_cuda(spec, kind: str, loop: int, *, batch: int | None = None):
    cache = spec.abstract_cache()
    steps, planes = chain_steps(cache, kind, loop)
    chain = (tuple(planes), cache.depth)
    if batch is None:

        def fn(chain, pages):
            return pallas_triton.decode_pages(chain[0], pages, None, chain[1], steps=steps,
                                              interpret=False)  # fmt: skip

        pages = spec.page_ids(8)
    else:
        call = api._batchable(steps, False, None)
        fn = jax.vmap(lambda chain, pages: call(chain, jnp.int32(0), pages), in_axes=(None, 0))
        pages = jax.ShapeDtypeStruct((batch, 8), jnp.int32)
    lowered = lower_for_gpu(fn, chain, pages)
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text, "no Triton kernel in the lowered module"
    assert plain_float_ops(text) == set(), "plain float division / add in the kernel"
    return text


def test_benchmark_times_every_format_on_the_kernel():
    """bench/page_reconstruct.py times each named format (the best served policy's pages,
    heavy-rope, included) at loops 0 and 3 and skips a backend that declines a configuration:
    every one it times is one the kernel serves."""
    for name in arg_specs.BENCH_FORMATS:
        assert {s.loop for s in arg_specs.bench_specs(name)} == {0, 3}, name
    for spec in arg_specs.BENCH_SPECS:
        for kind in arg_specs.KINDS:
            assert config_support(spec.config(), kind) is None, (spec.name, kind)


@pytest.mark.parametrize(
    "spec", arg_specs.SUPPORTED_SPECS, ids=[s.name for s in arg_specs.SUPPORTED_SPECS]
)
def test_lowers_for_cuda(spec):
    for kind in arg_specs.KINDS:
        assert config_support(spec.config(), kind) is None
        lower_for_cuda(spec, kind, spec.loop)


@pytest.mark.parametrize(
    "spec", arg_specs.PER_LOOP_SPECS, ids=[s.name for s in arg_specs.PER_LOOP_SPECS]
)
def test_per_loop_chains_lower_for_cuda(spec):
    """Per-loop formats (INT2 included) and absolute loops: every loop of both kinds."""
    for kind in arg_specs.KINDS:
        assert config_support(spec.config(), kind) is None
        for loop in range(spec.num_loops):
            lower_for_cuda(spec, kind, loop)


def test_lowers_for_cuda_loop0_and_vmap():
    spec = arg_specs.SUPPORTED_SPECS[0]
    for kind in arg_specs.KINDS:
        lower_for_cuda(spec, kind, 0)
        lower_for_cuda(spec, kind, spec.loop, batch=3)


# -- errors ------------------------------------------------------------------------------------


def test_errors():
    spec = arg_specs.TEST_SPECS[0]
    cache = filled(spec)
    with pytest.raises(ValueError, match="backend must be one of"):
        decode_pages(cache, "key", PAGES, loop=0, backend="triton")
    with pytest.raises(ValueError, match="kind must be one of"):
        decode_pages(cache, "keys", PAGES, loop=0)
    with pytest.raises(ValueError, match="loop must be in"):
        decode_pages(cache, "key", PAGES, loop=spec.num_loops)
    with pytest.raises(TypeError, match="static int"):
        decode_pages(cache, "key", PAGES, loop=1.0)
    with pytest.raises(ValueError, match="rank 1"):
        decode_pages(cache, "key", PAGES[None], loop=0)
    with pytest.raises(TypeError, match="int32"):
        decode_pages(cache, "key", PAGES.astype(np.float32), loop=0)
    with pytest.raises(TypeError, match="PagedKVCache"):
        decode_pages(cache.k_base, "key", PAGES, loop=0)
    with pytest.raises(TypeError, match="PagedCacheConfig"):
        config_support(cache, "key")
    if not ON_GPU:
        with pytest.raises(ValueError, match="CUDA GPU"):
            decode_pages(cache, "key", PAGES, loop=0, backend="pallas")


@pytest.mark.parametrize(
    "overrides, kind, reason",
    [
        (dict(page_size=12, k_group_size=4), "key", "page_size 12 is not a power of two"),
        (dict(head_dim=48), "value", "head_dim 48 is not a power of two"),
        (dict(page_size=512, head_dim=128), "key", "exceeds"),
        (dict(v_group_size=48), "value", "group size 48 along channels"),
        (dict(k_group_size=2, page_size=6, num_loops=1), "key", "page_size 6"),
        (dict(k_residual_format="int2", head_dim=2, k_group_size=1), "key", "head_dim >= 4"),
    ],
)
def test_unsupported_configs(overrides, kind, reason):
    """config_support names the reason; "pallas_interpret" raises it, "auto" falls back to
    XLA."""
    base = dict(num_pages=2, page_size=16, num_heads=1, head_dim=64, num_loops=2)
    config = PagedCacheConfig(**{**base, **overrides})
    assert reason in config_support(config, kind)
    cache = init_cache(config)
    pages = np.array([1, 0], np.int32)
    with pytest.raises(ValueError, match="pallas_interpret"):
        decode_pages(cache, kind, pages, loop=0, backend="pallas_interpret")
    got = decode_pages(cache, kind, pages, loop=0, backend="auto")
    ref = decode_pages(cache, kind, pages, loop=0, backend="xla")
    assert_same_values(got, ref, "auto fallback")


# -- adaptive exits -----------------------------------------------------------------------------


def _adaptive_pages(variant):
    cache, _ = adaptive_exit_cache(**ADAPTIVE_KERNEL_CACHES[variant])
    return cache, jnp.arange(cache.config.num_pages, dtype=jnp.int32)


@pytest.mark.parametrize("variant", ADAPTIVE_KERNEL_CACHES)
def test_adaptive_exits_match_decode_pages(variant):
    """Adaptive-exit caches (`PagedCacheConfig.adaptive_exit`: each row keeps its exit loop's
    reconstruction, the depth map; chains from loop 0 through loops stored absolute): the
    kernel (interpret mode) equals the XLA path, every page, kind and loop."""
    cache, pages = _adaptive_pages(variant)
    assert config_support(cache.config, "key") is None
    assert config_support(cache.config, "value") is None
    assert set(np.unique(np.asarray(cache.depth))) >= {0, 1, 2}  # rows exit in every loop
    for kind in arg_specs.KINDS:
        for loop in range(cache.config.num_loops):
            got = decode_pages(cache, kind, pages, loop=loop, backend="pallas_interpret")
            want = decode_pages(cache, kind, pages, loop=loop, backend="xla")
            assert_same_values(got, want, f"{variant} {kind} loop {loop}")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_adaptive_comparison_catches_a_kernel_ignoring_the_depth_map(monkeypatch):
    real = pallas_triton._tile_decode.reconstruct_tile

    def every_loop(*args, depth=None, **kwargs):
        return real(*args, **kwargs)

    monkeypatch.setattr(pallas_triton._tile_decode, "reconstruct_tile", every_loop)
    cache, pages = _adaptive_pages("int4-nvfp4")
    jax.clear_caches()
    try:
        got = decode_pages(cache, "key", pages, loop=2, backend="pallas_interpret")
        want = decode_pages(cache, "key", pages, loop=2, backend="xla")
        assert_same_values(got, want, "planted defect")
    finally:
        jax.clear_caches()
