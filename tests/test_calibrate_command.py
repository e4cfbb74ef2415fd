"""`kvq calibrate` and `--tables` (issue 24): tables from a model and a text in one command,
equal to a re-derivation from the same capture with the public table functions; a policy put
on them by `--tables` in `kvq generate` and `kvq report`; tables of another model, layer
count, head shape or RoPE base refused with the reason. The model is looped-tiny (shipped,
1 layer x 4 loops, its own tokenizer); the text is Python's difflib source (always there)."""

from __future__ import annotations

import difflib
import json
import re

import numpy as np
import pytest
from helpers import step_compiles

from kvq_jax.cli.commands import main
from kvq_jax.core import calibration
from kvq_jax.core.policies import POLICIES
from kvq_jax.report.capture import load_capture


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal")
    code = main(["calibrate", "--model", "looped-tiny", "--text", difflib.__file__,
                 "--windows", "3", "--tokens", "96", "--mean-query", "--out",
                 str(out / "lt.npz"), "--save-capture", str(out / "cap.npz")])  # fmt: skip
    assert code == 0
    return out


def test_tables_equal_a_rederivation_from_the_capture(tables, capsys):
    got = calibration.load_key_tables(tables / "lt.npz")
    cap = load_capture(tables / "cap.npz")
    assert cap.k.shape[:4] == (3, 1, 1, 96) and cap.meta["layers"] == [0]
    k, q = np.asarray(cap.k[:, 0, 0], np.float32), np.asarray(cap.q[:, 0, 0], np.float32)
    want = calibration.intb_bit_table(k, q, mean_bits=4.0, group_size=64)
    assert got.tables[0] == want
    np.testing.assert_array_equal(
        np.asarray(got.mean_query[0], np.float32),
        np.asarray(calibration.mean_query_table(q, k.shape[2]), np.float32),
    )
    assert "looped-tiny" in got.models and got.rope_theta is None
    assert np.mean(got.tables[0]) == 4.0


def test_generate_uses_the_tables(tables, capsys, tmp_path):
    path = tables / "lt.npz"
    # the shipped SmolLM2 tables do not fit looped-tiny: refused with the reason ...
    assert main(["generate", "--model", "looped-tiny", "--policy", "intb-hint4-smollm2",
                 "--prompt-ids", "5,6,7", "--max-new-tokens", "3"]) == 2  # fmt: skip
    assert "its key tables are for" in capsys.readouterr().err
    # ... its own, calibrated here, are served; the warm-up compiles each step program
    # once (the prompt's two chunk shapes and the decode step) and the run none again
    args = ["generate", "--model", "looped-tiny", "--policy", "intb-hint4-smollm2", "--tables",
            str(path), "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--json",
            str(tmp_path / "g.json")]  # fmt: skip
    rc = []
    compiled = step_compiles(lambda: rc.append(main(args)))
    assert rc == [0] and compiled == ["prefill_step", "prefill_step", "decode_step"], compiled
    run = json.loads((tmp_path / "g.json").read_text())["runs"][0]
    assert run["policy"] == "intb-hint4@lt"
    # a policy that takes no tables
    assert main(["generate", "--model", "looped-tiny", "--policy", "int4-g64", "--tables",
                 str(path), "--prompt-ids", "5,6", "--max-new-tokens", "2"]) == 2  # fmt: skip
    assert "stores per-layer key tables" in capsys.readouterr().err


