"""Page pack (kvq_jax.kernels.page_pack): every backend returns the bytes of `pack_kv` applied
to each page on its own (the unfused composition of the reference codec, eager, one page at a
time: `reference_packed`), and the kernel those of the scalar oracle.

- `PagePackBase` runs per backend (subclasses: XLA, Pallas interpret mode): edge-case pages
  (NaN / inf pages, zero and signed-zero pages, INT4 and E2M1 ties, tiny pages that hit the
  NVFP4 tiny-tensor rule and its fallback path, subnormals, FP16 overflow) in bf16 / fp16 /
  fp32, through `pack_paged(backend=...)` and `paged_cache.append(backend=...)`.
- The kernel against the plain-Python oracle on one small configuration per format (HINT4:
  rows rotated in registers, a kernel that skips the rotation planted and caught; INT2: four
  codes per byte, a kernel that packs them in the wrong order planted and caught).
- The non-interpret kernel lowers for CUDA (Triton IR) for every spec in `arg_specs.SPECS`:
  this runs on a CPU and is what proves the Triton kernel builds; interpret mode is lenient.
- `--run-gpu`: the compiled kernel against XLA on a real GPU.
- Errors: unknown backend, configurations the kernel does not take.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import assert_packed_equal, assert_same_bytes, assert_trees_same_bytes

from kvq_jax import oracle
from kvq_jax.cache.paged import pack_paged, resolve_paged
from kvq_jax.cache.paged_cache import PagedCacheConfig, append, init_cache
from kvq_jax.codecs.api import pack_kv, unpack_kv
from kvq_jax.codecs.cache_state import codec_view
from kvq_jax.codecs.heavy import pack_heavy
from kvq_jax.codecs.residual import encode_residual
from kvq_jax.core import registry
from kvq_jax.kernel_checks.arg_specs import page_pack as arg_specs
from kvq_jax.kernel_checks.arg_specs.formats import (
    ensure_registered,
    heavy_format,
    intb_table_format,
)
from kvq_jax.kernels import backend as kernel_backend
from kvq_jax.kernels._tile_decode import heavy_layout
from kvq_jax.kernels.jax_compat import lower_for_gpu
from kvq_jax.kernels.page_pack import api, config_support, pallas_triton
from kvq_jax.kernels.page_pack import xla as page_pack_xla

ON_GPU = kernel_backend.pallas_device_support() is None
NUM_EDGE_PAGES = 11


def edge_pages(spec: arg_specs.PagePackSpec, seed: int = 0) -> np.ndarray:
    """[11, page_size, H, D] pages in spec's dtype, one edge case each:

    0 normal, 1 x1000, 2 +-0.0 only, 3 x1e-36 (NVFP4: amax < 7.9e-36 -> g = f32 max, 1/g
    flushes, every block takes the tiny-scale fallback; fp16: underflows to zeros), 4 one NaN,
    5 one +inf and one -inf, 6 INT4 ties (half-integers, every group of >= 4 holds 0 and 15),
    7 E2M1 ties (g = 1: one 2688, other groups hold a 6 and the tie values), 8 subnormals
    among normal values, 9 +-1e5 (fp16: inf; INT4: FP16 metadata overflow), 10 positive
    values and -0.0 (a -0.0 minimum is stored as +0.0), plus small groups (E4M3 subnormal and
    zero block scales).
    """
    rng = np.random.default_rng(seed)
    _, ps, h, d = shape = spec.shape(NUM_EDGE_PAGES)
    x = rng.standard_normal(shape).astype(np.float32)
    t_idx = np.arange(ps)[:, None, None]
    d_idx = np.arange(d)[None, None, :]
    phase = np.broadcast_to((t_idx + d_idx) % 4, (ps, h, d))
    x[1] *= 1000.0
    x[2] = np.where(rng.random((ps, h, d)) < 0.5, -0.0, 0.0)
    x[3] *= np.float32(1e-36)
    x[4, ps // 2, h - 1, 3] = np.nan
    x[5, 1, 0, 0], x[5, ps - 1, h - 1, d - 1] = np.inf, -np.inf
    halves = rng.integers(0, 31, (ps, h, d)).astype(np.float32) / 2
    x[6] = np.where(phase == 0, 0.0, np.where(phase == 2, 15.0, halves))
    ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -1.75, -5.0, -0.0])
    x[7] = np.where(phase == 0, 6.0, rng.choice(ties, (ps, h, d)))
    x[7, 0, 0, 0] = 2688.0
    x[8] = np.where(rng.random((ps, h, d)) < 0.5, x[8] * np.float32(1e-39), x[8])
    x[9] = np.where(rng.random((ps, h, d)) < 0.5, 1e5, -1e5) * np.abs(x[9])
    x[10] = np.abs(x[10])
    x[10, :, :, ::5] = -0.0
    x[0, :, :, :16] *= np.float32(1e-5)  # small groups: E4M3 subnormal block scales
    x[0, :, :, 16:32] *= np.float32(1e-9)  # ... and zero block scales
    with np.errstate(over="ignore"):  # fp16: +-1e5 -> +-inf on purpose
        return x.astype(spec.np_dtype)


def per_page(pages, *, kind="key", format="int4", group_size=None, axis=None, layer=None):
    """`pack_kv` of each page alone (resolved as `pack_paged` resolves), stacked."""
    axis, group_size = resolve_paged(format, kind, pages.shape[1:], axis, group_size)
    args = dict(kind=kind, format=format, group_size=group_size, axis=axis)
    each = [pack_kv(page, **args, **({} if layer is None else {"layer": layer})) for page in pages]
    return jax.tree.map(lambda *a: jnp.stack(a), *each)


@functools.cache
def reference_packed(spec: arg_specs.PagePackSpec):
    """(pages, expected): the edge pages and `pack_kv` of each page alone, stacked."""
    pages = jnp.asarray(edge_pages(spec))
    return pages, per_page(pages, **spec.kwargs, layer=spec.layer)


# -- per backend ------------------------------------------------------------------------------


class PagePackBase:
    backend: str

    @pytest.mark.parametrize("spec", arg_specs.SMALL_SPECS, ids=lambda s: s.name)
    def test_edge_pages_match_xla(self, spec):
        pages, expected = reference_packed(spec)
        got = pack_paged(pages, **spec.kwargs, backend=self.backend)
        assert_trees_same_bytes(got, expected, spec.name)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        assert (got.format, got.kind, got.axis, got.group_size) == (
            expected.format,
            expected.kind,
            expected.axis,
            expected.group_size,
        )

    @pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
    def test_nvfp4_every_dtype(self, dtype):
        spec = arg_specs.PagePackSpec("nvfp4", "key", 16, 3, 32, dtype)
        pages, expected = reference_packed(spec)
        assert_trees_same_bytes(pack_paged(pages, **spec.kwargs, backend=self.backend), expected)

    def test_pack_paged_dispatches(self):
        spec = arg_specs.PagePackSpec("int4", "value", 32, 1, 64, "float32", 32)
        pages, expected = reference_packed(spec)
        got = pack_paged(pages[:3], **spec.kwargs, backend=self.backend)
        assert_trees_same_bytes(got, jax.tree.map(lambda a: a[:3], expected))

    def test_zero_pages(self):
        pages = jnp.zeros((0, 16, 2, 64), jnp.bfloat16)
        for fmt in ("int4", "nvfp4"):
            got = pack_paged(pages, kind="key", format=fmt, backend=self.backend)
            axis, group = resolve_paged(fmt, "key", pages.shape[1:], None, None)
            shapes = registry.layout(fmt).array_shapes(pages.shape[1:], axis, group)
            assert {n: (a.shape, a.dtype) for n, a in got.arrays.items()} == {
                n: ((0, *shape), dtype) for n, (shape, dtype) in shapes.items()
            }

    def test_append_loops(self):
        """The cache's append packs loop 0 pages and loop 1 residual deltas with the backend:
        each complete page holds `pack_kv` of its rows (loop 0) and the payload of
        `encode_residual` of its loop 1 rows against its decoded loop 0 (one page at a time),
        the unwritten pages stay zero, the partial pages wait raw in staging."""
        config = PagedCacheConfig(
            num_pages=6, page_size=16, num_heads=2, head_dim=64, dtype=jnp.bfloat16,
            num_loops=2, k_base_format="int4", k_residual_format="nvfp4",
            v_base_format="nvfp4", v_residual_format="int4", k_group_size=8, max_seqs=2,
        )  # fmt: skip
        rng = np.random.default_rng(1)
        kv = rng.standard_normal((2, 2, 2, 40, 2, 64)).astype(ml_dtypes.bfloat16)
        tables = np.asarray([[0, 2, 4], [1, 3, 5]], np.int32)
        seq_ids = jnp.asarray([0, 1], jnp.int32)
        cache = init_cache(config)
        for loop in range(2):
            k, v = jnp.asarray(kv[loop, 0]), jnp.asarray(kv[loop, 1])
            cache = append(
                cache, k, v, block_tables=jnp.asarray(tables), seq_ids=seq_ids, loop=loop,
                backend=self.backend,
            )  # fmt: skip
        for kv_index, (kind, prefix) in enumerate((("key", "k"), ("value", "v"))):
            base_args = config.pack_args(kind, "base")
            delta_args = config.pack_args(kind, "residual")
            stored_base, stored_delta = (
                codec_view(getattr(cache, f"{prefix}_base")),
                codec_view(getattr(cache, f"{prefix}_delta")),
            )
            for seq in range(2):
                for i in range(2):  # complete logical pages 0, 1
                    page = int(tables[seq, i])
                    rows = kv[:, kv_index, seq, 16 * i : 16 * (i + 1)]
                    base = pack_kv(jnp.asarray(rows[0]), **base_args)
                    delta = encode_residual(
                        jnp.asarray(rows[1]), unpack_kv(base), **delta_args
                    ).payload
                    what = f"{kind} seq {seq} page {i}"
                    assert_trees_same_bytes(
                        jax.tree.map(lambda a, p=page: a[p], stored_base), base, what
                    )
                    assert_trees_same_bytes(
                        jax.tree.map(lambda a, p=page: a[0, p], stored_delta),
                        delta,
                        what + " delta",
                    )
                staged = np.asarray(getattr(cache, f"{prefix}_stage"))[:, seq, :8]
                assert_same_bytes(staged, kv[:, kv_index, seq, 32:40], f"{kind} staging")
            for page in (4, 5):
                for leaf in jax.tree.leaves(jax.tree.map(lambda a, p=page: a[p], stored_base)):
                    assert not np.asarray(leaf).reshape(-1).view(np.uint8).any(), "unwritten page"


class TestXLA(PagePackBase):
    backend = "xla"


class TestPallasInterpret(PagePackBase):
    backend = "pallas_interpret"


def _double_the_pages(pages, **kwargs):
    """A planted defect in the XLA path: the pages are doubled before they are packed."""
    return _XLA_PACK(pages * 2, **kwargs)


_XLA_PACK = page_pack_xla.pack_paged


def _compare_planted(format: str, backend: str) -> None:
    """The per-backend comparison of `format`'s small spec, with JAX's caches cleared around
    it (a defect planted by monkeypatch must be traced, not taken from a cache)."""
    spec = next(s for s in arg_specs.SMALL_SPECS if s.format == format)
    pages, expected = reference_packed(spec)
    with _traced_anew():
        got = pack_paged(pages, **spec.kwargs, backend=backend)
        assert_trees_same_bytes(got, expected, "planted defect")


@contextlib.contextmanager
def _traced_anew():
    """JAX's caches cleared around a check of a planted defect (the monkeypatched function
    must be traced, not taken from a cache, and must not stay in one)."""
    jax.clear_caches()
    try:
        yield
    finally:
        jax.clear_caches()


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_reference_catches_a_planted_defect(monkeypatch):
    """The per-backend comparison fails when the XLA path packs doubled pages (xfail strict:
    the test suite fails if this ever passes)."""
    monkeypatch.setattr(page_pack_xla, "pack_paged", _double_the_pages)
    _compare_planted("int4", "xla")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_hint4_comparison_catches_a_kernel_that_skips_the_rotation(monkeypatch):
    """The per-backend comparison fails when the kernel packs HINT4 pages unrotated."""
    monkeypatch.setattr(pallas_triton._tile_decode, "rotate_tile", lambda x, interpret: x)
    _compare_planted("hint4", "pallas_interpret")


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_int2_comparison_catches_codes_packed_in_the_wrong_order(monkeypatch):
    """The per-backend comparison fails when the kernel puts channel 4j + 1 where 4j + 2
    belongs (pairs of pairs swapped inside each byte)."""

    def swapped(codes):
        r, d = codes.shape
        a, b, c, e = (codes.reshape(r, d // 4, 4)[..., i] for i in range(4))
        return (a | (c << 2) | (b << 4) | (e << 6)).astype(jnp.uint8)

    monkeypatch.setattr(pallas_triton, "_pack_2bit", swapped)
    _compare_planted("int2", "pallas_interpret")


# -- heavy-row values ---------------------------------------------------------------------------


def heavy_reference(spec, pages, rows) -> dict:
    """`pack_heavy` (kvq_jax.codecs.heavy) of each page alone with its rows, stacked, as the
    `PackedKV` fields of a heavy-row page plane."""
    axis, group_size = spec.resolved()
    heavy = heavy_layout(spec.format)
    each = []
    for page, r in zip(pages, rows, strict=True):
        hk = pack_heavy(
            page, r, kind=spec.kind, format=heavy.base.name, group_size=heavy.heavy_group,
            base_group_size=group_size, axis=axis,
        )  # fmt: skip
        each.append({**hk.payload.arrays, "heavy_rows": hk.rows, "heavy_codes": hk.codes,
                     "heavy_minimum": hk.minimum, "heavy_scale": hk.scale})  # fmt: skip
    return jax.tree.map(lambda *a: jnp.stack(a), *each)


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
@pytest.mark.parametrize(
    "spec", (*arg_specs.HEAVY_SPECS[::2], arg_specs.HEAVY_INT4_KEYS), ids=lambda s: s.name
)
def test_heavy_rows_match_pack_heavy(spec, backend):
    """Heavy-row pages (values on channel groups, keys on token groups of G - 1 rows; the rows
    handed in: random, a group's first and last row, an index past the group) equal
    `pack_heavy` of each page, on the edge pages (NaN, inf, signed zeros, subnormal and
    overflowing rows)."""
    pages, rows = jnp.asarray(edge_pages(spec)), spec.heavy_rows(NUM_EDGE_PAGES)
    got = pack_paged(pages, **spec.kwargs, rows=rows, backend=backend)
    assert_trees_same_bytes(got.arrays, heavy_reference(spec, pages, rows), spec.name)
    assert got.format == spec.format and got.shape == tuple(pages.shape[1:])


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_heavy_comparison_catches_a_wrong_heavy_row_code(monkeypatch):
    """The kernel quantizing the heavy rows with 127 levels instead of 255."""
    monkeypatch.setattr(pallas_triton, "HEAVY_LEVELS", np.float32(127.0))
    spec = arg_specs.HEAVY_SPECS[0]
    pages, rows = jnp.asarray(edge_pages(spec)), spec.heavy_rows(NUM_EDGE_PAGES)
    with _traced_anew():
        got = pack_paged(pages, **spec.kwargs, rows=rows, backend="pallas_interpret")
        assert_trees_same_bytes(got.arrays, heavy_reference(spec, pages, rows), "planted")


def test_heavy_kernel_matches_oracle():
    """Heavy rows over HINT4 (G 8, channel groups of 16) against the plain-Python oracle."""
    spec = arg_specs.PagePackSpec(heavy_format("hint4", 8), "value", 16, 2, 16, "bfloat16", 16)
    pages = edge_pages(spec, seed=3)
    rows = spec.heavy_rows(len(pages), seed=1)
    got = pack_paged(jnp.asarray(pages), **spec.kwargs, rows=rows, backend="pallas_interpret")
    for i, page in enumerate(pages):
        want = oracle.pack_heavy(page, np.asarray(rows[i]), format="hint4", kind="value",
                                 group_size=8, base_group_size=16, axis="channels")  # fmt: skip
        expected = {**want.payload.arrays, **{f"heavy_{n}": a for n, a in want.arrays.items()}}
        assert_packed_equal(jax.tree.map(lambda a, i=i: a[i], got), expected, f"page {i}")


def test_heavy_rows_arguments():
    spec = arg_specs.HEAVY_SPECS[0]
    pages = jnp.zeros(spec.shape(2), spec.np_dtype)
    assert "takes the heavy rows" in config_support(pages.shape, pages.dtype, **spec.kwargs)
    with pytest.raises(ValueError, match="rows must be an integer array"):
        pack_paged(pages, **spec.kwargs, rows=jnp.zeros((2, 2, 2), jnp.uint8))
    with pytest.raises(ValueError, match="stores no heavy rows"):
        pack_paged(pages, kind="value", rows=jnp.zeros((2, 1, 2), jnp.uint8))
    keys = {g: heavy_format("int4", g) for g in (16, 64)} | {0: heavy_format("hint4", 64)}
    ensure_registered(*keys.values())  # synthetic formats, out of the registry after the module
    support = functools.partial(config_support, pages.shape, pages.dtype, kind="key", rows=True)
    assert support(format=keys[64]) is None  # payload on token groups
    assert "over 'hint4' on token groups" in support(format=keys[0])
    assert "token groups of one heavy group" in support(format=keys[16], group_size=5)


# -- INTB keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("spec", arg_specs.INTB_SPECS, ids=lambda s: s.name)
def test_intb_keys_match_pack_kv(spec, backend):
    """INTB key pages (bit streams of W bytes, W not a power of two; a per-layer format read
    as its layer) equal `pack_kv` of each page, on the edge pages."""
    pages = jnp.asarray(edge_pages(spec))
    layer = None if spec.layer is None else jnp.int32(spec.layer)
    got = pack_paged(pages, **spec.kwargs, layer=layer, backend=backend)
    assert_trees_same_bytes(got, per_page(pages, **spec.kwargs, layer=spec.layer), spec.name)


def _msb_first(fmt, stream_bits):
    """A planted defect: each byte's stream bits in reverse order."""
    levels, channel, bit = _INTB_MAPS(fmt, stream_bits)
    flip = lambda a: a.reshape(*a.shape[:-1], -1, 8)[..., ::-1].reshape(a.shape)  # noqa: E731
    return levels, flip(channel), flip(bit)


_INTB_MAPS = pallas_triton.intb_maps


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_intb_comparison_catches_msb_first_streams(monkeypatch):
    monkeypatch.setattr(pallas_triton, "intb_maps", _msb_first)
    spec = arg_specs.INTB_SPECS[-1]
    pages = jnp.asarray(edge_pages(spec))
    with _traced_anew():
        got = pack_paged(pages, **spec.kwargs, layer=spec.layer, backend="pallas_interpret")
        want = per_page(pages, **spec.kwargs, layer=spec.layer)
        assert_trees_same_bytes(got, want, "planted defect")


def test_intb_streams_past_the_tile_limit_are_left_to_xla():
    wide = intb_table_format([[8] * 128] * 2)  # 8W = 1024 stream bits per row
    ensure_registered(wide)
    reason = config_support((1, 64, 2, 128), jnp.bfloat16, kind="key", format=wide)
    assert "64 * 1024 exceeds the kernel's tile limit" in reason
    assert config_support((1, 32, 2, 128), jnp.bfloat16, kind="key", format=wide) is None


def test_intb_kernel_matches_oracle():
    """An INTB table of 1-8 bit channels (codes straddling bytes, W = 9) against the
    plain-Python oracle, token groups of 8."""
    table = [[1, 2, 3, 4, 5, 6, 7, 8, 8, 7, 6, 5, 4, 3, 2, 1], [8, 1, 7, 2, 6, 3, 5, 4] * 2]
    spec = arg_specs.PagePackSpec(intb_table_format(table), "key", 16, 2, 16, "bfloat16", 8)
    pages = edge_pages(spec, seed=3)
    got = pack_paged(jnp.asarray(pages), **spec.kwargs, backend="pallas_interpret")
    assert got.codes.shape[-1] == 9
    for i, page in enumerate(pages):
        want = oracle.pack(page, format="intb", kind="key", group_size=8, bits=table)
        assert_packed_equal(jax.tree.map(lambda a, i=i: a[i], got), want.arrays, f"page {i}")


# -- oracle -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        arg_specs.PagePackSpec("int4", "key", 16, 2, 16, "bfloat16", 8),
        arg_specs.PagePackSpec("int4", "value", 16, 2, 16, "float32", 8),
        arg_specs.PagePackSpec("hint4", "value", 16, 2, 16, "bfloat16", 16),
        arg_specs.PagePackSpec("hint4", "key", 16, 2, 16, "float16", 8),
        arg_specs.PagePackSpec("int2", "key", 16, 2, 16, "float32", 8),
        arg_specs.PagePackSpec("hint2", "value", 16, 2, 16, "bfloat16", 16),
        arg_specs.PagePackSpec("nvfp4", "key", 16, 2, 16, "float16"),
        arg_specs.PagePackSpec("fp8_e4m3", "value", 16, 2, 16, "float32"),
    ],
    ids=lambda s: s.name,
)
def test_kernel_matches_oracle(spec):
    pages = edge_pages(spec, seed=3)
    got = pack_paged(jnp.asarray(pages), **spec.kwargs, backend="pallas_interpret")
    axis, group_size = spec.resolved()
    for i, page in enumerate(pages):
        want = oracle.pack(
            page, format=spec.format, kind=spec.kind, group_size=group_size, axis=axis
        )
        assert_packed_equal(jax.tree.map(lambda a, i=i: a[i], got), want.arrays, f"page {i}")


