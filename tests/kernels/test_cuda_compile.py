"""The Pallas Triton kernels compile to GPU machine code for sm_80, sm_90a and sm_120a, with no
GPU (`kvq_jax.kernel_checks.cuda_compile`: JAX deviceless AOT compilation, the pinned ptxas).

- `cuda_compile` tests (python -m pytest -m cuda_compile): every kernel configuration of the
  CI subset (`cuda_compile.ci_subset`: every kernel, every format, both head dims, the
  largest page; KVQ_CUDA_COMPILE=full: every configuration; =smoke: `cuda_compile.smoke_subset`,
  every format in every role once, for the second CI environment; for sm_90a and sm_120a the
  default run takes the smoke subset, the CI subset with --run-slow) compiles for each target with
  its measured knobs (`cuda_compile.tuned_knobs`), the PTX's `.target` is the target's, no
  register spills (0 bytes of spill stores) and shared memory within the target's limit.
  A deliberately broken kernel fails with the compiler's message. They skip, saying why and
  what to install (`cuda_compile.INSTALL_LINE`), where the CUDA plugin or ptxas is absent.
- The rest (parsing of ptxas / XLA output, target configs, the subset) runs everywhere.
"""

from __future__ import annotations

import os

import pytest

from kvq_jax.kernel_checks import cuda_compile as cc

MISSING = cc.availability()
needs_compiler = pytest.mark.skipif(MISSING is not None, reason=f"no CUDA compiler: {MISSING}")
LEVEL = os.environ.get("KVQ_CUDA_COMPILE", "ci")
if LEVEL not in ("ci", "full", "smoke"):
    raise ValueError(f"KVQ_CUDA_COMPILE must be ci, full or smoke, got {LEVEL!r}")
CONFIGS = cc.kernel_configs()
SELECTED = {
    "full": CONFIGS,
    "ci": cc.ci_subset(CONFIGS),
    "smoke": cc.smoke_subset(cc.ci_subset(CONFIGS)),
}[LEVEL]
TARGETS = tuple(cc.TARGETS)


# -- compile checks (need the CUDA plugin and ptxas) -------------------------------------------


def _compile_cases():
    """(cfg, target) cases, cfg fastest. At the CI level, sm_90a and sm_120a take the smoke
    subset by default and the rest of the CI subset with --run-slow (CI time: the second CI
    environment compiles the smoke subset for sm_120a too); sm_80, the target with the fewest
    registers to spare (docs/kernel_resources.md), takes the whole CI subset."""
    smoke = {(c.kernel, c.name) for c in cc.smoke_subset(SELECTED)} if LEVEL == "ci" else None
    for target in TARGETS:
        for c in SELECTED:
            marks = []
            if (c.kernel, c.name) in cc.KNOWN_SPILLS:
                marks.append(
                    pytest.mark.xfail(strict=True, reason=cc.KNOWN_SPILLS[c.kernel, c.name])
                )
            if smoke is not None and target != "sm_80" and (c.kernel, c.name) not in smoke:
                marks.append(pytest.mark.slow)
            yield pytest.param(c, target, id=f"{c.kernel}-{c.name}-{target}", marks=marks)


@pytest.mark.cuda_compile
@needs_compiler
@pytest.mark.parametrize("cfg,target", list(_compile_cases()))
def test_kernel_compiles_without_spills(cfg, target):
    knobs = cc.tuned_knobs(cfg, target)
    fn, args = cfg.build(knobs)
    result = cc.compile_for_target(fn, args, target)
    assert result.ptx_target == target
    limit = cc.TARGETS[target].shared_memory_per_block_optin
    for k in result.kernels:
        what = f"{cfg.kernel} {cfg.name} on {target} with {knobs.label()}: {k}"
        assert k.spill_stores == 0, f"register spills: {what}"
        assert k.smem <= limit, f"shared memory over {limit}: {what}"
        assert k.threads == 32 * knobs.num_warps, what


