"""Per-sequence math both schedules share: log-probs, losses, per-row coefficients, metrics, the final outputs.

After a chunk group's log-probs are known, ``pair_tail_`` turns them into its pairs' sequence log-probs, losses,
rewards and the per-row coefficients ``∂L/∂log p_t`` its gradients need; ``finish_`` reduces the per-pair results
to the outputs once every group is done. Both write into ``SequenceStats``, device buffers filled group by group.
The torch versions here are the spec (and the CPU backend); ``kernels/sequence.py`` does each in one Triton launch,
where torch takes about forty small ones per group (≈ 2-3 µs of GPU time each, 3-5% of an eval call at B = 2).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from .cpo_math import CPOHyperparams, cpo_pair_loss_grads, cpo_pair_losses
from .gemm import logits
from .plan import ChunkGroup, TokenPlan


@dataclass
class Grads:
    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


def unlabelled_hidden_sums(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[2B, H]``: each row's sum of hidden states over its unlabelled positions, in the hidden dtype."""
    unlabelled = (labels == ignore_index).to(hidden.dtype)
    return torch.bmm(unlabelled[:, None, :], hidden).squeeze(1)  # one read of hidden, fp32 accumulation


@dataclass
class SequenceStats:
    """Per-pair and per-row results of one call, written by ``pair_tail_`` group by group.

    Attributes:
        chosen_logps / rejected_logps: ``[P]`` sequence log-probs (sum, or mean for ipo/simpo), accumulator dtype.
        chosen_rewards / rejected_rewards: ``[P]`` float32, ``β·s`` (``β·r`` with AlphaPO).
        pair_losses: ``[P]`` float64, each pair's loss (not yet divided by ``P``).
        row_logp_sums: ``[2B]`` float64, each row's summed token log-probs (the chosen half gives the NLL).
        row_logit_sums: ``[2B]`` float64, each row's logits summed over its labelled positions and the vocabulary.
    """

    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    pair_losses: torch.Tensor
    row_logp_sums: torch.Tensor
    row_logit_sums: torch.Tensor

    @classmethod
    def empty(cls, num_rows: int, device: torch.device, dtype: torch.dtype) -> SequenceStats:
        pairs = num_rows // 2
        f64, f32 = torch.float64, torch.float32
        return cls(
            *(torch.empty(pairs, device=device, dtype=d) for d in (dtype, dtype, f32, f32, f64)),
            *(torch.empty(num_rows, device=device, dtype=f64) for _ in range(2)),
        )


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
    seq_len: int,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, nll, chosen_logits_mean, rejected_logits_mean)`` once every group has written ``stats``.

    ``unlabelled_sum`` ``[2B]``: each row's logits summed over its unlabelled positions (``chunks.py``). The
    means are TRL's ``logits.mean()`` of each half: every position, every vocabulary column.
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
    if bias is not None:  # an extra row's logits carry the bias once; its positions carry it once each
        total += (seq_len - plan.row_counts - 1).double() * bias.detach().sum(dtype=torch.float64)
    means = (total / (seq_len * vocab)).float()
    return loss, nll, means[:num_pairs].mean(), means[num_pairs:].mean()


def finish_outputs(
    backend: ModuleType,
    stats: SequenceStats,
    plan: TokenPlan,
    hp: CPOHyperparams,
    unlabelled_sum: torch.Tensor,
    bias: torch.Tensor | None,
    seq_len: int,
    vocab: int,
) -> tuple[torch.Tensor, ...]:
    """``LinearCPOFunction``'s outputs, ``backend.finish_`` applied: ``(loss, chosen_logps, rejected_logps,
    chosen_rewards, rejected_rewards, nll, chosen_logits_mean, rejected_logits_mean)``."""
    loss, nll, chosen_mean, rejected_mean = backend.finish_(stats, plan, hp, unlabelled_sum, bias, seq_len, vocab)
    per_pair = (stats.chosen_logps, stats.rejected_logps, stats.chosen_rewards, stats.rejected_rewards)
    return (loss, *per_pair, nll, chosen_mean, rejected_mean)


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


def unlabelled_logit_sums(
    unlabelled_hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``[2B]`` logit sums of the unlabelled-sum rows, for a batch whose GEMMs did not carry them (no labels)."""
    return logits(unlabelled_hidden, weight.detach(), bias).sum(-1, dtype=dtype)
