"""Prediction metrics of a policy's logits against the BF16 reference logits."""

from __future__ import annotations

import torch


def compare_logits(reference: torch.Tensor, quantized: torch.Tensor, targets: torch.Tensor):
    """Metrics over every (window, position) of logits [B, P, vocab] and targets [B, P].

    kl: mean KL(P_ref || P_q) in nats; delta_nll: mean NLL_q - NLL_ref of the real next
    tokens; top1: fraction of positions whose argmax matches the reference's; kl_max: the
    largest per-position KL; nll_ref / nll: mean NLLs; bitwise_equal: the logits are
    identical bit for bit.
    """
    ref = torch.log_softmax(reference.double(), dim=-1)
    q = torch.log_softmax(quantized.double(), dim=-1)
    kl = (ref.exp() * (ref - q)).sum(-1)
    t = targets[..., None]
    nll_ref = -ref.gather(-1, t)[..., 0]
    nll_q = -q.gather(-1, t)[..., 0]
    top1 = (reference.argmax(-1) == quantized.argmax(-1)).double()
    return {
        "kl": float(kl.mean()),
        "kl_max": float(kl.max()),
        "delta_nll": float((nll_q - nll_ref).mean()),
        "nll_ref": float(nll_ref.mean()),
        "nll": float(nll_q.mean()),
        "top1": float(top1.mean()),
        "positions": int(top1.numel()),
        "bitwise_equal": bool(torch.equal(reference, quantized)),
    }
