"""The launcher as a package entry point, and a user's one local file with every shipped recipe.

``python -m trl_fused_cpo.train``, ``scripts/train_cpo.py`` and the ``trl-fused-cpo`` console script are one command.
A single local .jsonl is one 'train' split: every recipe evaluates on a 'test' split, so each must train on such a
file without evaluation (saying so once) instead of failing, as they did, on the missing split and then on
``eval_on_start``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_fused_cpo.toy import TOY_MODEL_NAME, load_toy_preferences

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").rglob("*.yaml"))


def _env() -> dict[str, str]:
    return {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow  # two subprocesses: 10-12 s of imports each on 2 shared cores
@pytest.mark.parametrize(
    "command",
    [[sys.executable, "-m", "trl_fused_cpo.train"], [sys.executable, "scripts/train_cpo.py"]],
    ids=["python -m", "script"],
)
def test_entry_points_run_the_launcher(command):
    proc = subprocess.run(
        [*command, "--help"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--config RECIPE.yaml" in proc.stdout and "--fused_backend" in proc.stdout


def test_console_script_points_at_the_launcher():
    import importlib

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["trl-fused-cpo"].partition(":")
    from trl_fused_cpo.train import cli_main

    assert getattr(importlib.import_module(module), name) is cli_main


def _cpu_overrides(recipe: str) -> list[str]:
    """The toy model on CPU in fp32, one step of one micro-batch: each GPU recipe's own settings otherwise (its packed
    layout on sdpa's dense mask, the CPU path)."""
    cpu = ["--use_cpu", "true", "--bf16", "false", "--tf32", "false", "--dtype", "float32"]
    cpu += ["--model_name_or_path", TOY_MODEL_NAME, "--max_steps", "1", "--gradient_accumulation_steps", "1"]
    cpu += ["--save_strategy", "no", "--logging_steps", "1", "--disable_tqdm", "true"]
    text = (ROOT / recipe).read_text()
    if "qlora" in recipe:  # bitsandbytes: no 4-bit base, no paged 8-bit optimizer on CPU
        cpu += ["--load_in_4bit", "false", "--optim", "adamw_torch"]
    if not torch.cuda.is_available() and "adamw_torch_fused" in text:
        cpu += ["--optim", "adamw_torch"]
    if "attn_implementation: flex_attention" in text:  # flex's backward needs CUDA
        cpu += ["--attn_implementation", "sdpa"]
    return cpu


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_one_local_jsonl_trains_with_every_recipe(recipe, tmp_path, caplog):
    from trl_fused_cpo.train import main, make_parser

    data = tmp_path / "my_pairs.jsonl"
    rows = load_toy_preferences("train")[:8]
    data.write_text("".join(json.dumps({k: r[k] for k in ("prompt", "chosen", "rejected")}) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = ["--config", str(ROOT / recipe), "--dataset_name", str(data), "--output_dir", str(out)]
    args = make_parser().parse_args_and_config([*argv, *_cpu_overrides(recipe)])

    with caplog.at_level(logging.WARNING, logger="trl_fused_cpo.train"):
        metrics = main(*args)

    said = [r.getMessage() for r in caplog.records if r.name == "trl_fused_cpo.train"]
    assert len(said) == 1 and said[0].startswith("No evaluation: dataset_test_split='test'"), said
    assert "give a test split" in said[0]
    assert metrics["train_loss"] == metrics["train_loss"]  # finite, not NaN
    assert not any(k.startswith("eval_") for k in metrics)
    assert (out / "train_results.json").exists() and not (out / "eval_results.json").exists()
    saved = "adapter_model.safetensors" if "lora" in recipe else "model.safetensors"
    assert (out / saved).exists(), saved


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe", ["recipes/llama3_2/1B_full_cpo_single_device.yaml", "recipes/llama3/8B_lora_cpo_single_device.yaml"]
)
def test_the_packed_opt_in_trains_through_the_launcher_like_padded(recipe, tmp_path):
    """The headers' opt-in through the whole launcher: the same first step as the recipe's padded layout.

    On CPU the packed layout runs on sdpa's dense mask (flex_attention's backward needs CUDA); LoRA dropout is off so
    that both layouts draw no random numbers.
    """
    from trl_fused_cpo.train import main, make_parser

    metrics = {}
    for layout in ("padded", "prefix_shared"):
        argv = ["--config", str(ROOT / recipe), "--dataset_name", "toy", "--output_dir", str(tmp_path / layout)]
        argv += [*_cpu_overrides(recipe), "--batch_layout", layout, "--lora_dropout", "0", "--eval_strategy", "no"]
        argv += ["--eval_on_start", "false", "--per_device_train_batch_size", "4"]
        metrics[layout] = main(*make_parser().parse_args_and_config(argv))
    assert metrics["prefix_shared"]["train_loss"] == pytest.approx(metrics["padded"]["train_loss"], rel=1e-5)


def test_peak_memory_line_reports_the_run_on_cuda_and_nothing_without(monkeypatch):
    from types import SimpleNamespace

    from trl_fused_cpo.train import peak_memory_line

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peak_memory_line() is None
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 11.25 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 13.5 * gib)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=80 * gib))
    assert peak_memory_line() == ("Peak GPU memory (this process): 11.2 GiB allocated, 13.5 GiB reserved, of 80 GiB")
