"""Triton kernel: overwrite a ``[C, V]`` logits chunk with ``coef · (onehot(target) − softmax)`` in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_row_pass_args


@triton.jit
def _softmax_grad_kernel(
    # pointers
    logits_ptr,
    lse_ptr,
    targets_ptr,
    coef_ptr,
    # sizes and strides
    V,
    stride_row,
    # meta
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ptrs = logits_ptr + row * stride_row + cols
    lse = tl.load(lse_ptr + row)
    coef = tl.load(coef_ptr + row)
    target = tl.load(targets_ptr + row)
    x = tl.load(ptrs, mask=cols < V, other=0.0).to(tl.float32)
    grad = coef * (tl.where(cols == target, 1.0, 0.0) - tl.exp(x - lse))
    tl.store(ptrs, grad.to(logits_ptr.dtype.element_ty), mask=cols < V)


def softmax_grad_(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """In place: ``logits`` ``[C, V]`` becomes ``coef[:, None] · (onehot(targets) − softmax(logits))``."""
    rows, vocab = check_row_pass_args(logits, lse=lse, targets=targets, coef=coef)
    if rows:
        block = 2048  # a 2-D grid (rows x vocab blocks): ~V/2048 = 63 programs per row keep every SM streaming
        grid = (rows, triton.cdiv(vocab, block))
        _softmax_grad_kernel[grid](
            logits, lse, targets, coef.float(), vocab, logits.stride(0), BLOCK_V=block, num_warps=4
        )
    return logits
