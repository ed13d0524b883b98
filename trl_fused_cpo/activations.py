"""The activation policy: which decoder layers recompute their forward in the backward, chosen from the memory.

TRL's default ``gradient_checkpointing=True`` reruns every layer's forward (+33% of the backbone's GEMMs for a full
fine-tune, +50% with a frozen base) even where the step peaks at a seventh of the card. ``activation_policy`` says
what to keep instead:

- ``none``: keep every activation, recompute nothing;
- ``full``: TRL's blanket checkpointing of every layer (transformers applies it, as with ``gradient_checkpointing``);
- ``"k"`` (an integer): checkpoint the first ``k`` decoder layers, keep the others' activations;
- ``offload``: checkpoint every layer and hold the saved layer inputs in pinned host memory
  (``torch.autograd.graph.save_on_cpu``): the least device memory, a copy each way per layer;
- ``auto``: on CUDA, ``none`` when the estimated activations fit the memory left, else the fewest checkpointed
  layers that fit, else ``offload``; elsewhere (CPU, CI) ``gradient_checkpointing`` as configured.

Every policy is exact: a checkpointed layer reruns the same forward (non-reentrant ``torch.utils.checkpoint``, the RNG
state restored), so the gradients equal those of no checkpointing (``tests/test_activations.py``).

The estimate (one Llama-style decoder layer, one position, counted from the tensors autograd saves on the toy
model, ``tests/test_activations.py``): each RMSNorm keeps its input in fp32 (eager RMSNorm upcasts), the normalized
input and its output (the projections' input); attention keeps q, k, v, its output and the fp32 log-sum-exp; the MLP
keeps gate, up, silu(gate) and their product: ``e·(6·d + 2·kv + 4·d_ff) + 8·d + 4·heads + 8`` bytes (e = bytes of the
compute dtype), 106 KiB at Llama-3.2-1B, 196 KiB at Llama-3-8B. A checkpointed layer keeps only its input (``e·d``);
in the backward one layer's recompute is alive at a time. LoRA's extra ``r``-wide outputs are left out (0.1%).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import FLEX_BLOCK_SIZE
from .ops.schedule import DEFAULT_CHUNK_BYTES_TRAINABLE
from .packing import PADDED, PREFIX_SHARED
from .support import unwrap_causal_lm

logger = logging.getLogger(__name__)

NAMED_POLICIES = ("auto", "none", "full", "offload")
DEVICE_FRACTION = 0.85  # of the card's memory, at most: the allocator's fragmentation and cuBLAS workspaces need room


def check_policy(value: str | int) -> str:
    """``value`` as the config stores it (an integer becomes its digits); ValueError for anything else."""
    text = str(value).strip().lower() if not isinstance(value, bool) else ""
    if text in NAMED_POLICIES or text.isdigit():
        return text
    raise ValueError(
        f"activation_policy={value!r} is not one of {list(NAMED_POLICIES)} or a number of layers to checkpoint "
        "(e.g. 8: the first 8 decoder layers recompute their forward, the others keep their activations)."
    )


@dataclass(frozen=True)
class ActivationPlan:
    """What the backbone keeps: the first ``checkpointed`` decoder layers recompute (their inputs in pinned host
    memory when ``offload``); ``delegate``: leave ``gradient_checkpointing`` to transformers (TRL's behaviour)."""

    checkpointed: int
    offload: bool = False
    delegate: bool = False
    reason: str = ""

    def describe(self, num_layers: int) -> str:
        if self.delegate:
            return "gradient_checkpointing as configured"
        if self.offload:
            return f"offload (all {num_layers} layers checkpointed, their inputs in pinned host memory)"
        if self.checkpointed == 0:
            return "none (no recompute)"
        if self.checkpointed >= num_layers:
            return f"full (all {num_layers} layers checkpointed)"
        return f"the first {self.checkpointed} of {num_layers} layers checkpointed"


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes of one micro-batch's activations, from the model's widths and the largest micro-batch's positions."""

    positions: int
    num_layers: int
    layer_bytes_per_position: int  # one decoder layer, nothing recomputed
    boundary_bytes_per_position: int  # a checkpointed layer's saved input

    def bytes_with(self, checkpointed: int, offload: bool = False) -> int:
        """Device bytes with the first ``checkpointed`` layers recomputed: the kept layers' activations, the saved
        inputs (on the host when ``offload``) and one layer's recompute alive in the backward."""
        kept = (self.num_layers - checkpointed) * self.layer_bytes_per_position
        saved = 0 if offload else checkpointed * self.boundary_bytes_per_position
        working = self.layer_bytes_per_position if checkpointed else 0
        return self.positions * (kept + saved + working)


def layer_bytes_per_position(hidden: int, kv_dim: int, intermediate: int, heads: int, dtype_bytes: int) -> int:
    """Bytes one decoder layer keeps per position without recompute (the module docstring's formula)."""
    return dtype_bytes * (6 * hidden + 2 * kv_dim + 4 * intermediate) + 8 * hidden + 4 * heads + 8


def estimate_for(text_config, *, positions: int, dtype_bytes: int) -> ActivationEstimate:
    """The estimate for a transformers text config (Llama-style widths: hidden, heads, key-value heads, MLP)."""
    hidden = text_config.hidden_size
    head_dim = getattr(text_config, "head_dim", None) or hidden // text_config.num_attention_heads
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    intermediate = getattr(text_config, "intermediate_size", None) or 4 * hidden
    return ActivationEstimate(
        positions=positions,
        num_layers=text_config.num_hidden_layers,
        layer_bytes_per_position=layer_bytes_per_position(
            hidden, kv_heads * head_dim, intermediate, heads, dtype_bytes
        ),
        boundary_bytes_per_position=dtype_bytes * hidden,
    )


def activation_budget(free_bytes: int, total_bytes: int, *, reserved_bytes: int, fraction: float) -> int:
    """Bytes the activations may take: ``fraction`` of the card, less what is in use now (weights, other processes)
    and ``reserved_bytes`` still to come (gradients, optimizer state, the fused head's working set)."""
    return int(fraction * total_bytes) - (total_bytes - free_bytes) - reserved_bytes


def plan_for_budget(estimate: ActivationEstimate, budget_bytes: int) -> ActivationPlan:
    """``none`` when everything fits ``budget_bytes``, else the fewest checkpointed layers that fit, else offload."""
    gib = float(1 << 30)
    need = estimate.bytes_with(0)
    for k in range(estimate.num_layers + 1):
        if estimate.bytes_with(k) <= budget_bytes:
            why = f"{estimate.bytes_with(k) / gib:.1f} GiB of activations fit the {budget_bytes / gib:.1f} GiB left"
            if k:
                why += f" (keeping every layer's would take {need / gib:.1f} GiB)"
            return ActivationPlan(checkpointed=k, reason=why)
    low = estimate.bytes_with(estimate.num_layers, offload=True)
    why = (
        f"checkpointing every layer still takes {estimate.bytes_with(estimate.num_layers) / gib:.1f} GiB of the "
        f"{budget_bytes / gib:.1f} GiB left; offloaded, {low / gib:.1f} GiB"
    )
    return ActivationPlan(checkpointed=estimate.num_layers, offload=True, reason=why)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers, in order: transformers' ``GradientCheckpointingLayer`` instances."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def offloaded_checkpoint(function, *args, **kwargs):
    """``checkpoint`` with the saved inputs in pinned host memory (copied back asynchronously in the backward)."""
    device_type = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=device_type == "cuda")
    with hooks:
        return checkpoint(function, *args, **kwargs)


