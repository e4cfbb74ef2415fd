"""Compile the Pallas Triton kernels to GPU machine code on a machine without a GPU.

JAX's deviceless ahead-of-time compilation: a compile-only CUDA device is built from a
`GpuTargetConfigProto` holding a real device's limits (`TARGETS`), the kernel is jitted with a
sharding on that device and compiled; XLA runs its Triton passes and ptxas for the target's
architecture (sm_80, sm_90a, sm_120a). The PTX is dumped (`xla_dump_to`) and `ptxas -v` on
it gives registers, spill bytes and stack per kernel; the Triton shared memory (dynamic,
invisible to ptxas) comes from the `ttg.shared` attribute of the Triton GPU IR XLA dumps.

    from kvq_jax.kernel_checks import cuda_compile as cc
    result = cc.compile_for_target(fn, args, "sm_90a")        # raises CompileError
    result.ptx_target, result.kernels[0].registers, result.kernels[0].spill_stores

Needs `jax-cuda13-plugin` (the CUDA compiler in jaxlib's plugin form) and a ptxas + libdevice:
`availability()` says what is missing (None when everything is there). The ptxas is pinned:
the one of the PyPI package `nvidia-cuda-nvcc` at version `PINNED_NVCC`, or `KVQ_PTXAS` (a
path, an explicit override); XLA is pointed at its CUDA root (`xla_gpu_cuda_data_dir`) at
every compile, so XLA and the resource report use the same binary. Run with
JAX_PLATFORMS=cpu (nothing runs on a device).

The lowering is traced inside `kvq_jax.kernels.jax_compat.gpu_target` of the target's compute
capability. jax >= 0.11 then lowers for exactly that capability; jax 0.10 lowers as for 9.0
whatever the target (`jax/_src/pallas/triton/pallas_call_registration.py`), so there a
lowering decision keyed on the capability is taken as for sm_90, and XLA compiles that IR for
the target's architecture.

Kernel configurations (`kernel_configs`): one `KernelConfig` per (kernel, arg_specs entry,
kind), each able to build its jittable function and abstract arguments for given compiler
knobs (`Knobs`: num_warps, num_stages, num_splits).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

# The CUDA plugin checks for a usable CUDA installation (cuDNN, driver) when jax discovers
# it, unless JAX_PLATFORMS excludes CUDA; here only its compiler is used, so the check is
# skipped (it has to be set before jax's first backend initialization to count).
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def _jax_version() -> str:
    """The installed jax's version, without importing jax (the CUDA plugin must match it)."""
    from importlib import metadata

    try:
        return metadata.version("jax")
    except metadata.PackageNotFoundError:
        return "0.10.2"


#: The pinned ptxas: PyPI `nvidia-cuda-nvcc` of this version (with `nvidia-nvvm` for libdevice).
PINNED_NVCC = "13.5.37"
#: The line that installs what the `cuda_compile` tests need beside the installed jax (the
#: plugin of jax's own version; `.ci/run` installs it through the `cuda-compile` extra).
INSTALL_LINE = (
    f"pip install jax-cuda13-plugin=={_jax_version()} "
    f"nvidia-cuda-nvcc=={PINNED_NVCC} nvidia-nvvm=={PINNED_NVCC}"
)

