"""The memory-lean schedule: the vocabulary in slabs, logits computed twice, no fp32 weight-gradient accumulator.

The default schedule (``chunks.py``) keeps each chunk's logits for its gradients (6NVH) but, once a batch needs
several chunks, sums dW over them in an fp32 accumulator: 2 GiB at Llama-3 8B, 4 GiB at 70B. Here every GEMM
takes all labelled tokens and one slab of the vocabulary. Pass 1 computes each slab's logits for the log-sum-exp.
Pass 2 recomputes them for the gradients, and each slab's rows of dW come from one GEMM over all tokens, written
in the weight dtype at once (one rounding, as torch). dX sums over the slabs in fp32 (``[N, H]``: 0.25 GiB at
16k tokens of H = 4096). Cost: 8NVH, about 4/3 of the default's products. A frozen head has no accumulator to
save, so ``schedule.py`` keeps the default schedule for it.
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import gemm, grad_scale
from .cpo_math import CPOHyperparams
from .plan import plan_tokens
from .rows import PackedRows, PaddedRows
from .schedule import NeedGrads, Slabs
from .sequence import Grads, SequenceStats, finish_outputs, warn_where_trl_gives_nan

SLAB_ALIGN = 128  # vocabulary columns per slab: a multiple of the GEMM tile


def slab_bounds(vocab: int, rows: int, itemsize: int, slab_bytes: int) -> list[tuple[int, int]]:
    """Vocabulary slabs ``[start, end)`` whose ``[rows, end - start]`` logits fit ``slab_bytes``."""
    width = max(SLAB_ALIGN, slab_bytes // max(1, rows * itemsize) // SLAB_ALIGN * SLAB_ALIGN)
    return [(s, min(s + width, vocab)) for s in range(0, vocab, width)]


def slab_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: PaddedRows | PackedRows,
    hp: CPOHyperparams,
    schedule: Slabs,
    *,
    backend: ModuleType,
    need: NeedGrads,
    grad_guess: grad_scale.GradScaleGuess | None = None,
):
    """``chunks.chunked_forward``'s contract (same arguments but the schedule, same returns), in slabs."""
    num_rows, num_positions, hidden_size = rows.num_rows, rows.num_positions, hidden.shape[-1]
    vocab = weight.shape[0]
    device = hidden.device
    acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    x_all = hidden.reshape(num_positions, hidden_size)
    unlabelled_hidden = rows.unlabelled_hidden_sums(x_all.detach())
    plan = plan_tokens(
        rows.labels,
        ignore_index=rows.ignore_index,
        vocab_size=vocab,
        max_tokens=schedule.chunk_tokens,
        backend=backend,
        layout=rows.lay_out(vocab, backend),
    )
    n = plan.num_tokens
    # The labelled tokens, then the 2B unlabelled-sum rows (their logits sum to the unlabelled logits: metrics).
    x = torch.cat([x_all.index_select(0, plan.token_index), unlabelled_hidden])
    slabs = slab_bounds(vocab, x.shape[0], weight.element_size(), schedule.slab_bytes)

    def slab_logits(rows_of_x: torch.Tensor, s: int, e: int) -> torch.Tensor:
        return gemm.logits(rows_of_x, weight[s:e], None if bias is None else bias[s:e])

    lse, token_logp, token_sum, unlabelled_sum = _log_prob_pass(x, plan, slabs, slab_logits, backend, acc_dtype)
    warn_where_trl_gives_nan(plan.row_counts_host, hp)
    (everything,) = plan.groups  # one group: the budget is every position
    stats = SequenceStats.empty(num_rows, device, acc_dtype)

    grads, folded = Grads(None, None, None), None
    if not need.any:
        backend.pair_tail_(stats, plan, token_logp, token_sum, everything, hp)
    else:
        folded = grad_scale.fold(grad_guess, hidden.dtype, device, n, acc_dtype)
        row_coef = torch.empty(num_rows, device=device, dtype=acc_dtype)
        backend.pair_tail_(stats, plan, token_logp, token_sum, everything, hp, row_coef, folded)
        grads = _slab_gradients(x[:n], weight, plan, slabs, slab_logits, lse, row_coef[plan.token_row], backend, need)
        if grads.hidden is not None:
            dx = torch.zeros_like(x_all)
            dx.index_copy_(0, plan.token_index, grads.hidden.to(hidden.dtype))
            grads.hidden = dx.view_as(hidden)
    outputs = finish_outputs(backend, stats, plan, hp, unlabelled_sum, bias, rows.row_positions, vocab)
    return outputs, grads, folded


def _log_prob_pass(x, plan, slabs, slab_logits, backend, acc_dtype):
    """Pass 1: log-sum-exp over the slabs, the target logit from the slab that holds it, the row sums; the extra
    rows after the ``N`` labelled ones give the unlabelled logit sums."""
    n = plan.num_tokens
    lse = target_logit = None
    token_sum = torch.zeros(n, device=x.device, dtype=acc_dtype)
    unlabelled_sum = torch.zeros(x.shape[0] - n, device=x.device, dtype=acc_dtype)
    for s, e in slabs:
        logits = slab_logits(x, s, e)
        local = plan.targets - s
        in_slab = (local >= 0) & (local < e - s)
        slab_lse, slab_target, slab_sum = backend.logsumexp_target(logits[:n], local.clamp(0, e - s - 1))
        lse = slab_lse if lse is None else torch.logaddexp(lse, slab_lse)
        target_logit = torch.where(in_slab, slab_target, 0.0 if target_logit is None else target_logit)
        token_sum += slab_sum
        unlabelled_sum += logits[n:].sum(-1, dtype=acc_dtype)
        del logits
    return lse, (target_logit - lse).to(acc_dtype), token_sum, unlabelled_sum


def _slab_gradients(x, weight, plan, slabs, slab_logits, lse, coef, backend, need: NeedGrads) -> Grads:
    """Pass 2: per slab, recompute the logits, turn them into dlogits, and take their share of dX, dW and db."""
    need_dx, need_dw, need_db = need.hidden, need.weight, need.bias
    acc_dtype = coef.dtype
    dx = torch.empty(x.shape, device=x.device, dtype=acc_dtype) if need_dx else None  # fp32: summed over slabs
    dw = torch.empty_like(weight) if need_dw else None  # each slab's rows written once, in the weight dtype
    db = torch.empty(weight.shape[0], device=x.device, dtype=acc_dtype) if need_db else None
    for j, (s, e) in enumerate(slabs):
        dlogits = slab_logits(x, s, e)
        backend.softmax_grad_(dlogits, lse, plan.targets - s, coef)  # a target outside the slab matches no column
        if need_dx:
            gemm.accumulate_mm(dx, dlogits, weight[s:e], first=j == 0)
        if need_dw:
            gemm.accumulate_mm(dw[s:e], dlogits.t(), x, first=True)
        if need_db:
            db[s:e] = dlogits.sum(0, dtype=acc_dtype)
        del dlogits
    return Grads(hidden=dx, weight=dw, bias=db)
