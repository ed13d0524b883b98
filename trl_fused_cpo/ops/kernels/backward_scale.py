"""Triton kernels that apply the backward's correction ``ratio = grad_loss / fold`` (``grad_scale.py``).

``scale_cast``: the fp32 ``dW`` accumulator becomes the bf16 gradient, scaled on the way: one read of 2 GiB and
one write of 1 GiB (0.75 ms at Llama-3 8B) instead of a cast then a scale (1.2 ms).
``rescale_``: in place, and nothing at all when the ratio is 1 (every program reads it and returns), so the usual
backward costs one launch instead of a pass over the 1 GiB gradient. Both read the ratio from device memory: no
host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 8192


@triton.jit
def _scale_cast_kernel(src_ptr, out_ptr, scale_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    scale = tl.load(scale_ptr).to(tl.float32)
    x = tl.load(src_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rescale_kernel(ptr, ratio_ptr, numel, num_blocks, BLOCK: tl.constexpr):
    ratio = tl.load(ratio_ptr)
    if ratio != 1.0:
        for block in tl.range(tl.program_id(0), num_blocks, tl.num_programs(0)):  # grid-stride: a small grid
            offsets = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < numel
            x = tl.load(ptr + offsets, mask=mask)
            tl.store(ptr + offsets, (x.to(ratio.dtype) * ratio).to(x.dtype), mask=mask)


def _check(t: torch.Tensor, ratio: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError("the backward scale kernels need a contiguous tensor")
    if ratio.numel() != 1 or ratio.device != t.device:
        raise ValueError(f"ratio must be one element on {t.device}; got shape {tuple(ratio.shape)} on {ratio.device}")


def scale_cast(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(src * scale).to(dtype)`` for a contiguous ``src`` and a one-element ``scale`` on the same device."""
    _check(src, scale)
    out = torch.empty(src.shape, device=src.device, dtype=dtype)
    if src.numel():
        _scale_cast_kernel[(triton.cdiv(src.numel(), _BLOCK),)](
            src, out, scale.reshape(1).float(), src.numel(), BLOCK=_BLOCK, num_warps=8
        )
    return out


def rescale_(t: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """In place ``t *= ratio`` (in float32, float64 for float64 tensors); no memory traffic when ``ratio == 1``."""
    _check(t, ratio)
    numel = t.numel()
    if numel:
        num_blocks = triton.cdiv(numel, _BLOCK)
        sms = torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 4
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        _rescale_kernel[(min(num_blocks, 4 * sms),)](
            t, ratio.reshape(1).to(acc), numel, num_blocks, BLOCK=_BLOCK, num_warps=8
        )
    return t
