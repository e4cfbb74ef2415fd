"""The conformance cases: small named inputs covering every format, axis, dtype and edge case.

Plain numpy only (no JAX): each case is (name, values, format, kind, axis, group_size).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kvq_jax.core.layouts import check_bit_table, intb_name

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = (BF16, np.dtype(np.float16), np.dtype(np.float32))
F32 = np.float32


def _kv_like(rng, shape, dtype):
    _, h, d = shape
    x = rng.standard_normal(shape).astype(F32) + 2.0 * rng.standard_normal((1, h, d)).astype(F32)
    return x.astype(dtype)


def _int4_ties() -> np.ndarray:
    """One token group per channel whose (x - mn) / scale hits k + 0.5 exactly: min 0, max 15,
    so scale = 1 and x = k + 0.5 is a tie for every k."""
    col = np.array([0.0, 15.0] + [k + 0.5 for k in range(14)], F32)
    return np.stack([col, col * 2.0, col * 0.25], axis=-1)[:, None, :]  # [16, 1, 3]


def _int2_ties() -> np.ndarray:
    """Token groups per channel whose (x - mn) / scale hits k + 0.5 exactly: min 0, max 3, so
    scale = 1 and x = 0.5, 1.5, 2.5 are ties (to 0, 2, 2), plus their float32 neighbours."""
    ties = np.array([0.5, 1.5, 2.5], F32)
    col = np.concatenate(
        [[0.0, 3.0], ties, np.nextafter(ties, F32(0)), np.nextafter(ties, F32(3))]
    ).astype(F32)
    return np.stack([col, col * 2.0, col * 0.25], axis=-1)[:, None, :]  # [11, 1, 3]


def _e2m1_midpoints() -> np.ndarray:
    """NVFP4 value rows (channels axis) whose scaled values land on every E2M1 midpoint and on
    its float32 neighbours: a block with max 6 and amax 6 gives g = 448, s = 448, r = 1."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
    vals = np.concatenate([mids, np.nextafter(mids, F32(0)), np.nextafter(mids, F32(7))])
    vals = np.concatenate([vals, -vals, [F32(0.0), F32(-0.0)]]).astype(F32)
    rows = []
    for start in range(0, len(vals), 15):
        chunk = vals[start : start + 15]
        row = np.zeros(16, F32)
        row[0] = 6.0
        row[1 : 1 + len(chunk)] = chunk
        rows.append(row)
    return np.stack(rows)[:, None, :]  # [R, 1, 16]


def _e4m3_scale_midpoints() -> np.ndarray:
    """NVFP4 blocks whose block scale s = g * (vmax / 6) falls between E4M3 values."""
    amax = F32(6.0)  # g = 448
    vmaxes = np.array([6 * m / 448 for m in (0.0029296875, 0.013671875, 1.0625, 17.0, 208.0)], F32)
    vmaxes = np.concatenate([vmaxes, np.nextafter(vmaxes, F32(0)), np.nextafter(vmaxes, F32(1))])
    rows = [np.r_[amax, np.zeros(15, F32)]]
    for v in vmaxes:
        row = np.linspace(-v, v, 16).astype(F32)
        row[3] = v
        rows.append(row)
    return np.stack(rows)[:, None, :]


def _special(rng) -> dict[str, np.ndarray]:
    z = np.zeros((5, 2, 6), F32)
    neg_zero = z.copy()
    neg_zero[1::2] = -0.0
    tiny = np.array([1e-30, -1e-36, 2.0**-126, -(2.0**-126) * 1.5, 2.0**-127, 3e-39], F32)
    tiny_rows = np.stack([tiny, tiny * 1e-3, -tiny])[:, None, :]
    huge = np.array([6.0e4, 6.5e4, -7.0e4, 1.0e30, -3.0e38, 3.4e38], F32)
    nan_inf = rng.standard_normal((8, 2, 16)).astype(F32)
    nan_inf[3, 1, 5] = np.nan
    nan_inf[6, 0, 2] = np.inf
    zero_span = np.broadcast_to(F32(1.5), (9, 2, 5)).copy()
    return {
        "all_zero": z,
        "signed_zeros": neg_zero,
        "tiny": tiny_rows,
        "huge": np.stack([huge, huge / 7])[:, None, :],
        "nan_inf": nan_inf,
        "zero_span": zero_span,
        "tiny_tensor": (rng.standard_normal((4, 1, 16)) * 1e-37).astype(F32),
    }


