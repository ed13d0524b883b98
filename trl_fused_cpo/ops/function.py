"""The fused linear-CPO op: a pair-aligned chunk loop that finishes loss and gradients in the forward.

Per chunk of whole pairs (DESIGN.md §4): logits GEMM → per-token log-sum-exp and target logit → the chunk's CPO
loss and per-token coefficients ``g_t = ∂L/∂log p_t`` → ``dlogits = g_t·(onehot − softmax)`` written over the
logits buffer → ``dX = dlogits·W``, ``dW += dlogitsᵀ·X``. Three GEMMs per token (``6NVH``), one ``[C, V]``
buffer. The gradients are computed for a guess of the incoming gradient (``grad_scale.py``); the autograd
backward corrects them, which is free when the guess was right.

The ``logits/*`` metrics (the mean logit over every position, TRL's ``logits.mean()``) come from the same pass:
the log-sum-exp kernel also sums each labelled row, and the first chunk's GEMM carries 2B extra rows, each row's
sum of unlabelled hidden states, whose logits sum to that row's unlabelled logits (the product is linear).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

from ..loss import CPOHyperparams, cpo_pair_loss_grads, cpo_pair_losses
from . import grad_scale
from .plan import TokenPlan, plan_tokens


@dataclass
class _Grads:
    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


def _logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())


def _unlabelled_hidden_sums(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``[2B, H]``: each row's sum of hidden states over its unlabelled positions, in the hidden dtype."""
    unlabelled = (labels == ignore_index).to(hidden.dtype)
    return torch.bmm(unlabelled[:, None, :], hidden).squeeze(1)  # one read of hidden, fp32 accumulation


def _row_logit_means(
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


_FP32_OUT_MM: bool | None = None  # whether this torch can write a bf16/fp16 GEMM into an fp32 tensor (CUDA)


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool = False) -> None:
    """``acc += a @ b`` (``acc = a @ b`` when ``first``) with ``acc`` float32 and ``a``, ``b`` possibly bf16/fp16.

    fp32 accumulation of ``dW`` across chunks: summing bf16 partial products would round once per chunk, and the
    fused gradient must be no worse than torch's single-GEMM one. On CUDA, cuBLAS reads and writes the fp32 ``C``
    itself (``out_dtype``), so no bf16 ``[V, H]`` temporary exists; ``first`` skips zeroing and reading the 2 GiB
    accumulator (0.6 ms at Llama-3 8B).
    """
    global _FP32_OUT_MM
    if a.dtype == acc.dtype:  # same dtype: fp32 inputs, or a single GEMM written in the input dtype
        torch.mm(a, b, out=acc) if first else acc.addmm_(a, b)
        return
    if a.is_cuda and _FP32_OUT_MM is not False:
        try:
            if first:
                torch.mm(a, b, out_dtype=torch.float32, out=acc)
            else:
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _FP32_OUT_MM = True
            return
        except (RuntimeError, TypeError):
            _FP32_OUT_MM = False
    product = torch.mm(a, b).float() if a.is_cuda else torch.mm(a.float(), b.float())
    acc.copy_(product) if first else acc.add_(product)


