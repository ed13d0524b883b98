"""Torch row passes over one ``[C, V]`` logits chunk: the spec of the Triton kernels and the CPU backend."""

from __future__ import annotations

import torch


def logsumexp_target(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row log-sum-exp, target logit and sum, float32 (float64 for float64 logits).

    Args:
        logits: ``[C, V]`` logits of one chunk.
        targets: ``[C]`` int64 label of each row.
    """
    lf = logits if logits.dtype == torch.float64 else logits.float()
    return torch.logsumexp(lf, dim=-1), lf.gather(1, targets[:, None]).squeeze(1), lf.sum(-1)


def softmax_grad_(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Overwrite ``logits`` with ``dlogits = coef · (onehot(target) − softmax)``, i.e. ``coef · ∂log p_target/∂z``.

    Args:
        logits: ``[C, V]``, overwritten in place.
        lse: ``[C]`` float32 log-sum-exp of each row.
        targets: ``[C]`` int64.
        coef: ``[C]`` float32 (float64 for float64 logits), ``∂L/∂log p`` of each row's token.
    """
    lf = logits if logits.dtype == torch.float64 else logits.float()
    grad = torch.exp(lf - lse[:, None]).mul_(-coef[:, None])
    grad.scatter_add_(1, targets[:, None], coef[:, None].to(grad.dtype))
    return logits.copy_(grad)
