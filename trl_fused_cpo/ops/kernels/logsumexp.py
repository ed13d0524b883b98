"""Triton kernels: per-row log-sum-exp, target logit and sum of a ``[C, V]`` logits chunk, in one read of it.

The grid is rows × vocabulary segments: each program streams ``SEGMENT_COLS`` columns of one row into a partial
(max, ``Σ exp(z − max)``, sum), and a small kernel folds each row's partials. One program per whole row (256 KB
at Llama-3) left too few bytes in flight per SM and a partly filled last wave at ~2,000 rows (0.35 ms for 1 GiB:
3.0 TB/s). The sum is for the ``logits/*`` metrics: it rides on the pass that reads every logit anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_row_pass_args

SEGMENT_COLS, BLOCK_V, NUM_WARPS = 8192, 2048, 4  # 16 segments of a Llama-3 row; 2048 bf16 = 4 KB a load
COMBINE_ROWS = 128


@triton.jit
def _segment_stats_kernel(
    logits_ptr,
    targets_ptr,
    part_ptr,
    target_logit_ptr,
    rows,
    V,
    stride_row,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride overflows int32 past 16k rows of V = 128k
    seg = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    start = seg * SEGMENT
    offsets = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    total = 0.0
    for off in tl.range(0, SEGMENT, BLOCK):
        cols = start + off + offsets
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # A block wholly past V (the last segment's tail) leaves m = -inf only if it came first: never, since
        # every segment starts inside the row.
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        total += tl.sum(tl.where(cols < V, x, 0.0), axis=0)
        m = m_new
    part = seg.to(tl.int64) * rows + row
    segments = tl.num_programs(1)
    tl.store(part_ptr + part, m)
    tl.store(part_ptr + segments * rows + part, s)
    tl.store(part_ptr + 2 * segments * rows + part, total)
    target = tl.load(targets_ptr + row)
    if (target >= start) & (target < start + SEGMENT):
        tl.store(target_logit_ptr + row, tl.load(row_ptr + target).to(tl.float32))


@triton.jit
def _combine_kernel(
    part_ptr,
    lse_ptr,
    row_sum_ptr,
    target_logit_ptr,
    logp_ptr,
    rows,
    segments,
    ROWS: tl.constexpr,
    SEGMENTS: tl.constexpr,
    WRITE_LOGP: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.arange(0, SEGMENTS)
    offs = g.to(tl.int64)[:, None] * rows + r[None, :]
    mask = (g < segments)[:, None] & (r < rows)[None, :]
    pm = tl.load(part_ptr + offs, mask=mask, other=float("-inf"))
    ps = tl.load(part_ptr + segments * rows + offs, mask=mask, other=0.0)
    pt = tl.load(part_ptr + 2 * segments * rows + offs, mask=mask, other=0.0)
    m = tl.max(pm, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # rows past the end: keep the arithmetic finite
    s = tl.sum(ps * tl.exp(pm - m_safe[None, :]), axis=0)
    lse = m_safe + tl.log(s)
    tl.store(lse_ptr + r, lse, mask=r < rows)
    tl.store(row_sum_ptr + r, tl.sum(pt, axis=0).to(row_sum_ptr.dtype.element_ty), mask=r < rows)
    if WRITE_LOGP:  # the token log-prob, straight into the caller's buffer
        logp = tl.load(target_logit_ptr + r, mask=r < rows, other=0.0) - lse
        tl.store(logp_ptr + r, logp.to(logp_ptr.dtype.element_ty), mask=r < rows)


def logsumexp_target(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row log-sum-exp, target logit and sum (float32) of ``logits`` ``[C, V]`` for ``targets`` ``[C]``."""
    rows, _ = check_row_pass_args(logits, targets=targets)
    lse, target_logit, row_sum = (torch.empty(rows, device=logits.device, dtype=torch.float32) for _ in range(3))
    _launch(logits, targets, lse, target_logit, row_sum, None)
    return lse, target_logit, row_sum


def token_logps_(
    logits: torch.Tensor, targets: torch.Tensor, token_logp: torch.Tensor, row_sum: torch.Tensor
) -> torch.Tensor:
    """``logsumexp_target`` writing ``target − lse`` into ``token_logp`` and the sum into ``row_sum`` (``[C]``
    views of the caller's per-token buffers: no copies); returns the log-sum-exp."""
    rows, _ = check_row_pass_args(logits, targets=targets, token_logp=token_logp, row_sum=row_sum)
    lse, target_logit = (torch.empty(rows, device=logits.device, dtype=torch.float32) for _ in range(2))
    _launch(logits, targets, lse, target_logit, row_sum, token_logp)
    return lse


def _launch(logits, targets, lse, target_logit, row_sum, token_logp) -> None:
    rows, vocab = logits.shape
    if not rows:
        return
    segments = triton.cdiv(vocab, SEGMENT_COLS)
    part = torch.empty(3, segments, rows, device=logits.device, dtype=torch.float32)
    block = min(BLOCK_V, SEGMENT_COLS)
    _segment_stats_kernel[(rows, segments)](
        logits, targets, part, target_logit, rows, vocab, logits.stride(0),
        SEGMENT=SEGMENT_COLS, BLOCK=block, num_warps=NUM_WARPS,
    )  # fmt: skip
    _combine_kernel[(triton.cdiv(rows, COMBINE_ROWS),)](
        part, lse, row_sum, target_logit, lse if token_logp is None else token_logp, rows, segments,
        ROWS=COMBINE_ROWS, SEGMENTS=triton.next_power_of_2(segments), WRITE_LOGP=token_logp is not None,
    )  # fmt: skip
