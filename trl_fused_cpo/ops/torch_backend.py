"""Torch row passes over one ``[C, V]`` logits chunk and the token plan's label ops: the spec of the Triton kernels
and the CPU backend."""

from __future__ import annotations

import torch

from .sequence import finish_, pair_tail_  # noqa: F401  (the per-sequence tail: torch is its spec too)


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


def token_logps_(
    logits: torch.Tensor, targets: torch.Tensor, token_logp: torch.Tensor, row_sum: torch.Tensor
) -> torch.Tensor:
    """``logsumexp_target`` with ``target − lse`` written into ``token_logp`` and the sum into ``row_sum``; returns
    the log-sum-exp."""
    lse, target_logit, total = logsumexp_target(logits, targets)
    token_logp.copy_(target_logit - lse)
    row_sum.copy_(total)
    return lse


def shifted_exp_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    token_logp: torch.Tensor,
    row_sum: torch.Tensor,
    keep: torch.Tensor,
    inv: torch.Tensor,
) -> None:
    """A frozen head's one pass (``kernels/frozen_grad.py``): ``logits`` becomes ``E`` with ``E · inv`` the softmax
    without the target column; writes ``token_logp``, ``row_sum``, ``keep = 1 − p(target)`` and ``inv``. Here the
    shift is the log-sum-exp itself, so ``inv`` is 1."""
    lse = token_logps_(logits, targets, token_logp, row_sum)
    lf = logits if logits.dtype == torch.float64 else logits.float()
    probs = torch.exp(lf - lse[:, None]).scatter_(1, targets[:, None], 0.0)
    logits.copy_(probs)
    keep.copy_(probs.sum(-1))
    inv.fill_(1.0)


def frozen_dx_(
    dx: torch.Tensor,
    token_index: torch.Tensor,
    g: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    row_coef: torch.Tensor,
    token_row: torch.Tensor,
    keep: torch.Tensor,
    inv: torch.Tensor,
) -> None:
    """``dx[token_index] = coef · (keep · W[target] − inv · G)`` with ``coef = row_coef[token_row]``, ``G = E·W``."""
    coef = row_coef[token_row]
    w = weight.index_select(0, targets).to(g.dtype)
    dx.index_copy_(0, token_index, ((coef * keep)[:, None] * w - (coef * inv)[:, None] * g).to(dx.dtype))


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
