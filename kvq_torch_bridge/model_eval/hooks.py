"""The attention hook: a function registered with transformers' `AttentionInterface` that
receives each layer's post-RoPE query/key/value [B, heads, T, D], replaces K and V by their
kvq reconstruction under a policy, and calls the model's own attention implementation.

Per layer and per loop (`KVQuantizer.set_loop`), with one state per window of the batch:
loop 0 is packed in the policy's base format, loop l >= 1 as a residual against the
*reconstructed* loop l - 1 of the same layer (`encode_loops` semantics, BF16 window
included). The reconstruction then feeds attention, so quantization error propagates through
every later layer and loop. Policy "bf16" passes K and V through untouched.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from kvq_jax.core.policies import Policy

#: The name the hook is registered under (`config._attn_implementation` while it is active).
ATTENTION_NAME = "kvq_quantized_kv"
_ACTIVE: list = []


def _base_attention(module, implementation: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation == "eager" or implementation not in ALL_ATTENTION_FUNCTIONS:
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


def _hooked_attention(module, query, key, value, attention_mask, **kwargs):
    if not _ACTIVE:
        raise RuntimeError(f"{ATTENTION_NAME} attention called outside `quantized_attention`")
    return _ACTIVE[-1](module, query, key, value, attention_mask, **kwargs)


def register() -> None:
    """Register the hook with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _hooked_attention)


class KVQuantizer:
    """Codes K/V inside attention for one policy over one forward (all layers and loops).

    coder: a `codecs` loop coder ("torch" or "jax" backend).
    record: keep, per (layer, loop), the K/V that reached the hook ("k_in", "v_in"), those
      passed on to attention ("k_out", "v_out"), the query ("q") and the attention output
      ("attn_out"), all [B, T, heads, D] copies, in `records` (for tests and captures).
    record_layers: restrict `records` to these layers (None: every layer).
    layers: model layer -> that layer's policy, for a policy with per-layer key tables
      (`evaluate.layer_policies`); None: `policy` for every layer.
    """

    def __init__(
        self,
        policy: Policy,
        coder,
        *,
        base_implementation: str,
        record: bool = False,
        record_layers=None,
        layers=None,
    ):
        if policy.key_tables is not None and layers is None:
            raise ValueError(
                f"layers: policy {policy.name!r} has per-layer key tables; pass each layer's "
                "policy (model_eval.evaluate.layer_policies)"
            )
        self.policy = policy
        self.layers = layers
        self.coder = coder
        self.base_implementation = base_implementation
        self.loop = 0
        self.record = record
        self.record_layers = None if record_layers is None else set(record_layers)
        self.records: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._recon: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._last_loop: dict[int, int] = {}

    def set_loop(self, loop: int) -> None:
        self.loop = loop

    def _code(self, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] -> its reconstruction, same layout and dtype."""
        out = []
        previous = self._recon.get((layer, kind))
        policy = self.policy if self.layers is None else self.layers[layer]
        for b in range(x.shape[0]):
            rows = x[b].transpose(0, 1)  # [T, H, D], as kvq codes it
            if self.loop == 0:
                recon = self.coder.base(rows, policy, kind)
            else:
                recon = self.coder.residual(rows, previous[b], policy, kind, self.loop)
            out.append(recon)
        self._recon[(layer, kind)] = out
        return torch.stack(out).transpose(1, 2)

    def _code_heavy(self, policy: Policy, key: torch.Tensor, value: torch.Tensor):
        """Heavy rows: K and V [B, H, T, D] coded together, each loop whole with the rows
        chosen from that loop's keys (`Policy.heavy`)."""
        table = torch.tensor(policy.heavy_table, dtype=torch.bfloat16)
        ks, vs = [], []
        for b in range(key.shape[0]):
            k_hat, v_hat = self.coder.heavy(
                key[b].transpose(0, 1), value[b].transpose(0, 1), policy, table
            )
            ks.append(k_hat)
            vs.append(v_hat)
        return torch.stack(ks).transpose(1, 2), torch.stack(vs).transpose(1, 2)

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        layer = int(module.layer_idx)
        expected = self._last_loop.get(layer, -1) + 1
        if self.loop != expected:
            raise RuntimeError(
                f"layer {layer}: loop {self.loop} reached attention after loop "
                f"{expected - 1}; each layer must run once per loop, in order"
            )
        self._last_loop[layer] = self.loop
        k, v = key, value
        policy = self.policy if self.layers is None else self.layers[layer]
        if self.policy.quantized and policy.heavy is not None:
            k, v = self._code_heavy(policy, key, value)
        elif self.policy.quantized:
            k = self._code(layer, "key", key)
            v = self._code(layer, "value", value)
        base = _base_attention(module, self.base_implementation)
        out = base(module, query, k, v, attention_mask, **kwargs)
        if self.record and (self.record_layers is None or layer in self.record_layers):
            self.records[(layer, self.loop)] = {
                "q": query.transpose(1, 2).clone(),
                "k_in": key.transpose(1, 2).clone(),
                "v_in": value.transpose(1, 2).clone(),
                "k_out": k.transpose(1, 2).clone(),
                "v_out": v.transpose(1, 2).clone(),
                "attn_out": out[0].clone(),
            }
        return out


@contextlib.contextmanager
def quantized_attention(model, quantizer: KVQuantizer):
    """Route `model`'s attention through `quantizer` inside the block (restored after)."""
    register()
    configs = [model.config]
    sub = getattr(model.config, "get_text_config", None)
    if sub is not None and sub() is not model.config:
        configs.append(sub())
    saved = [c._attn_implementation for c in configs]
    _ACTIVE.append(quantizer)
    try:
        for c in configs:
            c._attn_implementation = ATTENTION_NAME
        yield quantizer
    finally:
        _ACTIVE.pop()
        for c, s in zip(configs, saved, strict=True):
            c._attn_implementation = s
