"""The progress bar of `kvq report`: tqdm on stderr, shown only when stderr is a terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterable


def progress(iterable: Iterable, *, total: int | None = None, desc: str = "", enabled=None):
    """Wrap `iterable` in a tqdm bar on stderr.

    enabled: None (the default) shows the bar only on a TTY; True / False force it.
    The bar is removed when done (leave=False), so the printed table stays clean.
    """
    from tqdm import tqdm

    return tqdm(
        iterable,
        total=total,
        desc=desc,
        file=sys.stderr,
        disable=None if enabled is None else not enabled,
        leave=False,
        unit="policy",
    )
