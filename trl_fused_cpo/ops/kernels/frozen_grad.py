"""Triton kernels of a frozen head's gradient: one pass over the logits instead of two.

With no weight gradient, ``dX = coef · (onehot − softmax)·W`` and the coefficient is one scalar per row, so the
softmax need not be normalised before the product. ``shifted_exp_`` overwrites each row's logits with
``E = exp(z − c)`` (the target's column set to 0) for a shift ``c`` known before the pass, the row's target logit,
while it sums ``S = Σ E`` and ``S' = Σ_{v≠target} E``: one read and one write, where log-sum-exp then
softmax-gradient read twice and wrote once. After the GEMM ``G = E·W`` (fp32), ``frozen_dx_`` writes
``dX = coef · (S'/S · W[target] − G/S)``: the target term ``1 − p`` comes as ``S'/S``, a sum of the other terms,
so it does not cancel when ``p → 1``.

The target logit as the shift (bf16 and fp32, whose range is fp32's; fp16 shifts by the log-sum-exp): every term
near the row's max has ``z − c ≥ 0`` (no underflow), and ``exp(z − c)`` overflows only where
``log p(target) < −64``; a segment that meets such a block rescales what it wrote (a rare second pass over that
segment) and the combine kernel brings the row's segments to one shift.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_row_pass_args
from .logsumexp import SEGMENT_COLS, logsumexp_target

SHIFT_LIMIT = 64.0  # exp(64) ≈ 6e27: Σ over 128k columns stays far from fp32's 3e38
# One warp per program, 512 columns a load, the next block's load issued before this one's guard: 0.160 ms for
# 1,024 rows of Llama-3 bf16 logits (3.29 TB/s) where 2,048 columns × 4 warps without it took 0.215 ms (2.44 TB/s)
# (scripts/sweep_shifted_exp.py at 5712b4b; docs/kernel-notes.md, v11).
EXP_BLOCK, EXP_WARPS = 512, 1


@triton.jit
def _shifted_exp_kernel(
    logits_ptr,
    targets_ptr,
    shift_ptr,
    part_ptr,
    rows,
    V,
    stride_row,
    LIMIT: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
    SHIFT_IS_TARGET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    start = seg * SEGMENT
    offsets = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row)
    if SHIFT_IS_TARGET:  # the raw target logit: that column keeps it (rewritten bit for bit) until the combine
        c = tl.load(row_ptr + target).to(tl.float32)
    else:
        c = tl.load(shift_ptr + row)
    s = 0.0
    s_other = 0.0
    total = 0.0
    # The next block's load is issued by hand before the guard, whose rare rescale stores into this row's earlier
    # blocks: one load is always in flight. The compiler did not do it itself (0.215 -> 0.172 ms at 2,048 x 4).
    x_next = tl.load(row_ptr + start + offsets, mask=start + offsets < V, other=float("-inf"))
    for off in tl.range(0, SEGMENT, BLOCK):
        cols = start + off + offsets
        x = x_next.to(tl.float32)
        next_cols = cols + BLOCK
        x_next = tl.load(row_ptr + next_cols, mask=(next_cols < V) & (off + BLOCK < SEGMENT), other=float("-inf"))
        block_max = tl.max(x, axis=0)
        if block_max > c + LIMIT:  # rare: rescale this segment's earlier blocks to the new shift
            factor = tl.exp(c - block_max)
            for prev in tl.range(0, off, BLOCK):
                pcols = start + prev + offsets
                e = tl.load(row_ptr + pcols, mask=pcols < V, other=0.0).to(tl.float32)
                e = tl.where(pcols == target, e, e * factor)  # the target column holds the raw logit: keep it
                tl.store(row_ptr + pcols, e.to(logits_ptr.dtype.element_ty), mask=pcols < V)
            s *= factor
            s_other *= factor
            c = block_max
        e = tl.exp(x - c)
        is_target = cols == target
        s += tl.sum(e, axis=0)
        s_other += tl.sum(tl.where(is_target, 0.0, e), axis=0)
        total += tl.sum(tl.where(cols < V, x, 0.0), axis=0)
        # The target column gets its raw logit back, the same bits (the other programs of this row read it as their
        # shift). A per-element store mask (cols != target) instead splits the vector stores: at 8efdfae it made
        # the frozen op 4-6% slower.
        tl.store(row_ptr + cols, tl.where(is_target, x, e).to(logits_ptr.dtype.element_ty), mask=cols < V)
    part = seg.to(tl.int64) * rows + row
    plane = tl.num_programs(1) * rows
    tl.store(part_ptr + part, c)
    tl.store(part_ptr + plane + part, s)
    tl.store(part_ptr + 2 * plane + part, s_other)
    tl.store(part_ptr + 3 * plane + part, total)


@triton.jit
def _shifted_exp_combine_kernel(
    logits_ptr,
    targets_ptr,
    part_ptr,
    target_logit_ptr,
    logp_ptr,
    row_sum_ptr,
    keep_ptr,
    inv_ptr,
    rows,
    segments,
    V,
    stride_row,
    SEGMENT: tl.constexpr,
    SEGMENTS: tl.constexpr,
    BLOCK: tl.constexpr,
    SHIFT_IS_TARGET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row)
    if SHIFT_IS_TARGET:  # still raw in the row: read it before the rescale below and the zeroing at the end
        target_logit = tl.load(row_ptr + target).to(tl.float32)
    else:
        target_logit = tl.load(target_logit_ptr + row)
    g = tl.arange(0, SEGMENTS)
    in_seg = g < segments
    offs = g.to(tl.int64) * rows + row
    plane = segments * rows
    shift = tl.load(part_ptr + offs, mask=in_seg, other=float("-inf"))
    c = tl.max(shift, axis=0)
    scale = tl.where(in_seg, tl.exp(shift - c), 0.0)
    s = tl.sum(tl.load(part_ptr + plane + offs, mask=in_seg, other=0.0) * scale, axis=0)
    s_other = tl.sum(tl.load(part_ptr + 2 * plane + offs, mask=in_seg, other=0.0) * scale, axis=0)
    total = tl.sum(tl.load(part_ptr + 3 * plane + offs, mask=in_seg, other=0.0), axis=0)
    if tl.min(tl.where(in_seg, shift, c), axis=0) != c:  # rare: segments on different shifts, bring them to c
        offsets = tl.arange(0, BLOCK)
        for k in range(segments):
            seg_shift = tl.load(part_ptr + k * rows + row)
            if seg_shift != c:
                factor = tl.exp(seg_shift - c)
                for off in tl.range(0, SEGMENT, BLOCK):
                    cols = k * SEGMENT + off + offsets
                    e = tl.load(row_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
                    tl.store(row_ptr + cols, (e * factor).to(logits_ptr.dtype.element_ty), mask=cols < V)
    tl.store(row_ptr + target, 0.0)  # E's target column is 0
    tl.store(logp_ptr + row, (target_logit - (c + tl.log(s))).to(logp_ptr.dtype.element_ty))
    tl.store(row_sum_ptr + row, total.to(row_sum_ptr.dtype.element_ty))
    tl.store(keep_ptr + row, (s_other / s).to(keep_ptr.dtype.element_ty))
    tl.store(inv_ptr + row, (1.0 / s).to(inv_ptr.dtype.element_ty))


def shifted_exp_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    token_logp: torch.Tensor,
    row_sum: torch.Tensor,
    keep: torch.Tensor,
    inv: torch.Tensor,
) -> None:
    """In place: ``logits`` ``[C, V]`` becomes ``E = exp(z − c)`` with each row's target column 0.

    Writes, into the caller's ``[C]`` buffers: ``token_logp`` (target − log-sum-exp), ``row_sum``,
    ``keep = 1 − p(target)`` and ``inv = 1/Σ exp(z − c)``, so that ``E · inv`` is the softmax without the target
    column.
    """
    rows, vocab = check_row_pass_args(
        logits, targets=targets, token_logp=token_logp, row_sum=row_sum, keep=keep, inv=inv
    )
    if not rows:
        return
    # bf16 and fp32 have fp32's range: the target logit is a shift known without a pass, read in the kernel. fp16
    # tops out at exp(11): shift by the log-sum-exp (a read more, as the two-pass path) so that E ≤ 1.
    from_target = logits.dtype != torch.float16
    shift = target_logit = row_sum  # placeholders, unread when the shift is the target logit
    if not from_target:
        shift, target_logit, _ = logsumexp_target(logits, targets)
    segments = triton.cdiv(vocab, SEGMENT_COLS)
    part = torch.empty(4, segments, rows, device=logits.device, dtype=torch.float32)
    block = min(EXP_BLOCK, SEGMENT_COLS)
    _shifted_exp_kernel[(rows, segments)](
        logits, targets, shift, part, rows, vocab, logits.stride(0),
        LIMIT=SHIFT_LIMIT, SEGMENT=SEGMENT_COLS, BLOCK=block, SHIFT_IS_TARGET=from_target, num_warps=EXP_WARPS,
    )  # fmt: skip
    _shifted_exp_combine_kernel[(rows,)](
        logits, targets, part, target_logit, token_logp, row_sum, keep, inv, rows, segments, vocab,
        logits.stride(0), SEGMENT=SEGMENT_COLS, SEGMENTS=triton.next_power_of_2(segments), BLOCK=block,
        SHIFT_IS_TARGET=from_target, num_warps=1,
    )  # fmt: skip


@triton.jit
def _frozen_dx_kernel(
    dx_ptr,
    token_index_ptr,
    g_ptr,
    w_ptr,
    targets_ptr,
    row_coef_ptr,
    token_row_ptr,
    keep_ptr,
    inv_ptr,
    H,
    BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    coef = tl.load(row_coef_ptr + tl.load(token_row_ptr + i)).to(tl.float32)
    target = tl.load(targets_ptr + i)
    w = tl.load(w_ptr + target * H + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + i * H + cols, mask=mask, other=0.0)
    dx = coef * (tl.load(keep_ptr + i) * w - tl.load(inv_ptr + i) * g)
    dst = dx_ptr + tl.load(token_index_ptr + i) * H + cols
    tl.store(dst, dx.to(dx_ptr.dtype.element_ty), mask=mask)


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
    """``dx[token_index] = coef · (keep · W[target] − inv · G)``, ``coef = row_coef[token_row]``, per token."""
    if not (dx.is_contiguous() and g.is_contiguous() and weight.is_contiguous() and row_coef.is_contiguous()):
        raise ValueError("frozen_dx_ needs contiguous dx, G, weight and row_coef")
    # The per-token tensors are indexed as ptr + token, like a row pass's per-row ones: the same check.
    tokens, hidden = check_row_pass_args(
        g, token_index=token_index, targets=targets, token_row=token_row, keep=keep, inv=inv
    )
    if tokens:
        block = 1024
        _frozen_dx_kernel[(tokens, triton.cdiv(hidden, block))](
            dx, token_index, g, weight, targets, row_coef, token_row, keep, inv, hidden, BLOCK_H=block, num_warps=4
        )
