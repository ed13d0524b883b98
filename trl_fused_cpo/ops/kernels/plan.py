"""Triton kernels for the token plan (``plan.py``): two launches where the torch version takes about twenty.

Before its one host sync the op is launch-bound, not GPU-bound: the GPU waits for the host to queue each small
op (≈ 1.5 ms at B = 4 through a profiler, 7% of the call). Both are queued before the sync (``compact_labels``
sized for every position, ``plan.LabelLayout``); the layout they write is ``torch_backend``'s (the spec).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _label_counts_kernel(labels_ptr, out_ptr, T, stride_row, num_rows, ignore_index, vocab, BLOCK_T: tl.constexpr):
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK_T)
    count = 0
    bad = 0
    for start in tl.range(0, T, BLOCK_T):
        cols = start + offsets
        label = tl.load(labels_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < T, other=ignore_index)
        labelled = label != ignore_index
        count += tl.sum(labelled.to(tl.int32), axis=0)
        bad += tl.sum((labelled & ((label < 0) | (label >= vocab))).to(tl.int32), axis=0)
    tl.store(out_ptr + row, count)
    tl.store(out_ptr + num_rows + row, bad)


@triton.jit
def _compact_labels_kernel(
    labels_ptr,
    counts_ptr,
    token_index_ptr,
    token_row_ptr,
    targets_ptr,
    T,
    stride_row,
    num_rows,
    ignore_index,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0)
    num_pairs = num_rows // 2
    # Pair order: chosen row i is 2i, rejected row B + i is 2i + 1; this row's tokens start after every row before it.
    rows = tl.arange(0, BLOCK_R)
    counts = tl.load(counts_ptr + rows, mask=rows < num_rows, other=0)
    order = tl.where(rows < num_pairs, 2 * rows, 2 * (rows - num_pairs) + 1)
    my_order = tl.where(row < num_pairs, 2 * row, 2 * (row - num_pairs) + 1)
    start_out = tl.sum(tl.where(order < my_order, counts, 0), axis=0).to(tl.int64)
    offsets = tl.arange(0, BLOCK_T)
    for start in tl.range(0, T, BLOCK_T):
        cols = start + offsets
        label = tl.load(labels_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < T, other=ignore_index)
        labelled = label != ignore_index
        position = start_out + tl.cumsum(labelled.to(tl.int32), axis=0) - 1
        tl.store(token_index_ptr + position, row.to(tl.int64) * T + cols, mask=labelled)
        tl.store(token_row_ptr + position, tl.zeros_like(cols).to(tl.int64) + row, mask=labelled)
        tl.store(targets_ptr + position, label.to(tl.int64), mask=labelled)
        start_out += tl.sum(labelled.to(tl.int32), axis=0)


def _block_t(seq_len: int) -> int:
    return min(2048, triton.next_power_of_2(max(seq_len, 16)))


def label_counts(labels: torch.Tensor, ignore_index: int, vocab_size: int) -> torch.Tensor:
    """``[2, 2B]`` int32: labelled tokens per row, and labels outside ``[0, vocab_size)`` per row."""
    labels = labels if labels.stride(1) == 1 else labels.contiguous()
    rows, seq_len = labels.shape
    out = torch.empty(2, rows, device=labels.device, dtype=torch.int32)
    _label_counts_kernel[(rows,)](
        labels, out, seq_len, labels.stride(0), rows, ignore_index, vocab_size, BLOCK_T=_block_t(seq_len)
    )
    return out


def compact_labels(
    labels: torch.Tensor, row_counts: torch.Tensor, num_tokens: int, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_index, token_row, targets)``, each ``[num_tokens]`` int64, in pair order (``plan.py``)."""
    labels = labels if labels.stride(1) == 1 else labels.contiguous()
    rows, seq_len = labels.shape
    # token_index zero-filled: past the labelled tokens (num_tokens may be every position: plan.LabelLayout) it
    # must still hold valid positions for a gather queued before the count is known.
    token_index = torch.zeros(num_tokens, device=labels.device, dtype=torch.int64)
    token_row, targets = (torch.empty(num_tokens, device=labels.device, dtype=torch.int64) for _ in range(2))
    if num_tokens:
        _compact_labels_kernel[(rows,)](
            labels,
            row_counts,
            token_index,
            token_row,
            targets,
            seq_len,
            labels.stride(0),
            rows,
            ignore_index,
            BLOCK_T=_block_t(seq_len),
            BLOCK_R=triton.next_power_of_2(rows),
        )
    return token_index, token_row, targets
