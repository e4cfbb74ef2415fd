"""KV storage policies compared by `kvq report`: one named row per (format, window) choice.

A policy says how a loop stack [L, T, H, D] of keys or values is stored: loop 0 whole in
`base_format`, each later loop as a residual in `residual_format` against the reconstructed
previous loop (`kvq_jax.encode_loops`), keys grouped over tokens and values over channels
(the defaults), with an optional BF16 window of raw rows (`kvq_jax.Window`). A single-loop
capture uses the base format only. "bf16" is the unquantized reference row.
"""

from __future__ import annotations

import dataclasses

from kvq_jax.core.window import Window

#: The BF16 window of the "+win" rows: 4 attention-sink rows and the 16 most recent rows.
DEFAULT_WINDOW = Window(sink=4, recent=16)


@dataclasses.dataclass(frozen=True)
class Policy:
    """One storage policy (hashable, static).

    name: the row label, e.g. "int4-g64+win".
    base_format / residual_format: registry names ("int4", "nvfp4", "fp8_e4m3"), or "bf16"
      for both in the unquantized reference.
    group_size: INT4 group size for keys and values (None: the format's default).
    window: raw BF16 rows kept unquantized, or None.
    """

    name: str
    base_format: str
    residual_format: str
    group_size: int | None = None
    window: Window | None = None

    @property
    def quantized(self) -> bool:
        return self.base_format != "bf16"

    def loop_kwargs(self, kind: str) -> dict:
        """Keyword arguments of `kvq_jax.encode_loops` (and the Torch mirror) for `kind`."""
        if not self.quantized:
            raise ValueError(f"policy {self.name!r} is the unquantized reference")
        return dict(
            kind=kind,
            base_format=self.base_format,
            residual_format=self.residual_format,
            group_size=self.group_size,
            window=self.window,
        )


def _with_window(policies: list[Policy]) -> list[Policy]:
    out = []
    for p in policies:
        out.append(p)
        out.append(dataclasses.replace(p, name=f"{p.name}+win", window=DEFAULT_WINDOW))
    return out


#: Every policy of the default report, in table order.
POLICIES: dict[str, Policy] = {
    p.name: p
    for p in [
        Policy("bf16", "bf16", "bf16"),
        *_with_window(
            [
                Policy("int4-g16", "int4", "int4", group_size=16),
                Policy("int4-g32", "int4", "int4", group_size=32),
                Policy("int4-g64", "int4", "int4", group_size=64),
                Policy("nvfp4", "nvfp4", "nvfp4"),
                Policy("fp8", "fp8_e4m3", "fp8_e4m3"),
                Policy("mixed", "int4", "nvfp4", group_size=64),
            ]
        ),
    ]
}


def parse_policies(text: str | None) -> list[Policy]:
    """'int4-g64,nvfp4+win' -> those policies (None or "all": every policy).

    Raises ValueError naming the unknown entries and listing the known names.
    """
    if text is None or text.strip() == "all":
        return list(POLICIES.values())
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise ValueError(
            f"policies: unknown {unknown or '(empty list)'}; known: {', '.join(POLICIES)}"
        )
    return [POLICIES[n] for n in dict.fromkeys(names)]
