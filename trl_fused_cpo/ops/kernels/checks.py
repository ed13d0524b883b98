"""The argument check every row-pass launcher makes before it hands raw pointers to a Triton kernel."""

from __future__ import annotations

import torch


def check_row_pass_args(logits: torch.Tensor, **per_row: torch.Tensor) -> tuple[int, int]:
    """``(rows, vocab)`` of a row-major ``[C, V]`` ``logits``; each keyword tensor must be a contiguous ``[C]``
    (the kernels index it as ``ptr + row``, inputs and the caller's output views alike)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a row-major [C, V] matrix; got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    for name, t in per_row.items():
        if t.shape != (rows,):
            raise ValueError(f"{name} must be [{rows}]; got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return rows, vocab
