"""Triton kernels for the per-sequence tail (``torch_backend.py``, the spec): one launch per chunk group, one to finish.

The torch tail is ~40 launches per group (index_add, divisions, log-sigmoids, a float64 autograd graph for
``∂L/∂s``, the coefficients) and ~25 more to finish, each a few microseconds of GPU time with the GEMMs waiting
behind it. Here one program per pair sums its two rows' token log-probs and logit sums (the rows' tokens are
contiguous in the plan's pair order, so the offsets follow from the counts), then applies the loss, its closed-form
derivative and the coefficients in float64; a one-program kernel reduces the pairs to the loss, the NLL and the
logit means. The closed forms are those of ``cpo_math.cpo_pair_losses`` (tests compare both with autograd):

- sigmoid / simpo: ``L = (1-ε)·softplus(-βu) + ε·softplus(βu)``, ``∂L/∂u = β·(ε·σ(βu) - (1-ε)·σ(-βu))``;
- hinge: ``L = relu(1 - βu)``, ``∂L/∂u = -β`` where ``1 - βu > 0`` (0 at the kink, as torch);
- ipo: ``L = (u - 1/(2β))²``, ``∂L/∂u = 2·(u - 1/(2β))``;

with ``u = c' - r'`` (minus ``γ/β`` for simpo) and AlphaPO's ``c' = -expm1(-α·c)/α``, ``∂c'/∂c = exp(-α·c)``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..cpo_math import CPOHyperparams
from ..plan import ChunkGroup, TokenPlan
from ..sequence import SequenceStats

LOSS_CODES = {"sigmoid": 0, "simpo": 0, "hinge": 1, "ipo": 2}


@triton.jit
def _hyperparams(hp_ptr):
    """float64 scalars from the device (a Python float reaches a kernel as float32)."""
    return (
        tl.load(hp_ptr),
        tl.load(hp_ptr + 1),
        tl.load(hp_ptr + 2),
        tl.load(hp_ptr + 3),
        tl.load(hp_ptr + 4),
    )


@triton.jit
def _row_sums(logp_ptr, logit_ptr, start, n, BLOCK_T: tl.constexpr):
    """Float64 sums of ``n`` consecutive entries of each array from ``start``."""
    offsets = tl.arange(0, BLOCK_T)
    logp = tl.zeros([BLOCK_T], dtype=tl.float64)
    logit = tl.zeros([BLOCK_T], dtype=tl.float64)
    for off in tl.range(0, n, BLOCK_T):
        mask = off + offsets < n
        idx = start + off + offsets
        logp += tl.load(logp_ptr + idx, mask=mask, other=0.0).to(tl.float64)
        logit += tl.load(logit_ptr + idx, mask=mask, other=0.0).to(tl.float64)
    return tl.sum(logp, axis=0), tl.sum(logit, axis=0)


@triton.jit
def _softplus(x):
    return tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))


@triton.jit
def _sigmoid(x):
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _expm1(x):
    # exp(x) - 1 cancels for small |x|: a Taylor series there (relative error < 1e-16 below 1e-3)
    small = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))))
    return tl.where(tl.abs(x) < 1e-3, small, tl.exp(x) - 1.0)


@triton.jit
def _pair_tail_kernel(
    token_logp_ptr,
    token_sum_ptr,
    counts_ptr,
    chosen_ptr,
    rejected_ptr,
    chosen_reward_ptr,
    rejected_reward_ptr,
    pair_loss_ptr,
    row_logp_ptr,
    row_logit_ptr,
    coef_ptr,
    fold_ptr,
    hp_ptr,
    pair_start,
    num_pairs,
    num_chosen,
    LOSS: tl.constexpr,
    SIMPO: tl.constexpr,
    NLL: tl.constexpr,
    AVERAGE: tl.constexpr,
    ALPHAPO: tl.constexpr,
    GRAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    i = pair_start + tl.program_id(0)
    j = num_pairs + i  # the rejected row
    beta, label_smoothing, simpo_gamma, alpha, cpo_alpha = _hyperparams(hp_ptr)
    # Pair order: chosen row i, then rejected row B + i; pair i's tokens start after every earlier pair's.
    rows = tl.arange(0, BLOCK_R)
    counts = tl.load(counts_ptr + rows, mask=rows < 2 * num_pairs, other=0)
    pair_of = tl.where(rows < num_pairs, rows, rows - num_pairs)
    start_c = tl.sum(tl.where(pair_of < i, counts, 0), axis=0).to(tl.int64)
    n_c = tl.load(counts_ptr + i)
    n_r = tl.load(counts_ptr + j)
    sum_c, logit_c = _row_sums(token_logp_ptr, token_sum_ptr, start_c, n_c, BLOCK_T)
    sum_r, logit_r = _row_sums(token_logp_ptr, token_sum_ptr, start_c + n_c, n_r, BLOCK_T)
    div_c = 1.0
    div_r = 1.0
    if AVERAGE:  # mean log-probs; an empty row has s = 0 (TRL: 0/0)
        div_c = tl.maximum(n_c, 1).to(tl.float64)
        div_r = tl.maximum(n_r, 1).to(tl.float64)
    c = sum_c / div_c
    r = sum_r / div_r
    c_t = c
    r_t = r
    dc_t = 1.0
    dr_t = 1.0
    if ALPHAPO:
        c_t = -_expm1(-alpha * c) / alpha
        r_t = -_expm1(-alpha * r) / alpha
        dc_t = tl.exp(-alpha * c)
        dr_t = tl.exp(-alpha * r)
    u = c_t - r_t
    if SIMPO:
        u -= simpo_gamma / beta
    if LOSS == 0:
        x = beta * u
        loss = (1.0 - label_smoothing) * _softplus(-x) + label_smoothing * _softplus(x)
        dl_du = beta * (label_smoothing * _sigmoid(x) - (1.0 - label_smoothing) * _sigmoid(-x))
    elif LOSS == 1:
        t = 1.0 - beta * u
        loss = tl.maximum(t, 0.0)
        dl_du = tl.where(t > 0, -beta, 0.0)
    else:
        t = u - 0.5 / beta
        loss = t * t
        dl_du = 2.0 * t
    tl.store(chosen_ptr + i, c.to(chosen_ptr.dtype.element_ty))
    tl.store(rejected_ptr + i, r.to(rejected_ptr.dtype.element_ty))
    tl.store(chosen_reward_ptr + i, (beta * c_t).to(tl.float32))
    tl.store(rejected_reward_ptr + i, (beta * r_t).to(tl.float32))
    tl.store(pair_loss_ptr + i, loss)
    tl.store(row_logp_ptr + i, sum_c)
    tl.store(row_logp_ptr + j, sum_r)
    tl.store(row_logit_ptr + i, logit_c)
    tl.store(row_logit_ptr + j, logit_r)
    if GRAD:
        fold = tl.load(fold_ptr)
        coef_c = dl_du * dc_t / num_pairs / div_c
        if NLL:
            coef_c -= cpo_alpha / num_chosen
        coef_r = -dl_du * dr_t / num_pairs / div_r
        tl.store(coef_ptr + i, coef_c.to(fold.dtype) * fold)
        tl.store(coef_ptr + j, coef_r.to(fold.dtype) * fold)


@triton.jit
def _finish_kernel(
    pair_loss_ptr,
    row_logp_ptr,
    row_logit_ptr,
    unlabelled_ptr,
    counts_ptr,
    positions_ptr,
    bias_sum_ptr,
    hp_ptr,
    loss_ptr,
    nll_ptr,
    means_ptr,
    num_pairs,
    num_chosen,
    vocab,
    HAS_NLL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_R)
    in_rows = rows < 2 * num_pairs
    chosen = rows < num_pairs
    rejected = in_rows & ~chosen
    out_ty = loss_ptr.dtype.element_ty
    cpo_alpha = tl.load(hp_ptr + 4).to(out_ty)
    pair_sum = tl.sum(tl.load(pair_loss_ptr + rows, mask=chosen, other=0.0), axis=0)
    nll = tl.sum(tl.zeros([BLOCK_R], dtype=tl.float64), axis=0).to(out_ty)
    if HAS_NLL:
        nll = (-tl.sum(tl.load(row_logp_ptr + rows, mask=chosen, other=0.0), axis=0) / num_chosen).to(out_ty)
    tl.store(nll_ptr, nll)
    tl.store(loss_ptr, (pair_sum / num_pairs).to(out_ty) + cpo_alpha * nll)
    total = tl.load(row_logit_ptr + rows, mask=in_rows, other=0.0)
    total += tl.load(unlabelled_ptr + rows, mask=in_rows, other=0.0).to(tl.float64)
    positions = tl.load(positions_ptr + rows, mask=in_rows, other=0).to(tl.float64)
    if HAS_BIAS:  # the unlabelled-sum row's logits carry the bias once; each unlabelled position once
        counts = tl.load(counts_ptr + rows, mask=in_rows, other=0).to(tl.float64)
        total += (positions - counts - 1.0) * tl.load(bias_sum_ptr)
    chosen_positions = tl.maximum(tl.sum(tl.where(chosen, positions, 0.0), axis=0), 1.0)
    rejected_positions = tl.maximum(tl.sum(tl.where(rejected, positions, 0.0), axis=0), 1.0)
    chosen_total = tl.sum(tl.where(chosen, total, 0.0), axis=0)
    rejected_total = tl.sum(tl.where(rejected, total, 0.0), axis=0)
    tl.store(means_ptr, (chosen_total / (chosen_positions * vocab)).to(tl.float32))
    tl.store(means_ptr + 1, (rejected_total / (rejected_positions * vocab)).to(tl.float32))


@functools.cache
def _hp_tensor(hp: CPOHyperparams, device: torch.device) -> torch.Tensor:
    """The float knobs as a float64 device tensor, made once per (knobs, device): one host-to-device copy."""
    knobs = (hp.beta, hp.label_smoothing, hp.simpo_gamma, hp.alpha, hp.cpo_alpha)
    return torch.tensor(knobs, dtype=torch.float64, device=device)


def _block_rows(num_rows: int) -> int:
    return max(16, triton.next_power_of_2(num_rows))


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
    """``torch_backend.pair_tail_`` in one launch: one program per pair of ``group``."""
    num_rows = plan.row_counts.numel()
    num_pairs = num_rows // 2
    pairs = group.pair_end - group.pair_start
    if pairs == 0:
        return
    grad = row_coef is not None
    _pair_tail_kernel[(pairs,)](
        token_logp, token_sum, plan.row_counts,
        stats.chosen_logps, stats.rejected_logps, stats.chosen_rewards, stats.rejected_rewards, stats.pair_losses,
        stats.row_logp_sums, stats.row_logit_sums,
        row_coef if grad else stats.pair_losses, fold if grad else stats.pair_losses, _hp_tensor(hp, token_logp.device),
        group.pair_start, num_pairs, max(plan.num_chosen_tokens, 1),
        LOSS=LOSS_CODES[hp.loss_type], SIMPO=hp.loss_type == "simpo",
        NLL=hp.cpo_alpha != 0 and plan.num_chosen_tokens > 0, AVERAGE=hp.average_log_prob, ALPHAPO=hp.alpha != 0.0,
        GRAD=grad, BLOCK_R=_block_rows(num_rows), BLOCK_T=1024, num_warps=4,
    )  # fmt: skip


def finish_(
    stats: SequenceStats,
    plan: TokenPlan,
    hp: CPOHyperparams,
    unlabelled_sum: torch.Tensor,
    bias: torch.Tensor | None,
    row_positions: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch_backend.finish_`` in one launch."""
    num_rows = plan.row_counts.numel()
    num_pairs = num_rows // 2
    device, dtype = stats.chosen_logps.device, stats.chosen_logps.dtype
    loss, nll = torch.empty((), device=device, dtype=dtype), torch.empty((), device=device, dtype=dtype)
    means = torch.empty(2, device=device, dtype=torch.float32)
    num_chosen = plan.num_chosen_tokens
    has_nll = hp.cpo_alpha != 0 and num_chosen > 0
    bias_sum = bias.detach().sum(dtype=torch.float64) if bias is not None else stats.pair_losses
    _finish_kernel[(1,)](
        stats.pair_losses, stats.row_logp_sums, stats.row_logit_sums, unlabelled_sum, plan.row_counts,
        row_positions, bias_sum, _hp_tensor(hp, device), loss, nll, means, num_pairs, max(num_chosen, 1), vocab,
        HAS_NLL=has_nll, HAS_BIAS=bias is not None, BLOCK_R=_block_rows(num_rows), num_warps=1,
    )  # fmt: skip
    return loss, nll, means[0], means[1]
