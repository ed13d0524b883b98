"""The fused linear-CPO op: a pair-aligned chunk loop that finishes loss and gradients in the forward.

Per chunk of whole pairs (DESIGN.md §4): logits GEMM → per-token log-sum-exp and target logit → the chunk's CPO
loss and per-token coefficients ``g_t = ∂L/∂log p_t`` → ``dlogits = g_t·(onehot − softmax)`` written over the
logits buffer → ``dX = dlogits·W``, ``dW += dlogitsᵀ·X``. Three GEMMs per token (``6NVH``), one ``[C, V]``
buffer. The gradients are computed for a power of two of the incoming gradient (``grad_scale.py``); the autograd
backward applies the rest, which is free when that power of two was the incoming gradient.

The ``logits/*`` metrics (the mean logit over every position, TRL's ``logits.mean()``) come from the same pass:
the log-sum-exp kernel also sums each labelled row, and the first chunk's GEMM carries 2B extra rows, each row's
sum of unlabelled hidden states, whose logits sum to that row's unlabelled logits (the product is linear).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from ..loss import CPOHyperparams
from . import gemm, grad_scale
from .plan import first_slice_bound, lay_out_labels, plan_tokens
from .sequence import (
    Grads,
    SequenceStats,
    finish_outputs,
    unlabelled_hidden_sums,
    unlabelled_logit_sums,
    warn_where_trl_gives_nan,
)


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
    grad_guess: grad_scale.GradScaleGuess | None = None,
):
    """Loss, sequence log-probs, NLL and (where ``need_grads``) the gradients of hidden, weight and bias.

    Args:
        rows: ``rows_torch`` or ``rows_triton``: the row passes (``token_logps_``, ``shifted_exp_``,
            ``softmax_grad_``, ``frozen_dx_``), the plan's label ops (``label_counts``, ``compact_labels``) and the
            per-sequence tail (``pair_tail_``, ``finish_``).
        need_grads: whether hidden, weight, bias need a gradient.
        grad_guess: the caller's guess of the incoming gradient, if it keeps one (``grad_scale.py``).

    Returns:
        ``(outputs, grads, folded)``: ``outputs`` as ``LinearCPOFunction`` returns them, the gradients computed for
        an incoming gradient of ``folded``, a power of two (``grad_scale.py``; ``None`` without gradients).
    """
    num_rows, seq_len, hidden_size = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    need_dx, need_dw, need_db = need_grads
    whole_batch_tokens = whole_batch_tokens if need_dw else None
    x_all = hidden.reshape(num_rows * seq_len, hidden_size)
    # Queued before the plan's host sync, so that after it the host launches the first GEMM at once (the GPU idles
    # from the sync to that launch): the label layout, and the first GEMM's rows, the 2B unlabelled-sum rows then
    # the first tokens, gathered for the largest first slice the plan can make.
    layout = lay_out_labels(labels, ignore_index=ignore_index, vocab_size=vocab, ops=rows)
    extras = num_rows
    first_rows = first_slice_bound(num_rows * seq_len, max_tokens, whole_batch_tokens)
    first_x = torch.empty(extras + first_rows, hidden_size, device=device, dtype=hidden.dtype)
    first_x[:extras] = unlabelled_hidden_sums(hidden.detach(), labels, ignore_index)
    torch.index_select(x_all.detach(), 0, layout.token_index[:first_rows], out=first_x[extras:])
    # The per-token buffers too, sized by the positions (the labelled count is known only after the sync), and the
    # per-row ones: ≈ 12 allocations that would otherwise stand between the sync and the first GEMM's launch.
    any_grad = need_dx or need_dw or need_db
    frozen = need_dx and not (need_dw or need_db)  # see the frozen branch below
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # per-token and per-row math
    token_buffers = torch.empty(4 if frozen else 2, num_rows * seq_len, device=device, dtype=acc_dtype)
    stats = SequenceStats.empty(num_rows, device, acc_dtype)
    row_coef = torch.empty(num_rows, device=device, dtype=acc_dtype) if any_grad else None  # ∂L/∂log p_t per row
    plan = plan_tokens(
        labels,
        ignore_index=ignore_index,
        vocab_size=vocab,
        max_tokens=max_tokens,
        whole_batch_tokens=whole_batch_tokens,
        ops=rows,
        layout=layout,
    )
    max_tokens = plan.max_tokens
    folded = grad_scale.fold(grad_guess, hidden.dtype, device, plan.num_tokens, acc_dtype) if any_grad else None
    token_logp = token_buffers[0, : plan.num_tokens]
    token_sum = token_buffers[1, : plan.num_tokens]  # each labelled row's logit sum
    unlabelled_sum = None
    # One GEMM over every token (a single chunk) rounds dW once, as torch does: write it in the weight dtype.
    # Several chunks accumulate in fp32, and the backward casts and scales in one pass (backward_scale_kernels).
    single_gemm = len(plan.groups) == 1 and len(plan.groups[0].slices(max_tokens)) == 1
    dx = dw = db = None  # allocated once the first GEMM is queued: until then the GPU waits on the host
    dw_written = False

    # A frozen head: dX = coef · (onehot − softmax)·W with one scalar coefficient per row, so each slice's logits
    # become unnormalised exponentials in one pass and go through the dX product at once, into fp32; the
    # coefficients and the normalisation are applied after (frozen_grad_kernels.py). The logits are computed once
    # whatever the budget, and a pair longer than it is cut freely. (dW and db sum over rows: they need the
    # coefficient first, and recompute a split pair instead.)
    if frozen:
        token_keep, token_inv = token_buffers[2, : plan.num_tokens], token_buffers[3, : plan.num_tokens]
    for group in plan.groups:
        slices = group.slices(max_tokens)
        kept = None  # the group's logits, kept for the gradient pass when the group is one slice
        span = slice(group.tok_start, group.tok_end)
        products = (
            torch.empty(group.tok_end - group.tok_start, hidden_size, device=device, dtype=acc_dtype)
            if frozen
            else None
        )
        lses = []
        for s, e in slices:
            if unlabelled_sum is None:  # the first GEMM, on the rows gathered before the sync
                if s != 0 or e > first_rows:
                    raise AssertionError(f"first slice [{s}, {e}) outside the {first_rows} rows gathered for it")
                logits = gemm.logits(first_x[: extras + e], weight, bias)
                unlabelled_sum = logits[:extras].sum(-1, dtype=acc_dtype)
                x, logits = first_x[extras : extras + e], logits[extras:]  # row suffixes: still contiguous
                first_x = None  # the other slices gather their own rows
            else:
                x = x_all.index_select(0, plan.token_index[s:e])
                logits = gemm.logits(x, weight, bias)
            if frozen:
                rows.shifted_exp_(
                    logits, plan.targets[s:e], token_logp[s:e], token_sum[s:e], token_keep[s:e], token_inv[s:e]
                )
                gemm.mm_into(products[s - group.tok_start : e - group.tok_start], logits, weight)
            else:
                lses.append(rows.token_logps_(logits, plan.targets[s:e], token_logp[s:e], token_sum[s:e]))
                if len(slices) == 1 and any_grad:
                    kept = (x, logits)
            del logits
        rows.pair_tail_(stats, plan, token_logp, token_sum, group, hp, row_coef, folded)
        if not any_grad:
            continue
        if dx is None and need_dx:
            dx = torch.zeros_like(x_all)
        if dw is None and need_dw:
            dw = torch.empty(weight.shape, device=device, dtype=weight.dtype if single_gemm else acc_dtype)
        if db is None and need_db:
            db = torch.zeros(vocab, device=device, dtype=acc_dtype)
        if frozen:
            rows.frozen_dx_(
                dx,
                plan.token_index[span],
                products,
                weight,
                plan.targets[span],
                row_coef,
                plan.token_row[span],
                token_keep[span],
                token_inv[span],
            )
            continue
        for (s, e), lse in zip(slices, lses, strict=True):
            idx = plan.token_index[s:e]
            if kept is not None:
                x, dlogits = kept
            else:  # a pair longer than the budget, with dW or db: recompute this slice's logits
                x = x_all.index_select(0, idx)
                dlogits = gemm.logits(x, weight, bias)
            rows.softmax_grad_(dlogits, lse, plan.targets[s:e], row_coef[plan.token_row[s:e]])
            if need_dx:
                dx.index_copy_(0, idx, torch.mm(dlogits, weight))
            if need_dw:
                gemm.accumulate_mm(dw, dlogits.t(), x, first=not dw_written)
                dw_written = True
            if need_db:
                db += dlogits.sum(0, dtype=acc_dtype)
            del x, dlogits

    warn_where_trl_gives_nan(plan.row_counts_host, hp)
    if unlabelled_sum is None:  # no labelled token at all: no chunk GEMM carried the extra rows
        unlabelled_hidden = unlabelled_hidden_sums(hidden.detach(), labels, ignore_index)
        unlabelled_sum = unlabelled_logit_sums(unlabelled_hidden, weight, bias, acc_dtype)
    outputs = finish_outputs(rows, stats, plan, hp, unlabelled_sum, bias, seq_len, vocab)
    grads = Grads(
        hidden=None if dx is None else dx.view_as(hidden),
        weight=None if dw is None else (dw if dw_written else torch.zeros_like(weight)),
        bias=db,
    )
    return outputs, grads, folded


@dataclass(frozen=True)
class Chunks:
    """The default schedule: pair-aligned token chunks of at most ``max_tokens`` (``whole_batch_tokens``: one GEMM)."""

    max_tokens: int
    whole_batch_tokens: int | None


@dataclass(frozen=True)
class Slabs:
    """The memory-lean schedule (``lean.py``): every token, vocabulary slabs of at most ``slab_bytes`` of logits."""

    slab_bytes: int


class LinearCPOFunction(torch.autograd.Function):
    """Autograd wrapper: gradients are computed in the forward; the backward corrects their scale."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, hp, ignore_index, schedule, rows, grad_enabled, grad_guess):
        # needs_input_grad follows requires_grad even under torch.no_grad(); eval must do forward work only.
        needs = [grad_enabled and n for n in ctx.needs_input_grad[:3]]
        need = (needs[0], needs[1], bias is not None and needs[2])
        common = dict(ignore_index=ignore_index, rows=rows, need_grads=need, grad_guess=grad_guess)
        if isinstance(schedule, Slabs):
            from .lean import linear_cpo_forward_lean

            results = linear_cpo_forward_lean(
                hidden, weight, bias, labels, hp, slab_bytes=schedule.slab_bytes, **common
            )
        else:
            results = linear_cpo_forward(
                hidden,
                weight,
                bias,
                labels,
                hp,
                max_tokens=schedule.max_tokens,
                whole_batch_tokens=schedule.whole_batch_tokens,
                **common,
            )
        outputs, grads, folded = results
        # Kept on ctx, not save_for_backward: they are outputs of this op, corrected in place in the backward.
        ctx.grads = grads
        ctx.folded = folded
        ctx.grad_guess = grad_guess
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_metrics):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fused_linear_cpo_loss cannot be differentiated twice (backward with create_graph=True: a "
                "Hessian-vector product, a gradient penalty): its gradients are computed in the forward, so their "
                "second-order part would be silently missing. Use the reference "
                "(trl_fused_cpo.ops.reference.reference_linear_cpo_loss) for second-order work."
            )
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("fused_linear_cpo_loss: backward ran twice through one forward; run the forward again.")
        ctx.grads = None  # frees the stored gradients as they are handed over
        ratio = grad_scale.correction(grad_loss, ctx.folded, ctx.grad_guess)
        dtypes = ctx.dtypes
        # None for labels, hp, ignore_index, schedule, rows, grad_enabled, grad_guess: not differentiable.
        return (
            grad_scale.apply(grads.hidden, ratio, dtypes[0]),
            grad_scale.apply(grads.weight, ratio, dtypes[1]),
            grad_scale.apply(grads.bias, ratio, dtypes[2]),
            *(None,) * 7,
        )