def _sequence_logps(
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


def _warn_where_trl_gives_nan(row_counts: list[int], hp: CPOHyperparams) -> None:
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


def linear_cpo_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    hp: CPOHyperparams,
    *,
    ignore_index: int,
    max_tokens: int,
    whole_batch_tokens: int | None,
    rows: ModuleType,
    need_grads: tuple[bool, bool, bool],
):
    """Loss, sequence log-probs, NLL and (where ``need_grads``) the gradients of hidden, weight and bias.

    Args:
        rows: ``rows_torch`` or ``rows_triton``: the row passes (``logsumexp_target``, ``softmax_grad_``) and the
            plan's label ops (``label_counts``, ``compact_labels``).
        need_grads: whether hidden, weight, bias need a gradient.

    Returns:
        ``(loss, chosen_logps [B], rejected_logps [B], nll, row_logit_means [2B], grads, guess)``, the gradients
        computed for an incoming gradient of ``guess`` (``grad_scale.py``; ``None`` without gradients).
    """
    num_rows, seq_len, hidden_size = hidden.shape
    num_pairs = num_rows // 2
    vocab = weight.shape[0]
    device = hidden.device
    need_dx, need_dw, need_db = need_grads
    # Queued before the plan's host sync: the GPU does this while the host plans.
    unlabelled_hidden = _unlabelled_hidden_sums(hidden.detach(), labels, ignore_index)
    plan = plan_tokens(
        labels,
        ignore_index=ignore_index,
        vocab_size=vocab,
        max_tokens=max_tokens,
        whole_batch_tokens=whole_batch_tokens if need_dw else None,
        ops=rows,
    )
    max_tokens = plan.max_tokens
    x_all = hidden.reshape(num_rows * seq_len, hidden_size)
    any_grad = need_dx or need_dw or need_db

    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # per-token and per-row math
    token_logp = torch.empty(plan.num_tokens, device=device, dtype=acc_dtype)
    token_sum = torch.empty(plan.num_tokens, device=device, dtype=acc_dtype)  # each labelled row's logit sum
    unlabelled_sum = None
    guess = grad_scale.guess(device, acc_dtype) if any_grad else None
    # One GEMM over every token (a single chunk) rounds dW once, as torch does: write it in the weight dtype.
    # Several chunks accumulate in fp32, and the backward casts and scales in one pass (backward_scale_kernels).
    single_gemm = len(plan.groups) == 1 and len(plan.groups[0].slices(max_tokens)) == 1
    dx = dw = db = None  # allocated once the first GEMM is queued: until then the GPU waits on the host
    dw_written = False
    num_chosen = plan.num_chosen_tokens
    nll_coef = -hp.cpo_alpha / num_chosen if (hp.cpo_alpha != 0 and num_chosen) else 0.0
    loss = None  # float64, summed over the groups (a Python accumulator: one launch fewer before the first GEMM)

    for group in plan.groups:
        slices = group.slices(max_tokens)
        kept = None  # the group's logits, kept for the gradient pass when the group is one slice
        lses = []
        for s, e in slices:
            x = x_all.index_select(0, plan.token_index[s:e])
            extra = unlabelled_sum is None  # the first GEMM also takes the 2B unlabelled-sum rows
            if extra:
                x = torch.cat([x, unlabelled_hidden])
            logits = _logits(x, weight, bias)
            if extra:
                unlabelled_sum = logits[e - s :].sum(-1, dtype=acc_dtype)
                x, logits = x[: e - s], logits[: e - s]  # row prefixes: still contiguous
            lse, target_logit, token_sum[s:e] = rows.logsumexp_target(logits, plan.targets[s:e])
            token_logp[s:e] = target_logit - lse
            lses.append(lse)
            if len(slices) == 1 and any_grad:
                kept = (x, logits)
            del logits
        chosen_s, rejected_s, divisor = _sequence_logps(
            plan, token_logp, group.pair_start, group.pair_end, group.tok_start, group.tok_end, hp
        )
        if not any_grad:
            group_loss = cpo_pair_losses(chosen_s.double(), rejected_s.double(), hp)[0].sum() / num_pairs
            loss = group_loss if loss is None else loss + group_loss
            continue
        group_loss, d_chosen, d_rejected = cpo_pair_loss_grads(chosen_s, rejected_s, hp, num_pairs)
        loss = group_loss if loss is None else loss + group_loss
        # Per-row coefficient ∂L/∂log p_t: the pair term (divided by the length for mean-type s) + the NLL term.
        row_coef = torch.zeros(num_rows, device=device, dtype=torch.float64)
        row_coef[group.pair_start : group.pair_end] = d_chosen
        row_coef[num_pairs + group.pair_start : num_pairs + group.pair_end] = d_rejected
        row_coef /= divisor.to(row_coef.dtype)
        row_coef[:num_pairs] += nll_coef
        row_coef = row_coef.to(acc_dtype) * guess
        if dx is None and need_dx:
            dx = torch.zeros_like(x_all)
        if dw is None and need_dw:
            dw = torch.empty(weight.shape, device=device, dtype=weight.dtype if single_gemm else acc_dtype)
        if db is None and need_db:
            db = torch.zeros(vocab, device=device, dtype=acc_dtype)
        for (s, e), lse in zip(slices, lses, strict=True):
            idx = plan.token_index[s:e]
            if kept is not None:
                x, dlogits = kept
            else:  # a pair longer than the budget: recompute this slice's logits
                x = x_all.index_select(0, idx)
                dlogits = _logits(x, weight, bias)
            rows.softmax_grad_(dlogits, lse, plan.targets[s:e], row_coef[plan.token_row[s:e]])
            if need_dx:
                dx.index_copy_(0, idx, torch.mm(dlogits, weight))
            if need_dw:
                _accumulate_mm(dw, dlogits.t(), x, first=not dw_written)
                dw_written = True
            if need_db:
                db += dlogits.sum(0, dtype=acc_dtype)
            del x, dlogits

    _warn_where_trl_gives_nan(plan.row_counts_host, hp)
    if unlabelled_sum is None:  # no labelled token at all: no chunk GEMM carried the extra rows
        unlabelled_sum = _logits(unlabelled_hidden, weight.detach(), bias).sum(-1, dtype=acc_dtype)
    row_means = _row_logit_means(plan, token_sum, unlabelled_sum, bias, seq_len, vocab)
    chosen_logps, rejected_logps, _ = _sequence_logps(plan, token_logp, 0, num_pairs, 0, plan.num_tokens, hp)
    chosen_logps, rejected_logps = chosen_logps.to(acc_dtype), rejected_logps.to(acc_dtype)
    if hp.cpo_alpha != 0 and num_chosen:
        chosen_tokens = plan.token_row < num_pairs
        nll = (-(token_logp.double() * chosen_tokens).sum() / num_chosen).to(acc_dtype)
    else:
        nll = torch.zeros((), device=device, dtype=acc_dtype)
    loss = (torch.zeros((), device=device) if loss is None else loss).to(acc_dtype) + hp.cpo_alpha * nll
    grads = _Grads(
        hidden=None if dx is None else dx.view_as(hidden),
        weight=None if dw is None else (dw if dw_written else torch.zeros_like(weight)),
        bias=db,
    )
    return loss, chosen_logps, rejected_logps, nll, row_means, grads, guess


