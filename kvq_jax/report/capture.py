"""Captured K/V/Q files: the input format of `kvq report --kv FILE`, and the embedded default.

File format (a NumPy .npz):
  k, v:  [loops, layers, tokens, heads, dim], or [windows, loops, layers, tokens, heads, dim]
         for several text windows: post-RoPE keys and values of the layers captured.
  q:     optional, the matching post-RoPE queries [..., tokens, q_heads, dim] (q_heads a
         multiple of heads: GQA); without it the report skips the attention-output columns.
  dtype: optional 0-d string: "bfloat16" when k, v, q hold bfloat16 bit patterns as uint16
         (NumPy cannot store bfloat16 itself); otherwise the arrays' own float dtype is used
         (float16 or float32).
  meta:  optional 0-d JSON string (model, text, loops and whether they are emulated, ...).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import zipfile
from typing import Any

import ml_dtypes
import numpy as np

from kvq_jax import data

#: The real K/V/Q shipped with kvq (SmolLM2-135M on English text; see meta for provenance).
EMBEDDED_PATH = data.path("real_kv.npz")

_FLOAT_DTYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


@dataclasses.dataclass(frozen=True)
class Capture:
    """K, V (and Q) as [windows, loops, layers, tokens, heads, dim] arrays of one float dtype."""

    k: np.ndarray
    v: np.ndarray
    q: np.ndarray | None
    meta: dict[str, Any]

    @property
    def dtype(self) -> np.dtype:
        return self.k.dtype

    @property
    def num_windows(self) -> int:
        return self.k.shape[0]

    @property
    def num_loops(self) -> int:
        return self.k.shape[1]

    @property
    def num_layers(self) -> int:
        return self.k.shape[2]

    @property
    def num_tokens(self) -> int:
        return self.k.shape[3]


def _check(name: str, x: np.ndarray) -> np.ndarray:
    if x.ndim not in (5, 6):
        raise ValueError(
            f"{name} must be [loops, layers, tokens, heads, dim] (or with a leading windows "
            f"axis), got shape {x.shape}"
        )
    if np.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")
    return x if x.ndim == 6 else x[None]


def make_capture(k, v, q=None, meta: dict | None = None) -> Capture:
    """Validate arrays (rank 5 or 6) into a `Capture`; raises ValueError/TypeError naming them."""
    k, v = np.asarray(k), np.asarray(v)
    k, v = _check("k", k), _check("v", v)
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"k {k.shape} {k.dtype} and v {v.shape} {v.dtype} must match")
    if min(k.shape) < 1:
        raise ValueError(f"k, v must have every axis >= 1, got shape {k.shape}")
    if q is not None:
        q = _check("q", np.asarray(q))
        if q.shape[:4] != k.shape[:4] or q.shape[5] != k.shape[5] or q.dtype != k.dtype:
            raise ValueError(
                f"q {q.shape} {q.dtype} must match k {k.shape} {k.dtype} except in heads"
            )
        if q.shape[4] % k.shape[4]:
            raise ValueError(f"q heads {q.shape[4]} must be a multiple of KV heads {k.shape[4]}")
    return Capture(k=k, v=v, q=q, meta=dict(meta or {}))


def save_capture(path, capture: Capture) -> None:
    """Write `capture` in the file format above (bfloat16 as uint16 bit patterns)."""
    arrays = {"k": capture.k, "v": capture.v}
    if capture.q is not None:
        arrays["q"] = capture.q
    dtype = np.dtype(capture.dtype)
    if dtype == np.dtype(ml_dtypes.bfloat16):
        arrays = {n: a.view(np.uint16) for n, a in arrays.items()}
    np.savez_compressed(
        path, **arrays, dtype=np.array(dtype.name), meta=np.array(json.dumps(capture.meta))
    )


def load_capture(path=None) -> Capture:
    """Read a capture file (default: the embedded one)."""
    path = EMBEDDED_PATH if path is None else pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"kv capture {path} does not exist")
    try:
        f = np.load(path, allow_pickle=False)
        if not isinstance(f, np.lib.npyio.NpzFile):
            raise ValueError("a single .npy array, not an .npz archive")
        with f:
            missing = {"k", "v"} - set(f.files)
            if missing:
                raise ValueError(f"missing array(s) {sorted(missing)} (need k and v)")
            arrays = {n: f[n] for n in ("k", "v", "q") if n in f.files}
            dtype = str(f["dtype"]) if "dtype" in f.files else None
            meta = json.loads(str(f["meta"])) if "meta" in f.files else {}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable kv capture: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: meta must be a JSON object, got {type(meta).__name__}")
    if dtype == "bfloat16":
        for name, a in arrays.items():
            if a.dtype != np.uint16:
                raise TypeError(f"{path}: dtype says bfloat16, so {name} must be uint16 bits")
            arrays[name] = a.view(ml_dtypes.bfloat16)
    try:
        return make_capture(arrays["k"], arrays["v"], arrays.get("q"), meta)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{path}: {e}") from e


def select(capture: Capture, windows=None, layers=None) -> Capture:
    """The capture restricted to some window and layer indices (None: all of them)."""
    k, v, q = capture.k, capture.v, capture.q
    if windows is not None:
        k, v, q = (None if x is None else x[list(windows)] for x in (k, v, q))
    meta = capture.meta
    if layers is not None:
        k, v, q = (None if x is None else x[:, :, list(layers)] for x in (k, v, q))
        model_layers = meta.get("layers")
        if isinstance(model_layers, list) and len(model_layers) == capture.num_layers:
            meta = {**meta, "layers": [model_layers[i] for i in layers]}  # model layer ids
    return Capture(k=k, v=v, q=q, meta=meta)
