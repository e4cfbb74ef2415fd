"""The checkpoint's tokenizer, built with the `tokenizers` library alone (no transformers, no
torch).

* HF directories: `tokenizer.json` as written by the checkpoint (`tokenizers.Tokenizer.from_file`).
* GGUF files: the file's own metadata (`tokenizer.ggml.*`). Byte-level BPE (`model = "gpt2"`)
  is rebuilt from `tokens` + `merges`; the split before BPE follows llama.cpp's table of
  `tokenizer.ggml.pre` names (the regexes the vocabulary's merges were learned with); control
  tokens (`token_type` 3) are special tokens kept whole. Other vocabularies (SentencePiece
  `"llama"`, ...) are refused by name.

`Tokenizer.encode(text, add_special_tokens=True) -> list[int]` and
`Tokenizer.decode(ids, skip_special_tokens=True) -> str`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib

#: llama.cpp's pre-tokenizer splits (llama-vocab.cpp) by `tokenizer.ggml.pre`: the regexes run
#: in order, each splitting the pieces of the one before ("isolated").
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),
    # StarCoder-style vocabularies (SmolLM's among them): every digit on its own, then GPT-2.
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-bpe": (_LLAMA3_SPLIT,),
}
#: GGUF token_type of a control token (llama.cpp LLAMA_TOKEN_TYPE_CONTROL).
_CONTROL = 3


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A `tokenizers.Tokenizer` with the two calls the engine makes; `source` says where it
    came from ("tokenizer.json" or "gguf metadata")."""

    backend: object
    source: str
    add_bos_id: int | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens: the checkpoint's BOS / post-processor."""
        ids = list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens and self.add_bos_id is not None:
            ids.insert(0, self.add_bos_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def gguf_tokenizer(fields: dict, where: str) -> Tokenizer:
    """The tokenizer a GGUF file describes. fields: `tokenizer.ggml.*` key -> value (strings,
    ints, lists). Raises ValueError naming the key for a vocabulary it cannot rebuild."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{where}: tokenizer.ggml.model={kind!r}: only byte-level BPE ('gpt2') vocabularies "
            "are rebuilt from GGUF metadata; pass --prompt-ids or use an HF directory"
        )
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_SPLITS:
        raise ValueError(
            f"{where}: tokenizer.ggml.pre={pre!r} is not one of {sorted(GGUF_PRE_SPLITS)}"
        )
    tokens = list(fields["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", ())]
    spell = _bytes_to_unicode()
    alphabet = set(spell.values())
    vocab = {
        (t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = [
        pre_tokenizers.Split(tokenizers.Regex(r), behavior="isolated") for r in GGUF_PRE_SPLITS[pre]
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    types = list(fields.get("tokenizer.ggml.token_type", ()))
    special = [t for t, ty in zip(tokens, types, strict=False) if ty == _CONTROL and t in vocab]
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, normalized=False, special=True) for t in special]
    )
    bos = fields.get("tokenizer.ggml.bos_token_id")
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    return Tokenizer(tok, "gguf metadata", int(bos) if add_bos else None)


def gguf_fields(reader) -> dict:
    """`tokenizer.ggml.*` fields of a `gguf.GGUFReader` as Python values."""
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}


@functools.cache
def _gguf_tokenizer_cached(path: str) -> Tokenizer:
    from gguf import GGUFReader

    return gguf_tokenizer(gguf_fields(GGUFReader(path)), path)


def load_tokenizer(directory: str | os.PathLike, gguf_file: str | None = None) -> Tokenizer | None:
    """The checkpoint's tokenizer: from the GGUF file's metadata when `gguf_file` is given, else
    `directory/tokenizer.json`; None when the directory has no tokenizer.json."""
    directory = pathlib.Path(directory)
    if gguf_file is not None:
        return _gguf_tokenizer_cached(str(directory / gguf_file))
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    import tokenizers

    return Tokenizer(tokenizers.Tokenizer.from_file(str(path)), "tokenizer.json")
