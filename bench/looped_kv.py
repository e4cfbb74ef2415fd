"""A real 4-loop K/V capture from looped-tiny, its loop-to-loop deltas, and residual vs absolute
loops at equal bits (issue 25, "Use it").

    python bench/looped_kv.py [--model looped-tiny] [--windows 8 --tokens 256]
        [--out /tmp/looped_tiny_kv.npz] [--policies int4-g64,nvfp4,fp8,flashloop-kivi]
        [--compare kvq_jax/data/real_kv.npz] [--in-model] [--json PATH]

1. Capture: the model's post-RoPE K, V and Q of every layer in every loop
   (`kvq_jax.report.calibrate.capture_from_model`, i.e. `attention_inputs_per_layer`: a
   cache-free JAX forward, float32), on `--windows` windows of `--tokens` tokens spread evenly
   over the text (default: the checkpoint's held-out split, Hamlet for looped-tiny), rounded
   to bfloat16 and written in the `kvq report --kv` format
   ([windows, loops, layers, tokens, heads, dim]).
2. Deltas: per captured layer and later loop l, ||X_l - X_(l-1)|| / ||X_l|| for K and V
   (`delta_ratios`: float32, pooled over windows, tokens, heads and dim), for this capture and
   for `--compare` (default: the embedded SmolLM2 capture, whose loops are emulated).
3. Residual vs absolute: each `--policies` policy (later loops stored as deltas against the
   reconstructed previous loop) beside its absolute twin (`absolute_twin`: the same formats,
   every later loop of K and V packed on its own; the same bits), evaluated by `kvq report`'s
   own code (`kvq_jax.report.evaluate`) on both captures.
4. --in-model: the same policies and twins (plus FlashLoop legacy and the loops-abs-*
   policies) inside the model, teacher forced over the capture's windows, every loop's
   attention reading K/V decoded from the policy's loop stack (`quantized_loop_logits`; the
   engine serves no absolute loops): KL / delta NLL / top-1 of the last loop's logits.

Results and commands: docs/LOOPED_TINY.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import ml_dtypes
import numpy as np

from kvq_jax.cli import plugins
from kvq_jax.core.policies import POLICIES, Policy
from kvq_jax.report.capture import EMBEDDED_PATH, Capture, load_capture, save_capture

DEFAULT_POLICIES = "int4-g64,nvfp4,fp8,flashloop-kivi"


def capture(model, ids: np.ndarray, *, meta=None, dtype="bfloat16", batch=4) -> Capture:
    """Every layer's post-RoPE K/V/Q in every loop of the model on windows ids [W, T], in
    `dtype` (the forward runs in the model's own dtype)."""
    from kvq_jax.report.calibrate import capture_from_model

    cap = capture_from_model(model, ids, batch=batch, loops=model.config.num_loops, meta=meta)
    cast = np.dtype(getattr(ml_dtypes, dtype, dtype))
    k, v, q = (x.astype(cast) for x in (cap.k, cap.v, cap.q))
    return Capture(k=k, v=v, q=q, meta={**cap.meta, "dtype": dtype})


def delta_ratios(x: np.ndarray) -> np.ndarray:
    """[layers, loops - 1]: ||X_l - X_(l-1)|| / ||X_l|| of x [windows, loops, layers, ...] for
    l = 1 .. loops - 1, in float32, pooled over every axis but loop and layer."""
    x = np.asarray(x, np.float32)
    axes = tuple(i for i in range(x.ndim) if i not in (1, 2))
    diff = np.sqrt(np.sum(np.square(x[:, 1:] - x[:, :-1]), axis=axes))
    norm = np.sqrt(np.sum(np.square(x[:, 1:]), axis=axes))
    return (diff / norm).T


def absolute_twin(policy: Policy, num_loops: int) -> Policy:
    """The policy with every later loop of K and V stored absolute (same formats and bits)."""
    later = tuple(range(1, num_loops))
    return dataclasses.replace(policy, name=f"{policy.name}-abs", absolute=later, v_absolute=later)


def quantized_loop_logits(params, config, tokens, policy: Policy | None):
    """The last loop's logits [B, T, V] float32 of an Ouro model whose attention reads, in
    every loop, K and V decoded from `policy`'s loop stack (None: unquantized): loop l's K/V
    of the window, given the quantized loops before it, are packed with the loops before as
    `encode_loops(**policy.loop_kwargs(kind, l + 1))` (a residual against the reconstructed
    loop l - 1, or absolute) and decoded. Whole windows (no paged cache, no raw staging rows),
    every loop run; the teacher-forced in-model check of a policy the engine does not serve
    (absolute loops)."""
    import jax
    import jax.numpy as jnp

    import kvq_jax
    from kvq_jax.models import ouro

    h = ouro.embed(params, tokens)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    kept = {"key": [], "value": []}  # this loop's K/V and every earlier loop's, per layer
    for loop in range(config.num_loops):
        for i in range(config.num_layers):
            layer = ouro.layer_params(params, i)
            q, k, v = ouro.attention_inputs(layer, h, positions, config)
            decoded = []
            for kind, x in (("key", k), ("value", v)):
                if loop == 0:
                    kept[kind].append([])
                kept[kind][i].append(x)
                if policy is None or not policy.quantized:
                    decoded.append(x)
                    continue
                kwargs = policy.loop_kwargs(kind, loop + 1)

                def last(one, kwargs=kwargs):  # [loops, T, H, D] -> [T, H, D]
                    code = kvq_jax.encode_loops(one, **kwargs)
                    return kvq_jax.decode_loops(code)[-1]

                stack = jnp.stack(kept[kind][i])  # [loops, B, T, H, D]
                decoded.append(jax.vmap(last, in_axes=1)(stack).astype(x.dtype))
            attn = ouro.causal_attention(q, *decoded)
            h = ouro.attention_output(layer, h, attn, config)
        h = ouro.final_norm(params, h, config)
    return ouro.logits(params, h, config).astype(jnp.float32)


def in_model(params, config, ids, policies) -> list[dict]:
    """KL(unquantized || policy), delta NLL and top-1 of the last loop's logits over windows
    ids [W, T] (every position but the last predicts the next id)."""
    import jax
    import jax.numpy as jnp

    tokens = jnp.asarray(ids)
    run = jax.jit(quantized_loop_logits, static_argnums=(1, 3))
    ref = jax.nn.log_softmax(run(params, config, tokens, None)[:, :-1], axis=-1)
    target = tokens[:, 1:, None]
    rows = []
    for policy in policies:
        got = jax.nn.log_softmax(run(params, config, tokens, policy)[:, :-1], axis=-1)
        kl = jnp.sum(jnp.exp(ref) * (ref - got), axis=-1)
        dnll = jnp.take_along_axis(ref - got, target, axis=-1)[..., 0]
        top1 = jnp.argmax(ref, -1) == jnp.argmax(got, -1)
        nll = -jnp.take_along_axis(got, target, axis=-1)[..., 0]
        rows.append({"policy": policy.name, "kl": float(kl.mean()),
                     "delta_nll": float(dnll.mean()), "top1": float(top1.mean()),
                     "nll": float(nll.mean())})  # fmt: skip
    return rows


def delta_table(name: str, cap: Capture) -> tuple[str, list[dict]]:
    layers = cap.meta.get("layers") or list(range(cap.num_layers))
    rows, lines = [], [f"{name}: ||X_l - X_(l-1)|| / ||X_l||"]
    head = "".join(f"{'l=' + str(i):>8}" for i in range(1, cap.num_loops))
    lines.append(f"{'layer':>6} {'':1}{head}")
    for kind, x in (("K", cap.k), ("V", cap.v)):
        for layer, r in zip(layers, delta_ratios(x), strict=True):
            rows.append({"capture": name, "kind": kind, "layer": layer, "ratios": r.tolist()})
            lines.append(f"{layer:>6} {kind}" + "".join(f"{v:8.3f}" for v in r))
    return "\n".join(lines), rows


def main(argv=None) -> int:
    plugins.install()  # JAX's plugin traceback (no GPU) as kvq's one line, as `kvq` does
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="looped-tiny")
    ap.add_argument("--text", default=None, help="UTF-8 text (default: the checkpoint's "
                    "heldout.txt)")  # fmt: skip
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/looped_tiny_kv.npz"))
    ap.add_argument("--compare", type=pathlib.Path, default=EMBEDDED_PATH)
    ap.add_argument("--policies", default=DEFAULT_POLICIES,
                    help="comma-separated; each beside its absolute twin ('' to skip)")  # fmt: skip
    ap.add_argument("--in-model", action="store_true",
                    help="also run them in the model (whole windows)")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from kvq_jax.models import load_model
    from kvq_jax.report.calibrate import text_id_windows

    t0 = time.perf_counter()
    model = load_model(args.model, "float32")
    text = args.text or str(pathlib.Path(str(model.source.get("path", ""))) / "heldout.txt")
    ids, where = text_id_windows(model.tokenizer, [text], args.windows, args.tokens)
    meta = {
        "model": args.model,
        "architecture": model.config.arch,
        "num_model_layers": model.config.num_layers,
        "emulated": False,
        "loop_input": "the final RMSNorm output of the previous loop (the trained recurrence)",
        "text": [{"file": pathlib.Path(f).name, "first_token": int(a)} for f, a in where],
        "tokens": args.tokens,
        "compute_dtype": "float32",
        "post_rope": True,
        "arrays": "k, v, q: [windows, loops, layers, tokens, heads, dim]",
        "generator": "bench/looped_kv.py",
    }
    cap = capture(model, ids, meta=meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_capture(args.out, cap)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB): k {cap.k.shape} "
          f"q {cap.q.shape} {cap.dtype}, {time.perf_counter() - t0:.0f} s")  # fmt: skip

    out = {"args": {k: str(v) for k, v in vars(args).items()}, "deltas": [], "policies": []}
    captures = [(args.model, cap), (args.compare.name, load_capture(args.compare))]
    for name, c in captures:
        table, rows = delta_table(name, c)
        out["deltas"] += rows
        print("\n" + table)

    names = [p for p in args.policies.split(",") if p]
    if names:
        from kvq_jax.report.evaluate import evaluate
        from kvq_jax.report.render import format_table

        for name, c in captures:
            policies = [POLICIES["bf16"]]
            for p in names:
                policies += [POLICIES[p], absolute_twin(POLICIES[p], c.num_loops)]
            results = evaluate(c, policies, show_progress=False)
            print(f"\n{name}: residual (policy) vs absolute (policy-abs) later loops")
            print(format_table(results))
            out["policies"] += [{"capture": name, **r.to_dict()} for r in results]
    if names and args.in_model:
        policies = []
        for p in names:
            policies += [POLICIES[p], absolute_twin(POLICIES[p], model.config.num_loops)]
        for extra in ("flashloop-legacy", "loops-abs-keys", "loops-abs-v2442"):
            policies.append(POLICIES[extra])
        print(
            f"\nin the model: {len(ids)} windows x {args.tokens} tokens, every loop's K/V "
            "quantized as a whole window, last loop's logits vs unquantized (float32)"
        )
        print(f"{'policy':<20} {'KL':>9} {'dNLL':>9} {'top-1':>6} {'NLL':>7}")
        rows = in_model(model.params, model.config, ids, policies)
        for r in rows:
            print(f"{r['policy']:<20} {r['kl']:9.5f} {r['delta_nll']:+9.5f} {r['top1']:6.3f} "
                  f"{r['nll']:7.4f}", flush=True)  # fmt: skip
        out["in_model"] = rows
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\n{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
