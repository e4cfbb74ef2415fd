"""Teacher-forced forward that runs the decoder layer stack `loops` times (Ouro's execution).

Ouro (`OuroModel.forward`) runs every decoder layer once per "UT step", applies the final
RMSNorm after each step and feeds that normalized hidden state to the next step; the logits
come from the last step's normalized state (`lm_head`). `run_logits` does the same with the
loaded model's own modules (embed_tokens, rotary_emb, layers, norm, lm_head), with no cache:
each layer's attention sees the whole window (K/V of every position, post-RoPE). With
loops=1 this is the model's own forward. On a plain model loops > 1 is an emulation.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch


def _decoder(model):
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            raise TypeError(
                f"{type(model).__name__}: the decoder has no {name!r}; only Llama-style "
                f"decoder stacks (embed_tokens, rotary_emb, layers, norm) can be looped here"
            )
    return decoder


def _masks(model, decoder, embeds, position_ids) -> dict:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kwargs = dict(
        config=model.config, inputs_embeds=embeds, attention_mask=None, position_ids=position_ids
    )
    # transformers 5 renames the mask functions' `past_key_values` to `cache`
    params = inspect.signature(create_causal_mask).parameters
    kwargs["cache" if "cache" in params else "past_key_values"] = None
    masks = {"full_attention": create_causal_mask(**kwargs)}
    types = {getattr(layer, "attention_type", "full_attention") for layer in decoder.layers}
    if "sliding_attention" in types:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
    return masks


def _accepts(layer, name: str) -> bool:
    params = inspect.signature(layer.forward).parameters
    return name in params


@torch.no_grad()
def run_logits(
    model,
    input_ids: torch.Tensor,
    *,
    loops: int = 1,
    keep: int = 1,
    on_loop: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Logits [B, keep, vocab] (float32) of the last `keep` positions of `input_ids` [B, T].

    on_loop(l) is called before loop l (0-based) runs the layer stack: attention hooks use it
    to know which loop they are in.
    """
    decoder = _decoder(model)
    num_layers = model.config.num_hidden_layers
    embeds = decoder.embed_tokens(input_ids)
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    masks = _masks(model, decoder, embeds, position_ids)
    position_embeddings = decoder.rotary_emb(embeds, position_ids)
    layers = list(decoder.layers[:num_layers])
    pass_ut = [_accepts(layer, "current_ut") for layer in layers]
    hidden = embeds
    for loop in range(loops):
        if on_loop is not None:
            on_loop(loop)
        for layer, ut in zip(layers, pass_ut, strict=True):
            extra = {"current_ut": loop} if ut else {}
            out = layer(
                hidden,
                attention_mask=masks[getattr(layer, "attention_type", "full_attention")],
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                use_cache=False,
                **extra,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        hidden = decoder.norm(hidden)
    return model.lm_head(hidden[:, -keep:]).float()
