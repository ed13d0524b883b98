"""Triton kernel: ``out = (src * scale).to(out.dtype)`` in one pass, ``scale`` read from device memory.

The backward turns the fp32 ``dW`` accumulator into the bf16 gradient and applies the incoming gradient at once:
one read of 2 GiB and one write of 1 GiB (0.75 ms at Llama-3 8B) instead of a cast then a scale (1.2 ms), and
no host sync to read ``scale``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scale_cast_kernel(src_ptr, out_ptr, scale_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    scale = tl.load(scale_ptr).to(tl.float32)
    x = tl.load(src_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x * scale).to(out_ptr.dtype.element_ty), mask=mask)


def scale_cast(src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(src * scale).to(dtype)`` for a contiguous ``src`` and a 0-dim ``scale`` on the same device."""
    if not src.is_contiguous():
        raise ValueError("scale_cast needs a contiguous source")
    out = torch.empty(src.shape, device=src.device, dtype=dtype)
    numel = src.numel()
    if numel:
        block = 8192
        _scale_cast_kernel[(triton.cdiv(numel, block),)](
            src, out, scale.reshape(1).float(), numel, BLOCK=block, num_warps=8
        )
    return out
