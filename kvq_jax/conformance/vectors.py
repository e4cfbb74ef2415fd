"""Reading and writing the conformance vectors file (no JAX needed).

File format (numpy .npz, every array stored as raw uint8 bytes so no custom dtype is needed):
  "manifest": a JSON document (uint8 UTF-8 bytes): {"version", "format_doc", "cases": [...]},
    each case {"name", "format", "kind", "axis", "group_size" (resolved), "input": spec,
    "arrays": {field: spec}, "decoded": spec}, a spec being {"dtype", "shape", "key"}, and
    for a table format (INTB, FORMAT.md 2b) "bits": the bit table as [H][D] ints (the case's
    format is then the table's registry name, `kvq_jax.core.layouts.intb_name`);
  one entry per spec "key" with the raw bytes.
"""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np

from kvq_jax import data

VERSION = "kvq-conformance-v1"
VECTORS_PATH = data.path("vectors_v1.npz")
_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "uint8": np.dtype(np.uint8),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
}


@dataclasses.dataclass(frozen=True, eq=False)
class Case:
    """One vector: the input and the exact arrays and decoded output it must produce."""

    name: str
    format: str
    kind: str
    axis: str
    group_size: int
    values: np.ndarray
    arrays: dict[str, np.ndarray]
    decoded: np.ndarray
    bits: tuple[tuple[int, ...], ...] | None = None  # INTB's bit table (format = its name)

    @property
    def pack_args(self) -> dict:
        """Keyword arguments of `pack_kv` (axis and group size given explicitly)."""
        return dict(kind=self.kind, format=self.format, group_size=self.group_size, axis=self.axis)


def _spec(store: dict, key: str, array: np.ndarray) -> dict:
    array = np.array(array, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    store[key] = array.reshape(-1).view(np.uint8)
    return {"dtype": array.dtype.name, "shape": list(array.shape), "key": key}


def _array(data, spec: dict) -> np.ndarray:
    raw = np.asarray(data[spec["key"]], np.uint8)
    return raw.view(_DTYPES[spec["dtype"]]).reshape(tuple(spec["shape"]))


def save_vectors(cases: list[Case], path=VECTORS_PATH) -> None:
    store, manifest = {}, []
    for i, c in enumerate(cases):
        manifest.append(
            {
                "name": c.name,
                "format": c.format,
                "kind": c.kind,
                "axis": c.axis,
                "group_size": c.group_size,
                "input": _spec(store, f"{i}/input", c.values),
                "arrays": {k: _spec(store, f"{i}/{k}", a) for k, a in c.arrays.items()},
                "decoded": _spec(store, f"{i}/decoded", c.decoded),
            }
        )
        if c.bits is not None:
            manifest[-1]["bits"] = [list(row) for row in c.bits]
    doc = {"version": VERSION, "format_doc": "docs/FORMAT.md", "cases": manifest}
    store["manifest"] = np.frombuffer(json.dumps(doc, indent=1).encode(), np.uint8)
    np.savez_compressed(path, **store)


def load_vectors(path=VECTORS_PATH) -> list[Case]:
    """All cases of a vectors file (default: the one shipped with kvq)."""
    with np.load(path) as data:
        doc = json.loads(bytes(data["manifest"]).decode())
        if doc["version"] != VERSION:
            raise ValueError(f"{path}: version {doc['version']!r}, expected {VERSION!r}")
        return [
            Case(
                name=c["name"],
                format=c["format"],
                kind=c["kind"],
                axis=c["axis"],
                group_size=c["group_size"],
                values=_array(data, c["input"]),
                arrays={k: _array(data, s) for k, s in c["arrays"].items()},
                decoded=_array(data, c["decoded"]),
                bits=tuple(tuple(row) for row in c["bits"]) if "bits" in c else None,
            )
            for c in doc["cases"]
        ]
