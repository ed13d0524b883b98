"""The torch backend, whole (``backend.BACKEND_FUNCTIONS``): the spec of the Triton kernels and the CPU backend.

The row passes over one ``[C, V]`` logits chunk, the token plan's label ops, and the per-sequence tail
(``pair_tail_``, ``finish_``). The tail takes about forty small launches per group where ``kernels/sequence.py``
takes one (≈ 2-3 µs of GPU time each, 3-5% of an eval call at B = 2).
"""

from __future__ import annotations

import torch

from .cpo_math import CPOHyperparams, cpo_pair_loss_grads, cpo_pair_losses
from .plan import ChunkGroup, TokenPlan
from .sequence import SequenceStats


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


def pair_tail_(
    stats: SequenceStats,
    plan: TokenPlan,
    token_logp: torch.Tensor,
    token_sum: torch.Tensor,
    group: ChunkGroup,
    hp: CPOHyperparams,
    row_coef: torch.Tensor | None = None,
    fold: torch.Tensor | None = None,
) -> None:
    """Fill ``stats`` for the pairs of ``group`` from its tokens' log-probs and logit sums.

    With ``row_coef`` (``[2B]``, the accumulator dtype): also write the group's rows of ``∂L/∂log p_t``, the pair
    term (over the length for mean-type log-probs) plus the NLL term, times ``fold`` (``grad_scale.py``). Rows of
    other groups are left as they are.
    """
    num_rows = plan.row_counts.numel()
    num_pairs = num_rows // 2
    span = slice(group.tok_start, group.tok_end)
    # float64 sums: at T = 32k a float32 sum of ~-80,000 loses the difference s_c - s_r to 1e-3 (tests/edge cases)
    sums = torch.zeros(2, num_rows, device=token_logp.device, dtype=torch.float64)
    sums[0].index_add_(0, plan.token_row[span], token_logp[span].double())
    sums[1].index_add_(0, plan.token_row[span], token_sum[span].double())
    pairs = slice(group.pair_start, group.pair_end)
    rejected_rows = slice(num_pairs + group.pair_start, num_pairs + group.pair_end)
    for rows in (pairs, rejected_rows):
        stats.row_logp_sums[rows] = sums[0, rows]
        stats.row_logit_sums[rows] = sums[1, rows]
    counts = plan.row_counts.double()
    # TRL divides 0/0 on an empty completion (NaN); a sequence with no labelled token has s = 0 here instead.
    divisor = counts.clamp(min=1) if hp.average_log_prob else torch.ones_like(counts)
    s = sums[0] / divisor
    chosen, rejected = s[pairs], s[rejected_rows]
    stats.chosen_logps[pairs] = chosen
    stats.rejected_logps[pairs] = rejected
    if row_coef is None:
        losses, chosen_r, rejected_r = cpo_pair_losses(chosen, rejected, hp)
    else:
        losses, chosen_r, rejected_r, d_chosen, d_rejected = cpo_pair_loss_grads(chosen, rejected, hp, num_pairs)
        d_chosen = d_chosen / divisor[pairs]
        if hp.cpo_alpha != 0 and plan.num_chosen_tokens:
            d_chosen = d_chosen - hp.cpo_alpha / plan.num_chosen_tokens
        row_coef[pairs] = d_chosen.to(row_coef.dtype) * fold
        row_coef[rejected_rows] = (d_rejected / divisor[rejected_rows]).to(row_coef.dtype) * fold
    stats.pair_losses[pairs] = losses
    stats.chosen_rewards[pairs] = chosen_r.float()
    stats.rejected_rewards[pairs] = rejected_r.float()


def finish_(
    stats: SequenceStats,
    plan: TokenPlan,
    hp: CPOHyperparams,
    unlabelled_sum: torch.Tensor,
    bias: torch.Tensor | None,
    row_positions: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, nll, chosen_logits_mean, rejected_logits_mean)`` once every group has written ``stats``.

    ``unlabelled_sum`` ``[2B]``: each row's logits summed over its unlabelled positions (``chunks.py``).
    ``row_positions`` ``[2B]`` int64: the positions each row has (``rows.py``: ``T`` padded, its length packed).
    Each mean is the half's logit sum over the half's positions and the vocabulary: TRL's ``logits.mean()`` of the
    padded half, the mean over the real positions of a packed one.
    """
    num_pairs = plan.row_counts.numel() // 2
    dtype = stats.chosen_logps.dtype
    num_chosen = plan.num_chosen_tokens
    if hp.cpo_alpha != 0 and num_chosen:
        nll = (-stats.row_logp_sums[:num_pairs].sum() / num_chosen).to(dtype)
    else:
        nll = torch.zeros((), device=stats.pair_losses.device, dtype=dtype)
    loss = (stats.pair_losses.sum() / num_pairs).to(dtype) + hp.cpo_alpha * nll
    total = stats.row_logit_sums + unlabelled_sum.double()
    positions = row_positions.double()
    if bias is not None:  # the unlabelled-sum row's logits carry the bias once; each unlabelled position once
        total = total + (positions - plan.row_counts.double() - 1) * bias.detach().sum(dtype=torch.float64)
    means = [
        (total[half].sum() / (positions[half].sum().clamp(min=1) * vocab)).float()
        for half in (slice(0, num_pairs), slice(num_pairs, None))
    ]
    return loss, nll, means[0], means[1]
