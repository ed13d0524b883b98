"""The spec: CPO from fully materialised logits in a chosen precision. Readable, any device, autograd backward.

Every fused path is tested against this; this in turn is tested against TRL's own ``get_batch_logps`` and
``cpo_loss`` (tests/test_loss.py). Memory is ``[2B, T, V]`` in ``compute_dtype``: tests and small shapes only.
"""

from __future__ import annotations

import torch

from .cpo_math import CPOHyperparams, CPOLossOutput, cpo_pair_losses


def reference_linear_cpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    hp: CPOHyperparams,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    compute_dtype: torch.dtype = torch.float32,
) -> CPOLossOutput:
    """Same contract as ``fused_linear_cpo_loss``; logits in ``compute_dtype`` (pass float64 for ground truth)."""
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).t()
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    num_pairs = hidden.shape[0] // 2
    mask = labels != ignore_index
    token_logp = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).long()[..., None]).squeeze(-1)
    token_logp = token_logp * mask
    counts = mask.sum(-1)
    sums = token_logp.sum(-1)
    s = sums / counts.clamp(min=1) if hp.average_log_prob else sums  # empty completion: s = 0 (TRL: NaN)
    losses, chosen_rewards, rejected_rewards = cpo_pair_losses(s[:num_pairs], s[num_pairs:], hp)
    num_chosen = counts[:num_pairs].sum()
    if hp.cpo_alpha != 0:
        nll = -token_logp[:num_pairs].sum() / num_chosen.clamp(min=1)
    else:
        nll = torch.zeros((), dtype=compute_dtype, device=hidden.device)
    loss = losses.mean() + hp.cpo_alpha * nll
    return CPOLossOutput(
        loss=loss,
        chosen_logps=s[:num_pairs].detach(),
        rejected_logps=s[num_pairs:].detach(),
        chosen_rewards=chosen_rewards.detach(),
        rejected_rewards=rejected_rewards.detach(),
        nll_loss=nll.detach(),
        chosen_logits_mean=logits[:num_pairs].detach().mean(),
        rejected_logits_mean=logits[num_pairs:].detach().mean(),
    )
