"""Torch vs JAX: codec speed on the same bytes, and the cost of the DLPack handoff.

    python bench/torch_vs_jax.py [--quick] [--json PATH] [--device cpu|cuda] [--repeats N]

1. Codec. For each bf16 [T, H, D] shape, format in `kvq_jax.CODECS` and kind (key / value):
   pack and unpack (to bf16) in JAX (`kvq_jax.pack_kv` / `unpack_kv`, jitted, blocked until
   ready) and in Torch (`kvq_torch_bridge.pack_kv` / `unpack_kv`, followed by
   `torch.cuda.synchronize()` on CUDA), in this process, on the same bytes: the input is made
   once in JAX and handed to Torch through DLPack (shared, checked by data pointer), and Torch
   unpacks the JAX-packed arrays, shared the same way. Before timing, every array field of both
   packs and both unpacked tensors is compared as raw bytes: a case whose stacks disagree
   aborts the benchmark instead of being timed. Times are medians after a warm-up; torch/jax
   is the ratio of the medians.

2. Handoff. A ~1 GiB packed cache (int4 keys, bf16 [T, 8, 128] with T chosen so the packed
   arrays total ~1 GiB) is built directly in JAX: the array shapes and dtypes come from
   `jax.eval_shape(kvq_jax.pack_kv, ...)` (so the metadata is exactly what packing gives), the
   contents from a jitted integer hash (pseudo-random codes, finite float16 minimum / scale):
   packing 4 GiB of bf16 is needed for no part of the handoff, whose cost does not depend on
   the values. `to_torch` / `from_torch` are timed (median of several runs) with the default
   `copy=None` (shared), with `copy=True`, and from a Torch cache whose tensors are views at an
   odd element offset, which XLA:CPU cannot import (64-byte alignment): the bridge copies and
   emits a CopyWarning. "copied" counts the bytes of every array whose data pointer differs
   between source and result; "RSS +MiB" is the growth of the process's resident memory
   (VmRSS) around one call with its result kept alive; on CUDA "dev +MiB" is the growth of
   the device memory held by Torch's allocator and JAX. A shared slice of the cache is
   decoded by both stacks and must agree byte for byte.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import _timing

import kvq_jax
import kvq_torch_bridge as kt
from kvq_jax.codecs.packed import META_FIELDS
from kvq_torch_bridge.bridge.dlpack import CPU_ALIGNMENT
from kvq_torch_bridge.codecs._dtypes import numpy_dtype

SHAPES = ((2048, 16, 128), (32768, 8, 128))
KINDS = ("key", "value")
#: The handoff cache: int4 keys of a bf16 [T, HANDOFF_HEADS, HANDOFF_DIM] tensor.
HANDOFF_BYTES = 1 << 30
HANDOFF_HEADS, HANDOFF_DIM = 8, 128
#: Tokens decoded by both stacks from the handed-off cache (a check, not timed).
CHECK_TOKENS = 4096
MIB = 1 << 20

CODEC_COLUMNS = (
    ("shape", "shape [T,H,D]", None),
    ("format", "format", None),
    ("kind", "kind", None),
    ("op", "op", None),
    ("jax_ms", "jax ms", ".3f"),
    ("torch_ms", "torch ms", ".3f"),
    ("torch_over_jax", "torch/jax", ".2f"),
    ("runs", "runs jax/torch", None),
)
HANDOFF_COLUMNS = (
    ("call", "call", None),
    ("source", "source", None),
    ("ms", "median ms", ".3f"),
    ("min_ms", "min ms", ".3f"),
    ("repeats", "runs", "d"),
    ("copied_bytes", "copied (pointers)", ",d"),
    ("rss_mib", "RSS +MiB", ".1f"),
    ("device_mib", "dev +MiB", ".1f"),
    ("gbps", "GB/s", ".2f"),
    ("warnings", "CopyWarnings", "d"),
)


# --- devices and synchronization -------------------------------------------------------------


def jax_device(kind: str) -> jax.Device:
    """The first JAX device of `kind` ("cpu" or "cuda")."""
    platforms = ("cpu",) if kind == "cpu" else ("cuda", "gpu")
    for platform in platforms:
        try:
            return jax.devices(platform)[0]
        except RuntimeError:
            continue
    raise SystemExit(f"no JAX {kind} device (jax.devices() = {jax.devices()})")


def torch_synced(fn, device: str):
    """`fn`, followed by torch.cuda.synchronize() on CUDA so its queued kernels are timed."""
    if device != "cuda":
        return fn

    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        return out

    return call


# --- byte identity -------------------------------------------------------------------------


def jax_bytes(array: jax.Array) -> np.ndarray:
    """A JAX array's raw bytes as a flat uint8 numpy array (host copy only off the CPU)."""
    return np.ascontiguousarray(np.asarray(array)).reshape(-1).view(np.uint8)


