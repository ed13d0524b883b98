"""``--cpu_smoke true`` runs every shipped recipe on CPU at toy size, keeping what the recipe says about the method.

Before, a GPU recipe on a CPU machine failed in transformers ("Your setup doesn't support bf16/gpu"), and the
overrides that made one run on CPU lived only in a test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from trl_fused_cpo.cpu_smoke import SMOKE_MAX_LENGTH, SMOKE_STEPS, cpu_smoke_overrides
from trl_fused_cpo.toy import TOY_DATASET_NAME, TOY_MODEL_NAME

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").rglob("*.yaml"))


def _parse(*argv: str):
    from trl_fused_cpo.cli import make_parser

    return make_parser().parse_args_and_config(list(argv))


@pytest.mark.parametrize("recipe", RECIPES)
def test_cpu_smoke_trains_every_recipe_on_cpu(recipe, tmp_path, monkeypatch, capsys):
    from trl_fused_cpo.train import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same run on a GPU machine
    out = tmp_path / "out"
    script_args, training_args, model_args = _parse(
        "--config", str(ROOT / recipe), "--cpu_smoke", "true", "--output_dir", str(out)
    )
    own = yaml.safe_load((ROOT / recipe).read_text())
    # What needs a GPU or a download is replaced ...
    assert model_args.model_name_or_path == TOY_MODEL_NAME and training_args.use_cpu
    assert not training_args.bf16 and not training_args.tf32 and not model_args.load_in_4bit
    assert training_args.max_steps == SMOKE_STEPS and training_args.max_length == SMOKE_MAX_LENGTH
    assert script_args.dataset_name == TOY_DATASET_NAME
    # ... and what the recipe says about the method is kept.
    for key in ("loss_type", "beta", "cpo_alpha", "batch_layout", "use_peft", "lora_r", "gradient_checkpointing"):
        if key in own:
            objects = (script_args, training_args, model_args)
            assert next(getattr(o, key) for o in objects if hasattr(o, key)) == own[key], key

    metrics = main(script_args, training_args, model_args)

    assert metrics["train_loss"] == metrics["train_loss"], metrics  # finite
    stdout = capsys.readouterr().out
    assert f"Training {TOY_MODEL_NAME}" in stdout and f"batch_layout {own.get('batch_layout', 'padded')}" in stdout
    saved = "adapter_model.safetensors" if own.get("use_peft") else "model.safetensors"
    assert (out / saved).exists(), saved


def test_cpu_smoke_keeps_a_local_dataset_and_the_command_line_wins(tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text('{"prompt": "name some fruits :", "chosen": " apple", "rejected": " red"}\n')
    recipe = str(ROOT / "recipes" / "llama3_2" / "1B_full_cpo_single_device.yaml")
    script_args, training_args, model_args = _parse(
        "--config", recipe, "--cpu_smoke", "true", "--dataset_name", str(data), "--max_steps", "5"
    )
    assert script_args.dataset_name == str(data) and training_args.max_steps == 5
    assert model_args.attn_implementation == "sdpa"  # flex_attention's backward needs CUDA
    assert training_args.output_dir == "outputs/llama3_2-1B-full-cpo-cpu-smoke"  # not the real run's folder


def test_cpu_smoke_overrides_replace_only_the_gpu_settings():
    overrides = cpu_smoke_overrides({"optim": "paged_adamw_8bit", "attn_implementation": "eager", "lora_r": 16})
    assert overrides["optim"] == "adamw_torch" and "attn_implementation" not in overrides and "lora_r" not in overrides
    assert "optim" not in cpu_smoke_overrides({"optim": "adamw_torch"})


@pytest.mark.slow
def test_cpu_smoke_through_the_real_command(tmp_path):
    recipe = str(ROOT / "recipes" / "llama3" / "8B_lora_cpo_single_device.yaml")
    cmd = [sys.executable, "-m", "trl_fused_cpo.train", "--config", recipe, "--cpu_smoke", "true"]
    cmd += ["--output_dir", str(tmp_path / "out")]
    env = {"CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Training toy-llama3" in proc.stdout and "batch_layout prefix_shared" in proc.stdout
    assert "Saved adapter and tokenizer to" in proc.stdout