def build_cases() -> list[dict]:
    """Every case as a dict: name, values (numpy), format, kind, axis, group_size (and bits,
    the bit table, for INTB)."""
    rng = np.random.default_rng(20261129)
    cases = []

    def add(name, values, fmt, kind, axis=None, group_size=None, bits=None):
        case = dict(
            name=name,
            values=np.array(values, order="C"),
            format=fmt if bits is None else intb_name(bits),
            kind=kind,
            axis=axis,
            group_size=group_size,
        )
        if bits is not None:
            case["bits"] = check_bit_table(bits)
        cases.append(case)

    shapes = {"T1": (1, 2, 8), "oddD": (19, 2, 7), "partial": (37, 3, 20), "D1": (6, 1, 1)}
    for dtype in DTYPES:
        dn = {BF16: "bf16"}.get(dtype, str(dtype).replace("float", "fp"))
        for sname, shape in shapes.items():
            x = _kv_like(rng, shape, dtype)
            for kind in ("key", "value"):
                add(f"{sname}/{dn}/int4/{kind}", x, "int4", kind, group_size=16)
                add(f"{sname}/{dn}/nvfp4/{kind}", x, "nvfp4", kind)
                add(f"{sname}/{dn}/fp8/{kind}", x, "fp8_e4m3", kind)
        add(f"empty/{dn}/int4", np.zeros((0, 2, 8), dtype), "int4", "key")
        add(f"empty/{dn}/nvfp4", np.zeros((0, 2, 8), dtype), "nvfp4", "value")
        add(f"empty/{dn}/fp8", np.zeros((0, 2, 8), dtype), "fp8_e4m3", "key")
    x = _kv_like(rng, (70, 2, 24), BF16)
    for g in (1, 3, 7, 32, 64, 128):
        add(f"int4_group/{g}/tokens", x, "int4", "key", group_size=g)
        add(f"int4_group/{g}/channels", x, "int4", "value", group_size=g)
    add("override/int4/key_channels", x, "int4", "key", axis="channels", group_size=8)
    add("override/nvfp4/value_tokens", x, "nvfp4", "value", axis="tokens")
    add("ties/int4", _int4_ties(), "int4", "key", group_size=16)
    add("ties/e2m1_midpoints", _e2m1_midpoints(), "nvfp4", "value")
    add("ties/e4m3_scales", _e4m3_scale_midpoints(), "nvfp4", "value")
    add("ties/fp8_e4m3", _e2m1_midpoints() * F32(74.0), "fp8_e4m3", "value")
    for name, values in _special(rng).items():
        for fmt in ("int4", "nvfp4", "fp8_e4m3"):
            add(
                f"special/{name}/{fmt}/key",
                values,
                fmt,
                "key",
                group_size=4 if fmt == "int4" else None,
            )
            add(
                f"special/{name}/{fmt}/value",
                values.astype(BF16),
                fmt,
                "value",
                group_size=4 if fmt == "int4" else None,
            )
    add(
        "shape/fp32/int4/g5",
        _kv_like(rng, (12, 5, 4), np.dtype(np.float32)),
        "int4",
        "key",
        group_size=5,
    )
    _add_int2(add, rng)
    _add_intb(add, rng)
    _add_hint(add, rng)
    return cases


def _add_int2(add, rng) -> None:
    """The int2 cases (after every other case, so the earlier cases keep their indices)."""
    shapes = {"T1": (1, 2, 8), "oddD": (19, 2, 7), "partial": (37, 3, 22), "D1": (6, 1, 1)}
    for dtype in DTYPES:
        dn = {BF16: "bf16"}.get(dtype, str(dtype).replace("float", "fp"))
        for sname, shape in shapes.items():
            x = _kv_like(rng, shape, dtype)
            for kind in ("key", "value"):
                add(f"{sname}/{dn}/int2/{kind}", x, "int2", kind, group_size=16)
        add(f"empty/{dn}/int2", np.zeros((0, 2, 8), dtype), "int2", "value")
    x = _kv_like(rng, (70, 2, 26), BF16)
    for g in (1, 3, 64, 128):
        add(f"int2_group/{g}/tokens", x, "int2", "key", group_size=g)
        add(f"int2_group/{g}/channels", x, "int2", "value", group_size=g)
    add("int2_group/default/key", x, "int2", "key")
    add("override/int2/key_channels", x, "int2", "key", axis="channels", group_size=8)
    add("ties/int2", _int2_ties(), "int2", "key", group_size=11)
    for name, values in _special(rng).items():
        add(f"special/{name}/int2/key", values, "int2", "key", group_size=4)
        add(f"special/{name}/int2/value", values.astype(BF16), "int2", "value", group_size=4)


