"""Per-policy evaluation of `kvq report`: encode every loop stack, decode, measure.

For each policy, the loop stack [L, T, H, D] of every (window, layer) of the capture is packed
with `kvq_jax.encode_loops(**policy.loop_kwargs(kind))` for K and for V and every loop is
decoded with `kvq_jax.decode_loops`. All stacks of a capture go through one `jax.vmap`, so each
policy compiles once; a policy with per-layer INTB key tables (`key_tables`) runs each layer's
stacks under that layer's formats (`kvq_jax.report.key_tables`), one compilation per layer.
Measured (all relative L2, pooled; see `metrics`):

  bits/element      8 * storage_bytes of the actual codes (K and V) / elements (K and V)
  K / V             reconstruction of every loop vs the original, all rows
  loop l            the same for loop l alone (the last entry is the final loop)
  base / residual   payload errors on the quantized rows (window rows excluded), as in the
                    seed evaluation: base = decoded loop 0 vs loop 0; residual l = decoded
                    delta vs the delta it encodes, X_l - R_{l-1} rounded to the input dtype
                    (a loop stored absolute: decoded payload vs X_l)
  attention         causal GQA attention with the captured queries, original vs decoded K/V:
                    one error per (layer, query head), pooled over windows, loops, tokens and
                    dim; mean and max over layers and heads (plus the final loop alone)
  decode-like       the same for the last DECODE_QUERIES queries of each window, each attending
    attention       as a decode step does: the rows of the policy's window relative to that
                    query raw (the first `sink` tokens and its own `recent` newest tokens, as
                    the append-time cache's sink and staging rows hold them), every other row
                    decoded; without a window every row is decoded

"bf16" is the reference row: zero error, the capture dtype's own bits (16 for bfloat16).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvq_jax.codecs._numerics import subtract_in_dtype
from kvq_jax.codecs.api import unpack_kv
from kvq_jax.codecs.heavy import heavy_kv
from kvq_jax.codecs.loops import decode_loops, encode_loops
from kvq_jax.core.policies import Policy
from kvq_jax.core.rope import rope_tables
from kvq_jax.report.capture import Capture
from kvq_jax.report.key_tables import layer_policies
from kvq_jax.report.metrics import (
    batched_attention,
    batched_decode_attention,
    pool,
    square_sums,
)
from kvq_jax.report.progress import progress

#: Queries per window of the decode-like attention error: the last 64 (all when fewer).
DECODE_QUERIES = 64


@dataclasses.dataclass
class PolicyResult:
    """The numbers of one policy row (errors are fractions, not percent).

    *_loop_rel_l2: one entry per loop; *_residual_rel_l2: one per later loop (empty for a
    single loop); attention_*: None without queries; attention_layer_head: [layers][q_heads].
    """

    name: str
    base_format: str
    residual_format: str
    group_size: int | None
    window: tuple[int, int] | None
    k_loop_formats: list[str]
    v_loop_formats: list[str]
    k_absolute_loops: list[int]
    v_absolute_loops: list[int]
    bits_per_element: float
    k_bits_per_element: float
    v_bits_per_element: float
    k_storage_bytes: int
    v_storage_bytes: int
    num_elements: int  # per kind (K or V)
    k_rel_l2: float
    v_rel_l2: float
    k_loop_rel_l2: list[float]
    v_loop_rel_l2: list[float]
    k_base_rel_l2: float
    v_base_rel_l2: float
    k_residual_rel_l2: list[float]
    v_residual_rel_l2: list[float]
    attention_mean: float | None
    attention_max: float | None
    attention_final_loop_mean: float | None
    attention_final_loop_max: float | None
    attention_layer_head: list[list[float]] | None
    attention_decode_mean: float | None
    attention_decode_max: float | None
    attention_decode_final_loop_mean: float | None
    attention_decode_layer_head: list[list[float]] | None
    attention_decode_queries: int | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.window is not None:
            out["window"] = {"sink": self.window[0], "recent": self.window[1]}
        return out


def stacks(x: np.ndarray) -> np.ndarray:
    """[W, L, N, T, H, D] -> [W * N, L, T, H, D]: one loop stack per (window, layer)."""
    windows, loops, layers = x.shape[:3]
    return np.moveaxis(x, 2, 1).reshape(windows * layers, loops, *x.shape[3:])


def unstack(x, num_windows: int) -> np.ndarray:
    """[W * N, L, ...] -> [W, L, N, ...] (inverse of `stacks` on the leading axes)."""
    x = np.asarray(x)
    x = x.reshape(num_windows, -1, *x.shape[1:])
    return np.moveaxis(x, 1, 2)


@jax.jit
def reference_attention(q, k, v) -> jnp.ndarray:
    """Attention output of the original stacks: float32 [B, L, T, Hq, D]."""
    return batched_attention(q, k, v)


def _stack_sums(stack, kind: str, policy: Policy):
    """Encode/decode one [L, T, H, D] stack; returns (code, recon, sums) with float32 sums
    [L, H] (every row of every loop) and [L, H] payload sums (quantized rows: base, residuals).
    """
    code = encode_loops(stack, **policy.loop_kwargs(kind, stack.shape[0]))
    recon = decode_loops(code)
    rows = stack.shape[1]
    head, middle, _ = policy.window.split_sizes(rows) if policy.window else (0, rows, 0)
    mid = slice(head, head + middle)
    base = square_sums(stack[0, mid], recon[0, mid])
    payload = [base]
    for i, residual in enumerate(code.residuals):
        delta = stack[i + 1, mid]
        if not residual.absolute:
            delta = subtract_in_dtype(delta, recon[i, mid])
        payload.append(square_sums(delta, unpack_kv(residual.payload)))
    payload_err = jnp.stack([p[0] for p in payload])
    payload_ref = jnp.stack([p[1] for p in payload])
    return code, recon, (*square_sums(stack, recon), payload_err, payload_ref)


def _heavy_stack_sums(k_stack, v_stack, policy: Policy):
    """A heavy-row policy (one layer's) on one K and V stack [L, T, H, D]: every loop stored
    whole with its own rows (`kvq_jax.codecs.heavy.heavy_kv`). Returns (k_hat, v_hat, k_bytes,
    v_bytes, sums) with the sums of `_stack_sums` (payload: the packed rows of each loop)."""
    table = jnp.asarray(np.asarray(policy.heavy_table, np.float32), jnp.bfloat16)
    rows = k_stack.shape[1]
    rope = None
    if policy.rope_theta is not None:  # keys stored before RoPE (positions 0 .. T-1)
        rope = tuple(map(jnp.asarray, rope_tables(rows, k_stack.shape[3], policy.rope_theta)))
    head, middle, _ = policy.window.split_sizes(rows) if policy.window else (0, rows, 0)
    mid = slice(head, head + middle)
    out = {"key": ([], [], 0), "value": ([], [], 0)}
    for loop in range(k_stack.shape[0]):
        k_hat, v_hat, k_packed, v_packed = heavy_kv(
            k_stack[loop],
            v_stack[loop],
            table,
            key_format=policy.base_format,
            value_format=policy.formats("value")[0],
            group_size=policy.heavy,
            window=policy.window,
            rope=rope,
        )
        for kind, x, x_hat, packed in (
            ("key", k_stack[loop], k_hat, k_packed),
            ("value", v_stack[loop], v_hat, v_packed),
        ):
            hats, payload, nbytes = out[kind]
            hats.append(x_hat)
            payload.append(square_sums(x[mid], x_hat[mid]))
            window_bytes = (rows - middle) * x.shape[1] * x.shape[2] * x.dtype.itemsize
            out[kind] = (hats, payload, nbytes + packed.storage_bytes + window_bytes)
    results = []
    for kind, stack in (("key", k_stack), ("value", v_stack)):
        hats, payload, nbytes = out[kind]
        recon = jnp.stack(hats)
        sums = (
            *square_sums(stack, recon),
            jnp.stack([p[0] for p in payload]),
            jnp.stack([p[1] for p in payload]),
        )
        results.append((recon, nbytes, sums))
    return results


@functools.partial(jax.jit, static_argnames=("policy",))
def heavy_policy_sums(k, v, *, policy: Policy):
    """`policy_sums` of a heavy-row policy (one layer's): (k_hat, v_hat, sums); the storage
    bytes per stack are static (`heavy_policy_bytes`)."""
    (k_hat, _, k_sums), (v_hat, _, v_sums) = jax.vmap(lambda a, b: _heavy_stack_sums(a, b, policy))(
        k, v
    )
    names = ("err", "ref", "payload_err", "payload_ref")
    sums = {f"k_{n}": s for n, s in zip(names, k_sums, strict=True)}
    sums.update({f"v_{n}": s for n, s in zip(names, v_sums, strict=True)})
    return k_hat, v_hat, sums


def heavy_policy_bytes(k, v, policy: Policy) -> tuple[int, int]:
    """(K bytes, V bytes) a heavy-row policy stores for stacks k, v [B, L, T, H, D]."""
    counted = {}

    def one_stack(a, b):  # traced for shapes only: the byte counts are static
        (k_hat, k_bytes, _), (_, v_bytes, _) = _heavy_stack_sums(a, b, policy)
        counted.update(k=k_bytes, v=v_bytes)
        return k_hat

    jax.eval_shape(one_stack, k[0], v[0])
    return counted["k"] * k.shape[0], counted["v"] * v.shape[0]


@functools.partial(jax.jit, static_argnames=("policy",))
def policy_sums(k, v, *, policy: Policy):
    """One policy on B stacks k, v [B, L, T, H, D]. Returns (k_code, v_code, k_hat, v_hat,
    sums): batched LoopCodes, the decoded stacks and a dict of float32 partial sums, each
    [B, L, H]."""
    k_code, k_hat, k_sums = jax.vmap(lambda s: _stack_sums(s, "key", policy))(k)
    v_code, v_hat, v_sums = jax.vmap(lambda s: _stack_sums(s, "value", policy))(v)
    names = ("err", "ref", "payload_err", "payload_ref")
    sums = {f"k_{n}": s for n, s in zip(names, k_sums, strict=True)}
    sums.update({f"v_{n}": s for n, s in zip(names, v_sums, strict=True)})
    return k_code, v_code, k_hat, v_hat, sums


@jax.jit
def attention_sums(q, k_hat, v_hat, ref_out):
    """Attention error partial sums [B, L, Hq] of decoded stacks against `ref_out` (one
    compilation shared by every policy)."""
    return square_sums(ref_out, batched_attention(q, k_hat, v_hat))


@functools.partial(jax.jit, static_argnames=("sink", "recent"))
def decode_attention_sums(q, k, v, k_hat, v_hat, ref_out, *, sink: int, recent: int):
    """Decode-like attention error partial sums [B, L, Hq] of the last DECODE_QUERIES queries
    (`metrics.decode_attention`; ref_out: the original stacks' attention [B, L, T, Hq, D])."""
    n = min(DECODE_QUERIES, q.shape[-3])
    out = batched_decode_attention(q, k, v, k_hat, v_hat, sink=sink, recent=recent, num_queries=n)
    return square_sums(ref_out[..., q.shape[-3] - n :, :, :], out)


def _policy_run(policy: Policy, k, v, q, ref_out):
    """(K bytes, V bytes, numpy sums) of one policy on stacks k, v [B, L, T, H, D]."""
    if policy.heavy is not None:
        k_hat, v_hat, sums = heavy_policy_sums(k, v, policy=policy)
        k_bytes, v_bytes = heavy_policy_bytes(k, v, policy)
    else:
        k_code, v_code, k_hat, v_hat, sums = policy_sums(k, v, policy=policy)
        k_bytes, v_bytes = int(k_code.storage_bytes), int(v_code.storage_bytes)
    if q is not None:
        sums["attn_err"], sums["attn_ref"] = attention_sums(q, k_hat, v_hat, ref_out)
        window = policy.window
        sink, recent = (window.sink, window.recent) if window is not None else (0, 0)
        sums["dec_err"], sums["dec_ref"] = decode_attention_sums(
            q, k, v, k_hat, v_hat, ref_out, sink=sink, recent=recent
        )
    sums = {name: np.asarray(a) for name, a in sums.items()}
    return k_bytes, v_bytes, sums


def _run_policy(policy: Policy, k, v, q, ref_out, layers: list[Policy] | None = None):
    """One policy's (K bytes, V bytes, numpy sums [B, ...], seconds). `layers`: a
    key_tables policy's per-layer policies; stack b (= window * N + layer) runs under
    layers[b % N]."""
    start = time.perf_counter()
    if layers is None:
        k_bytes, v_bytes, sums = _policy_run(policy, k, v, q, ref_out)
    else:
        k_bytes = v_bytes = 0
        sums = {}
        count = k.shape[0]
        for n, layer_policy in enumerate(layers):
            rows = np.arange(n, count, len(layers))
            q_n = None if q is None else q[rows]
            ref_n = None if ref_out is None else ref_out[rows]
            kb, vb, part = _policy_run(layer_policy, k[rows], v[rows], q_n, ref_n)
            k_bytes, v_bytes = k_bytes + kb, v_bytes + vb
            for name, a in part.items():
                sums.setdefault(name, np.empty((count, *a.shape[1:]), a.dtype))[rows] = a
    return k_bytes, v_bytes, sums, time.perf_counter() - start


def _window_tuple(policy: Policy):
    return None if policy.window is None else (policy.window.sink, policy.window.recent)


def _reference_row(policy: Policy, capture: Capture, num_elements: int) -> PolicyResult:
    loops, layers = capture.num_loops, capture.num_layers
    bits = 8.0 * np.dtype(capture.dtype).itemsize
    nbytes = num_elements * np.dtype(capture.dtype).itemsize
    has_q = capture.q is not None
    q_heads = capture.q.shape[4] if has_q else 0
    return PolicyResult(
        name=policy.name,
        base_format=policy.base_format,
        residual_format=policy.residual_format,
        group_size=policy.group_size,
        window=_window_tuple(policy),
        k_loop_formats=["bf16"] * loops,
        v_loop_formats=["bf16"] * loops,
        k_absolute_loops=[],
        v_absolute_loops=[],
        bits_per_element=bits,
        k_bits_per_element=bits,
        v_bits_per_element=bits,
        k_storage_bytes=nbytes,
        v_storage_bytes=nbytes,
        num_elements=num_elements,
        k_rel_l2=0.0,
        v_rel_l2=0.0,
        k_loop_rel_l2=[0.0] * loops,
        v_loop_rel_l2=[0.0] * loops,
        k_base_rel_l2=0.0,
        v_base_rel_l2=0.0,
        k_residual_rel_l2=[0.0] * (loops - 1),
        v_residual_rel_l2=[0.0] * (loops - 1),
        attention_mean=0.0 if has_q else None,
        attention_max=0.0 if has_q else None,
        attention_final_loop_mean=0.0 if has_q else None,
        attention_final_loop_max=0.0 if has_q else None,
        attention_layer_head=[[0.0] * q_heads for _ in range(layers)] if has_q else None,
        attention_decode_mean=0.0 if has_q else None,
        attention_decode_max=0.0 if has_q else None,
        attention_decode_final_loop_mean=0.0 if has_q else None,
        attention_decode_layer_head=[[0.0] * q_heads for _ in range(layers)] if has_q else None,
        attention_decode_queries=min(DECODE_QUERIES, capture.num_tokens) if has_q else None,
        seconds=0.0,
    )


def _row(
    policy, k_bytes, v_bytes, sums, num_windows, num_elements, seconds, num_loops, num_queries
) -> PolicyResult:
    s = {n: unstack(a, num_windows) for n, a in sums.items()}  # [W, L, N, H]
    attn = {}
    if "attn_err" in s:
        per_lh = pool(s["attn_err"], s["attn_ref"], axis=(0, 1))  # [N, Hq]
        final = pool(s["attn_err"][:, -1], s["attn_ref"][:, -1], axis=0)  # [N, Hq]
        attn = dict(
            attention_mean=float(per_lh.mean()),
            attention_max=float(per_lh.max()),
            attention_final_loop_mean=float(final.mean()),
            attention_final_loop_max=float(final.max()),
            attention_layer_head=per_lh.tolist(),
        )
        per_lh = pool(s["dec_err"], s["dec_ref"], axis=(0, 1))  # [N, Hq]
        final = pool(s["dec_err"][:, -1], s["dec_ref"][:, -1], axis=0)  # [N, Hq]
        attn.update(
            attention_decode_mean=float(per_lh.mean()),
            attention_decode_max=float(per_lh.max()),
            attention_decode_final_loop_mean=float(final.mean()),
            attention_decode_layer_head=per_lh.tolist(),
            attention_decode_queries=num_queries,
        )
    else:
        attn = dict.fromkeys(
            (
                "attention_mean",
                "attention_max",
                "attention_final_loop_mean",
                "attention_final_loop_max",
                "attention_layer_head",
                "attention_decode_mean",
                "attention_decode_max",
                "attention_decode_final_loop_mean",
                "attention_decode_layer_head",
                "attention_decode_queries",
            )
        )
    by_loop = (0, 2, 3)  # pool over windows, layers, heads; keep loops
    kv = {}
    for c in ("k", "v"):
        loops = pool(s[f"{c}_err"], s[f"{c}_ref"], axis=by_loop)
        payload = pool(s[f"{c}_payload_err"], s[f"{c}_payload_ref"], axis=by_loop)
        kv[f"{c}_rel_l2"] = pool(s[f"{c}_err"], s[f"{c}_ref"])
        kv[f"{c}_loop_rel_l2"] = [float(x) for x in loops]
        kv[f"{c}_base_rel_l2"] = float(payload[0])
        kv[f"{c}_residual_rel_l2"] = [float(x) for x in payload[1:]]
    return PolicyResult(
        name=policy.name,
        base_format=policy.base_format,
        residual_format=policy.residual_format,
        group_size=policy.group_size,
        window=_window_tuple(policy),
        k_loop_formats=list(policy.loop_formats("key", num_loops)),
        v_loop_formats=list(policy.loop_formats("value", num_loops)),
        k_absolute_loops=list(policy.absolute_loops("key", num_loops)),
        v_absolute_loops=list(policy.absolute_loops("value", num_loops)),
        bits_per_element=8.0 * (k_bytes + v_bytes) / (2 * num_elements),
        k_bits_per_element=8.0 * k_bytes / num_elements,
        v_bits_per_element=8.0 * v_bytes / num_elements,
        k_storage_bytes=k_bytes,
        v_storage_bytes=v_bytes,
        num_elements=num_elements,
        **kv,
        **attn,
        seconds=seconds,
    )


def evaluate(capture: Capture, policies: list[Policy], *, show_progress=None) -> list[PolicyResult]:
    """One `PolicyResult` per policy, in order (show_progress: None = a bar on a TTY)."""
    k, v = stacks(capture.k), stacks(capture.v)
    q = None if capture.q is None else stacks(capture.q)
    num_elements = math.prod(capture.k.shape)
    ref_out = None
    if q is not None and any(p.quantized for p in policies):
        ref_out = reference_attention(q, k, v)
    quantized = [p for p in policies if p.quantized]
    # (at most 8 at a time: each holds its decoded K/V until its row is done)
    workers = max(1, min(len(quantized), os.cpu_count() or 1, 8))
    done = {}
    # Compilation dominates and releases the GIL: run policies in threads, one per core.
    # a key_tables policy runs layer by layer (registering its formats here, not in threads)
    layers = {
        p: layer_policies(p, capture.meta, capture.k.shape)
        for p in quantized
        if p.key_tables is not None
    }
    with concurrent.futures.ThreadPoolExecutor(workers) as pool_:
        futures = {
            pool_.submit(_run_policy, p, k, v, q, ref_out, layers.get(p)): p for p in quantized
        }
        bar = progress(
            concurrent.futures.as_completed(futures),
            total=len(futures),
            desc="kvq report",
            enabled=show_progress,
        )
        for future in bar:
            policy = futures[future]
            k_bytes, v_bytes, sums, seconds = future.result()
            done[policy] = _row(
                policy,
                k_bytes,
                v_bytes,
                sums,
                capture.num_windows,
                num_elements,
                seconds,
                capture.num_loops,
                min(DECODE_QUERIES, capture.num_tokens),
            )
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(policy.name)
    return [done[p] if p.quantized else _reference_row(p, capture, num_elements) for p in policies]
