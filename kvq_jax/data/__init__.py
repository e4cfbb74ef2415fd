"""Data shipped with kvq, in one place, found through `importlib.resources`.

    from kvq_jax import data
    path = data.path("vectors_v1.npz")

- `vectors_v1.npz`, `heavy_v1.npz`: the conformance vectors (`kvq_jax.conformance`).
- `real_kv.npz`: the embedded 4-loop KV capture of `kvq report` (`kvq_jax.report.capture`).
- `intb_smollm2*.npz`: SmolLM2's calibrated key tables (`kvq_jax.core.calibration`).
- `looped_tiny/`: a folder, the HF checkpoint `load_model("looped-tiny")` loads (a 4-loop
  Ouro-architecture model trained by bench/train_looped.py; its README.md is the card).

Framework-neutral (imports nothing of kvq's): every layer may use it.
"""

from __future__ import annotations

import pathlib
from importlib import resources

#: The files shipped here.
FILES = (
    "vectors_v1.npz",
    "heavy_v1.npz",
    "real_kv.npz",
    "intb_smollm2.npz",
    "intb_smollm2_heavy.npz",
    "intb_smollm2_heavy_prerope.npz",
    "looped_tiny",
)


def path(name: str) -> pathlib.Path:
    """The file system path of the shipped file (or folder) `name` (one of `FILES`)."""
    if name not in FILES:
        raise ValueError(f"name must be one of {sorted(FILES)}, got {name!r}")
    return pathlib.Path(str(resources.files(__name__).joinpath(name)))
