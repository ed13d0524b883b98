"""The default schedule (``Chunks``): a pair-aligned chunk loop that finishes loss and gradients in the forward.

Per chunk of whole pairs (docs/design.md §4): logits GEMM → per-token log-sum-exp and target logit → the chunk's CPO
loss and per-token coefficients ``g_t = ∂L/∂log p_t`` → ``dlogits = g_t·(onehot − softmax)`` written over the
logits buffer → ``dX = dlogits·W``, ``dW += dlogitsᵀ·X``. Three GEMMs per token (``6NVH``), one ``[C, V]``
buffer. The gradients are computed for a power of two of the incoming gradient (``grad_scale.py``); the autograd
backward applies the rest, which is free when that power of two was the incoming gradient.

The ``logits/*`` metrics (the mean logit over every position, TRL's ``logits.mean()``) come from the same pass:
the log-sum-exp kernel also sums each labelled row, and the first chunk's GEMM carries 2B extra rows, each row's
sum of unlabelled hidden states, whose logits sum to that row's unlabelled logits (the product is linear).
"""

from __future__ import annotations

from types import ModuleType

import torch

from . import gemm, grad_scale
from .cpo_math import CPOHyperparams
from .plan import ChunkGroup, plan_tokens
from .rows import PackedRows, PaddedRows
from .schedule import Chunks, NeedGrads
from .sequence import Grads, SequenceStats, finish_outputs, unlabelled_logit_sums, warn_where_trl_gives_nan


def chunked_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    rows: PaddedRows | PackedRows,
    hp: CPOHyperparams,
    schedule: Chunks,
    *,
    backend: ModuleType,
    need: NeedGrads,
    grad_guess: grad_scale.GradScaleGuess | None = None,
):
    """Loss, sequence log-probs, NLL and (where ``need``) the gradients of hidden, weight and bias.

    Args:
        hidden, weight, bias, hp: as ``fused_linear_cpo_loss`` takes them (``hp`` normalised).
        rows: where TRL's 2B rows are among the positions of ``hidden``, with their labels (``rows.py``).
        schedule: the token budget (``schedule.py``).
        backend: ``torch_backend`` or ``kernels`` (``backend.py``).
        need: which gradients to compute.
        grad_guess: the caller's guess of the incoming gradient, if it keeps one (``grad_scale.py``).

    Returns:
        ``(outputs, grads, fold)``: ``outputs`` as ``LinearCPOFunction`` returns them, the gradients computed for
        an incoming gradient of ``fold``, a power of two (``grad_scale.py``; ``None`` without gradients).
    """
    run = _ChunkedPass(hidden, weight, bias, rows, hp, schedule, backend, need, grad_guess)
    run.plan_tokens()
    for group in run.plan.groups:
        if need.frozen_head:
            run.frozen_group(group)
        else:
            run.trainable_group(group)
    return run.finish()


class _FirstSlice:
    """The first GEMM's rows, gathered before the plan's sync (its size is not known yet): the 2B unlabelled-sum rows
    (each row's sum of unlabelled hidden states, whose logits sum to that row's unlabelled logits: the ``logits/*``
    metrics), then the first ``bound`` tokens, the largest first slice the schedule allows. Used once: by the first
    slice, or, in a batch without a labelled token, for the unlabelled sums alone."""

    def __init__(self, rows: PaddedRows | PackedRows, x_all: torch.Tensor, token_index: torch.Tensor, bound: int):
        self.extras, self.bound = rows.num_rows, bound
        x_all = x_all.detach()
        self.x = torch.empty(self.extras + bound, x_all.shape[-1], device=x_all.device, dtype=x_all.dtype)
        self.x[: self.extras] = rows.unlabelled_hidden_sums(x_all)
        torch.index_select(x_all, 0, token_index[:bound], out=self.x[self.extras :])

    def logits(self, e: int, weight, bias, acc_dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x, logits, unlabelled_sum)`` of tokens ``[0, e)``, one GEMM that also carries the extra rows."""
        if e > self.bound:
            raise AssertionError(f"first slice [0, {e}) outside the {self.bound} rows gathered for it")
        logits = gemm.logits(self.x[: self.extras + e], weight, bias)
        unlabelled_sum = logits[: self.extras].sum(-1, dtype=acc_dtype)
        return self.x[self.extras : self.extras + e], logits[self.extras :], unlabelled_sum  # row suffixes: contiguous

    def unlabelled_sums(self, weight, bias, acc_dtype) -> torch.Tensor:
        """The extra rows' logit sums alone, for a batch whose GEMMs did not carry them (no labelled token)."""
        return unlabelled_logit_sums(self.x[: self.extras], weight, bias, acc_dtype)