def _kernel_call(kernel, in_shapes, out_shape, *, num_warps=4):
    import jax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    def fn(*xs):
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
            name="kvq_broken",
        )(*xs)

    return fn, tuple(jax.ShapeDtypeStruct(s, d) for s, d in in_shapes)


def _big_dot():
    """A [128, 256] x [256, 128] bf16 dot: 128 KiB of shared memory (operand tiles)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import triton as pltriton

    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = pltriton.dot(x_ref[...], y_ref[...])

    shapes = (((128, 256), jnp.bfloat16), ((256, 128), jnp.bfloat16))
    return _kernel_call(kernel, shapes, jax.ShapeDtypeStruct((128, 128), jnp.float32))


def _fp8_convert_asm():
    """cvt.rn.satfinite.e4m3x2.f32 as inline PTX: an instruction sm_80 lacks (sm_89+)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import triton as pltriton

    def kernel(x_ref, o_ref):
        x = x_ref[...]
        (y,) = pltriton.elementwise_inline_asm(
            "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $1, $1; cvt.u32.u16 $0, t; }",
            args=[x],
            constraints="=r,r",
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.int32)],
        )
        o_ref[...] = y

    shapes = (((64, 64), jnp.float32),)
    return _kernel_call(kernel, shapes, jax.ShapeDtypeStruct((64, 64), jnp.int32))


@pytest.mark.cuda_compile
@needs_compiler
def test_too_much_shared_memory_fails_on_sm120(tmp_path):
    fn, args = _big_dot()
    ok = cc.compile_for_target(fn, args, "sm_90a")
    assert ok.ptx_target == "sm_90a"
    assert max(k.smem for k in ok.kernels) > cc.TARGETS["sm_120a"].shared_memory_per_block_optin
    with pytest.raises(cc.CompileError, match=r"Shared memory size limit exceeded.*101376"):
        cc.compile_for_target(fn, args, "sm_120a", dump_dir=str(tmp_path))
    # XLA refuses the launch before any PTX is written; none of another target either.
    assert cc.dumped_ptx_targets(str(tmp_path)) <= {"sm_120a"}


@pytest.mark.cuda_compile
@needs_compiler
def test_instruction_sm80_lacks_fails_on_sm80(tmp_path):
    fn, args = _fp8_convert_asm()
    for target in ("sm_90a", "sm_120a"):
        assert cc.compile_for_target(fn, args, target).ptx_target == target
    with pytest.raises(cc.CompileError, match=r"ptxas.*requires \.target sm_89 or higher"):
        cc.compile_for_target(fn, args, "sm_80", dump_dir=str(tmp_path))
    assert cc.dumped_ptx_targets(str(tmp_path)) == {"sm_80"}  # the PTX ptxas refused


@pytest.mark.cuda_compile
@needs_compiler
def test_pinned_ptxas_is_used(tmp_path):
    """XLA compiles with the CUDA root of the ptxas the report runs (one ptxas for both)."""
    assert cc.ptxas_version().startswith(("12.", "13."))
    fn, args = _fp8_convert_asm()
    cc.compile_for_target(fn, args, "sm_90a", dump_dir=str(tmp_path))
    opts = "".join(p.read_text() for p in tmp_path.glob("*.debug_options"))
    assert f'xla_gpu_cuda_data_dir: "{cc.cuda_data_dir()}"' in opts


# -- the CPU-only parts (always run) -------------------------------------------------------------

PTXAS_V = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kvq_paged_decode_attention' for 'sm_90a'
ptxas info    : Function properties for kvq_paged_decode_attention
    6144 bytes stack frame, 20264 bytes spill stores, 21480 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 6144 bytes cumulative stack size
