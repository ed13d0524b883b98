"""The two GEMM forms both schedules use (``function.py``, ``lean.py``): logits, and an fp32-accumulating product."""

from __future__ import annotations

import torch


def logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())


_FP32_OUT_MM: bool | None = None  # whether this torch can write a bf16/fp16 GEMM into an fp32 tensor (CUDA)


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, first: bool = False) -> None:
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
