"""Any recipe on CPU at toy size (``--cpu_smoke true``), and the GPU settings that a machine without CUDA refuses.

``--cpu_smoke true`` keeps what a recipe says about the method (loss, LoRA, batch layout, gradient checkpointing,
optimiser schedule) and swaps what needs a GPU or a download for its CPU stand-in: the embedded toy model in fp32,
no bf16/fp16/tf32 and no 4-bit base, sdpa for flex_attention (flex's backward needs CUDA), the toy data for a hub
dataset (a local file or folder is kept: that is the user's data to check), a few steps of small batches at a short
``max_length``, nothing saved but the final model, to ``<output_dir>-cpu-smoke``. Any flag on the command line still
overrides these: they are the recipe's values, replaced before the command line is read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .toy import TOY_DATASET_NAME, TOY_MODEL_NAME

SMOKE_FLAG = "--cpu_smoke"
SMOKE_STEPS = 2  # one step proves the wiring; a second one runs the optimizer's state after its first update
SMOKE_MAX_LENGTH = 64  # the longest toy pair is ~20 tokens; a user's long pairs are truncated, not refused
_SMOKE_BATCH = 4  # pairs a micro-batch: enough for prefix_shared to pack several pairs into one row
_CPU_ATTENTION = ("sdpa", "eager")
_GPU_OPTIMIZERS = ("paged_", "adamw_bnb", "adamw_8bit", "lion_8bit", "adamw_torch_fused", "adamw_apex_fused")


def cpu_smoke_overrides(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe values that ``--cpu_smoke true`` replaces (see the module docstring), given the recipe's own."""
    overrides: dict[str, Any] = dict(
        model_name_or_path=TOY_MODEL_NAME,
        dtype="float32",
        use_cpu=True,
        bf16=False,
        fp16=False,
        tf32=False,
        load_in_4bit=False,
        load_in_8bit=False,
        use_liger_kernel=False,
        torch_compile=False,
        max_steps=SMOKE_STEPS,
        gradient_accumulation_steps=1,
        per_device_train_batch_size=min(int(recipe.get("per_device_train_batch_size") or 8), _SMOKE_BATCH),
        per_device_eval_batch_size=_SMOKE_BATCH,
        max_length=SMOKE_MAX_LENGTH,
        max_completion_length=None,
        max_train_samples=_SMOKE_BATCH * SMOKE_STEPS,
        max_eval_samples=_SMOKE_BATCH,
        eval_on_start=False,
        save_strategy="no",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        output_dir=f"{str(recipe.get('output_dir') or 'outputs/run').rstrip('/')}-cpu-smoke",
    )
    if recipe.get("attn_implementation") not in (None, *_CPU_ATTENTION):
        overrides["attn_implementation"] = "sdpa"  # the packed layouts run on sdpa's dense mask on CPU
    optim = str(recipe.get("optim") or "")
    if optim.startswith(_GPU_OPTIMIZERS):
        overrides["optim"] = "adamw_torch"
    if recipe.get("fused_backend") == "triton":
        overrides["fused_backend"] = "auto"  # the torch backend on CPU
    name = recipe.get("dataset_name")
    if name and name != TOY_DATASET_NAME and not os.path.exists(str(name)):
        overrides["dataset_name"] = TOY_DATASET_NAME  # a hub dataset: no download in a smoke run
        overrides.update(dataset_config=None, dataset_train_split="train", dataset_test_split="test")
    return overrides


def smoke_requested(argv: list[str]) -> bool | None:
    """``--cpu_smoke`` on the command line: True/False as given (a bare flag is True), None when absent."""
    from transformers.hf_argparser import string_to_bool

    for index, arg in enumerate(argv):
        if arg == SMOKE_FLAG:
            value = argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("--") else "true"
            return string_to_bool(value)
        if arg.startswith(SMOKE_FLAG + "="):
            return string_to_bool(arg.split("=", 1)[1])
    return None


def gpu_settings(values: Mapping[str, Any]) -> list[str]:
    """The settings among ``values`` (parsed fields) that need a CUDA GPU, as ``key: value`` for a message.

    The ones transformers refuses while the config is built: bf16 and fp16 without a GPU unless ``use_cpu`` is set
    (then bf16 autocasts on CPU), and tf32 always. (A 4-bit base is refused later, when the model loads.)
    """
    found = []
    if not values.get("use_cpu"):
        for key in ("bf16", "fp16"):
            if values.get(key):
                found.append(f"{key}: true")
        if values.get("bf16") is None and not values.get("fp16"):
            found.append("bf16 unset (CPOConfig's default: true)")
    if values.get("tf32"):
        found.append("tf32: true")
    return found