def apply_plan(model: nn.Module, plan: ActivationPlan) -> None:
    """Set each decoder layer's ``gradient_checkpointing`` flag and checkpoint function (the two attributes that
    transformers' ``GradientCheckpointingLayer`` reads in every 5.x release), first ``plan.checkpointed`` on."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no transformers GradientCheckpointingLayer, so activation_policy cannot "
            "choose layers. Set activation_policy: full (transformers' gradient_checkpointing) or none."
        )
    function = partial(offloaded_checkpoint if plan.offload else checkpoint, use_reentrant=False)
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < plan.checkpointed
        layer._gradient_checkpointing_func = function
    if plan.checkpointed and hasattr(model, "enable_input_require_grads"):
        # a frozen embedding (LoRA) gives the first layer an input without grad; transformers and TRL do the same
        model.enable_input_require_grads()


def resolve_plan(
    policy: str,
    *,
    num_layers: int,
    checkpointing_explicit: bool,
    estimate: ActivationEstimate | None = None,
    memory: tuple[int, int] | None = None,
    reserved_bytes: int = 0,
    fraction: float = DEVICE_FRACTION,
) -> ActivationPlan:
    """The plan for ``policy``. ``memory``: ``(free, total)`` bytes of the device (``torch.cuda.mem_get_info``), None
    off CUDA or under sharding, where ``auto`` leaves ``gradient_checkpointing`` as configured, as it does when the
    user set ``gradient_checkpointing`` explicitly (an explicit choice wins over ``auto``, never over a named policy)."""
    if policy == "none":
        return ActivationPlan(0, reason="activation_policy=none")
    if policy == "full":
        return ActivationPlan(num_layers, reason="activation_policy=full")
    if policy == "offload":
        return ActivationPlan(num_layers, offload=True, reason="activation_policy=offload")
    if policy.isdigit():
        if int(policy) > num_layers:
            raise ValueError(
                f"activation_policy={policy} checkpoints more layers than the model's {num_layers}. "
                f"Use a number from 0 to {num_layers}, or full."
            )
        return ActivationPlan(int(policy), reason=f"activation_policy={policy}")
    if checkpointing_explicit:
        return ActivationPlan(
            0, delegate=True, reason="activation_policy=auto and gradient_checkpointing set explicitly"
        )
    if memory is None or estimate is None:
        return ActivationPlan(0, delegate=True, reason="activation_policy=auto off a single CUDA device's memory")
    budget = activation_budget(*memory, reserved_bytes=reserved_bytes, fraction=fraction)
    plan = plan_for_budget(estimate, budget)
    card = f"{fraction:.0%} of the card's {memory[1] / (1 << 30):.1f} GiB"
    return ActivationPlan(plan.checkpointed, plan.offload, reason=f"activation_policy=auto: {plan.reason} ({card})")


def state_bytes(model: nn.Module) -> int:
    """Gradients and AdamW's two moments of the trainable parameters, in their dtype: still to come at ``__init__``."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def install_plan(model: nn.Module, args, plan: ActivationPlan) -> None:
    """Apply ``plan`` to ``model`` and turn transformers' blanket checkpointing off so that it stays the only one
    (``args``: the trainer's config; a delegated plan leaves both untouched)."""
    if plan.delegate:
        return
    apply_plan(model, plan)
    for name in ("gradient_checkpointing", "activation_checkpointing"):
        if hasattr(args, name):
            setattr(args, name, False)


