"""The incoming gradient ``grad_loss``: guessed in the forward, corrected in the backward (usually not at all).

The op finishes its gradients in the forward, before autograd hands it ``grad_loss``. Scaling them afterwards is
a pass over dW (1 GiB at Llama-3 8B; 0.67 ms on an H200, 7% of a B = 2 call). But ``grad_loss`` is nearly always
the one of the previous backward (1, 1/gradient_accumulation_steps, a loss scale that changes every few hundred
steps), so the forward folds that one into the per-token coefficients, where it costs nothing, and the backward
multiplies by ``grad_loss / guess`` with a kernel that does nothing when the ratio is 1. The guess and the ratio
stay on the device: no host sync. A wrong guess costs the pass it saves, never correctness.
"""

from __future__ import annotations

import torch

_LAST: dict[torch.device, torch.Tensor] = {}  # per device: the grad_loss of the last backward through the op


def guess(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """0-dim: the last ``grad_loss`` seen on ``device`` (1 before the first, or where it was 0 or not finite)."""
    last = _LAST.get(device)
    if last is None:
        return torch.ones((), device=device, dtype=dtype)
    return torch.where(torch.isfinite(last) & (last != 0), last, torch.ones_like(last)).to(dtype)


def correction(grad_loss: torch.Tensor, guess_used: torch.Tensor) -> torch.Tensor:
    """``grad_loss / guess_used``, and remember ``grad_loss`` as the next guess."""
    _LAST[grad_loss.device] = grad_loss.detach().to(guess_used.dtype).clone()
    return grad_loss.to(guess_used.dtype) / guess_used


def apply(grad: torch.Tensor | None, ratio: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``(grad * ratio).to(dtype)``: in place where the dtype is already right, skipped where the ratio is 1."""
    if grad is None:
        return None
    if grad.is_cuda:
        from .backward_scale_kernels import rescale_, scale_cast

        return scale_cast(grad, ratio, dtype) if grad.dtype != dtype else rescale_(grad, ratio)
    if grad.dtype != dtype:
        return (grad * ratio).to(dtype)
    return grad if ratio.item() == 1 else grad.mul_(ratio.to(grad.dtype))  # on the CPU .item() costs no sync
