"""The GEMM forms both schedules use (``chunks.py``, ``slabs.py``): logits, and products into fp32."""

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
    if first:
        mm_into(acc, a, b)
    elif a.dtype == acc.dtype:  # fp32 inputs
        acc.addmm_(a, b)
    elif not _fp32_out(lambda: torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc), a):
        acc.add_(torch.mm(a, b).float() if a.is_cuda else torch.mm(a.float(), b.float()))


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b``, rounded once into ``out``'s dtype (float32 ``out`` from bf16/fp16 ``a``, ``b`` included)."""
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out)
    elif not _fp32_out(lambda: torch.mm(a, b, out_dtype=torch.float32, out=out), a):
        out.copy_(torch.mm(a, b) if a.is_cuda else torch.mm(a.float(), b.float()))


def _fp32_out(product, a: torch.Tensor) -> bool:
    """Run ``product`` (a cuBLAS call with ``out_dtype=float32``) where this torch has it; whether it ran."""
    global _FP32_OUT_MM
    if not a.is_cuda or _FP32_OUT_MM is False:
        return False
    try:
        product()
    except (RuntimeError, TypeError):
        _FP32_OUT_MM = False
        return False
    _FP32_OUT_MM = True
    return True