def largest_batch_positions(dataset, batch_size: int, layout: str) -> int | None:
    """Positions of the longest micro-batch of ``batch_size`` rows that TRL's tokenized ``dataset`` can give, or None
    without its ``*_input_ids`` columns (a streaming dataset). ``padded``: ``2·B·`` the longest sequence; packed: the
    ``B`` longest pairs, ``chosen + rejected`` (less ``prompt - 1`` shared positions with ``prefix_shared``: TRL's
    rows repeat the prompt, unlabelled, so the shared prefix is the prompt) and flex_attention's 128-position tail."""
    import numpy as np

    try:
        table = dataset.data
        length = {k: _list_lengths(table.column(f"{k}_input_ids")) for k in ("prompt", "chosen", "rejected")}
    except (AttributeError, KeyError, TypeError, ValueError):  # not an Arrow-backed dataset with TRL's columns
        return None
    if not len(length["chosen"]):
        return None
    if layout == PADDED:
        return 2 * batch_size * int(max(length["chosen"].max(), length["rejected"].max()))
    shared = np.maximum(length["prompt"] - 1, 0) if layout == PREFIX_SHARED else 0
    per_pair = np.sort(length["chosen"] + length["rejected"] - shared)
    return int(per_pair[-batch_size:].sum()) + FLEX_BLOCK_SIZE


def _list_lengths(column):
    """Lengths of an Arrow list column, read from its offsets (no row is materialized)."""
    import numpy as np
    import pyarrow.compute as pc

    return np.asarray(pc.list_value_length(column).to_numpy(), dtype=np.int64)


def plan_for_training(
    model: nn.Module, args, *, max_length: int, sharded: bool, memory=None, dataset=None
) -> ActivationPlan:
    """The plan for a trainer's ``model`` and config ``args``: the largest micro-batch is ``2 · batch · max_length``
    positions in every layout (a packed pair ``[prompt | chosen | rejected]`` reaches ``2·max_length - prompt``), or
    fewer where the tokenized training ``dataset`` says so (``largest_batch_positions``). ``memory``: ``(free,
    total)`` bytes, read from the model's CUDA device when None; ignored when ``sharded`` (FSDP / DeepSpeed shard the
    state that the budget counts whole)."""
    policy = check_policy(getattr(args, "activation_policy", "auto"))
    lm = unwrap_causal_lm(model)
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    device = next(model.parameters()).device
    if memory is None and device.type == "cuda" and not sharded:
        memory = torch.cuda.mem_get_info(device)
    half = getattr(args, "bf16", False) or getattr(args, "fp16", False) or lm.dtype in (torch.bfloat16, torch.float16)
    batch = args.per_device_train_batch_size
    positions = 2 * batch * max_length
    if dataset is not None and policy == "auto" and memory is not None and not sharded:  # only auto reads it
        longest = largest_batch_positions(dataset, batch, getattr(args, "batch_layout", PADDED))
        positions = min(positions, longest or positions)
    estimate = estimate_for(config, positions=positions, dtype_bytes=2 if half else 4)
    chunk = getattr(args, "fused_chunk_bytes", None) or DEFAULT_CHUNK_BYTES_TRAINABLE
    head = 2 * chunk + positions * config.hidden_size * 4  # a logits chunk and its gradient, the fp32 dHidden
    return resolve_plan(
        policy,
        num_layers=len(decoder_layers(model)) or config.num_hidden_layers,
        # a plain CPOConfig cannot say whether its gradient_checkpointing=True was chosen: keep TRL's behaviour
        checkpointing_explicit=getattr(args, "_gradient_checkpointing_explicit", True),
        estimate=estimate,
        memory=None if sharded else memory,
        reserved_bytes=state_bytes(model) + head,
    )


def plan_line(plan: ActivationPlan, num_layers: int) -> str:
    """The one logged line: what was chosen and why."""
    return f"FusedCPOTrainer: activations: {plan.describe(num_layers)}; {plan.reason}."
