"""Every user error of the launcher is one ``error:`` line with the file, row or key and the fix, exit status 2.

Each case runs the real entry point: in-process through ``cli_main`` (fast), and through ``python -m
trl_fused_cpo.train`` in a subprocess (marked slow: 10 s of imports each on 2 shared cores). Before, each of these
was a ~24-line traceback (exit 1), or for no arguments and a GPU recipe on a CPU machine, transformers' "Your setup
doesn't support bf16/gpu". ``TRL_FUSED_CPO_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trl_fused_cpo.toy import load_toy_preferences, toy_model, toy_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "recipes" / "dev" / "tiny_cpo.yaml")
GPU_RECIPE = str(ROOT / "recipes" / "llama3" / "8B_lora_simpo_single_device.yaml")
QUICK = ["--max_steps", "1", "--eval_strategy", "no", "--eval_on_start", "false", "--disable_tqdm", "true"]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("TRL_FUSED_CPO_DEBUG", None)
    return env


def _pairs_file(tmp_path: Path, rows: list[dict] | None = None, name: str = "pairs.jsonl") -> Path:
    rows = rows if rows is not None else load_toy_preferences("train")[:4]
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _no_template_checkpoint(tmp_path: Path) -> Path:
    """A local model folder whose tokenizer has no chat template (as a base model's)."""
    folder = tmp_path / "base-model"
    tokenizer = toy_tokenizer()
    tokenizer.chat_template = None
    toy_model().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


CONVERSATIONAL = [
    {
        "chosen": [{"role": "user", "content": "name some fruits :"}, {"role": "assistant", "content": "apple pear"}],
        "rejected": [{"role": "user", "content": "name some fruits :"}, {"role": "assistant", "content": "red cat"}],
    }
] * 4


def _case(name: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """``(argv, what the error line must say)`` for one user error."""
    out = ["--output_dir", str(tmp_path / "out"), *QUICK]
    if name == "recipe file missing":
        return ["--config", str(tmp_path / "my_recipe.yaml")], ["my_recipe.yaml: no such file", "recipes/dev/tiny"]
    if name == "recipe not YAML":
        bad = tmp_path / "bad.yaml"
        bad.write_text("beta: 0.1\nloss_type: [sigmoid\n")
        return ["--config", str(bad)], [f"Recipe {bad}, line 3: not valid YAML"]
    if name == "recipe not a mapping":
        bad = tmp_path / "list.yaml"
        bad.write_text("- beta: 0.1\n")
        return ["--config", str(bad)], [f"Recipe {bad}: a YAML list, expected a mapping"]
    if name == "config value refused":
        return ["--config", TINY, "--use_fused_loss", "false", "--batch_layout", "prefix_shared"], [
            f"Recipe {TINY}: batch_layout='prefix_shared' needs use_fused_loss=True"
        ]
    if name == "data file missing":
        return ["--config", TINY, "--dataset_name", "my_pairs.jsonl", *out], [
            "dataset_name='my_pairs.jsonl': no such file or folder",
            "'toy' for the shipped toy data",
        ]
    if name == "data file empty":
        empty = tmp_path / "empty.jsonl"
        empty.write_text("\n")
        return ["--config", TINY, "--dataset_name", str(empty), *out], [f"{empty} is empty"]
    if name == "data file malformed":
        path = _pairs_file(tmp_path)
        path.write_text(path.read_text().replace("}\n", "\n", 1))  # line 1 loses its closing brace
        return ["--config", TINY, "--dataset_name", str(path), *out], [f"{path}, line 1: malformed JSON"]
    if name == "wrong columns":
        path = _pairs_file(tmp_path, [{"prompt": "name :", "response_a": "apple", "response_b": "red"}])
        return ["--config", TINY, "--dataset_name", str(path), *out], [
            f"dataset_name={str(path)!r}: The 'train' split has no 'chosen' or 'rejected' column",
            "['prompt', 'response_a', 'response_b']",
        ]
    if name == "no chat template":
        path = _pairs_file(tmp_path, CONVERSATIONAL)
        model = _no_template_checkpoint(tmp_path)
        return ["--config", TINY, "--dataset_name", str(path), "--model_name_or_path", str(model), *out], [
            "is conversational",
            "no chat_template",
            "--chat_template",
        ]
    if name == "chat template file missing":
        return ["--config", TINY, "--chat_template", "my_template.jinja", *out], [
            "chat_template='my_template.jinja': no such file"
        ]
    if name == "model folder missing":
        return ["--config", TINY, "--model_name_or_path", str(tmp_path / "no-model"), *out], [
            "did not load",
            "toy-llama3",
        ]
    if name == "attention the toy cannot run":
        return ["--config", TINY, "--attn_implementation", "flash_attention_2", *out], [
            "attn_implementation='flash_attention_2' cannot run here",
            "Use sdpa or eager",
        ]
    if name == "GPU recipe on a CPU machine":
        return ["--config", GPU_RECIPE], [
            "needs a CUDA GPU (bf16: true, tf32: true) and this machine has none",
            f"trl-fused-cpo --config {GPU_RECIPE} --cpu_smoke true",
        ]
    raise AssertionError(name)


CASES = [
    "recipe file missing",
    "recipe not YAML",
    "recipe not a mapping",
    "config value refused",
    "data file missing",
    "data file empty",
    "data file malformed",
    "wrong columns",
    "no chat template",
    "chat template file missing",
    "model folder missing",
    "attention the toy cannot run",
    "GPU recipe on a CPU machine",
]


def _assert_one_error_line(err: str, says: list[str]) -> None:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines[-8:]
    assert "Traceback" not in err, err[-3000:]
    for words in says:
        assert words in errors[0], (words, errors[0])


@pytest.mark.parametrize("name", CASES)
def test_user_error_is_one_line_with_exit_2(name, tmp_path, capsys, monkeypatch):
    import torch

    from trl_fused_cpo.train import cli_main

    monkeypatch.delenv("TRL_FUSED_CPO_DEBUG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    argv, says = _case(name, tmp_path)
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    assert exit_.value.code == 2
    _assert_one_error_line(capsys.readouterr().err, says)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["data file malformed", "no chat template", "GPU recipe on a CPU machine"])
def test_user_error_through_the_real_command(name, tmp_path):
    argv, says = _case(name, tmp_path)
    cmd = [sys.executable, "-m", "trl_fused_cpo.train", *argv]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    _assert_one_error_line(proc.stderr, says)


def test_no_arguments_prints_the_usage_and_that_config_is_required(capsys):
    from trl_fused_cpo.train import cli_main

    with pytest.raises(SystemExit) as exit_:
        cli_main([])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("usage: trl-fused-cpo --config RECIPE.yaml"), err
    assert err[1].startswith("error: --config RECIPE.yaml is required"), err


@pytest.mark.slow
def test_no_arguments_through_the_console_entry(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "trl_fused_cpo.train"], cwd=tmp_path, env=_env(), capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "usage: trl-fused-cpo --config RECIPE.yaml" in proc.stderr
    assert "error: --config RECIPE.yaml is required" in proc.stderr


def test_debug_env_shows_the_traceback(tmp_path, monkeypatch):
    from trl_fused_cpo.errors import LauncherError
    from trl_fused_cpo.train import cli_main

    monkeypatch.setenv("TRL_FUSED_CPO_DEBUG", "1")
    with pytest.raises(LauncherError, match="no such file"):
        cli_main(["--config", str(tmp_path / "missing.yaml")])


def test_one_process_cpu_launch_of_several_is_refused_naming_torchrun(capsys, monkeypatch):
    # What `accelerate launch --cpu --num_processes 2` hands the script: one process, MASTER_PORT, no WORLD_SIZE.
    from trl_fused_cpo.train import cli_main

    for key in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["--config", TINY, *QUICK])
    assert exit_.value.code == 2
    _assert_one_error_line(
        capsys.readouterr().err, ["starts one process on CPU", "configs/cpu_ddp.yaml", "torchrun --nproc_per_node 2"]
    )


@pytest.mark.slow
def test_accelerate_cpu_launch_of_two_processes_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "scripts" / "train_cpo.py")]
    cmd += ["--config", TINY, *QUICK, "--output_dir", str(tmp_path / "out")]
    env = _env(HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    # The script's one line, and its exit status 2 (accelerate then adds its own CalledProcessError traceback).
    assert proc.returncode != 0 and "returned non-zero exit status 2" in proc.stderr, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and "starts one process on CPU" in ours[0] and "torchrun" in ours[0], ours


def test_recipe_files_in_yaml_form_still_parse(tmp_path):
    # The recipe check reads the file itself; an ordinary recipe passes through it unchanged.
    from trl_fused_cpo.cli import make_parser

    recipe = yaml.safe_load(Path(TINY).read_text())
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**recipe, "beta": 0.25}))
    script_args, training_args, model_args = make_parser().parse_args_and_config(["--config", str(path)])
    assert training_args.beta == 0.25 and model_args.model_name_or_path == "toy-llama3"
