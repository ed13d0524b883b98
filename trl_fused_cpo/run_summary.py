"""The launcher's opening and closing lines: what runs (model, data, trainer, backend, layout, hardware), and what it
did (the metric before -> after, where the model went)."""

from __future__ import annotations

import math
from typing import Any


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n < 1e9 else f"{n / 1e9:.2f}B"


def opening_line(trainer, script_args, model_args, n_train: int, n_eval: int | None, evaluate: bool) -> str:
    """``Training <model> (<params>) on <data>: <pairs>; <trainer>, <loss>, <backend>, <layout>; <hardware>; <steps>``."""
    from .ops.backend import resolve_backend

    args = trainer.args
    model = trainer.model
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    device = trainer.accelerator.device
    dtype = next(model.parameters()).dtype
    if getattr(trainer, "use_fused_loss", False):
        backend = resolve_backend(args.fused_backend, device, dtype)
        loss = f"fused loss on the {backend} backend"
    else:
        loss = "TRL's stock loss"
    precision = str(dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
    if trainer.accelerator.mixed_precision != "no":
        precision = f"{trainer.accelerator.mixed_precision} autocast over {precision} weights"
    data = f"{n_train} train" + (f" / {n_eval} eval pairs" if evaluate and n_eval else " pairs, no evaluation")
    steps = f"{args.max_steps} steps" if args.max_steps > 0 else f"{args.num_train_epochs:g} epochs"
    world = trainer.accelerator.num_processes
    return (
        f"Training {model_args.model_name_or_path} ({_millions(params)} parameters, {_millions(trainable)} trainable) "
        f"on {script_args.dataset_name}: {data}. {type(trainer).__name__}, {args.loss_type} loss, {loss}, "
        f"batch_layout {getattr(trainer, 'batch_layout', 'padded')}, attention "
        f"{getattr(model.config, '_attn_implementation', '?')}; {device.type}, {precision}, "
        f"{world} process{'es' if world > 1 else ''}; {steps} of {args.per_device_train_batch_size} pairs a device."
    )


def _first_and_last(history: list[dict[str, Any]], key: str) -> tuple[dict, dict] | None:
    entries = [h for h in history if isinstance(h.get(key), (int, float)) and math.isfinite(h[key])]
    if len(entries) < 2 or entries[0].get("step") == entries[-1].get("step"):
        return None  # the final evaluate() repeats the last step's: no before -> after
    return entries[0], entries[-1]


def closing_line(history: list[dict[str, Any]], saved: str, output_dir: str) -> str:
    """``Done: <metric> <before> -> <after> (step a -> b). Saved <what> and tokenizer to <dir>.``

    The held-out ``eval_rewards/accuracies`` when it was measured twice (``eval_on_start`` gives the untrained one),
    else the training loss from its first to its last logged step.
    """
    for key in ("eval_rewards/accuracies", "loss"):
        pair = _first_and_last(history, key)
        if pair:
            first, last = pair
            change = f"{key} {first[key]:.3f} -> {last[key]:.3f} (step {first.get('step', '?')} -> {last.get('step')})"
            break
    else:
        change = "too few logged steps for a before -> after"
    return f"Done: {change}. Saved {saved} and tokenizer to {output_dir}."