ptxas info    : Compile time = 3753.028 ms
ptxas info    : Compiling entry function 'other' for 'sm_90a'
ptxas info    : Function properties for other
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 1024 bytes smem, 380 bytes cmem[0]
"""

THUNKS = """\
001: kCustomKernel [source       | next=002 (1)] loop_clamp_fusion grid: [1, 1, 1] threads: \
[8, 1, 1]  shared_memory: 0 bytes
002: kCustomKernel [prev=001 (1) | sink        ] kvq_page_reconstruct grid: [8, 4, 1] \
threads: [64, 1, 1]  shared_memory: 4096 bytes
"""


def test_parse_ptxas():
    a, b = cc.parse_ptxas(PTXAS_V)
    assert a == cc.KernelResources("kvq_paged_decode_attention", 32, 20264, 21480, 6144, 0)
    assert (b.name, b.registers, b.spill_stores, b.static_smem) == ("other", 12, 0, 1024)


def test_parse_thunk_sequence():
    assert cc.parse_thunk_sequence(THUNKS) == {
        "loop_clamp_fusion": (8, 0),
        "kvq_page_reconstruct": (64, 4096),
    }


def test_ptx_target():
    assert cc.ptx_target("//\n.version 9.0\n.target sm_120a\n.address_size 64\n") == "sm_120a"
    with pytest.raises(ValueError):
        cc.ptx_target(".version 9.0\n")


@pytest.mark.parametrize(
    ("target", "optin", "ext"),
    [("sm_80", 166912, "NONE"), ("sm_90a", 232448, "ACCELERATED_FEATURES"),
     ("sm_120a", 101376, "ACCELERATED_FEATURES")],
)  # fmt: skip
def test_target_configs(target, optin, ext):
    text = cc.TARGETS[target].config_text()
    assert f"shared_memory_per_block_optin: {optin}\n" in text
    assert f"feature_extension: {ext}\n" in text
    major = {"sm_80": 8, "sm_90a": 9, "sm_120a": 12}[target]
    assert f"major: {major}\n" in text and 'platform_name: "CUDA"' in text


def test_ci_subset_covers_every_kernel_format_and_head_dim():
    subset = cc.ci_subset(CONFIGS)
    assert len(subset) < len(CONFIGS) / 2
    for attr in ("kernel", "head_dim"):
        assert {getattr(c, attr) for c in subset} == {getattr(c, attr) for c in CONFIGS}
    for kernel in cc.KERNELS:
        every = {f for c in CONFIGS if c.kernel == kernel for f in c.formats}
        assert every == {f for c in subset if c.kernel == kernel for f in c.formats}
        largest = max(c.page_size for c in CONFIGS if c.kernel == kernel)
        assert any(c.page_size == largest for c in subset if c.kernel == kernel)
    names = [f"{c.kernel}/{c.name}" for c in CONFIGS]
    assert len(set(names)) == len(names)


def test_smoke_subset_compiles_every_format_of_every_kernel():
    subset = cc.ci_subset(CONFIGS)
    smoke = cc.smoke_subset(subset)
    assert len(smoke) < len(subset) / 2
    for kernel in cc.KERNELS:
        every = {f for c in subset if c.kernel == kernel for f in c.formats}
        assert {f for c in smoke if c.kernel == kernel for f in c.formats} == every, kernel
    kinds = {c.spec.kind for c in smoke if c.kernel == "page_pack"}
    assert kinds == {"key", "value"}


def test_tuned_knobs_are_valid():
    for cfg in CONFIGS:
        for target in TARGETS:
            k = cc.tuned_knobs(cfg, target)
            assert k.num_warps in (1, 2, 4, 8, 16) and k.num_stages >= 1, (cfg.name, k)


def test_install_line_is_well_formed():
    from packaging.requirements import Requirement

    words = cc.INSTALL_LINE.split()
    assert words[:2] == ["pip", "install"]
    reqs = [Requirement(w) for w in words[2:]]
    assert {r.name for r in reqs} >= {"jax-cuda13-plugin", "nvidia-cuda-nvcc", "nvidia-nvvm"}
    assert all(str(r.specifier) for r in reqs)
    if MISSING is not None:
        assert cc.INSTALL_LINE in MISSING