def test_e4m3_encode_matches_cast():
    """The kernel's arithmetic f32 -> E4M3 rounding equals XLA's cast on [0, 448]: every E4M3
    value, every midpoint between neighbours (ties to even), the values one float32 ulp either
    side of them, and random values across the range (log-uniform, subnormal E4M3 included)."""
    grid = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = (grid[:-1] + grid[1:]) / 2
    pts = np.concatenate([grid, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf)])
    rand = np.exp(np.random.default_rng(0).uniform(np.log(1e-4), np.log(448.0), 20000))
    a = np.concatenate([pts, rand, [0.0, 2.0**-10, 448.0, np.nan]]).astype(np.float32)
    code, value = jax.jit(functools.partial(pallas_triton._e4m3_encode, interpret=True))(a)
    want = jnp.asarray(a).astype(jnp.float8_e4m3fn)
    assert_same_bytes(np.asarray(code).astype(np.uint8), np.asarray(want).view(np.uint8), "code")
    assert_same_bytes(np.asarray(value), np.asarray(want.astype(jnp.float32)), "value")


# -- Triton lowering --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", (*arg_specs.SPECS, arg_specs.HEAVY_INT4_KEYS),
                         ids=lambda s: s.name)  # fmt: skip
def test_kernel_lowers_for_cuda(spec):
    axis, group_size = spec.resolved()
    rows = spec.rows_struct(5)  # heavy-row values: their rows handed in
    heavy = rows is not None
    assert config_support(spec.shape(5), spec.np_dtype, **spec.kwargs, rows=heavy) is None

    def kernel(pages, rows):
        return pallas_triton.pack_paged(
            pages, kind=spec.kind, format=spec.format, axis=axis, group_size=group_size,
            interpret=False, rows=rows,
        )  # fmt: skip

    lowered = lower_for_gpu(kernel, spec.shape_dtype_struct(5), rows)
    text = lowered.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1  # one fused kernel per call
    assert "num_warps" in text