def torch_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A torch tensor's raw bytes as a flat uint8 numpy array (bf16 / float8 included)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def assert_same_array(j: jax.Array, t: torch.Tensor, what: str) -> None:
    """Same dtype, same shape, same bytes."""
    jd, td = np.dtype(j.dtype), numpy_dtype(t.dtype)
    if jd != td or tuple(j.shape) != tuple(t.shape):
        raise AssertionError(f"{what}: jax {jd}{list(j.shape)} vs torch {td}{list(t.shape)}")
    jb, tb = jax_bytes(j), torch_bytes(t)
    if not np.array_equal(jb, tb):
        raise AssertionError(
            f"{what}: {int(np.count_nonzero(jb != tb))} of {jb.size} bytes differ "
            f"(first at byte {int(np.flatnonzero(jb != tb)[0])})"
        )


def assert_same_packed(pj: kvq_jax.PackedKV, pt: kt.PackedKV, what: str) -> None:
    """Same metadata, same array fields, each byte-identical."""
    for name in META_FIELDS:
        if getattr(pj, name) != getattr(pt, name):
            raise AssertionError(f"{what}.{name}: {getattr(pj, name)} != {getattr(pt, name)}")
    if set(pj.arrays) != set(pt.arrays):
        raise AssertionError(f"{what}: fields {sorted(pj.arrays)} != {sorted(pt.arrays)}")
    for name, array in pj.arrays.items():
        assert_same_array(array, pt.arrays[name], f"{what}.{name}")


# --- 1. codec speed ------------------------------------------------------------------------


def bench_codec(shape, device: str, *, warmup: int, repeats: int, budget_s) -> list[dict]:
    x = jax.random.normal(jax.random.key(0), shape, jnp.bfloat16)
    xt = kt.jax_to_torch(x, copy=False)  # the same buffer: raises if it could not be shared
    assert xt.device.type == device, (xt.device, device)
    label = "x".join(map(str, shape))
    rows = []
    for fmt in kvq_jax.CODECS:
        for kind in KINDS:
            what = f"{label} {fmt} {kind}"
            print(f"  {what}", file=sys.stderr, flush=True)

            def jax_pack(v, kind=kind, fmt=fmt):
                return kvq_jax.pack_kv(v, kind=kind, format=fmt)

            def torch_pack_(v, kind=kind, fmt=fmt):
                return kt.pack_kv(v, kind=kind, format=fmt)

            torch_pack = torch_synced(torch_pack_, device)
            torch_unpack = torch_synced(kt.unpack_kv, device)

            # One call of each, checked byte for byte: doubles as the compiling warm-up.
            pj = jax.block_until_ready(jax_pack(x))
            pt = torch_pack(xt)
            assert_same_packed(pj, pt, f"{what} pack")
            pj_shared = kt.to_torch(pj, copy=False)  # Torch unpacks the very same bytes
            uj = jax.block_until_ready(kvq_jax.unpack_kv(pj))
            ut = torch_unpack(pj_shared)
            assert_same_array(uj, ut, f"{what} unpack")
            del pt, uj, ut

            def timed(fn, arg):
                return _timing.median_time(
                    fn, arg, warmup=warmup, repeats=repeats, budget_s=budget_s
                )

            timings = {
                "pack": (timed(jax_pack, x), timed(torch_pack, xt)),
                "unpack": (timed(kvq_jax.unpack_kv, pj), timed(torch_unpack, pj_shared)),
            }
            for op, (tj, tt) in timings.items():
                rows.append(
                    {
                        "shape": label,
                        "format": fmt,
                        "kind": kind,
                        "axis": pj.axis,
                        "op": op,
                        "jax_ms": tj.median_ms,
                        "jax_min_ms": tj.min_s * 1e3,
                        "torch_ms": tt.median_ms,
                        "torch_min_ms": tt.min_s * 1e3,
                        "torch_over_jax": tt.median_s / tj.median_s,
                        "runs": f"{len(tj.times_s)}/{len(tt.times_s)}",
                        "identical_bytes": True,
                    }
                )
    return rows


