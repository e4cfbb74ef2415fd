"""Model-level evaluation of kvq's KV policies (`kvq report --model NAME`).

Teacher-forced runs of a causal LM (SmolLM2 from its packaged GGUF, a local HF directory, or
a looped checkpoint such as Ouro, whose decoder stack is run N times) in which every
layer's post-RoPE K and V are coded by kvq inside attention, per layer and per loop with
`encode_loops` semantics, so the quantized cache propagates; the logits are compared with
the BF16 run (KL, delta NLL, top-1), and policy "bf16" through the same hook must be
bitwise equal. One concern per module: loading, text, looped (the forward), hooks (the
attention function), codecs (torch / jax), metrics, evaluate, cli.

Needs torch and the `eval` extra (transformers, gguf, accelerate); imported lazily.
"""

from kvq_torch_bridge.model_eval.cli import add_model_arguments, run_model_report

__all__ = ["add_model_arguments", "run_model_report"]
