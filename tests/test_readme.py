"""The README's promises: a front page (<= 200 lines), its test command is what CI runs, and
its examples (then docs/GUIDE.md's) run as printed. (The main job's output, `kvq report` on
the embedded capture, is compared with the README's block by
`tests/test_report.py::test_default_run_on_the_embedded_capture`.)"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
GUIDE = (ROOT / "docs" / "GUIDE.md").read_text()


def bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_two_setup_commands_and_ci_runs_the_test_command():
    blocks = bash_blocks(README)
    assert len(blocks) == 2, blocks
    main_job, tests = blocks
    assert main_job.endswith("kvq report")
    assert "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, f"{tests!r} is not a line of .ci/run"


def test_readme_is_a_front_page():
    assert len(README.splitlines()) <= 200
    for doc in ("docs/GUIDE.md", "docs/RESULTS.md", "docs/LAYERS.md", "CONTRIBUTING.md"):
        assert f"]({doc})" in README and (ROOT / doc).is_file(), doc


def test_python_examples_run_and_their_comments_are_true(capsys):
    readme = re.findall(r"```python\n(.*?)```", README, re.S)
    guide = re.findall(r"```python\n(.*?)```", GUIDE, re.S)
    assert len(readme) >= 3 and len(guide) >= 2
    blocks = readme + guide
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README python block {i}", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    expected = [
        re.search(r"# (.*)$", line).group(1)
        for code in blocks
        for line in code.splitlines()
        if line.startswith("print(")
    ]
    assert printed == expected
    assert namespace["recon"].shape == (4, 2048, 16, 128)
    assert namespace["j_packed"].format == "int4"


@pytest.mark.parametrize("argv", [["demo", "--repeats", "1"]])
def test_demo_prints_every_format(argv, capsys):
    from kvq_jax import CODECS
    from kvq_jax.cli import commands as cli
    from kvq_jax.cli.demo import fits
    from kvq_jax.codecs.formats.heavy_rows import register_heavy
    from kvq_jax.codecs.formats.intb import register_layer_tables, register_table

    # formats that cannot pack the demo tensor on their own are listed as not run, not an
    # error: an INTB format of another model's shape, one table per layer, heavy-row values
    others = [register_table(((4,) * 8,) * 2), register_layer_tables([((4,) * 8,) * 2] * 2),
              register_heavy("hint4", 16)]  # fmt: skip
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    fitting = [f for f in CODECS if fits(f, "key")]
    (not_run,) = [line for line in out.splitlines() if line.startswith("Not run (registered")]
    for other in others:
        assert other not in fitting and other in not_run.split(": ", 1)[1].split(", ")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in ([f] for f in fitting)]
    assert len(rows) == 2 * len(fitting) and len(fitting) >= 4
    bits = {(r[0], r[1]): float(r[4]) for r in rows}
    assert bits[("int4", "key")] == 4.5 and bits[("nvfp4", "value")] == 4.5
    assert bits[("fp8_e4m3", "key")] == 8.25