def _bit_table(rng, heads: int, channels: int) -> tuple[tuple[int, ...], ...]:
    """Random INTB widths in 1..8 per (head, channel), every row summing to the same
    multiple of 8 (widths raised one at a time, lowest channels first, to get there)."""
    rows = rng.integers(1, 9, (heads, channels))
    target = -(-int(rows.sum(axis=1).max()) // 8) * 8
    if target > 8 * channels:
        target -= 8
    for row in rows:
        while row.sum() > target:
            row[int(np.argmax(row))] -= 1
        while row.sum() < target:
            row[int(np.argmin(row))] += 1
    return check_bit_table(rows)


def _add_intb(add, rng) -> None:
    """The INTB cases (FORMAT.md 2b; after every other case, so the earlier cases keep their
    indices): random tables with codes straddling bytes, all-1 and all-8 tables, token
    groups of 1 to 128, keys and values (always over tokens), edge values."""
    shapes = {"T1": (1, 2, 8), "oddD": (19, 2, 7), "partial": (37, 3, 20), "D1": (6, 1, 8)}
    for dtype in DTYPES:
        dn = {BF16: "bf16"}.get(dtype, str(dtype).replace("float", "fp"))
        for sname, shape in shapes.items():
            x = _kv_like(rng, shape, dtype)
            bits = _bit_table(rng, shape[1], shape[2])
            for kind in ("key", "value"):
                add(f"{sname}/{dn}/intb/{kind}", x, "intb", kind, group_size=16, bits=bits)
        add(f"empty/{dn}/intb", np.zeros((0, 2, 8), dtype), "intb", "key", bits=((4,) * 8,) * 2)
    x = _kv_like(rng, (70, 2, 24), BF16)
    bits = _bit_table(rng, 2, 24)
    for g in (1, 3, 64, 128):
        add(f"intb_group/{g}/tokens", x, "intb", "key", group_size=g, bits=bits)
    add("intb_group/default/key", x, "intb", "key", bits=bits)
    add("intb_widths/all1", x, "intb", "key", group_size=8, bits=((1,) * 24,) * 2)
    add("intb_widths/all8", x, "intb", "value", group_size=8, bits=((8,) * 24,) * 2)
    add("ties/intb", _int4_ties(), "intb", "key", group_size=16, bits=((4, 4, 8),))
    for name, values in _special(rng).items():
        bits = _bit_table(rng, values.shape[1], values.shape[2])
        add(f"special/{name}/intb/key", values, "intb", "key", group_size=4, bits=bits)
        add(
            f"special/{name}/intb/value",
            values.astype(BF16),
            "intb",
            "value",
            group_size=4,
            bits=bits,
        )


def _add_hint(add, rng) -> None:
    """The HINT4 / HINT2 cases (FORMAT.md 2c; after every other case, so the earlier cases keep
    their indices): D from 1 to 128, both axes, group sizes 1 to 128, edge values (their
    channels zero-padded to a power of two)."""
    shapes = {"T1": (1, 2, 8), "D1": (6, 1, 1), "D2": (9, 2, 2), "partial": (37, 3, 16)}
    for fmt in ("hint4", "hint2"):
        for dtype in DTYPES:
            dn = {BF16: "bf16"}.get(dtype, str(dtype).replace("float", "fp"))
            for sname, shape in shapes.items():
                x = _kv_like(rng, shape, dtype)
                for kind in ("key", "value"):
                    add(f"{sname}/{dn}/{fmt}/{kind}", x, fmt, kind, group_size=8)
            add(f"empty/{dn}/{fmt}", np.zeros((0, 2, 8), dtype), fmt, "value")
        x = _kv_like(rng, (40, 2, 32), BF16)
        for g in (1, 3, 32, 64):
            add(f"{fmt}_group/{g}/tokens", x, fmt, "key", group_size=g)
            add(f"{fmt}_group/{g}/channels", x, fmt, "value", group_size=g)
        add(f"{fmt}_group/default/value", _kv_like(rng, (5, 2, 128), BF16), fmt, "value")
        add(f"override/{fmt}/key_channels", x, fmt, "key", axis="channels", group_size=16)
        for name, values in _special(rng).items():
            d = values.shape[2]
            pad = (1 << (d - 1).bit_length()) - d
            values = np.pad(values, ((0, 0), (0, 0), (0, pad)))
            add(f"special/{name}/{fmt}/key", values, fmt, "key", group_size=4)
            add(f"special/{name}/{fmt}/value", values.astype(BF16), fmt, "value", group_size=4)