class _ChunkedPass:
    """One call's state, shared by its steps: queue the first GEMM's inputs, plan (the one host sync), then each
    group of pairs (frozen or trainable), then the outputs."""

    def __init__(self, hidden, weight, bias, rows, hp, schedule, backend, need, grad_guess):
        self.hidden, self.weight, self.bias, self.rows, self.hp = hidden, weight, bias, rows, hp
        self.backend, self.need, self.grad_guess, self.schedule = backend, need, grad_guess, schedule
        num_rows, num_positions, hidden_size = rows.num_rows, rows.num_positions, hidden.shape[-1]
        device = hidden.device
        self.x_all = hidden.reshape(num_positions, hidden_size)
        # Queued before the plan's host sync, so that after it the host launches the first GEMM at once (the GPU
        # idles from the sync to that launch): the label layout, and the first GEMM's rows.
        self.layout = rows.lay_out(weight.shape[0], backend)
        self.first_slice = _FirstSlice(
            rows, self.x_all, self.layout.token_index, schedule.first_slice_bound(num_positions)
        )
        # The per-token buffers too, sized by the positions (the labelled count is known only after the sync), and
        # the per-row ones: ≈ 12 allocations that would otherwise stand between the sync and the first GEMM's launch.
        self.acc_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # per-token/row math
        buffers = 4 if need.frozen_head else 2
        self.token_buffers = torch.empty(buffers, num_positions, device=device, dtype=self.acc_dtype)
        self.stats = SequenceStats.empty(num_rows, device, self.acc_dtype)
        # ∂L/∂log p_t per row
        self.row_coef = torch.empty(num_rows, device=device, dtype=self.acc_dtype) if need.any else None
        self.fold = None  # made once the first group needs it: no launch between the sync and the first GEMM
        self.unlabelled_sum = None  # from the first GEMM's extra rows, when _FirstSlice is consumed
        self.dx = self.dw = self.db = None  # allocated once the first GEMM is queued: until then the GPU waits
        self.dw_written = False

    def plan_tokens(self) -> None:
        """The plan (the one host sync) and the per-token views it sizes."""
        self.plan = plan = plan_tokens(
            self.rows.labels,
            ignore_index=self.rows.ignore_index,
            vocab_size=self.weight.shape[0],
            max_tokens=self.schedule.chunk_tokens,
            backend=self.backend,
            layout=self.layout,
        )
        n = plan.num_tokens
        self.token_logp, self.token_sum = self.token_buffers[0, :n], self.token_buffers[1, :n]  # sum: logits per row
        if self.need.frozen_head:
            self.token_keep, self.token_inv = self.token_buffers[2, :n], self.token_buffers[3, :n]
        # One GEMM over every token (a single chunk) rounds dW once, as torch does: write it in the weight dtype.
        # Several chunks accumulate in fp32, and the backward casts and scales in one pass (kernels/backward_scale).
        self.single_gemm = plan.one_gemm

    def slice_logits(self, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, logits)`` of tokens ``[s, e)``: the first slice on the rows gathered before the sync (``_FirstSlice``,
        consumed here), later ones on rows gathered now."""
        if self.first_slice is None:
            x = self.x_all.index_select(0, self.plan.token_index[s:e])
            return x, gemm.logits(x, self.weight, self.bias)
        if s != 0:
            raise AssertionError(f"slice [{s}, {e}) came first; the plan's slices start at token 0")
        first, self.first_slice = self.first_slice, None  # the other slices gather their own rows
        x, logits, self.unlabelled_sum = first.logits(e, self.weight, self.bias, self.acc_dtype)
        return x, logits

    def pair_tail(self, group: ChunkGroup) -> None:
        """The group's sequence log-probs, losses and (with gradients) per-row coefficients."""
        if self.need.any and self.fold is None:
            acc = self.acc_dtype
            self.fold = grad_scale.fold(
                self.grad_guess, self.hidden.dtype, self.hidden.device, self.plan.num_tokens, acc
            )
        args = (self.stats, self.plan, self.token_logp, self.token_sum, group, self.hp)
        self.backend.pair_tail_(*args, self.row_coef, self.fold)

    def frozen_group(self, group: ChunkGroup) -> None:
        """A frozen head: dX = coef · (onehot − softmax)·W with one scalar coefficient per row, so each slice's logits
        become unnormalised exponentials in one pass and go through the dX product at once, into fp32; the
        coefficients and the normalisation are applied after (``kernels/frozen_grad.py``). The logits are computed
        once whatever the budget, and a pair longer than it is cut freely."""
        span = slice(group.tok_start, group.tok_end)
        products = torch.empty(
            group.tok_end - group.tok_start, self.weight.shape[1], device=self.hidden.device, dtype=self.acc_dtype
        )
        for s, e in group.slices(self.plan.max_tokens):
            _, logits = self.slice_logits(s, e)
            self.backend.shifted_exp_(
                logits,
                self.plan.targets[s:e],
                self.token_logp[s:e],
                self.token_sum[s:e],
                self.token_keep[s:e],
                self.token_inv[s:e],
            )
            gemm.mm_into(products[s - group.tok_start : e - group.tok_start], logits, self.weight)
            del logits
        self.pair_tail(group)
        if self.dx is None:
            self.dx = torch.zeros_like(self.x_all)
        plan = self.plan
        self.backend.frozen_dx_(
            self.dx,
            plan.token_index[span],
            products,
            self.weight,
            plan.targets[span],
            self.row_coef,
            plan.token_row[span],
            self.token_keep[span],
            self.token_inv[span],
        )

    def trainable_group(self, group: ChunkGroup) -> None:
        """A trainable head (or no gradient at all): log-probs per slice, then per slice ``dlogits`` over the logits
        buffer and its share of dX, dW and db. dW and db sum over rows, so they need the coefficients first: a pair
        longer than the budget has its logits computed twice."""
        slices = group.slices(self.plan.max_tokens)
        kept = None  # the group's logits, kept for the gradient pass when the group is one slice
        lses = []
        for s, e in slices:
            x, logits = self.slice_logits(s, e)
            lses.append(
                self.backend.token_logps_(logits, self.plan.targets[s:e], self.token_logp[s:e], self.token_sum[s:e])
            )
            if len(slices) == 1 and self.need.any:
                kept = (x, logits)
            del logits
        self.pair_tail(group)
        if not self.need.any:
            return
        self._allocate_gradients()
        for (s, e), lse in zip(slices, lses, strict=True):
            idx = self.plan.token_index[s:e]
            if kept is not None:
                x, dlogits = kept
            else:  # a pair longer than the budget: recompute this slice's logits
                x = self.x_all.index_select(0, idx)
                dlogits = gemm.logits(x, self.weight, self.bias)
            coef = self.row_coef[self.plan.token_row[s:e]]
            self.backend.softmax_grad_(dlogits, lse, self.plan.targets[s:e], coef)
            if self.need.hidden:
                self.dx.index_copy_(0, idx, torch.mm(dlogits, self.weight))
            if self.need.weight:
                gemm.accumulate_mm(self.dw, dlogits.t(), x, first=not self.dw_written)
                self.dw_written = True
            if self.need.bias:
                self.db += dlogits.sum(0, dtype=self.acc_dtype)
            del x, dlogits

    def _allocate_gradients(self) -> None:
        weight, device = self.weight, self.hidden.device
        if self.dx is None and self.need.hidden:
            self.dx = torch.zeros_like(self.x_all)
        if self.dw is None and self.need.weight:
            self.dw = torch.empty(
                weight.shape, device=device, dtype=weight.dtype if self.single_gemm else self.acc_dtype
            )
        if self.db is None and self.need.bias:
            self.db = torch.zeros(weight.shape[0], device=device, dtype=self.acc_dtype)

    def finish(self):
        """``(outputs, grads, fold)`` once every group is done."""
        plan, weight, bias = self.plan, self.weight, self.bias
        warn_where_trl_gives_nan(plan.row_counts_host, self.hp)
        if self.first_slice is not None:  # no labelled token at all: no chunk GEMM carried the extra rows
            first, self.first_slice = self.first_slice, None
            self.unlabelled_sum = first.unlabelled_sums(weight, bias, self.acc_dtype)
        outputs = finish_outputs(
            self.backend, self.stats, plan, self.hp, self.unlabelled_sum, bias, self.rows.row_positions, weight.shape[0]
        )
        grads = Grads(
            hidden=None if self.dx is None else self.dx.view_as(self.hidden),
            weight=None if self.dw is None else (self.dw if self.dw_written else torch.zeros_like(weight)),
            bias=self.db,
        )
        return outputs, grads, self.fold
