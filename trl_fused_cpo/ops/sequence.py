"""Per-sequence math both schedules share: log-probs, per-token coefficients, metrics, the final outputs."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..loss import CPOHyperparams
from .gemm import logits
from .plan import TokenPlan


@dataclass
class Grads:
    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


def unlabelled_hidden_sums(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[2B, H]``: each row's sum of hidden states over its unlabelled positions, in the hidden dtype."""
    unlabelled = (labels == ignore_index).to(hidden.dtype)
    return torch.bmm(unlabelled[:, None, :], hidden).squeeze(1)  # one read of hidden, fp32 accumulation


def row_logit_means(
    plan: TokenPlan,
    token_sum: torch.Tensor,
    unlabelled_sum: torch.Tensor,
    bias: torch.Tensor | None,
    seq_len: int,
    vocab: int,
) -> torch.Tensor:
    """``[2B]`` float32: each row's mean logit over its T positions and the vocabulary."""
    rows = plan.row_counts.numel()
    total = torch.zeros(rows, device=token_sum.device, dtype=torch.float64)
    total.index_add_(0, plan.token_row, token_sum.double())
    total += unlabelled_sum.double()
    if bias is not None:  # an extra row's logits carry the bias once; its positions carry it once each
        total += (seq_len - plan.row_counts - 1).double() * bias.detach().sum(dtype=torch.float64)
    return (total / (seq_len * vocab)).float()


def sequence_logps(
    plan: TokenPlan, token_logp: torch.Tensor, pair_start: int, pair_end: int, tok_start: int, tok_end: int, hp
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence log-probs of pairs ``[pair_start, pair_end)`` and the per-row divisor (1, or the token count)."""
    rows = plan.row_counts.numel()
    num_pairs = rows // 2
    # float64 sums: at T = 32k a float32 sum of ~-80,000 loses the difference s_c - s_r to 1e-3 (tests/edge cases)
    sums = torch.zeros(rows, device=token_logp.device, dtype=torch.float64)
    sums.index_add_(0, plan.token_row[tok_start:tok_end], token_logp[tok_start:tok_end].double())
    counts = plan.row_counts.double()
    # TRL divides 0/0 on an empty completion (NaN); a sequence with no labelled token has s = 0 here instead.
    divisor = counts.clamp(min=1) if hp.average_log_prob else torch.ones_like(counts)
    s = sums / divisor
    chosen = slice(pair_start, pair_end)
    rejected = slice(num_pairs + pair_start, num_pairs + pair_end)
    return s[chosen], s[rejected], divisor


def warn_where_trl_gives_nan(row_counts: list[int], hp: CPOHyperparams) -> None:
    """TRL divides 0/0 on empty completions; here the result is finite and documented, with a warning."""
    empty = [i for i, n in enumerate(row_counts) if n == 0]
    if empty and hp.average_log_prob:
        warnings.warn(
            f"rows {empty[:8]} have no labelled token (prompt fills max_length?): their mean log-prob is taken as 0 "
            f"(TRL's CPOTrainer gives NaN for loss_type={hp.loss_type!r}).",
            stacklevel=4,
        )
    if hp.cpo_alpha != 0 and sum(row_counts[: len(row_counts) // 2]) == 0:
        warnings.warn("no chosen row has a labelled token: nll_loss is 0 (TRL's CPOTrainer gives NaN).", stacklevel=4)


def row_coefficients(
    plan: TokenPlan,
    pairs: tuple[int, int],
    d_chosen: torch.Tensor,
    d_rejected: torch.Tensor,
    divisor: torch.Tensor,
    hp: CPOHyperparams,
    dtype: torch.dtype,
    guess: torch.Tensor,
) -> torch.Tensor:
    """``[2B]`` per-row ``∂L/∂log p_t`` for pairs ``[start, end)``: the pair term (over the length for mean-type
    log-probs) plus the NLL term, times the incoming-gradient guess."""
    num_rows = plan.row_counts.numel()
    num_pairs = num_rows // 2
    start, end = pairs
    num_chosen = plan.num_chosen_tokens
    coef = torch.zeros(num_rows, device=d_chosen.device, dtype=torch.float64)
    coef[start:end] = d_chosen
    coef[num_pairs + start : num_pairs + end] = d_rejected
    coef /= divisor.to(coef.dtype)
    if hp.cpo_alpha != 0 and num_chosen:
        coef[:num_pairs] -= hp.cpo_alpha / num_chosen
    return coef.to(dtype) * guess


def finish(
    plan: TokenPlan,
    hp: CPOHyperparams,
    token_logp: torch.Tensor,
    pair_loss: torch.Tensor | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, chosen_logps, rejected_logps, nll)`` from the token log-probs and the summed pair loss."""
    num_pairs = plan.row_counts.numel() // 2
    device = token_logp.device
    chosen_logps, rejected_logps, _ = sequence_logps(plan, token_logp, 0, num_pairs, 0, plan.num_tokens, hp)
    num_chosen = plan.num_chosen_tokens
    if hp.cpo_alpha != 0 and num_chosen:
        chosen_tokens = plan.token_row < num_pairs
        nll = (-(token_logp.double() * chosen_tokens).sum() / num_chosen).to(dtype)
    else:
        nll = torch.zeros((), device=device, dtype=dtype)
    loss = (torch.zeros((), device=device) if pair_loss is None else pair_loss).to(dtype) + hp.cpo_alpha * nll
    return loss, chosen_logps.to(dtype), rejected_logps.to(dtype), nll


def unlabelled_logit_sums(
    unlabelled_hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``[2B]`` logit sums of the unlabelled-sum rows, for a batch whose GEMMs did not carry them (no labels)."""
    return logits(unlabelled_hidden, weight.detach(), bias).sum(-1, dtype=dtype)
