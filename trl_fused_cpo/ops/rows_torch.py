"""Torch row passes over one ``[C, V]`` logits chunk and the token plan's label ops: the spec of the Triton kernels
and the CPU backend."""

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
        logits: ``[C, V]``, overwritten in place (``V`` may be one vocabulary slab of the full row).
        lse: ``[C]`` float32 log-sum-exp of each full row.
        targets: ``[C]`` int64; a target outside ``[0, V)`` (in another slab) matches no column.
        coef: ``[C]`` float32 (float64 for float64 logits), ``∂L/∂log p`` of each row's token.
    """
    lf = logits if logits.dtype == torch.float64 else logits.float()
    grad = torch.exp(lf - lse[:, None]).mul_(-coef[:, None])
    here = (targets >= 0) & (targets < logits.shape[1])
    onehot = (coef * here).to(grad.dtype)[:, None]
    grad.scatter_add_(1, targets.clamp(0, logits.shape[1] - 1)[:, None], onehot)
    return logits.copy_(grad)


def label_counts(labels: torch.Tensor, ignore_index: int, vocab_size: int) -> torch.Tensor:
    """``[2, 2B]``: labelled tokens per row, and labels outside ``[0, vocab_size)`` per row."""
    labelled = labels != ignore_index
    bad = labelled & ((labels < 0) | (labels >= vocab_size))
    return torch.stack([labelled.sum(1), bad.sum(1)])


def compact_labels(
    labels: torch.Tensor, row_counts: torch.Tensor, num_tokens: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_index, token_row, targets)`` of the labelled positions in pair order: chosen row i, then
    rejected row B + i, each in position order. ``token_index`` indexes the flattened ``[2B * T]`` batch."""
    rows, seq_len = labels.shape
    num_pairs = rows // 2
    pair = torch.arange(num_pairs, device=labels.device)
    row_order = torch.stack([pair, pair + num_pairs], dim=1).flatten()
    ordered = (labels != ignore_index)[row_order].flatten()
    # The True entries in order without boolean indexing's host sync: N is known, a stable sort puts them first.
    flat = torch.sort((~ordered).to(torch.uint8), stable=True).indices[:num_tokens]
    token_row = row_order[flat // seq_len]
    token_index = token_row * seq_len + flat % seq_len
    return token_index, token_row, labels.reshape(-1)[token_index].long()
