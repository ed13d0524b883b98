"""Running the fused loss inside the wrapped model's forward, and reading lm_head under ZeRO-3 and FSDP2.

DDP's gradient hooks, FSDP's all-gathers and ZeRO-3's parameter fetches fire around the *wrapper's* forward.
Calling the backbone from outside it skips them (DESIGN.md §3), so the trainer patches the causal LM's own
``forward``: with ``fused_cpo_labels=...`` it runs the backbone and the fused head and returns a ``CPOLossOutput``;
without, it is the original forward (generation is unchanged).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()

# Keys the PEFT wrapper or Trainer may pass that a bare backbone does not take.
_HEAD_ONLY_KWARGS = ("labels", "logits_to_keep", "num_items_in_batch", "return_dict")


def call_through_head(head: nn.Module, fn: Callable[..., object], hidden: torch.Tensor):
    """``fn(hidden, weight, bias)`` run as ``head``'s own forward when ``head`` is ZeRO-3 partitioned, else directly.

    ZeRO-3 fetches a module's parameters in its pre-forward hook and, through hooks on the forward's outputs, again
    in the backward, where the gradient accumulates into them. A direct read of ``lm_head.weight`` gets neither:
    the weight is numel 0 when its gradient arrives ("size of tensor a (0) must match", seen on an H200 with an
    untied head). Running the fused loss as the head's forward arms both; the outputs travel as a tuple, which
    ZeRO-3's hooks walk.
    """
    if not hasattr(head.weight, "ds_id"):
        return fn(hidden, *full_head_params(head))
    from dataclasses import fields

    result_type = []

    def fused_head_forward(h: torch.Tensor):
        out = fn(h, head.weight, getattr(head, "bias", None))
        result_type.append(type(out))
        return tuple(getattr(out, f.name) for f in fields(out))

    had_own_forward = "forward" in head.__dict__
    original = head.__dict__.get("forward")
    head.forward = fused_head_forward
    try:
        values = head(hidden)
    finally:
        if had_own_forward:
            head.forward = original
        else:
            del head.forward
    return result_type[0](*values)


def full_head_params(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's full ``(weight, bias)`` for a direct read.

    FSDP2 holds parameters as DTensors when the head is outside the module being run: ``full_tensor()`` gathers
    them, and its backward reduce-scatters the gradient. (ZeRO-3 heads never get here: ``call_through_head``.)
    """
    weight, bias = head.weight, getattr(head, "bias", None)
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
        bias = bias.full_tensor() if isinstance(bias, DTensor) else bias
    return weight, bias


def install_fused_forward(causal_lm: nn.Module, loss_fn: Callable[..., object]) -> None:
    """Patch ``causal_lm.forward`` so ``forward(..., fused_cpo_labels=labels)`` returns ``loss_fn(hidden, head, labels)``.

    Args:
        causal_lm: the unwrapped ``*ForCausalLM`` (under PEFT, ``peft_model.get_base_model()``).
        loss_fn: ``(hidden [2B, T, H], head: nn.Module, labels [2B, T]) -> CPOLossOutput``.
    """
    if getattr(causal_lm, "_fused_cpo_original_forward", None) is not None:
        original = causal_lm._fused_cpo_original_forward  # re-patching (a second trainer): keep the true original
    else:
        original = causal_lm.forward
        causal_lm._fused_cpo_original_forward = original

    @functools.wraps(type(causal_lm).forward)  # keep the signature: generate() validates kwargs against it
    def fused_forward(self, *args, fused_cpo_labels: torch.Tensor | None = None, **kwargs):
        if fused_cpo_labels is None:
            return original(*args, **kwargs)
        for key in _HEAD_ONLY_KWARGS:
            kwargs.pop(key, None)
        kwargs["use_cache"] = False
        # Looked up per call: FSDP and PEFT replace the backbone's modules after the patch.
        outputs = self.base_model(*args, **kwargs)
        head = self.get_output_embeddings()
        hidden = outputs.last_hidden_state.to(head.weight.device)
        return loss_fn(hidden, head, fused_cpo_labels.to(hidden.device))

    causal_lm.forward = types.MethodType(fused_forward, causal_lm)
