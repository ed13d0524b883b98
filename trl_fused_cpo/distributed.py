"""Running the fused loss inside the wrapped model's forward, and as lm_head's own forward under ZeRO-3 and FSDP2.

DDP's gradient hooks, FSDP's all-gathers and ZeRO-3's parameter fetches fire around the *wrapper's* forward.
Calling the backbone from outside it skips them (docs/design.md §3), so the trainer patches the causal LM's own
``forward``: with ``fused_cpo_labels=...`` it runs the backbone and the fused head and returns a ``CPOLossOutput``;
without, it is the original forward (generation is unchanged).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import fields

import torch
from torch import nn

from .support import head_transform

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed
    DTensor = ()

# Keys the PEFT wrapper or Trainer may pass that a bare backbone does not take.
_HEAD_ONLY_KWARGS = ("labels", "logits_to_keep", "num_items_in_batch", "return_dict")


# torch_compile: Dynamo compiles the backbone and stops here (one graph break). Traced, the op broke into 29 graphs on
# the toy model, 3 min of CPU compile for 3 steps (host syncs, torch.autograd.grad, generators).
@torch.compiler.disable
def call_through_head(head: nn.Module, loss: Callable[..., object], hidden: torch.Tensor, *args):
    """``loss(hidden, weight, bias, *args)``, run as ``head``'s own forward when a sharding wrapper manages ``head``.

    ZeRO-3 and FSDP2 gather a module's parameters in its pre-forward hook and reduce their gradients in hooks the
    forward arms; a direct read of ``lm_head.weight`` gets neither. Seen, not guessed: under ZeRO-3 the weight is
    numel 0 when its gradient arrives ("size of tensor a (0) must match", an H200 with an untied head); under
    FSDP2 with ``lm_head`` in its own unit a direct read sees the sharded DTensor, and ``full_tensor()`` hands
    each rank its own unreduced gradient (2 ranks on CPU: 96% off, ``tests/test_fsdp2_ranks.py``). Running the
    fused loss as the head's forward arms both wrappers exactly as the stock ``lm_head(hidden)`` call does; the
    outputs travel as a tuple, which the wrappers' hooks walk.
    """
    if not _sharded(head):
        return loss(hidden, head.weight, getattr(head, "bias", None), *args)
    result_type = []

    def fused_head_forward(h: torch.Tensor):
        weight = head.weight
        if isinstance(weight, DTensor):  # still sharded inside the forward: not FSDP2 (tensor parallel?)
            raise NotImplementedError(
                f"lm_head.weight is a DTensor ({weight.placements}) inside lm_head's forward: the fused loss "
                "supports FSDP2 and ZeRO-3 sharding, not tensor parallelism. Set use_fused_loss=False."
            )
        out = loss(h, weight, getattr(head, "bias", None), *args)
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


def _sharded(head: nn.Module) -> bool:
    """Whether ZeRO-3 (``ds_id`` on the weight) or FSDP2 (an ``FSDPModule``, or a DTensor weight) manages ``head``."""
    if hasattr(head.weight, "ds_id") or isinstance(head.weight, DTensor):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(head, FSDPModule)


def install_fused_forward(causal_lm: nn.Module, head_loss: Callable[..., object]) -> None:
    """Patch ``causal_lm.forward`` so ``forward(..., fused_cpo_labels=labels)`` returns ``head_loss(hidden, weight,
    bias, labels)``, run through the head (``call_through_head``); without ``fused_cpo_labels`` it is the original
    forward (generation is unchanged). The call runs one way: this forward, then the loss, then the functional.

    The patch is a method bound to the model whose function holds no state, the settings live on the model: so the
    model behaves like a plain one. ``copy.deepcopy`` rebinds the method to the copy (a closure over the original's
    bound forward made a copy compute with the original's weights), Accelerate's mixed-precision wrapper (which
    rewraps ``forward.__func__``) keeps that property, nothing holds the trainer (deleting it frees it and its
    optimizer), and pickling stores a plain model (the patch comes back when a trainer uses it).

    Args:
        causal_lm: the unwrapped ``*ForCausalLM`` (under PEFT, ``peft_model.get_base_model()``).
        head_loss: ``(hidden [2B, T, H], weight, bias, labels [2B, T]) -> CPOLossOutput``; kept on the model, so it
            must not hold the trainer (``trainer.FusedHead``: settings only).
    """
    causal_lm._fused_cpo_head = head_loss
    fused = _fused_forward(type(causal_lm))
    current = causal_lm.__dict__.get("forward")
    if current is None:
        causal_lm.forward = types.MethodType(fused, causal_lm)
    elif not _wraps(current, fused):  # an instance-level forward installed before ours: ours calls it
        causal_lm._fused_cpo_replaced_forward = current
        causal_lm.forward = types.MethodType(fused, causal_lm)
    # else: already patched, possibly under a wrapper of its own (Accelerate's mixed precision): settings only


def _wraps(forward: Callable[..., object], fused: Callable[..., object]) -> bool:
    """Whether ``fused`` is ``forward``'s function or inside its ``__wrapped__`` chain (Accelerate's autocast and
    fp32-output wrappers keep one)."""
    f = getattr(forward, "__func__", forward)
    for _ in range(16):  # the chain is short: a few decorators at most
        if f is fused:
            return True
        f = getattr(f, "__wrapped__", None)
        if f is None:
            return False
        f = getattr(f, "__func__", f)
    return False


@functools.cache
def _fused_forward(cls: type) -> Callable[..., object]:
    """The patched forward of ``cls``: one function per model class, bound to each instance."""

    @functools.wraps(cls.forward)  # keep the signature: generate() validates kwargs against it
    def forward(self, *args, fused_cpo_labels: torch.Tensor | None = None, **kwargs):
        if fused_cpo_labels is None:
            replaced = self.__dict__.get("_fused_cpo_replaced_forward")
            return replaced(*args, **kwargs) if replaced is not None else cls.forward(self, *args, **kwargs)
        for key in _HEAD_ONLY_KWARGS:
            kwargs.pop(key, None)
        kwargs["use_cache"] = False
        # Looked up per call: FSDP and PEFT replace the backbone's modules after the patch.
        outputs = self.base_model(*args, **kwargs)
        head = self.get_output_embeddings()
        hidden = outputs.last_hidden_state.to(head.weight.device)
        transform = head_transform(self)  # BERT/RoBERTa: dense, activation, LayerNorm before the decoder
        if transform is not None:
            hidden = transform(hidden)
        return call_through_head(head, self._fused_cpo_head, hidden, fused_cpo_labels.to(hidden.device))

    return forward