@pytest.mark.gpu
@pytest.mark.parametrize("spec", arg_specs.SPECS, ids=lambda s: s.name)
def test_compiled_kernel_matches_xla_on_gpu(spec):
    if not ON_GPU:
        pytest.skip(kernel_backend.pallas_device_support())
    if spec.heavy_group is not None:
        pages, rows = jnp.asarray(edge_pages(spec)), spec.heavy_rows(NUM_EDGE_PAGES)
        expected = heavy_reference(spec, pages, rows)
        for backend in ("pallas", "auto"):
            got = pack_paged(pages, **spec.kwargs, rows=rows, backend=backend)
            assert_trees_same_bytes(got.arrays, expected, backend)
        return
    pages, expected = reference_packed(spec)
    layer = None if spec.layer is None else jnp.int32(spec.layer)
    for backend in ("pallas", "auto"):
        got = pack_paged(pages, **spec.kwargs, layer=layer, backend=backend)
        assert_trees_same_bytes(got, expected, backend)


# -- errors and fallbacks ---------------------------------------------------------------------


def test_bad_backend():
    pages = jnp.zeros((2, 16, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="backend"):
        pack_paged(pages, kind="key", backend="triton")
    with pytest.raises(ValueError, match="backend"):
        pack_paged(pages, kind="key", backend="cuda")


def test_invalid_arguments_raise_as_pack_paged():
    pages = jnp.zeros((2, 16, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="must divide page_size"):
        pack_paged(pages, kind="key", group_size=32, backend="pallas_interpret")
    with pytest.raises(ValueError, match="group_size must be 16"):
        pack_paged(pages, kind="key", format="nvfp4", group_size=8)
    with pytest.raises(ValueError, match="rank 4"):
        pack_paged(pages[0], kind="key")
    with pytest.raises(TypeError, match="dtype"):
        pack_paged(pages.astype(jnp.int32), kind="key")


@pytest.mark.parametrize(
    "shape, kwargs, reason",
    [
        ((2, 48, 2, 64), dict(kind="key"), "page_size 48"),
        ((2, 16, 2, 96), dict(kind="value", format="fp8_e4m3"), "D=96"),
        ((2, 16, 2, 8), dict(kind="value", format="nvfp4"), "partial channel group"),
        ((2, 16, 2, 64), dict(kind="value", group_size=48), "partial channel group"),
        ((2, 256, 1, 256), dict(kind="key", format="nvfp4"), "tile limit"),
    ],
)
def test_unsupported_config(shape, kwargs, reason):
    """config_support names the reason; explicit Pallas raises (auto: next test)."""
    assert reason in config_support(shape, np.float32, **kwargs)
    pages = jnp.zeros(shape, jnp.float32)
    for backend in ("pallas", "pallas_interpret"):
        with pytest.raises(ValueError, match=rf"backend='{backend}'.*{reason}"):
            pack_paged(pages, **kwargs, backend=backend)


def test_auto_falls_back_to_xla():
    """A page size the kernel does not take (48) packs through XLA under auto."""
    pages = jnp.asarray(np.random.default_rng(0).standard_normal((2, 48, 2, 64)), jnp.float32)
    assert config_support(pages.shape, pages.dtype, kind="key") is not None
    assert_trees_same_bytes(pack_paged(pages, kind="key", backend="auto"), per_page(pages))


@pytest.mark.skipif(ON_GPU, reason="the device runs the kernel")
def test_pallas_needs_a_cuda_device():
    pages = jnp.zeros((2, 16, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"backend='pallas'.*CUDA"):
        pack_paged(pages, kind="key", backend="pallas")
    # auto runs XLA here
    assert_trees_same_bytes(pack_paged(pages, kind="key"), per_page(pages))


def test_storage_bytes():
    read, written = api.storage_bytes((4, 16, 2, 64), jnp.bfloat16, kind="key", format="nvfp4")
    assert read == 4 * 16 * 2 * 64 * 2
    assert written == 4 * (16 * 2 * 32 + 2 * 64 + 4)