# -- targets -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Target:
    """One GPU's limits, as XLA's `GpuTargetConfigProto` wants them (values of
    openxla/xla `xla/backends/gpu/target_config/specs`; RTX 5090 from NVIDIA's figures)."""

    arch: str  # ptxas --gpu-name: sm_80, sm_90a, sm_120a
    device: str
    major: int
    minor: int
    accelerated: bool  # feature_extension ACCELERATED_FEATURES (sm_90a / sm_120a)
    core_count: int
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    threads_per_core_limit: int
    fpus_per_core: int
    memory_bandwidth: int
    l2_cache_size: int
    clock_rate_ghz: float
    device_memory_size: int

    def config_text(self) -> str:
        """The GpuTargetConfigProto in protobuf text format."""
        ext = "ACCELERATED_FEATURES" if self.accelerated else "NONE"
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_core}
  threads_per_core_limit: {self.threads_per_core_limit}
  core_count: {self.core_count}
  fpus_per_core: {self.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.memory_bandwidth}
  l2_cache_size: {self.l2_cache_size}
  clock_rate_ghz: {self.clock_rate_ghz}
  device_memory_size: {self.device_memory_size}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {self.major}
    minor: {self.minor}
    feature_extension: {ext}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 10
  patch: 0
}}
device_description_str: "{self.device}"
"""


TARGETS: dict[str, Target] = {
    "sm_80": Target(
        "sm_80", "NVIDIA A100-SXM4-80GB", 8, 0, False, 108, 167936, 166912, 2048, 64,
        2039040000000, 41943040, 1.41, 85100068864,
    ),
    "sm_90a": Target(
        "sm_90a", "NVIDIA H100 80GB HBM3", 9, 0, True, 132, 233472, 232448, 2048, 128,
        3352320000000, 52428800, 1.98, 85520809984,
    ),
    "sm_120a": Target(
        "sm_120a", "NVIDIA GeForce RTX 5090", 12, 0, True, 170, 102400, 101376, 1536, 128,
        1792000000000, 100663296, 2.41, 34190917632,
    ),
}  # fmt: skip

# -- tools ---------------------------------------------------------------------------------


def _nvcc_package_root() -> pathlib.Path | None:
    """The CUDA root of the PyPI `nvidia-cuda-nvcc` package (bin/ptxas), if installed."""
    for base in sys.path:
        for sub in ("nvidia/cu13", "nvidia/cuda_nvcc"):
            root = pathlib.Path(base) / sub
            if (root / "bin" / "ptxas").is_file():
                return root
    return None


def ptxas_path() -> str | None:
    """The pinned ptxas: $KVQ_PTXAS (an explicit choice), else PyPI nvidia-cuda-nvcc's; a
    ptxas on PATH is not taken (its version would change the figures silently)."""
    env = os.environ.get("KVQ_PTXAS")
    if env:
        return env if os.path.isfile(env) else None
    root = _nvcc_package_root()
    return None if root is None else str(root / "bin" / "ptxas")


def cuda_data_dir() -> str | None:
    """The CUDA root that holds the pinned ptxas (bin/ptxas) and libdevice
    (nvvm/libdevice/libdevice.10.bc), for --xla_gpu_cuda_data_dir."""
    ptxas = ptxas_path()
    if ptxas is None:
        return None
    root = pathlib.Path(ptxas).resolve().parent.parent
    if (root / "nvvm" / "libdevice" / "libdevice.10.bc").is_file():
        return str(root)
    return None


@functools.cache
def ptxas_version(ptxas: str | None = None) -> str:
    """ "13.5.37"-like, from `ptxas --version`."""
    ptxas = ptxas or ptxas_path()
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"V(\d+\.\d+\.\d+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1]


def availability() -> str | None:
    """None when deviceless CUDA compilation can run here, else what is missing (and the
    line that installs it)."""
    try:
        import jax_plugins.xla_cuda13  # noqa: F401
    except ImportError:
        return f"the JAX CUDA plugin is not installed ({INSTALL_LINE})"
    if ptxas_path() is None:
        return f"no ptxas (set KVQ_PTXAS=/path/to/cuda/bin/ptxas or {INSTALL_LINE})"
    if cuda_data_dir() is None:
        return f"no libdevice beside ptxas {ptxas_path()} ({INSTALL_LINE})"
    if not os.environ.get("KVQ_PTXAS") and ptxas_version() != PINNED_NVCC:
        return f"ptxas {ptxas_version()} is not the pinned {PINNED_NVCC} ({INSTALL_LINE})"
    try:
        _mesh("sm_90a")
    except Exception as e:  # the plugin failed at jax's discovery (e.g. its CUDA check)
        return (
            f"no compile-only CUDA device ({type(e).__name__}: {e}); run with "
            "JAX_PLATFORMS=cpu or JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1"
        )
    return None


def _configure_xla() -> None:
    """Point XLA at the pinned CUDA root (ptxas, libdevice); before the backend starts."""
    root = cuda_data_dir()
    flags = os.environ.get("XLA_FLAGS", "")
    if root and "--xla_gpu_cuda_data_dir" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_cuda_data_dir={root}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# -- compilation ---------------------------------------------------------------------------------


#: XLA's default optimization of the LLVM backends, whatever XLA_FLAGS or
#: JAX_DISABLE_MOST_OPTIMIZATIONS say (the test suite lowers it for its CPU compiles): the
#: figures are those of the code a GPU runs.
DEFAULT_OPTIMIZATION = {"xla_backend_optimization_level": 3,
                        "xla_llvm_disable_expensive_passes": False}  # fmt: skip


class CompileError(RuntimeError):
    """XLA / Triton / ptxas refused a kernel; the message is the compiler's."""


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """`ptxas -v` figures for one kernel (entry function) of a compiled program."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    static_smem: int
    shared_mem: int = 0  # launch (dynamic) shared memory, from XLA's thunk sequence
    threads: int = 0  # threads per block (num_warps * 32)

    @property
    def smem(self) -> int:
        """Shared memory per block: static (ptxas) + dynamic (launch)."""
        return self.static_smem + self.shared_mem


@dataclasses.dataclass(frozen=True)
class CompileResult:
    target: str
    ptx_target: str  # the PTX's `.target` line's architecture
    kernels: tuple[KernelResources, ...]
    dump_dir: str


@functools.cache
def _mesh(arch: str):
    _configure_xla()
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        platform="cuda", topology="1x1x1", target_config=TARGETS[arch].config_text()
    )
    return topologies.make_mesh(topo, (1,), ("x",))


_PTX_TARGET = re.compile(r"^\s*\.target\s+(sm_\w+)", re.M)
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def ptx_target(ptx: str) -> str:
    m = _PTX_TARGET.search(ptx)
    if not m:
        raise ValueError("no .target line in the PTX")
    return m.group(1)


def dumped_ptx_targets(dump_dir: str, kernel_prefix: str = "kvq_") -> set[str]:
    """The `.target`s of the PTX files in `dump_dir` holding a `kernel_prefix` kernel (also
    after a failed compile: XLA dumps the PTX before ptxas runs)."""
    out = set()
    for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
        ptx = pathlib.Path(path).read_text()
        if f".entry {kernel_prefix}" in ptx:
            out.add(ptx_target(ptx))
    return out


def parse_ptxas(text: str) -> list[KernelResources]:
    """Per entry function: registers, spill stores / loads, stack, static smem."""
    out = []
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", text):
        entry = _ENTRY.search(block)
        if not entry:
            continue
        props, used = _PROPS.search(block), _USED.search(block)
        if not props or not used:
            raise ValueError(f"unexpected ptxas -v output: {block!r}")
        out.append(
            KernelResources(
                name=entry.group(1),
                registers=int(used.group(1)),
                spill_stores=int(props.group(2)),
                spill_loads=int(props.group(3)),
                stack=int(props.group(1)),
                static_smem=int(used.group(2) or 0),
            )
        )
    return out


def run_ptxas(ptx_file: str, arch: str, ptxas: str | None = None) -> list[KernelResources]:
    ptxas = ptxas or ptxas_path()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [ptxas, "-v", f"--gpu-name={arch}", ptx_file, "-o", os.path.join(tmp, "out.cubin")],
            capture_output=True,
            text=True,
        )
    if proc.returncode:
        raise CompileError(f"ptxas failed on {ptx_file}: {proc.stderr}")
    return parse_ptxas(proc.stdout + proc.stderr)


_THUNK = re.compile(
    r"kCustomKernel.*?\]\s+(\S+)\s+grid: \[([\d, ]+)\]\s+threads: \[([\d, ]+)\]"
    r"\s+shared_memory: (\d+) bytes"
)


def parse_thunk_sequence(text: str) -> dict[str, tuple[int, int]]:
    """Kernel name -> (threads per block, shared memory bytes) from XLA's dumped
    `*.thunk_sequence.txt` (Triton's shared memory is dynamic: ptxas -v does not see it)."""
    out = {}
    for m in _THUNK.finditer(text):
        threads = 1
        for t in m.group(3).split(","):
            threads *= int(t)
        out[m.group(1)] = (threads, int(m.group(4)))
    return out


def compile_for_target(
    fn: Callable,
    args: Sequence[Any],
    arch: str,
    *,
    dump_dir: str | None = None,
    kernel_prefix: str = "kvq_",
) -> CompileResult:
    """Compile `jax.jit(fn)(*args)` (args: pytrees of ShapeDtypeStructs) for `arch` with no
    GPU; raises CompileError with XLA's message when the compiler refuses it. Returns the
    PTX's target and the ptxas figures of every kernel whose name starts with
    `kernel_prefix`."""
    if arch not in TARGETS:
        raise ValueError(f"unknown target {arch!r}; known: {sorted(TARGETS)}")
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from kvq_jax.kernels import jax_compat

    mesh = _mesh(arch)
    sharding = NamedSharding(mesh, PartitionSpec())
    own_dir = dump_dir is None
    dump_dir = dump_dir or tempfile.mkdtemp(prefix=f"kvq-{arch}-")
    try:
        target = TARGETS[arch]
        with jax_compat.gpu_target((target.major, target.minor)):
            lowered = jax.jit(fn, in_shardings=sharding).trace(*args).lower()
        try:
            # every module's PTX: jax >= 0.11 dumps it only when asked, and the regex is
            # matched against the kind of emitter dump, so "ptx" asks for the PTX alone (".*"
            # also dumps every MLIR pass of every kernel: ~25 s instead of ~1 s a compile)
            options = {"xla_dump_to": dump_dir, "xla_dump_emitter_re": "ptx",
                       **DEFAULT_OPTIMIZATION}  # fmt: skip
            root = cuda_data_dir()
            if root:  # the pinned ptxas and libdevice, whatever XLA_FLAGS said at start-up
                options["xla_gpu_cuda_data_dir"] = root
            lowered.compile(compiler_options=options)
        except Exception as e:  # XlaRuntimeError / JaxRuntimeError
            raise CompileError(str(e)) from e
        launch = {}
        for path in glob.glob(os.path.join(dump_dir, "*.thunk_sequence.txt")):
            launch.update(parse_thunk_sequence(pathlib.Path(path).read_text()))
        kernels, targets = [], set()
        for ptx_file in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
            ptx = pathlib.Path(ptx_file).read_text()
            if f".entry {kernel_prefix}" not in ptx:
                continue
            targets.add(ptx_target(ptx))
            for k in run_ptxas(ptx_file, arch):
                if k.name.startswith(kernel_prefix):
                    threads, smem = launch.get(k.name, (0, 0))
                    kernels.append(dataclasses.replace(k, shared_mem=smem, threads=threads))
        if len(targets) != 1 or not kernels:
            raise CompileError(f"expected kernels of one PTX target in {dump_dir}: {targets}")
        return CompileResult(arch, targets.pop(), tuple(kernels), dump_dir)
    finally:
        if own_dir:
            shutil.rmtree(dump_dir, ignore_errors=True)


# -- kernel configurations -----------------------------------------------------------------------

KERNELS = ("page_pack", "page_reconstruct", "paged_attention")


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Compiler knobs of one kernel call: `pltriton.CompilerParams(num_warps, num_stages)`
    and, for attention, the split count of each sequence's pages (None: the API default)."""

    num_warps: int
    num_stages: int
    num_splits: int | None = None

    def label(self) -> str:
        splits = "" if self.num_splits is None else f" s{self.num_splits}"
        return f"w{self.num_warps} st{self.num_stages}{splits}"

    @property
    def launch(self):
        from kvq_jax.kernels.launch import Launch

        return Launch(self.num_warps, self.num_stages)


#: The knobs each kernel used at 3aba84c (module constants / parameter defaults), before the
#: launch rules: `bench/kernel_resources.py --knobs default` reproduces the "before" table.
DEFAULT_KNOBS = {
    "page_pack": Knobs(4, 1),
    "page_reconstruct": Knobs(2, 1),
    "paged_attention": Knobs(4, 2),
}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One kernel configuration: a `kernel` of KERNELS, an arg_specs entry (`spec`) and, for
    page reconstruction, the kind. `build(knobs)` -> (fn, abstract args) to compile."""

    kernel: str
    spec: Any
    kind: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name + (f"-{self.kind}" if self.kind else "")

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def formats(self) -> tuple[str, ...]:
        s = self.spec
        if self.kernel == "page_pack":
            return (s.format,)
        if self.kernel == "page_reconstruct":
            k = self.kind[0]
            residual = getattr(s, f"{k}_residual_format")
            residual = residual if isinstance(residual, tuple) else (residual,)
            return (getattr(s, f"{k}_base_format"), *residual)
        out = []
        for base, residual in ((s.k_base_format, s.k_residual_format),
                               (s.v_base_format, s.v_residual_format)):  # fmt: skip
            out += [base, *(residual if isinstance(residual, tuple) else (residual,))]
        return tuple(out)

    def build(self, knobs: Knobs) -> tuple[Callable, tuple]:
        return _BUILDERS[self.kernel](self, knobs)


def _build_page_pack(cfg: KernelConfig, knobs: Knobs):
    from kvq_jax.kernels.page_pack import pallas_triton

    spec = cfg.spec
    axis, group_size = spec.resolved()

    def fn(pages, rows):
        return pallas_triton.pack_paged(
            pages, kind=spec.kind, format=spec.format, axis=axis, group_size=group_size,
            interpret=False, launch=knobs.launch, rows=rows,
        )  # fmt: skip

    return fn, (spec.shape_dtype_struct(5), spec.rows_struct(5))


def _build_page_reconstruct(cfg: KernelConfig, knobs: Knobs):
    from kvq_jax.kernels._tile_decode import chain_steps
    from kvq_jax.kernels.page_reconstruct import pallas_triton

    spec = cfg.spec
    if knobs.num_stages != 1:
        raise ValueError("page_reconstruct takes num_stages 1 only (one tile per program)")
    cache = spec.abstract_cache()
    steps, planes = chain_steps(cache, cfg.kind, spec.loop)

    def fn(planes, pages, depth):
        return pallas_triton.decode_pages(planes, pages, None, depth, steps=steps,
                                          interpret=False, launch=knobs.launch)  # fmt: skip

    return fn, (tuple(planes), spec.page_ids(8), cache.depth)


def _build_paged_attention(cfg: KernelConfig, knobs: Knobs):
    from kvq_jax.kernel_checks.arg_specs import paged_attention as arg_specs
    from kvq_jax.kernels.paged_attention import api, pallas_triton

    spec = cfg.spec
    shapes = arg_specs.input_shapes(spec)
    splits = knobs.num_splits or api.default_num_splits(spec.batch, spec.kv_heads, spec.max_pages)

    def fn(q, cache, tables, lens, ids):
        return pallas_triton.paged_decode_attention(
            q, cache, tables, lens, ids, loop=spec.loop, num_splits=splits, interpret=False,
            launch=knobs.launch,
        )  # fmt: skip

    return fn, (shapes.q, shapes.cache, shapes.block_tables, shapes.seq_lens, shapes.seq_ids)


_BUILDERS = {
    "page_pack": _build_page_pack,
    "page_reconstruct": _build_page_reconstruct,
    "paged_attention": _build_paged_attention,
}


def kernel_configs(kernels: Sequence[str] = KERNELS) -> list[KernelConfig]:
    """Every configuration the kernels claim to support (their arg_specs)."""
    out = []
    for kernel in kernels:
        if kernel == "page_pack":
            from kvq_jax.kernel_checks.arg_specs import page_pack as arg_specs

            out += [KernelConfig(kernel, s) for s in arg_specs.SPECS]
        elif kernel == "page_reconstruct":
            from kvq_jax.kernel_checks.arg_specs import page_reconstruct as arg_specs

            out += [
                KernelConfig(kernel, s, kind)
                for s in arg_specs.SUPPORTED_SPECS
                for kind in arg_specs.KINDS
            ]
        elif kernel == "paged_attention":
            from kvq_jax.kernel_checks.arg_specs import paged_attention as arg_specs

            out += [KernelConfig(kernel, s) for s in arg_specs.SUPPORTED_SPECS]
        else:
            raise ValueError(f"unknown kernel {kernel!r}; known: {KERNELS}")
    return out


def ci_subset(configs: Sequence[KernelConfig]) -> list[KernelConfig]:
    """The representative subset CI compiles per target: every kernel, every format (and
    format variant), both head dims, at the largest page size of each kernel; attention (8
    configurations, each a different case) is taken whole."""
    largest = {}
    for c in configs:
        largest[c.kernel] = max(largest.get(c.kernel, 0), c.page_size)
    subset = [
        c for c in configs if c.kernel == "paged_attention" or c.page_size == largest[c.kernel]
    ]
    # A format or head dim that only appears at smaller pages keeps one configuration.
    seen = {(c.kernel, x) for c in subset for x in (*c.formats, c.head_dim)}
    for c in configs:
        if any((c.kernel, x) not in seen for x in (*c.formats, c.head_dim)):
            subset.append(c)
            seen.update((c.kernel, x) for x in (*c.formats, c.head_dim))
    return subset


def smoke_subset(configs: Sequence[KernelConfig]) -> list[KernelConfig]:
    """A few configurations per kernel for a quick second-environment check: at the largest
    head dim of each kernel, a configuration is taken when it brings a (kernel, format, kind
    or position) not yet compiled (every format in every role once, not every geometry); a
    format that only appears at smaller head dims keeps one configuration."""
    top = {}
    for c in configs:
        top[c.kernel] = max(top.get(c.kernel, 0), c.head_dim)
    taken, seen = [], set()
    for c in configs:
        if c.head_dim != top[c.kernel]:
            continue
        role = c.spec.kind if c.kernel == "page_pack" else c.kind
        new = {(c.kernel, role, i, f) for i, f in enumerate(c.formats)} - seen
        if new:
            taken.append(c)
            seen |= new
    formats = {(c.kernel, f) for c in taken for f in c.formats}
    for c in configs:
        if any((c.kernel, f) not in formats for f in c.formats):
            taken.append(c)
            formats.update((c.kernel, f) for f in c.formats)
    return taken


# -- measured knobs ------------------------------------------------------------------------------


#: Configurations no knob value rids of spills (kernel, config name) -> why; the compile test
#: expects them to spill (strict xfail) until the kernel changes. None today.
KNOWN_SPILLS: dict[tuple[str, str], str] = {}


def tuned_knobs(cfg: KernelConfig, target: str) -> Knobs:
    """The knobs the kernels launch `cfg` with on `target` (`backend="auto"`): the rules of
    `kvq_jax.kernels.launch`, measured spill-free with bench/kernel_resources.py (ptxas
    PINNED_NVCC; docs/kernel_resources.md). The same on every target."""
    from kvq_jax.kernels import launch

    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}")
    if cfg.kernel == "page_pack":
        rule = launch.page_pack(cfg.page_size, cfg.head_dim, cfg.spec.format)
    elif cfg.kernel == "page_reconstruct":
        rule = launch.page_reconstruct(cfg.page_size, cfg.head_dim)
    elif cfg.kernel == "paged_attention":
        from kvq_jax.kernels.paged_attention import pallas_triton

        rule = pallas_triton.default_launch(cfg.spec.config(), cfg.spec.group, cfg.spec.loop)
    else:
        raise ValueError(f"unknown kernel {cfg.kernel!r}")
    return Knobs(rule.num_warps, rule.num_stages)
