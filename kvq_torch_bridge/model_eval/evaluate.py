"""Teacher-forced evaluation of KV policies: each policy's K/V are coded inside attention
(`hooks.KVQuantizer`) over the whole window, per layer and per loop, so the quantized cache
propagates through every later layer and loop; the logits of the last `predictions`
positions are compared with the BF16 reference run (the model's own attention, no hook).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from kvq_jax.core.policies import POLICIES, Policy
from kvq_torch_bridge.model_eval.codecs import get_loop_coder
from kvq_torch_bridge.model_eval.hooks import KVQuantizer, quantized_attention
from kvq_torch_bridge.model_eval.loading import LoadedModel
from kvq_torch_bridge.model_eval.looped import run_logits
from kvq_torch_bridge.model_eval.metrics import compare_logits


@dataclasses.dataclass
class PolicyResult:
    policy: Policy
    metrics: dict
    seconds: float
    quantizer: KVQuantizer | None = None  # kept when record=True (one batch)
    logits: torch.Tensor | None = None  # kept when record=True


@dataclasses.dataclass
class EvalResult:
    reference_seconds: float
    passthrough: PolicyResult  # policy "bf16" through the hook: must be bitwise equal
    results: list[PolicyResult]
    reference_logits: torch.Tensor


def _forward(loaded: LoadedModel, ids, keep, quantizer=None):
    if quantizer is None:
        return run_logits(loaded.model, ids, loops=loaded.loops, keep=keep)
    with quantized_attention(loaded.model, quantizer):
        return run_logits(
            loaded.model, ids, loops=loaded.loops, keep=keep, on_loop=quantizer.set_loop
        )


def check_key_tables(policy: Policy, loaded: LoadedModel):
    """The key tables of a `key_tables` policy, if they are for `loaded`'s model (name, layers,
    KV heads, head dim, RoPE base of pre-RoPE tables); else a ValueError saying why."""
    from kvq_jax.core.calibration import get_key_tables

    tables = get_key_tables(policy.key_tables)
    model = loaded.source.get("model") if isinstance(loaded.source, dict) else None
    config = loaded.model.config
    q_heads = getattr(config, "num_attention_heads", None)
    heads = getattr(config, "num_key_value_heads", None) or q_heads
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and q_heads and getattr(config, "hidden_size", None):
        head_dim = config.hidden_size // q_heads
    tables.check_fit(policy.name, [loaded.name, model], int(config.num_hidden_layers),
                     num_kv_heads=heads, head_dim=head_dim,
                     rope_theta=_rope_theta(config), spec=model)  # fmt: skip
    return tables


def _rope_theta(config):
    """The model's RoPE base (`rope_theta`, or transformers 5's `rope_parameters`)."""
    theta = getattr(config, "rope_theta", None)
    params = getattr(config, "rope_parameters", None)
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return None if theta is None else float(theta)


def layer_policies(policy: Policy, loaded: LoadedModel, coder) -> dict[int, Policy] | None:
    """Model layer -> its policy, for a `key_tables` policy (each layer's INTB format
    registered in the coder's stack); None for any other policy."""
    if policy.key_tables is None:
        return None
    tables = check_key_tables(policy, loaded)
    return {
        layer: policy.for_key_format(
            coder.register_intb(table),
            tables.heavy_table(policy.name, layer) if policy.heavy is not None else None,
            tables.rope_theta,
        )
        for layer, table in tables.tables.items()
    }


def evaluate_policies(
    loaded: LoadedModel,
    windows: np.ndarray,
    policies: list[Policy],
    *,
    predictions: int,
    codec: str = "torch",
    record: bool = False,
    batch: int | None = None,
    progress=None,
) -> EvalResult:
    """Evaluate `policies` on token windows [W, prefix + predictions + 1] (int).

    The model reads the first prefix + predictions tokens of each window; the logits of its
    last `predictions` positions predict the last `predictions` tokens (teacher forcing).
    batch: windows per forward (None: all at once). progress(str) gets one line per policy.
    """
    ids = torch.as_tensor(np.asarray(windows), dtype=torch.long)
    if ids.ndim != 2 or ids.shape[1] < predictions + 2:
        raise ValueError(f"windows must be [W, >= predictions + 2], got {tuple(ids.shape)}")
    inputs, targets = ids[:, :-1], ids[:, -predictions:]
    batch = batch or len(ids)
    coder = get_loop_coder(codec)
    base_impl = loaded.model.config._attn_implementation

    def run(quantizer_factory):
        outs, quantizers = [], []
        for start in range(0, len(ids), batch):
            qz = quantizer_factory()
            outs.append(_forward(loaded, inputs[start : start + batch], predictions, qz))
            quantizers.append(qz)
        return torch.cat(outs), quantizers

    t0 = time.perf_counter()
    reference, _ = run(lambda: None)
    ref_seconds = time.perf_counter() - t0
    if progress:
        progress(f"reference (model attention, no hook): {ref_seconds:.1f} s")

    def one(policy: Policy) -> PolicyResult:
        t = time.perf_counter()
        layers = layer_policies(policy, loaded, coder)
        logits, quantizers = run(
            lambda: KVQuantizer(
                policy, coder, base_implementation=base_impl, record=record, layers=layers
            )
        )
        seconds = time.perf_counter() - t
        res = PolicyResult(
            policy,
            compare_logits(reference, logits, targets),
            seconds,
            quantizers[0] if record and len(quantizers) == 1 else None,
            logits if record else None,
        )
        if progress:
            m = res.metrics
            progress(
                f"{policy.name}: KL {m['kl']:.6f} dNLL {m['delta_nll']:+.6f} "
                f"top1 {m['top1']:.2%} ({seconds:.1f} s)"
            )
        return res

    # The BF16 passthrough check always runs, and is always the first row.
    passthrough = one(POLICIES["bf16"])
    results = [passthrough] + [one(p) for p in policies if p.quantized]
    return EvalResult(ref_seconds, passthrough, results, reference)