def test_a_refusal_names_the_command_that_makes_fitting_tables(capsys, tmp_path):
    """The shipped tables of the best policy refused on another model name the `kvq calibrate`
    command of a table set of their kind (3.75 mean bits, mean-query tables, keys before
    RoPE); run as printed (a text for FILE ..., fewer windows), it makes tables the policy
    takes on that model (looped-tiny: with exits, every loop run)."""
    policy = "intb-prerope-hint4-heavy-smollm2"
    generate = ["generate", "--model", "looped-tiny", "--policy", policy, "--prompt-ids",
                "5,6,7", "--max-new-tokens", "2"]  # fmt: skip
    assert main(generate) == 2
    err = capsys.readouterr().err
    command = re.search(r"tables of this kind for it: (kvq calibrate .*?) \(then --tables", err)
    assert command, err
    command = command.group(1)
    assert command == ("kvq calibrate --model looped-tiny --text FILE ... --mean-bits 3.75 "
                       "--mean-query --pre-rope --out TABLES.npz")  # fmt: skip
    path = tmp_path / "fit.npz"
    argv = command.replace("FILE ...", difflib.__file__).replace("TABLES.npz", str(path))
    assert main([*argv.split()[1:], "--windows", "2", "--tokens", "64"]) == 0
    argv = [*generate, "--tables", str(path), "--compare", "int4-g64"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    tag = f"{policy.replace('-smollm2', '')}@fit"
    assert f"[{tag}]" in out
    # looped-tiny's exits would skip loops: with heavy rows every loop runs, and it says so;
    # the policy it is compared with runs every loop too (the same loops, the KL the KV's)
    assert "4.00 loops/token (every loop runs: heavy-row pages are not served with" in out
    assert "vs int4-g64 (both run every loop): " in out
    said = f"; 4.00 loops/token (every loop runs: compared with {tag}, which does)"
    assert out.split("[int4-g64]")[1].count(said) == 1, out


def test_with_key_tables_checks_the_file(tables, tmp_path):
    policy = POLICIES["intb-hint4-smollm2+win"]
    bound = calibration.with_key_tables(policy, tables / "lt.npz")
    assert bound.name == "intb-hint4@lt+win" and bound.key_tables.startswith("file:")
    assert calibration.get_key_tables(bound.key_tables).tables[0]
    with pytest.raises(FileNotFoundError):
        calibration.with_key_tables(policy, tmp_path / "missing.npz")
    with pytest.raises(ValueError, match="stores no per-layer key tables"):
        calibration.with_key_tables(POLICIES["int4-g64"], tables / "lt.npz")
    heavy = next(p for p in POLICIES.values() if p.heavy is not None and not p.pre_rope)
    no_mq = calibration.KeyTables(("m",), {0: ((4,) * 8,) * 2}, 64, "t")
    calibration.save_key_tables(tmp_path / "nomq.npz", no_mq)
    with pytest.raises(ValueError, match="has no mean-query tables"):
        calibration.with_key_tables(heavy, tmp_path / "nomq.npz")
    prerope = next(p for p in POLICIES.values() if p.pre_rope)
    with pytest.raises(ValueError, match="stores keys before RoPE"):
        calibration.with_key_tables(prerope, tables / "lt.npz")


def test_tables_of_another_model_shape_or_rope_base_are_refused(tables):
    got = calibration.load_key_tables(tables / "lt.npz")
    heads, dim = len(got.tables[0]), len(got.tables[0][0])
    got.check_fit("p", ["looped-tiny"], 1, num_kv_heads=heads, head_dim=dim)
    with pytest.raises(ValueError, match="its key tables are for"):
        got.check_fit("p", ["smollm2"], 1)
    with pytest.raises(ValueError, match=r"no key table for layers \[1\]"):
        got.check_fit("p", ["looped-tiny"], 2)
    with pytest.raises(ValueError, match="KV heads, head dim"):
        got.check_fit("p", ["looped-tiny"], 1, num_kv_heads=heads + 1, head_dim=dim)
    got.check_fit("p", None, 1, num_kv_heads=heads, head_dim=dim)  # name not known: not checked
    with pytest.raises(ValueError, match="KV heads, head dim"):
        got.check_fit("p", None, 1, num_kv_heads=heads + 1, head_dim=dim)
    pre = calibration.KeyTables(("m",), got.tables, 64, "t", rope_theta=10000.0)
    pre.check_fit("p", ["m"], 1, rope_theta=10000.0)
    with pytest.raises(ValueError, match=r"pre-RoPE key tables are for RoPE base 10000\.0"):
        pre.check_fit("p", ["m"], 1, rope_theta=1e6)


def test_bad_arguments_are_one_line(capsys, tmp_path):
    assert main(["calibrate", "--model", "looped-tiny", "--text", difflib.__file__, "--out",
                 str(tmp_path / "x.npz"), "--windows", "0"]) == 2  # fmt: skip
    assert "--windows must be >= 1" in capsys.readouterr().err
    assert main(["calibrate", "--model", "looped-tiny", "--text", str(tmp_path / "none.txt"),
                 "--out", str(tmp_path / "x.npz")]) == 2  # fmt: skip
    assert f"kvq calibrate: error: --text: {tmp_path / 'none.txt'} is not a file" in (
        capsys.readouterr().err
    )
    # a capture that could not be written: refused before anything is written
    assert main(["calibrate", "--model", "looped-tiny", "--text", difflib.__file__, "--out",
                 str(tmp_path / "x.npz"), "--save-capture",
                 str(tmp_path / "no" / "c.npz")]) == 2  # fmt: skip
    assert f"--save-capture: folder {tmp_path / 'no'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "x.npz").exists()


def test_report_on_a_capture_uses_the_tables(tables, capsys, tmp_path):
    out = tmp_path / "r.json"
    assert main(["report", "--kv", str(tables / "cap.npz"), "--policies",
                 "intb-hint4-smollm2,int4-g64", "--tables", str(tables / "lt.npz"),
                 "--no-progress", "--json", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "intb-hint4@lt" in text and "int4-g64" in text
    assert "intb-hint4@lt" in out.read_text()
