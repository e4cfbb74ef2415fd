"""Check any `pack_kv`-shaped implementation against the conformance vectors.

    results = check_pack(my_pack_kv, unpack_fn=my_unpack_kv, input_kind="torch")
    print(format_report(results))

`pack_fn(values, *, kind, format, group_size, axis)` may return an object with the array fields as
attributes (kvq's PackedKV) or a dict of them. A table-format case (INTB, FORMAT.md 2b: `case.bits`
set, `case.format` the table's registry name) runs only when `register_table` is given: it is called
with the table before the case (kvq's stacks: `kvq_jax.codecs.formats.intb.register_table`,
`kvq_torch_bridge.codecs.formats.intb.register_table`); without it the case is reported as skipped;
arrays may be numpy, JAX or torch (CPU or CUDA). Arrays are compared as raw bytes; decoded values
too, except that a NaN expected anywhere only has to be a NaN (decoded NaN payloads depend on the
device).
"""

from __future__ import annotations

import dataclasses
import traceback
from collections import defaultdict

import ml_dtypes
import numpy as np

from kvq_jax.conformance.vectors import Case, load_vectors

INPUT_KINDS = ("numpy", "jax", "torch")


@dataclasses.dataclass(frozen=True)
class CaseResult:
    name: str
    format: str
    passed: bool
    detail: str = ""
    skipped: bool = False


def to_numpy(x) -> np.ndarray:
    """numpy / JAX / torch array -> numpy array with the same dtype and bytes."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch, without importing it
        t = x.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        special = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}
        if name in special:
            import torch

            return t.view(torch.uint8).numpy().view(special[name]).reshape(tuple(t.shape))
        return t.numpy()
    return np.asarray(x)


def _convert_input(values: np.ndarray, input_kind: str):
    if input_kind == "numpy":
        return values
    if input_kind == "jax":
        import jax.numpy as jnp

        return jnp.asarray(values)
    import torch

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        values.dtype.name
    ]
    if values.size == 0:
        return torch.empty(values.shape, dtype=dtype)
    raw = torch.from_numpy(np.ascontiguousarray(values).reshape(-1).view(np.uint8).copy())
    return raw.view(dtype).reshape(values.shape)


def _first_difference(actual: np.ndarray, expected: np.ndarray, nan_ok: bool) -> str | None:
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return (
            f"got {actual.dtype}{list(actual.shape)}, expected {expected.dtype}"
            f"{list(expected.shape)}"
        )
    if expected.size == 0:
        return None
    a = np.ascontiguousarray(actual).reshape(-1)
    e = np.ascontiguousarray(expected).reshape(-1)
    width = e.dtype.itemsize
    same = (a.view(np.uint8).reshape(-1, width) == e.view(np.uint8).reshape(-1, width)).all(1)
    if nan_ok:
        e_nan = np.isnan(e.astype(np.float32))
        same |= e_nan & np.isnan(a.astype(np.float32))
    if same.all():
        return None
    i = int(np.flatnonzero(~same)[0])
    idx = tuple(int(v) for v in np.unravel_index(i, expected.shape))
    return f"{int((~same).sum())} elements differ, first at {idx}: got {a[i]!r}, expected {e[i]!r}"


def _field(packed, name: str):
    return packed[name] if isinstance(packed, dict) else getattr(packed, name, None)


def check_outputs(case, packed, field, unpack_fn=None) -> CaseResult | None:
    """The first mismatch of `packed` against a case's arrays (read with `field(packed,
    name)`) and, with `unpack_fn`, its decoded values; None when everything matches."""
    for name, expected in case.arrays.items():
        got = field(packed, name)
        if got is None:
            return CaseResult(case.name, case.format, False, f"no field {name!r}")
        diff = _first_difference(to_numpy(got), expected, nan_ok=False)
        if diff:
            return CaseResult(case.name, case.format, False, f"{name}: {diff}")
    if unpack_fn is not None:
        diff = _first_difference(to_numpy(unpack_fn(packed)), case.decoded, nan_ok=True)
        if diff:
            return CaseResult(case.name, case.format, False, f"decoded: {diff}")
    return None


def check_case(
    case: Case, pack_fn, unpack_fn=None, input_kind: str = "numpy", register_table=None
) -> CaseResult:
    if case.bits is not None and register_table is None:
        return CaseResult(case.name, case.format, False, "table format: no register_table", True)
    try:
        if case.bits is not None:
            register_table(case.bits)
        packed = pack_fn(_convert_input(case.values, input_kind), **case.pack_args)
        failure = check_outputs(case, packed, _field, unpack_fn)
        if failure is not None:
            return failure
    except Exception as e:  # an implementation's failure is a result
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return CaseResult(case.name, case.format, False, f"raised {last}")
    return CaseResult(case.name, case.format, True)


def check_pack(
    pack_fn,
    *,
    unpack_fn=None,
    input_kind: str = "numpy",
    cases: list[Case] | None = None,
    register_table=None,
) -> list[CaseResult]:
    """Run every vector (default: the shipped file) through `pack_fn` (and `unpack_fn`);
    `register_table(bits)` registers a table format first (None: those cases are skipped)."""
    if input_kind not in INPUT_KINDS:
        raise ValueError(f"input_kind must be one of {INPUT_KINDS}, got {input_kind!r}")
    cases = load_vectors() if cases is None else cases
    return [check_case(c, pack_fn, unpack_fn, input_kind, register_table) for c in cases]


def format_report(results: list[CaseResult]) -> str:
    """A pass/fail table by case family and format, then every failure."""
    table: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in results:
        fmt = "intb" if r.format.startswith("intb-") else r.format
        table[(r.name.split("/")[0], fmt)][2 if r.skipped else 0 if r.passed else 1] += 1
    lines = [f"{'family':<12} {'format':<9} {'pass':>5} {'fail':>5} {'skip':>5}", "-" * 40]
    for (family, fmt), (ok, bad, skip) in sorted(table.items()):
        flag = "   FAIL" if bad else ""
        lines.append(f"{family:<12} {fmt:<9} {ok:>5} {bad:>5} {skip:>5}{flag}")
    passed = sum(r.passed for r in results)
    skipped = sum(r.skipped for r in results)
    lines.append("-" * 40)
    summary = f"{passed} passed, {len(results) - passed - skipped} failed"
    if skipped:
        summary += f", {skipped} skipped (table formats: pass --register-table)"
    lines.append(summary)
    lines += [
        f"FAIL {r.name} [{r.format}]: {r.detail}" for r in results if not r.passed and not r.skipped
    ]
    return "\n".join(lines)
