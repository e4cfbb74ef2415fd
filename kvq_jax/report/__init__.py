"""`kvq report`: compare KV storage policies on captured (or embedded) real K/V.

One concern per module: `capture` (the `--kv` file format and the embedded capture in
`data/`), `metrics` (pooled relative L2, causal GQA attention),
`evaluate` (encode/decode every loop stack per policy, one compiled program per policy),
`render` (table, JSON), `plot` (`--plot`), `progress` (the tqdm bar) and `command` (the
`kvq report` arguments and run). The named policies are `kvq_jax.core.policies` (shared with
the Torch report); the `--model` report lives in `kvq_torch_bridge.model_eval`.
"""