# --- 2. handoff ----------------------------------------------------------------------------


def _hash_u32(n: int, seed: int) -> jax.Array:
    """n pseudo-random uint32 (murmur3's finalizer over the index), one XLA fusion."""
    h = jax.lax.iota(jnp.uint32, n) + jnp.uint32((seed * 0x9E3779B9) & 0xFFFFFFFF)
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _fill(spec: jax.ShapeDtypeStruct, seed: int, low: float, high: float) -> jax.Array:
    n = math.prod(spec.shape)
    h = _hash_u32(n, seed)
    if spec.dtype == jnp.uint8:
        out = (h >> 24).astype(jnp.uint8)
    else:  # uniform in [low, high), then rounded to the field's float dtype
        u = (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
        out = (low + (high - low) * u).astype(spec.dtype)
    return out.reshape(spec.shape)


def handoff_cache(target_bytes: int = HANDOFF_BYTES) -> kvq_jax.PackedKV:
    """A JAX PackedKV (int4, keys) of ~`target_bytes`, laid out exactly as pack_kv lays out a
    bf16 [T, 8, 128] tensor, with pseudo-random contents (see the module doc)."""
    h, d = HANDOFF_HEADS, HANDOFF_DIM

    def spec(t):
        values = jax.ShapeDtypeStruct((t, h, d), jnp.bfloat16)
        return jax.eval_shape(lambda v: kvq_jax.pack_kv(v, kind="key", format="int4"), values)

    group = spec(1).group_size
    per_group = spec(group).storage_bytes
    t = (target_bytes // per_group) * group
    shapes = spec(t)
    ranges = {"codes": (0, 0), "minimum": (-2.0, 2.0), "scale": (0.01, 0.1)}
    fill = jax.jit(_fill, static_argnums=(0, 1, 2, 3))
    arrays = {
        name: jax.block_until_ready(fill(s, seed, *ranges[name]))
        for seed, (name, s) in enumerate(shapes.arrays.items())
    }
    return dataclasses.replace(shapes, **arrays)


def _ptr(array) -> int:
    return array.data_ptr() if isinstance(array, torch.Tensor) else array.unsafe_buffer_pointer()


def _nbytes(array) -> int:
    if isinstance(array, torch.Tensor):
        return array.numel() * array.element_size()
    return array.size * np.dtype(array.dtype).itemsize


def copied_bytes(src, dst) -> int:
    """Bytes of the arrays of `dst` that do not share their source's buffer."""
    assert set(src.arrays) == set(dst.arrays)
    return sum(_nbytes(a) for name, a in src.arrays.items() if _ptr(a) != _ptr(dst.arrays[name]))


def rss_bytes() -> int | None:
    """Resident set size of this process (VmRSS), or None where /proc is not available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_bytes(device: str, jdev: jax.Device) -> int | None:
    """Device memory held by Torch's allocator plus JAX's (CUDA only)."""
    if device != "cuda":
        return None
    stats = jdev.memory_stats() or {}
    return torch.cuda.memory_allocated() + stats.get("bytes_in_use", 0)


def _growth(after, before) -> float | None:
    return None if after is None or before is None else (after - before) / MIB


def assert_same_content(src, dst, what: str) -> None:
    """Every array of a handed-off container holds its source's bytes."""
    for name, a in src.arrays.items():
        b = dst.arrays[name]
        ab = torch_bytes(a) if isinstance(a, torch.Tensor) else jax_bytes(a)
        bb = torch_bytes(b) if isinstance(b, torch.Tensor) else jax_bytes(b)
        if not np.array_equal(ab, bb):
            raise AssertionError(f"{what}.{name}: handed-off bytes differ from the source")


def misaligned_copy(packed: kt.PackedKV) -> kt.PackedKV:
    """The same cache in Torch, every tensor a view one element into a larger buffer (so its
    data pointer is off XLA:CPU's 64-byte alignment)."""

    def view(t: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        out = buf[1:].view(t.shape)
        out.copy_(t)
        return out

    return dataclasses.replace(packed, **{n: view(t) for n, t in packed.arrays.items()})


def bench_call(
    call: str,
    source: str,
    fn,
    src,
    device: str,
    jdev: jax.Device,
    *,
    repeats: int,
    budget_s: float | None,
    cache_bytes: int,
) -> dict:
    """Measure one call (bytes copied by pointer, RSS / device memory growth, CopyWarnings,
    content check), then time it (median of up to `repeats` runs after one warm-up)."""
    sync = torch_synced(lambda out: out, device)
    gc.collect()
    rss0, dev0 = rss_bytes(), device_bytes(device, jdev)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", kt.CopyWarning)
        out = jax.block_until_ready(sync(fn(src)))
    rss1, dev1 = rss_bytes(), device_bytes(device, jdev)
    copied = copied_bytes(src, out)
    n_warn = sum(issubclass(w.category, kt.CopyWarning) for w in caught)
    if copied:
        assert_same_content(src, out, f"{call} from {source}")
    del out
    gc.collect()

    def timed():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kt.CopyWarning)
            return sync(fn(src))

    t = _timing.median_time(timed, warmup=1, repeats=repeats, budget_s=budget_s)
    return {
        "call": call,
        "source": source,
        "ms": t.median_ms,
        "min_ms": t.min_s * 1e3,
        "repeats": len(t.times_s),
        "copied_bytes": copied,
        "rss_mib": _growth(rss1, rss0),
        "device_mib": _growth(dev1, dev0),
        "gbps": _timing.gbps(copied, t.median_s) if copied else None,
        "warnings": n_warn,
        "cache_bytes": cache_bytes,
    }


def bench_handoff(
    device: str, jdev: jax.Device, *, shared_repeats: int, copy_repeats: int, budget_s
):
    cache = handoff_cache()
    nbytes = cache.storage_bytes
    fields = ", ".join(f"{n} {a.dtype}{list(a.shape)}" for n, a in cache.arrays.items())
    print(
        f"\nhandoff cache: int4 keys of bf16 {list(cache.shape)}, {nbytes:,} bytes "
        f"({nbytes / (1 << 30):.4f} GiB): {fields}; contents generated in JAX (hash), not packed"
    )

    # Torch decodes a shared slice of the handed-off cache exactly as JAX does.
    shared = kt.to_torch(cache, copy=False)
    g = cache.group_size
    n = CHECK_TOKENS

    def head(p):
        meta = {k: v[: n // g] for k, v in p.arrays.items() if k != "codes"}
        return dataclasses.replace(p, codes=p.codes[:n], shape=(n, *p.shape[1:]), **meta)

    assert_same_array(kvq_jax.unpack_kv(head(cache)), kt.unpack_kv(head(shared)), "handoff decode")
    del shared

    # A Torch-owned cache (torch's allocator aligns to 64 bytes) and a misaligned one.
    owned = kt.to_torch(cache, copy=True)
    assert copied_bytes(cache, owned) == nbytes
    common = {"device": device, "jdev": jdev, "cache_bytes": nbytes, "budget_s": budget_s}
    rows = [
        bench_call(
            "to_torch(copy=None)", "JAX", kt.to_torch, cache, repeats=shared_repeats, **common
        ),
        bench_call(
            "to_torch(copy=True)",
            "JAX",
            lambda p: kt.to_torch(p, copy=True),
            cache,
            repeats=copy_repeats,
            **common,
        ),
        bench_call(
            "from_torch(copy=None)",
            "Torch, 64-B aligned",
            kt.from_torch,
            owned,
            repeats=shared_repeats,
            **common,
        ),
        bench_call(
            "from_torch(copy=True)",
            "Torch, 64-B aligned",
            lambda p: kt.from_torch(p, copy=True),
            owned,
            repeats=copy_repeats,
            **common,
        ),
    ]
    if device == "cpu":
        misaligned = misaligned_copy(owned)
        offsets = " ".join(
            f"{n}%{CPU_ALIGNMENT}={t.data_ptr() % CPU_ALIGNMENT}"
            for n, t in misaligned.arrays.items()
        )
        try:
            kt.from_torch(misaligned, copy=False)
        except ValueError:
            pass
        else:
            raise AssertionError("from_torch(copy=False) shared a misaligned CPU buffer")
        rows.append(
            bench_call(
                "from_torch(copy=None)",
                f"Torch, misaligned ({offsets})",
                kt.from_torch,
                misaligned,
                repeats=copy_repeats,
                **common,
            )
        )
    return rows, {"cache_shape": list(cache.shape), "cache_bytes": nbytes}


# --- main ----------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = _timing.bench_parser(__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args(argv)
    # Full: up to 15 timed runs per measurement, stopping after ~2 s of them (never fewer
    # than 3): JAX's ms-scale cases get 15, Torch's multi-second ones 3. Quick: one run.
    warmup, repeats, budget_s = (1, 1, None) if args.quick else (1, 15, 2.0)
    if args.repeats is not None:
        repeats = args.repeats
    shared_repeats, copy_repeats = (10, 1) if args.quick else (50, 5)

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    jdev = jax_device(args.device)
    jax.config.update("jax_default_device", jdev)
    if args.device == "cuda":
        torch_dev = f"cuda:{torch.cuda.current_device()} {torch.cuda.get_device_name()}"
    else:
        torch_dev = "cpu"
    header = (
        f"{_timing.device_header()}\n"
        f"torch {torch.__version__} on {torch_dev}, {torch.get_num_threads()} intra-op "
        f"threads | jax arrays on {jdev.platform}:{jdev.id} {jdev.device_kind}"
    )
    print(header)
    runs = f"{repeats} runs"
    if budget_s is not None:
        runs = f"up to {runs} (at least {min(3, repeats)}, stopping after {budget_s} s of runs)"
    print(
        f"kvq {kvq_jax.__version__}; formats {', '.join(kvq_jax.CODECS)}; bf16 input; "
        f"median of {runs} after {warmup} warm-up, plus one checked call per stack; "
        f"same input bytes in both stacks (DLPack-shared), outputs byte-identical",
        flush=True,
    )
    codec_rows = []
    for shape in SHAPES:
        codec_rows += bench_codec(
            shape, args.device, warmup=warmup, repeats=repeats, budget_s=budget_s
        )
    print()
    _timing.print_table(codec_rows, CODEC_COLUMNS)

    handoff_rows, handoff_info = bench_handoff(
        args.device,
        jdev,
        shared_repeats=shared_repeats,
        copy_repeats=copy_repeats,
        budget_s=None if args.quick else 6.0,
    )
    print(
        "median of N runs after 1 warm-up; copied = bytes of arrays whose data pointer "
        "differs from the source's; RSS/dev = memory growth around one call, result alive"
    )
    print()
    _timing.print_table(handoff_rows, HANDOFF_COLUMNS)
    if args.json:
        _timing.write_json(
            args.json,
            header,
            codec_rows,
            warmup=warmup,
            repeats=repeats,
            budget_s=budget_s,
            handoff=handoff_rows,
            **handoff_info,
        )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
