"""Regenerate the conformance vectors from the scalar oracle.

python -m kvq_jax.conformance.generate [PATH]    # default: the shipped vectors_v1.npz
                                                 # (and heavy_v1.npz, heavy rows)
"""

from __future__ import annotations

import sys

from kvq_jax import oracle
from kvq_jax.conformance.cases import build_cases
from kvq_jax.conformance.vectors import VECTORS_PATH, Case, save_vectors


def generate() -> list[Case]:
    """Every case of `cases.build_cases`, with the oracle's arrays and decoded output."""
    out = []
    for c in build_cases():
        bits = c.get("bits")
        enc = oracle.pack(
            c["values"],
            format="intb" if bits is not None else c["format"],
            kind=c["kind"],
            group_size=c["group_size"],
            axis=c["axis"],
            **({} if bits is None else {"bits": bits}),
        )
        out.append(
            Case(
                name=c["name"],
                format=c["format"],
                kind=c["kind"],
                axis=enc.axis,
                group_size=enc.group_size,
                values=c["values"],
                arrays=dict(enc.arrays),
                decoded=oracle.unpack(enc),
                bits=bits,
            )
        )
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else VECTORS_PATH
    cases = generate()
    save_vectors(cases, path)
    print(f"wrote {len(cases)} cases to {path}")
    if not argv:  # the shipped files: the heavy-row vectors too
        from kvq_jax.conformance.heavy import (
            HEAVY_VECTORS_PATH,
            generate_heavy,
            save_heavy_vectors,
        )

        heavy = generate_heavy()
        save_heavy_vectors(heavy, HEAVY_VECTORS_PATH)
        print(f"wrote {len(heavy)} heavy-row cases to {HEAVY_VECTORS_PATH}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
