"""Triton kernel: per-row log-sum-exp, target logit and sum of a ``[C, V]`` logits chunk, one pass over each row.

The sum is for the ``logits/*`` metrics: it rides on the pass that reads every logit anyway.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _logsumexp_target_kernel(
    # pointers
    logits_ptr,
    targets_ptr,
    lse_ptr,
    target_logit_ptr,
    row_sum_ptr,
    # sizes and strides
    V,
    stride_row,
    # meta
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride overflows int32 past 16k rows of V = 128k
    row_ptr = logits_ptr + row * stride_row
    offsets = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s = 0.0
    total = 0.0
    for start in tl.range(0, V, BLOCK_V):
        cols = start + offsets
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        total += tl.sum(tl.where(cols < V, x, 0.0), axis=0)
        m = m_new
    target = tl.load(targets_ptr + row)
    tl.store(lse_ptr + row, m + tl.log(s))
    tl.store(row_sum_ptr + row, total)
    tl.store(target_logit_ptr + row, tl.load(row_ptr + target).to(tl.float32))


def logsumexp_target(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row log-sum-exp, target logit and sum (float32) of ``logits`` ``[C, V]`` for ``targets`` ``[C]``."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a row-major [C, V] matrix; got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if targets.shape != (rows,):
        raise ValueError(f"targets must be [{rows}]; got {tuple(targets.shape)}")
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    target_logit = torch.empty_like(lse)
    row_sum = torch.empty_like(lse)
    if rows:
        # 4096 bf16 = 8 KB a step, 16 per thread at 8 warps: enough bytes in flight to stream one 256 KB row.
        _logsumexp_target_kernel[(rows,)](
            logits, targets, lse, target_logit, row_sum, vocab, logits.stride(0), BLOCK_V=4096, num_warps=8
        )
    return lse, target_logit, row_sum
