"""A sequence's cache state off the device: in host memory (`HostSequence`) and on disk
(safetensors), shared by both stacks (a sequence swapped out of the JAX cache swaps into the
Torch cache, byte for byte, and back).

`HostSequence.arrays` maps names to NumPy arrays (N = the sequence's pages, L loops):

    k_base.<field>, v_base.<field>     [N, ...]        loop 0 of its pages (each packed field)
    k_delta.<field>, v_delta.<field>   [L - 1, N, ...] loops 1.. (with L > 1), or, when the
                                       later loops are stored in runs of different formats,
                                       k_delta.<r>.<field> [len(run r), N, ...] per run
                                       (`PagedCacheConfig.plane_specs`)
    k_stage, v_stage                   [L, page_size, H, D]  raw rows of its partial page
    k_sink, v_sink                     [L, sink, H, D] its raw sink rows
    seq_lens                           int32 [L]       tokens written per loop
    depth                              uint8 [N, page_size]  (adaptive exits) last loop with
                                                       its own K/V, per row of each page
    stage_exited                       bool [L, page_size] (adaptive exits) staged rows that
                                                       exited before each loop

On disk: one safetensors file whose tensors are those arrays (native dtypes: BF16, F8_E4M3,
...; inspect it with any safetensors reader) and whose metadata holds the cache configuration
(formats, shapes, page size, group sizes) and a SHA-256 checksum of every tensor's name,
dtype, shape and bytes. `load_sequence` refuses a truncated or corrupted file, a checksum
that does not match, or a configuration other than the cache's, before anything is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os

import ml_dtypes
import numpy as np
import safetensors

from kvq_jax.core import registry
from kvq_jax.core.cache_config import PagedCacheConfig

#: The file format's name and version, in the safetensors metadata.
FILE_FORMAT = "kvq.sequence/1"


def expected_shapes(config: PagedCacheConfig, num_pages: int) -> dict[str, tuple[tuple, np.dtype]]:
    """{name: (shape, dtype)} of every array of a sequence holding `num_pages` pages."""
    out = {}
    for plane, _, loops, args in config.plane_specs():
        shapes = registry.layout(args["format"]).array_shapes(
            config.page_shape, args["axis"], args["group_size"]
        )
        lead = (num_pages,) if plane.endswith("base") else (len(loops), num_pages)
        for field, (shape, dtype) in shapes.items():
            out[f"{plane}.{field}"] = ((*lead, *shape), np.dtype(dtype))
    rows = config.page_shape[1:]
    loops = config.num_loops
    for prefix in ("k", "v"):
        out[f"{prefix}_stage"] = ((loops, config.page_size, *rows), config.dtype)
        out[f"{prefix}_sink"] = ((loops, config.sink, *rows), config.dtype)
    out["seq_lens"] = ((loops,), np.dtype(np.int32))
    if config.adaptive_exit:
        out["depth"] = ((num_pages, config.page_size), np.dtype(np.uint8))
        out["stage_exited"] = ((loops, config.page_size), np.dtype(np.bool_))
    return out


@dataclasses.dataclass(frozen=True)
class HostSequence:
    """One sequence's cache state in host memory (see the module doc for `arrays`)."""

    config: PagedCacheConfig
    arrays: dict

    def __post_init__(self):
        check_arrays(self.config, self.arrays)

    @property
    def num_pages(self) -> int:
        return int(self.arrays["k_base.codes"].shape[0])

    @property
    def seq_lens(self) -> np.ndarray:
        return self.arrays["seq_lens"]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def check_arrays(config: PagedCacheConfig, arrays: dict) -> None:
    """Raise ValueError unless `arrays` are exactly a sequence's arrays for `config`."""
    if "k_base.codes" not in arrays:
        raise ValueError("sequence arrays lack k_base.codes")
    num_pages = int(np.shape(arrays["k_base.codes"])[0])
    want = expected_shapes(config, num_pages)
    if set(arrays) != set(want):
        missing, extra = sorted(set(want) - set(arrays)), sorted(set(arrays) - set(want))
        raise ValueError(f"sequence arrays do not fit the cache: missing {missing}, extra {extra}")
    for name, (shape, dtype) in want.items():
        a = arrays[name]
        if tuple(a.shape) != shape or np.dtype(a.dtype) != dtype:
            raise ValueError(
                f"sequence array {name} is {np.dtype(a.dtype)}{list(a.shape)}, the cache "
                f"needs {dtype}{list(shape)}"
            )


