"""CPO math over per-sequence log-probs (every loss_type) and the op's output type: the bottom of the package.

Contrastive Preference Optimization (Xu et al., 2024, arXiv:2401.08417), eq. 3, as TRL's ``CPOTrainer`` computes
it. With ``s`` the sequence log-prob (sum over completion tokens; the mean for ``ipo``/``simpo``) and
``Δ = s_c − s_r`` (AlphaPO, ``alpha ≠ 0``: ``Δ = r_c − r_r`` with ``r = (1 − exp(−alpha·s)) / alpha``)::

    sigmoid  −(1−ε)·logσ(βΔ) − ε·logσ(−βΔ)         simpo  the same on Δ − γ/β
    hinge    relu(1 − βΔ)                           ipo    (Δ − 1/(2β))²
    loss = mean_pairs(losses) + cpo_alpha · nll,    nll = −Σ_chosen log p / N_chosen_tokens
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

LossType = Literal["sigmoid", "hinge", "ipo", "simpo", "alphapo"]
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo", "alphapo")


@dataclass(frozen=True)
class CPOHyperparams:
    """The CPO knobs after TRL's normalisation (``alphapo`` → ``simpo`` with ``cpo_alpha = 0``)."""

    beta: float = 0.1
    loss_type: LossType = "sigmoid"
    label_smoothing: float = 0.0
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0

    @classmethod
    def create(cls, **kwargs) -> CPOHyperparams:
        loss_type = kwargs.setdefault("loss_type", "sigmoid")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r} is not one of {LOSS_TYPES}.")
        if loss_type == "alphapo":  # TRL's CPOConfig.__post_init__ does the same rewrite
            kwargs["loss_type"], kwargs["cpo_alpha"] = "simpo", 0.0
        beta = kwargs.get("beta", 0.1)
        if kwargs["loss_type"] in ("ipo", "simpo") and beta == 0:
            raise ValueError(f"beta must be non-zero for loss_type={loss_type!r} (it divides by beta).")
        return cls(**kwargs)

    @property
    def average_log_prob(self) -> bool:
        """TRL averages the token log-probs of a sequence for ipo and simpo, and sums them otherwise."""
        return self.loss_type in ("ipo", "simpo")


def cpo_pair_losses(
    chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, hp: CPOHyperparams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair CPO losses and rewards, TRL's ``CPOTrainer.cpo_loss`` with a stable AlphaPO transform.

    Args:
        chosen_logps: ``[P]`` sequence log-probs of the chosen completions.
        rejected_logps: ``[P]`` sequence log-probs of the rejected completions.
        hp: the CPO hyperparameters.

    Returns:
        ``(losses [P], chosen_rewards [P], rejected_rewards [P])`` in the inputs' dtype; rewards are not detached
        here (callers detach).
    """
    if hp.alpha != 0.0:
        # TRL writes (1 - exp(s).pow(-alpha)) / alpha: exp(s) underflows to 0 for summed log-probs (s ≈ -500) and
        # 0 ** -alpha is inf. -expm1(-alpha * s) / alpha is the same function without the underflow.
        chosen_r = -torch.expm1(-hp.alpha * chosen_logps) / hp.alpha
        rejected_r = -torch.expm1(-hp.alpha * rejected_logps) / hp.alpha
    else:
        chosen_r, rejected_r = chosen_logps, rejected_logps
    logits = chosen_r - rejected_r
    if hp.loss_type in ("sigmoid", "simpo"):
        if hp.loss_type == "simpo":
            logits = logits - hp.simpo_gamma / hp.beta
        losses = (
            -F.logsigmoid(hp.beta * logits) * (1 - hp.label_smoothing)
            - F.logsigmoid(-hp.beta * logits) * hp.label_smoothing
        )
    elif hp.loss_type == "hinge":
        losses = torch.relu(1 - hp.beta * logits)
    elif hp.loss_type == "ipo":
        losses = (logits - 1 / (2 * hp.beta)) ** 2
    else:  # CPOHyperparams.create rejects anything else
        raise ValueError(f"Unknown loss type {hp.loss_type!r}")
    return losses, hp.beta * chosen_r, hp.beta * rejected_r


def cpo_pair_loss_grads(
    chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, hp: CPOHyperparams, num_pairs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and rewards of some pairs, and the derivative of ``Σ losses / num_pairs`` w.r.t. each
    sequence log-prob.

    The fused op needs ``∂L/∂s`` for the pairs of one chunk before it can write that chunk's ``dlogits``. Autograd
    over these ``[P]``-sized tensors (float64, microseconds) gives it for every loss type from the same formula the
    forward uses: this is the spec that the closed forms of ``ops/kernels/sequence.py`` are tested against.

    Returns:
        ``(losses [P], chosen_rewards [P], rejected_rewards [P], d_chosen [P], d_rejected [P])``, all float64.
    """
    with torch.enable_grad():
        c = chosen_logps.detach().double().requires_grad_(True)
        r = rejected_logps.detach().double().requires_grad_(True)
        losses, chosen_rewards, rejected_rewards = cpo_pair_losses(c, r, hp)
        d_c, d_r = torch.autograd.grad(losses.sum() / num_pairs, (c, r))
    return losses.detach(), chosen_rewards.detach(), rejected_rewards.detach(), d_c, d_r


@dataclass
class CPOLossOutput:
    """What ``fused_linear_cpo_loss`` returns. Only ``loss`` carries gradients; everything else is detached.

    Attributes:
        loss: scalar, ``mean(losses) + cpo_alpha · nll``.
        chosen_logps / rejected_logps: ``[B]`` sequence log-probs (sum, or mean for ipo/simpo).
        chosen_rewards / rejected_rewards: ``[B]``, ``β·s`` (``β·r`` with AlphaPO).
        nll_loss: scalar, token-mean NLL of the chosen completions (0 when ``cpo_alpha == 0``).
        chosen_logits_mean / rejected_logits_mean: scalar mean of the ``[B, T, V]`` logits of each half over every
            position, prompt and padding included (TRL's ``logits/chosen``), computed without the logits.
    """

    loss: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    nll_loss: torch.Tensor
    chosen_logits_mean: torch.Tensor
    rejected_logits_mean: torch.Tensor
