"""The fused op as an autograd Function: the schedule computes loss and gradients in the forward; the backward only
applies the incoming gradient (``grad_scale.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from . import grad_scale
from .backend import Backend, backend_module, resolve_backend
from .chunks import chunked_forward
from .cpo_math import CPOHyperparams, CPOLossOutput
from .rows import PackedRows, PaddedRows
from .schedule import Chunks, NeedGrads, Slabs, choose_schedule
from .slabs import slab_forward

__all__ = ["Backend", "FusedOpOptions", "LinearCPOFunction", "linear_cpo"]


@dataclass(frozen=True)
class FusedOpOptions:
    """Everything but the tensors, decided once per call (``linear_cpo``).

    Attributes:
        hp: the CPO hyperparameters, normalised.
        schedule: ``Chunks`` or ``Slabs``, with its budget (``schedule.py``).
        backend: ``torch_backend`` or ``kernels`` (``backend.py``).
        need: which inputs get a gradient.
        grad_guess: the caller's kept guess of the incoming gradient, or None (``grad_scale.py``).
    """

    hp: CPOHyperparams
    schedule: Chunks | Slabs
    backend: ModuleType
    need: NeedGrads
    grad_guess: grad_scale.GradScaleGuess | None = None


class LinearCPOFunction(torch.autograd.Function):
    """Autograd wrapper: gradients are computed in the forward; the backward corrects their scale."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows: PaddedRows | PackedRows, options: FusedOpOptions):
        forward = slab_forward if isinstance(options.schedule, Slabs) else chunked_forward
        outputs, grads, fold = forward(
            hidden,
            weight,
            bias,
            rows,
            options.hp,
            options.schedule,
            backend=options.backend,
            need=options.need,
            grad_guess=options.grad_guess,
        )
        # Kept on ctx, not save_for_backward: they are outputs of this op, corrected in place in the backward.
        ctx.grads, ctx.fold, ctx.grad_guess = grads, fold, options.grad_guess
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(*outputs[1:])
        return outputs

    @staticmethod
    def backward(ctx, grad_loss, *_metrics):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "fused_linear_cpo_loss cannot be differentiated twice (backward with create_graph=True: a "
                "Hessian-vector product, a gradient penalty): its gradients are computed in the forward, so their "
                "second-order part would be silently missing. Use the reference "
                "(trl_fused_cpo.ops.reference.reference_linear_cpo_loss) for second-order work."
            )
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("fused_linear_cpo_loss: backward ran twice through one forward; run the forward again.")
        ctx.grads = None  # frees the stored gradients as they are handed over
        ratio = grad_scale.correction(grad_loss, ctx.fold, ctx.grad_guess)
        dtypes = ctx.dtypes
        return (
            grad_scale.apply(grads.hidden, ratio, dtypes[0]),
            grad_scale.apply(grads.weight, ratio, dtypes[1]),
            grad_scale.apply(grads.bias, ratio, dtypes[2]),
            None,  # rows: the layout and its integer labels
            None,  # options: not a tensor
        )


def linear_cpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: PaddedRows | PackedRows,
    bias: torch.Tensor | None,
    hp: CPOHyperparams,
    *,
    backend: str,
    chunk_bytes: int | None,
    memory: str = "fast",
    grad_guess: grad_scale.GradScaleGuess | None = None,
) -> CPOLossOutput:
    """The fused op on checked inputs (``fused_linear_cpo_loss`` checks them): backend, gradients and schedule are
    decided here, once."""
    resolved = resolve_backend(backend, hidden.device, hidden.dtype)
    need = NeedGrads.of(hidden, weight, bias)
    schedule = choose_schedule(weight, chunk_bytes, memory, need)
    if resolved == "triton" and not weight.is_contiguous():  # the kernels read rows of W; torch.mm takes any strides
        weight = weight.contiguous()
    options = FusedOpOptions(hp, schedule, backend_module(resolved), need, grad_guess)
    loss, chosen_logps, rejected_logps, chosen_rewards, rejected_rewards, nll, chosen_mean, rejected_mean = (
        LinearCPOFunction.apply(hidden, weight, bias, rows, options)
    )
    return CPOLossOutput(
        loss=loss,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        nll_loss=nll,
        chosen_logits_mean=chosen_mean,
        rejected_logits_mean=rejected_mean,
    )