class LinearCPOFunction(torch.autograd.Function):
    """Autograd wrapper: gradients are computed in the forward; the backward corrects their scale."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, hp, ignore_index, chunk_tokens, rows, grad_enabled):
        # needs_input_grad follows requires_grad even under torch.no_grad(); eval must do forward work only.
        needs = [grad_enabled and n for n in ctx.needs_input_grad[:3]]
        need = (needs[0], needs[1], bias is not None and needs[2])
        max_tokens, whole_batch_tokens = chunk_tokens
        loss, chosen_logps, rejected_logps, nll, row_means, grads, guess = linear_cpo_forward(
            hidden,
            weight,
            bias,
            labels,
            hp,
            ignore_index=ignore_index,
            max_tokens=max_tokens,
            whole_batch_tokens=whole_batch_tokens,
            rows=rows,
            need_grads=need,
        )
        # Kept on ctx, not save_for_backward: they are outputs of this op, corrected in place in the backward.
        ctx.grads = grads
        ctx.guess = guess
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(chosen_logps, rejected_logps, nll, row_means)
        return loss, chosen_logps, rejected_logps, nll, row_means

    @staticmethod
    def backward(ctx, grad_loss, _chosen, _rejected, _nll, _means):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("fused_linear_cpo_loss: backward ran twice through one forward; run the forward again.")
        ctx.grads = None  # frees the stored gradients as they are handed over
        ratio = grad_scale.correction(grad_loss, ctx.guess)
        dtypes = ctx.dtypes
        # None for labels, hp, ignore_index, chunk_tokens, rows, grad_enabled: not differentiable.
        return (
            grad_scale.apply(grads.hidden, ratio, dtypes[0]),
            grad_scale.apply(grads.weight, ratio, dtypes[1]),
            grad_scale.apply(grads.bias, ratio, dtypes[2]),
            None,
            None,
            None,
            None,
            None,
            None,
        )
