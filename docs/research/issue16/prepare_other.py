"""Builds other_text.txt for the smol-other capture: first half plain English prose from the
shortened English Wikipedia dump shipped in gensim's test data, second half Python stdlib
source, equal lengths, so that text_windows(count=4) on the one file starts windows 0-1 in
the prose and windows 2-3 in the Python source."""
import bz2
import html
import pathlib
import re
import sys
import sysconfig
import xml.etree.ElementTree as ET

DUMP = "/tmp/research16/site/gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
HALF = 150_000
PY_FILES = ["textwrap.py", "fractions.py", "heapq.py", "statistics.py", "shlex.py",
            "difflib.py", "argparse.py"]


def strip_nested(s, open_, close):
    out, depth, i = [], 0, 0
    while i < len(s):
        if s.startswith(open_, i):
            depth += 1; i += len(open_); continue
        if depth and s.startswith(close, i):
            depth -= 1; i += len(close); continue
        if not depth:
            out.append(s[i])
        i += 1
    return "".join(out)


def clean(t):
    t = html.unescape(t)
    t = re.sub(r"<!--.*?-->", "", t, flags=re.S)
    t = re.sub(r"<ref[^>/]*/>", "", t)
    t = re.sub(r"<ref[^>]*>.*?</ref>", "", t, flags=re.S)
    t = strip_nested(t, "{{", "}}")
    t = strip_nested(t, "{|", "|}")
    t = re.sub(r"<[^>]+>", "", t)
    # files / images / categories (possibly with nested links in captions)
    for _ in range(3):
        t = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\[\]]*\]\][^\[\]]*)*\]\]", "", t)
    t = re.sub(r"^\[\[[a-z\-]{2,12}:[^\]]*\]\]$", "", t, flags=re.M)  # interlanguage
    t = re.sub(r"\[\[(?:[^\]|]*\|)?([^\]]*)\]\]", r"\1", t)
    t = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", t)
    t = re.sub(r"\[https?://\S+\]", "", t)
    t = re.sub(r"'{2,}", "", t)
    t = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", t, flags=re.M)
    lines = []
    for ln in t.split("\n"):
        ln = ln.strip()
        if not ln or ln.startswith(("*", "#", ":", ";", "|", "!")):
            continue
        lines.append(ln)
    # keep paragraphs; drop the reference sections at the end
    out = "\n".join(lines)
    out = re.split(r"\n(?:See also|References|Notes|Further reading|External links)\n", out)[0]
    return out


def prose():
    ns = "{http://www.mediawiki.org/xml/export-0.10/}"
    parts = []
    with bz2.open(DUMP) as f:
        for _, el in ET.iterparse(f):
            if not el.tag.endswith("}page"):
                continue
            tag = el.tag[: el.tag.index("}") + 1]
            title = el.findtext(f"{tag}title")
            nsv = el.findtext(f"{tag}ns")
            text = el.findtext(f"{tag}revision/{tag}text") or ""
            el.clear()
            if nsv != "0" or text.lower().startswith("#redirect") or len(text) < 20000:
                continue
            parts.append((title, clean(text)))
            if sum(len(p) for _, p in parts) > HALF * 1.1:
                break
    return parts


if __name__ == "__main__":
    parts = prose()
    ptxt = "\n\n".join(p for _, p in parts)[:HALF]
    ptxt = ptxt[: ptxt.rfind("\n") + 1].ljust(HALF, "\n")[:HALF]
    lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    py = "\n\n".join((lib / n).read_text() for n in PY_FILES)
    assert len(py) >= HALF, len(py)
    py = py[:HALF]
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/research16/other_text.txt")
    out.write_text(ptxt + py)
    print("articles:", [t for t, _ in parts], "stdlib:", lib, PY_FILES, "chars", len(ptxt), len(py))