def config_metadata(config: PagedCacheConfig) -> str:
    """The configuration as JSON (field -> value, dtype by name; fields added later are left out
    at their defaults (no absolute loops, keys as handed over), as in files written before
    they existed)."""
    fields = dataclasses.asdict(config)
    fields["dtype"] = str(np.dtype(config.dtype))
    for name in ("k_absolute", "v_absolute", "rope_theta"):
        if not fields[name]:
            del fields[name]
    return json.dumps(fields, sort_keys=True)


def checksum(arrays: dict) -> str:
    """SHA-256 over every array's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.name}|{list(a.shape)}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save_sequence(path: str | os.PathLike, sequence: HostSequence) -> None:
    """Write `sequence` to a safetensors file (see the module doc)."""
    arrays = {name: np.ascontiguousarray(a) for name, a in sequence.arrays.items()}
    specs = {
        name: safetensors.TensorSpec(
            dtype=a.dtype.name, shape=list(a.shape), data_ptr=a.ctypes.data, data_len=a.nbytes
        )
        for name, a in arrays.items()
    }
    metadata = {
        "format": FILE_FORMAT,
        "config": config_metadata(sequence.config),
        "sha256": checksum(arrays),
    }
    safetensors.serialize_file(specs, os.fspath(path), metadata=metadata)


#: safetensors dtype names -> NumPy dtypes.
_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}


def _header(data: bytes) -> dict:
    if len(data) < 8:
        raise ValueError("not a safetensors file: shorter than its 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    try:
        return json.loads(data[8 : 8 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not a safetensors file: unreadable header ({e})") from None


def load_sequence(path: str | os.PathLike, config: PagedCacheConfig) -> HostSequence:
    """Read a file written by `save_sequence` for a cache of `config`.

    Raises ValueError (naming the problem) for a truncated or corrupted file, a file that is
    not a kvq sequence, a configuration other than `config`, or a checksum mismatch.
    """
    with open(path, "rb") as f:
        data = f.read()
    meta = _header(data).get("__metadata__", {})
    if meta.get("format") != FILE_FORMAT:
        raise ValueError(f"{path}: not a kvq sequence file (format {meta.get('format')!r})")
    saved, ours = json.loads(meta.get("config", "{}")), json.loads(config_metadata(config))
    diff = sorted(k for k in set(saved) | set(ours) if saved.get(k) != ours.get(k))
    if diff:
        detail = ", ".join(f"{k}: file {saved.get(k)!r} vs cache {ours.get(k)!r}" for k in diff)
        raise ValueError(f"{path}: saved for another cache configuration ({detail})")
    try:
        tensors = safetensors.deserialize(data)
    except Exception as e:  # the Rust SafetensorError, or a header it cannot parse
        raise ValueError(f"{path}: truncated or corrupted safetensors file ({e})") from None
    arrays = {}
    for name, t in tensors:
        dtype = _DTYPES.get(t["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {t['dtype']}")
        data_ = t["data"]
        if len(data_) != math.prod(t["shape"]) * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name} holds {len(data_)} bytes for {t['shape']}")
        arrays[name] = np.frombuffer(data_, dtype).reshape(t["shape"]).copy()
    if checksum(arrays) != meta.get("sha256"):
        raise ValueError(f"{path}: checksum mismatch: the file is corrupted")
    return HostSequence(config=config, arrays=arrays)
