"""Per-sequence state both schedules share: ``SequenceStats``, the gradients, the final outputs and the warnings.

After a chunk group's log-probs are known, the backend's ``pair_tail_`` turns them into its pairs' sequence
log-probs, losses, rewards and the per-row coefficients ``∂L/∂log p_t`` its gradients need; its ``finish_`` reduces
the per-pair results to the outputs once every group is done. Both write into ``SequenceStats``, device buffers
filled group by group. The torch versions (``torch_backend.py``) are the spec; ``kernels/sequence.py`` does each in
one Triton launch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from .cpo_math import CPOHyperparams
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


def finish_outputs(
    backend: ModuleType,
    stats: SequenceStats,
    plan: TokenPlan,
    hp: CPOHyperparams,
    unlabelled_sum: torch.Tensor,
    bias: torch.Tensor | None,
    row_positions: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, ...]:
    """``LinearCPOFunction``'s outputs, ``backend.finish_`` applied: ``(loss, chosen_logps, rejected_logps,
    chosen_rewards, rejected_rewards, nll, chosen_logits_mean, rejected_logits_mean)``. ``row_positions``: the
    layout's (``rows.py``)."""
    loss, nll, chosen_mean, rejected_mean = backend.finish_(stats, plan, hp, unlabelled_sum, bias, row_positions, vocab)
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
