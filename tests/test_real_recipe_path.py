"""A real (hub-style) recipe through the launcher on a local random-init checkpoint: from_pretrained + jsonl data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_llama3_2_1b_recipe_runs_on_a_local_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRL_EXPERIMENTAL_SILENCE": "1"}
    ckpt = tmp_path / "ckpt"
    subprocess.run(
        [sys.executable, "scripts/make_random_checkpoint.py", "--model", "toy", "--out", str(ckpt), "--rows", "16"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    cpu = ["--bf16", "false", "--use_cpu", "true", "--tf32", "false", "--gradient_checkpointing", "false"]
    cpu += ["--attn_implementation", "sdpa"]  # the recipe's flex_attention: its backward needs CUDA
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "scripts/train_cpo.py",
        "--config",
        "recipes/llama3_2/1B_full_cpo_single_device.yaml",
        "--model_name_or_path",
        str(ckpt),
        "--dataset_name",
        str(ckpt / "preferences.jsonl"),
        "--max_steps",
        "2",
        "--max_length",
        "64",
        "--per_device_train_batch_size",
        "2",
        "--dtype",
        "float32",
        "--eval_strategy",
        "no",
        "--save_strategy",
        "no",
        "--output_dir",
        str(out),
        *cpu,
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "train_results.json").read_text())
    assert metrics["train_loss"] == metrics["train_loss"]  # finite, not NaN
    assert (out / "model.safetensors").exists()
