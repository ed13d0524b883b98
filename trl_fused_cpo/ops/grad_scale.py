"""The incoming gradient ``grad_loss``: a power of two folded into the forward's gradients, the rest applied in the
backward, so that no result depends on anything but a call's inputs and its own ``grad_loss``.

The op finishes its gradients in the forward, before autograd hands it ``grad_loss``. Scaling them afterwards is a
pass over dW (1 GiB at Llama-3 8B; 0.67 ms on an H200, 7% of a B = 2 call). So the forward multiplies its per-token
coefficients by a *fold* ``s``, and the backward multiplies by ``grad_loss / s`` in float32 with a kernel that does
nothing when that ratio is 1. ``s`` is always a power of two: multiplying by it is exact (it only moves the exponent),
so the gradients equal those of ``s = 1`` bit for bit, whatever ``s`` was. The fold is:

- float16: a power of two near the number of labelled tokens, from the inputs alone. The coefficients are about
  ``1 / tokens``; folded, they are about 1, so ``dlogits = g·(onehot − softmax)`` stays inside fp16's range, as
  GradScaler's scale keeps the stock trainer's logits gradient there. (Folding a guess of ``grad_loss`` here would
  make the fp16 rounding depend on an earlier call: after a backward with 1e-5 the next one underflowed to NaN.)
- otherwise: the power of two of the last ``grad_loss`` seen by a ``GradScaleGuess`` the caller keeps (a trainer
  keeps one: its ``grad_loss`` is ``1 / gradient_accumulation_steps`` every step), or 1 without one. bf16 shares
  fp32's exponent range, so there the fold changes nothing but the cost of the backward.
"""

from __future__ import annotations

import math

import torch

_MAX_EXPONENT = 24  # folds within 2**±24: far from float32's limits for coefficients of 1e-8 to 1e4


def _power_of_two(x: torch.Tensor) -> torch.Tensor:
    """``2**round(log2|x|)`` within ``2**±24``; 1 where ``x`` is 0 or not finite. On the device, no sync."""
    usable = torch.where(torch.isfinite(x) & (x != 0), x.abs(), torch.ones_like(x))
    return torch.exp2(torch.round(torch.log2(usable)).clamp(-_MAX_EXPONENT, _MAX_EXPONENT))


class GradScaleGuess:
    """The last incoming gradient's power of two, kept by one caller (a trainer) across calls. Saves the backward's
    pass over dW when ``grad_loss`` repeats; cannot change a result (the fold is a power of two)."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None  # 0-dim float32, on the device of the last backward

    def observe(self, grad_loss: torch.Tensor) -> None:
        self.last = _power_of_two(grad_loss.detach().float())


def fold(
    guess: GradScaleGuess | None, dtype: torch.dtype, device: torch.device, num_tokens: int, acc_dtype: torch.dtype
) -> torch.Tensor:
    """0-dim ``acc_dtype``: the power of two the forward folds into its gradients (see the module docstring)."""
    if dtype == torch.float16:
        value = 2.0 ** min(_MAX_EXPONENT, max(0, round(math.log2(max(1, num_tokens)))))
        return torch.full((), value, device=device, dtype=acc_dtype)
    if guess is None or guess.last is None or guess.last.device != device:
        return torch.ones((), device=device, dtype=acc_dtype)
    return guess.last.to(acc_dtype)


def correction(grad_loss: torch.Tensor, folded: torch.Tensor, guess: GradScaleGuess | None) -> torch.Tensor:
    """``grad_loss / folded`` in float32 (float64 for a float64 fold): exact, ``folded`` being a power of two."""
    if guess is not None:
        guess.observe(grad_loss)
    return grad_loss.detach().to(folded.dtype) / folded


def apply(grad: torch.Tensor | None, ratio: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``(grad * ratio).to(dtype)``, the product in float32 or wider; in place where the dtype is already right,
    skipped where the ratio is 1."""
    if grad is None:
        return None
    if grad.is_cuda:
        from .kernels.backward_scale import rescale_, scale_cast

        return scale_cast(grad, ratio, dtype) if grad.dtype != dtype else rescale_(grad, ratio)
    if ratio.item() == 1:  # on the CPU .item() costs no sync
        return grad if grad.dtype == dtype else grad.to(dtype)
    wide = torch.promote_types(grad.dtype, ratio.dtype)  # an fp16 ratio of 65,536 would be inf
    if grad.dtype == wide == dtype:
        return grad.mul_(ratio)
    return (grad.to(wide) * ratio).to(dtype)
