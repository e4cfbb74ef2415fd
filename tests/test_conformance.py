"""The shared conformance vectors: in sync with the oracle, passed by kvq_jax, and able to
catch a wrong implementation."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_same_bytes

import kvq_jax
from kvq_jax.cli import commands as cli
from kvq_jax.codecs.formats.intb import register_table
from kvq_jax.conformance import check_pack, load_vectors
from kvq_jax.conformance.generate import generate
from kvq_jax.conformance.vectors import save_vectors
from kvq_jax.core.constants import FORMATS, ROTATED_FORMATS
from kvq_jax.core.layouts import intb_name

CASES = load_vectors()


def test_shipped_vectors_equal_a_fresh_oracle_run():
    fresh = generate()
    assert [c.name for c in fresh] == [c.name for c in CASES]
    for new, old in zip(fresh, CASES, strict=True):
        assert (new.format, new.kind, new.axis, new.group_size) == (
            old.format,
            old.kind,
            old.axis,
            old.group_size,
        )
        assert_same_bytes(new.values, old.values, f"{old.name} input")
        assert set(new.arrays) == set(old.arrays)
        for field in old.arrays:
            assert_same_bytes(new.arrays[field], old.arrays[field], f"{old.name}.{field}")
        assert_same_bytes(new.decoded, old.decoded, f"{old.name} decoded")


def test_vectors_cover_formats_dtypes_and_edge_cases():
    # every built-in format
    assert {c.format for c in CASES if c.bits is None} == {*FORMATS, *ROTATED_FORMATS}
    tables = [c for c in CASES if c.bits is not None]  # INTB: the format is the table's name
    assert len(tables) >= 40 and all(c.format == intb_name(c.bits) for c in tables)
    assert {c.values.dtype.name for c in CASES} == {"bfloat16", "float16", "float32"}
    assert {(c.format, c.axis) for c in CASES} >= {
        ("int4", "tokens"),
        ("int4", "channels"),
        ("nvfp4", "tokens"),
        ("nvfp4", "channels"),
    }
    assert any(c.values.shape[0] == 0 for c in CASES)
    assert any(c.values.shape[0] == 1 for c in CASES)
    assert any(c.values.shape[2] % 2 for c in CASES)
    assert any(np.isnan(c.values.astype(np.float32)).any() for c in CASES)
    # the tie cases really sit on ties
    ties = {c.name: c for c in CASES}
    x = ties["ties/int4"].values.astype(np.float64)
    q = (x - x.min(axis=0)) / ((x.max(axis=0) - x.min(axis=0)) / 15)
    assert np.sum(q % 1 == 0.5) >= 28
    mids = ties["ties/e2m1_midpoints"].values
    for m in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0):
        assert (mids == m).any() and (mids == -m).any(), m


#: numpy inputs differ from jax inputs only at the entry conversion: every 9th vector (none of
#: the JAX sample's below) and the first of each (format, dtype), and all of them, with
#: --run-slow (by default test_cli_reports_pass_and_fail runs every vector with numpy inputs).
_FIRST = {
    (c.format if c.bits is None else "intb", c.values.dtype.name): c.name for c in reversed(CASES)
}
NUMPY_SAMPLE = [c for i, c in enumerate(CASES) if i % 9 == 4 or c.name in _FIRST.values()]
#: the JAX-array run of the default test command: every ninth vector and the first of each
#: (format, dtype) (CI time: every vector is an eager compile; the CLI test runs the same
#: sample with numpy inputs); every vector with --run-slow.
JAX_SAMPLE = [c for i, c in enumerate(CASES) if i % 9 == 0 or c.name in _FIRST.values()]


@pytest.mark.parametrize(
    "input_kind, cases",
    [
        pytest.param("jax", JAX_SAMPLE, id="jax-sample"),
        pytest.param("jax", CASES, id="jax", marks=pytest.mark.slow),
        # numpy inputs of the sample / every vector: test_cli_reports_pass_and_fail (the CLI)
        pytest.param("numpy", NUMPY_SAMPLE, id="numpy-sample", marks=pytest.mark.slow),
        pytest.param("numpy", CASES, id="numpy", marks=pytest.mark.slow),
    ],
)
def test_kvq_jax_passes_every_vector(input_kind, cases):
    if cases is NUMPY_SAMPLE or cases is JAX_SAMPLE:
        assert {c.format for c in cases if c.bits is None} == {
            c.format for c in CASES if c.bits is None
        }
        assert {c.values.dtype for c in cases} == {c.values.dtype for c in CASES}
    results = check_pack(
        kvq_jax.pack_kv,
        unpack_fn=kvq_jax.unpack_kv,
        input_kind=input_kind,
        cases=cases,
        register_table=register_table,
    )
    failed = [f"{r.name}: {r.detail}" for r in results if not r.passed]
    assert not failed, failed[:5]
    assert len(results) == len(cases) and len(CASES) >= 100


def off_by_one_code(values, **kwargs):
    """An implementation with one wrong nibble per NVFP4 tensor: must be caught."""
    packed = kvq_jax.pack_kv(values, **kwargs)
    if kwargs["format"] != "nvfp4" or packed.codes.size == 0:
        return packed
    arrays = dict(packed.arrays)
    arrays["codes"] = packed.codes.at[(0,) * packed.codes.ndim].add(1)
    return kvq_jax.PackedKV(
        **arrays,
        format=packed.format,
        kind=packed.kind,
        axis=packed.axis,
        group_size=packed.group_size,
        shape=packed.shape,
        dtype=packed.dtype,
    )


def raises(values, **kwargs):
    raise NotImplementedError("no kernel for this shape")


@pytest.mark.parametrize(
    "cases",
    [pytest.param(JAX_SAMPLE, id="sample"), pytest.param(CASES, id="all", marks=pytest.mark.slow)],
)
def test_a_wrong_implementation_fails_exactly_where_it_is_wrong(cases):
    results = check_pack(off_by_one_code, cases=cases)
    assert {r.name for r in results if r.skipped} == {c.name for c in cases if c.bits is not None}
    failed = {r.name for r in results if not r.passed and not r.skipped}
    nonempty_nvfp4 = {c.name for c in cases if c.format == "nvfp4" and c.values.size}
    assert failed and failed == nonempty_nvfp4
    assert all("codes" in r.detail for r in results if not r.passed and not r.skipped)
    raised = check_pack(raises, cases=cases, register_table=lambda bits: None)
    assert all("raised NotImplementedError" in r.detail for r in raised)


@pytest.mark.slow
def test_cli_skips_table_cases_without_a_register_table(capsys):
    table_cases = sum(c.bits is not None for c in CASES)
    assert cli.main(["conformance", "--unpack", "kvq_jax:unpack_kv"]) == 0
    out = capsys.readouterr().out
    assert f"{len(CASES) - table_cases} passed, 0 failed, {table_cases} skipped" in out


@pytest.mark.parametrize(
    "every",
    [pytest.param(False, id="sample"), pytest.param(True, id="all", marks=pytest.mark.slow)],
)
def test_cli_reports_pass_and_fail(capsys, tmp_path, monkeypatch, every):
    """The CLI (numpy inputs, decoding too) passes every vector (by default a --vectors file of
    the JAX sample and the E2M1 ties: CI time, each vector is an eager compile) and fails a
    wrong implementation."""
    vectors = []
    cases = CASES
    if not every:
        cases = [c for c in CASES if c in JAX_SAMPLE or c.name == "ties/e2m1_midpoints"]
        save_vectors(cases, tmp_path / "sample.npz")
        vectors = ["--vectors", str(tmp_path / "sample.npz")]
    register = ["--register-table", "kvq_jax.codecs.formats.intb:register_table"]
    assert cli.main(["conformance", "--unpack", "kvq_jax:unpack_kv", *register, *vectors]) == 0
    out = capsys.readouterr().out
    assert f"on {len(cases)} vectors" in out and f"{len(cases)} passed, 0 failed\n" in out
    assert cli.main(["conformance", "test_conformance:off_by_one_code", *vectors]) == 1
    out = capsys.readouterr().out
    assert "FAIL ties/e2m1_midpoints [nvfp4]: codes:" in out
    # arguments that cannot be loaded: one line each, exit 2, before any vector runs
    broken = tmp_path / "kvq_broken_module.py"  # a module whose own code fails
    broken.write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for argv, message in (
        (["kvq_jax.pack_kv"], "expected MODULE:FUNCTION, got 'kvq_jax.pack_kv'"),
        (["no_such_module_kvq:pack"], "no_such_module_kvq:pack: cannot import no_such_module_kvq"),
        (["kvq_jax:no_such_pack"], "kvq_jax:no_such_pack: kvq_jax has no attribute"),
        (["kvq_jax:__version__"], "kvq_jax:__version__ is not callable"),
        (["kvq_jax:pack_kv", "--vectors", str(tmp_path / "none.npz")], "none.npz"),
        (["kvq_jax:pack_kv", "--heavy", "kvq_jax.codecs"], "has no attribute 'select_heavy'"),
        ([f"{broken.stem}:pack"], f"cannot import {broken.stem} (ZeroDivisionError: "),
    ):
        assert cli.main(["conformance", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("kvq conformance: error: ") and err.count("\n") == 1, err
        assert message in err and "Traceback" not in err, (argv, err)
