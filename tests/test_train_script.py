"""The launcher end to end on CPU: through `accelerate launch`, with LoRA, and as 2-process DDP (gloo) through
configs/cpu_ddp.yaml; a GPU accelerate config's bf16 on CPU gives way to the recipe's fp32.

The DDP test is the one that catches a fused path that skips the wrapper's hooks: both ranks must end with the
same parameters (gradients were all-reduced) and those must equal a 1-process run over the same global batch
(gradients were averaged correctly, NLL token normalisation included).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "scripts" / "train_cpo.py")
TINY = str(ROOT / "recipes" / "dev" / "tiny_cpo.yaml")
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def _env(tmp_path: Path, threads: int = 2) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        HF_HOME=str(tmp_path / "hf"),  # no user accelerate default_config.yaml leaks in
        HF_HUB_OFFLINE="1",
        TRL_EXPERIMENTAL_SILENCE="1",
        OMP_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        CUDA_VISIBLE_DEVICES="",  # these are CPU tests even on a GPU runner
    )
    return env


def _run(cmd: list[str], tmp_path: Path, *, threads: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd, cwd=ROOT, env=_env(tmp_path, threads), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc


QUICK = ["--eval_on_start", "false", "--logging_steps", "1", "--disable_tqdm", "true", "--max_eval_samples", "16"]


@pytest.mark.slow
def test_tiny_recipe_trains_through_accelerate_launch(tmp_path):
    out = tmp_path / "run"
    cmd = [*ACCELERATE, "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no"]
    cmd += ["--dynamo_backend", "no", SCRIPT, "--config", TINY, "--max_steps", "3", "--eval_steps", "3"]
    proc = _run([*cmd, *QUICK, "--output_dir", str(out)], tmp_path)

    assert "Final eval: rewards/accuracies" in proc.stdout
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "trainer_state.json"):
        assert (out / name).exists(), name
    evals = json.loads((out / "eval_results.json").read_text())
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert f"eval_{key}" in evals, key  # TRL's metric keys, eval_-prefixed
    assert 0.0 <= evals["eval_rewards/accuracies"] <= 1.0 and math.isfinite(evals["eval_loss"])
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    train_logs = [h for h in history if "loss" in h and "rewards/accuracies" in h]
    assert len(train_logs) == 3 and all(math.isfinite(h["loss"]) for h in train_logs)

    # What was saved reloads as an ordinary causal LM with its tokenizer.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).pad_token == "<pad>" and model.config.num_hidden_layers == 2


@pytest.mark.slow
def test_lora_run_saves_the_adapter_and_tokenizer(tmp_path):
    # Plain `python scripts/train_cpo.py` (no launcher), LoRA on a tied-embedding toy model.
    out = tmp_path / "lora"
    cmd = [sys.executable, SCRIPT, "--config", TINY, "--max_steps", "2", "--eval_steps", "2", *QUICK]
    cmd += ["--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj"]
    cmd += ["--tie_word_embeddings", "true", "--output_dir", str(out)]
    proc = _run(cmd, tmp_path)

    assert "Saved adapter and tokenizer" in proc.stdout
    assert (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists()
    assert (out / "tokenizer.json").exists() and not (out / "model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    assert "eval_rewards/accuracies" in json.loads((out / "eval_results.json").read_text())  # the step-2 evaluation


_DRIVER = textwrap.dedent(
    """
    # Runs the launcher's main() unchanged; each rank also saves its own parameters at save time.
    import os
    import torch
    from trl_fused_cpo import train
    from trl_fused_cpo.trainer import FusedCPOTrainer

    _save_model = FusedCPOTrainer.save_model

    def save_model(self, output_dir=None, _internal_call=False):
        model = self.accelerator.unwrap_model(self.model)
        state = {{k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}
        torch.save(state, os.path.join(self.args.output_dir, f"rank{{self.accelerator.process_index}}.pt"))
        with open(os.path.join(self.args.output_dir, f"world{{self.accelerator.process_index}}.txt"), "w") as f:
            f.write(f"{{self.accelerator.num_processes}} {{self.accelerator.distributed_type.value}}")
        return _save_model(self, output_dir, _internal_call)

    FusedCPOTrainer.save_model = save_model
    train.cli_main()
    """
)


def _equal_chosen_length_pairs(path: Path, n: int, words: int = 3) -> None:
    """Toy pairs whose chosen completions all have ``words`` tokens (+ eos).

    CPO's NLL term is a token mean over the *local* batch's chosen tokens; DDP averages per-rank losses. The two
    agree with one process over the global batch only when every rank sees as many chosen tokens, so the test
    equalises them (the preference term is a per-pair mean and agrees regardless).
    """
    from trl_fused_cpo.toy import load_toy_preferences

    rows = [r for r in load_toy_preferences("train") if len(r["chosen"].split()) == words][:n]
    assert len(rows) == n
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_ddp_two_ranks_match_one_process_over_the_same_global_batch(tmp_path):
    steps = 3
    data = tmp_path / "pairs.jsonl"
    _equal_chosen_length_pairs(data, n=4 * steps)
    driver = tmp_path / "driver.py"
    driver.write_text(_DRIVER.format())
    # SGD keeps the update linear in the gradient: Adam's g/sqrt(v) turns 1e-7 float reduction-order noise into 3e-5
    # after 3 steps at lr 1e-2 (measured), which would hide nothing but loosen the tolerance.
    common = ["--config", TINY, "--dataset_name", str(data), "--eval_strategy", "no", "--eval_on_start", "false"]
    common += ["--max_steps", str(steps), "--train_sampling_strategy", "sequential", "--optim", "sgd"]
    common += ["--learning_rate", "0.5", "--lr_scheduler_type", "constant", "--warmup_steps", "0"]
    common += ["--logging_steps", "1", "--disable_tqdm", "true", "--seed", "42"]

    two, one = tmp_path / "two", tmp_path / "one"
    # The shipped CPU config: accelerate's torchrun launcher; with use_cpu (the recipe) each rank is a CPU process.
    ddp = [*ACCELERATE, "--config_file", str(ROOT / "configs" / "cpu_ddp.yaml"), "--main_process_port", "29517"]
    ddp += [str(driver)]
    proc = _run([*ddp, *common, "--per_device_train_batch_size", "2", "--output_dir", str(two)], tmp_path, threads=1)
    # The recipe's ddp_find_unused_parameters: false: no "find_unused_parameters=True ... did not find any" per rank.
    assert "find_unused_parameters" not in proc.stderr, proc.stderr[-3000:]
    _run(
        [sys.executable, str(driver), *common, "--per_device_train_batch_size", "4", "--output_dir", str(one)], tmp_path
    )

    assert (two / "world0.txt").read_text() == (two / "world1.txt").read_text() == "2 MULTI_CPU"
    rank0, rank1 = torch.load(two / "rank0.pt"), torch.load(two / "rank1.pt")
    single = torch.load(one / "rank0.pt")
    from trl_fused_cpo.toy import toy_model

    init = toy_model(seed=42).state_dict()
    assert rank0.keys() == rank1.keys() == single.keys()
    moved = max((rank0[k] - init[k]).abs().max().item() for k in rank0)
    assert moved > 1e-2, f"training barely moved the parameters ({moved:.2e}): the comparison would be vacuous"
    for key in rank0:
        torch.testing.assert_close(rank0[key], rank1[key], rtol=0, atol=0, msg=f"ranks differ on {key}")
        torch.testing.assert_close(rank0[key], single[key], rtol=0, atol=1e-5, msg=f"DDP != 1 process on {key}")
    # The saved checkpoint is rank 0's.
    from safetensors.torch import load_file

    saved = load_file(two / "model.safetensors")
    torch.testing.assert_close(saved["lm_head.weight"], rank0["lm_head.weight"])


@pytest.mark.slow
def test_a_gpu_accelerate_config_on_cpu_keeps_the_recipe_fp32(tmp_path):
    """configs/single_gpu.yaml exports mixed_precision bf16; on CPU with the recipe's bf16: false it ran bf16 autocast
    (4.6x slower) silently. Now it is turned off, saying so, and the opening line says fp32."""
    cmd = [*ACCELERATE, "--config_file", str(ROOT / "configs" / "single_gpu.yaml"), SCRIPT, "--config", TINY]
    cmd += ["--max_steps", "1", "--eval_strategy", "no", *QUICK, "--output_dir", str(tmp_path / "out")]
    proc = _run(cmd, tmp_path)
    assert "mixed_precision: bf16 is off: this run is on CPU" in proc.stderr, proc.stderr[-3000:]
    opening = next(line for line in proc.stdout.splitlines() if line.startswith("Training "))
    assert "cpu, fp32, 1 process" in opening, opening
