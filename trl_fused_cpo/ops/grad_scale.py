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

_LAST: dict[torch.device, torch.Tensor] = {}  # per device: the last grad_loss, 1 where it was 0 or not finite


def guess(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """0-dim: the last usable ``grad_loss`` seen on ``device`` (1 before the first). No launch once there is one."""
    last = _LAST.get(device)
    if last is None or last.dtype != dtype:
        return torch.ones((), device=device, dtype=dtype)
    return last


def correction(grad_loss: torch.Tensor, guess_used: torch.Tensor) -> torch.Tensor:
    """``grad_loss / guess_used``, and remember ``grad_loss`` as the next guess (never mutated: new tensors)."""
    grad_loss = grad_loss.detach().to(guess_used.dtype)
    usable = torch.nan_to_num(grad_loss, nan=1.0, posinf=1.0, neginf=1.0)
    _LAST[grad_loss.device] = usable + (usable == 0)  # a guess of 0 could not be corrected
    return grad_loss / guess_used


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
