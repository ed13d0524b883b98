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

from trl_fused_cpo.toy import load_toy_preferences

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
    """The launcher's own CPU switch (trl_fused_cpo/cpu_smoke.py: the toy model on CPU in fp32, each GPU recipe's own
    settings otherwise, its packed layout on sdpa's dense mask), one step."""
    return ["--cpu_smoke", "true", "--max_steps", "1", "--disable_tqdm", "true"]


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
        argv += ["--eval_on_start", "false", "--per_device_train_batch_size", "4", "--max_train_samples", "8"]
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


# ------------------------------------------------------------------------- settings honoured, lines printed


def _tiny(tmp_path, *extra: str):
    from trl_fused_cpo.train import make_parser

    argv = ["--config", str(ROOT / "recipes" / "dev" / "tiny_cpo.yaml"), "--output_dir", str(tmp_path / "out")]
    argv += ["--max_steps", "2", "--disable_tqdm", "true", "--max_eval_samples", "8", *extra]
    return make_parser().parse_args_and_config(argv)


def test_eval_strategy_no_means_no_evaluation(tmp_path, capsys):
    from trl_fused_cpo.train import main

    metrics = main(*_tiny(tmp_path, "--eval_strategy", "no", "--eval_on_start", "false"))
    assert not any(k.startswith("eval_") for k in metrics), metrics  # the final evaluation ran here before
    assert not (tmp_path / "out" / "eval_results.json").exists()
    assert "Final eval" not in capsys.readouterr().out


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_toy_model_honours_attn_implementation(tmp_path, attention):
    from trl_fused_cpo.models import load_model_and_tokenizer

    script_args, training_args, model_args = _tiny(tmp_path, "--attn_implementation", attention)
    model, _ = load_model_and_tokenizer(script_args, training_args, model_args)
    assert model.config._attn_implementation == attention  # always sdpa before


def test_opening_and_closing_lines_say_what_runs_and_what_it_did(tmp_path, capsys):
    from trl_fused_cpo.train import main

    main(*_tiny(tmp_path, "--eval_steps", "2", "--logging_steps", "1"))
    lines = capsys.readouterr().out.splitlines()
    opening = next(line for line in lines if line.startswith("Training "))
    for words in ("toy-llama3", "on toy: 512 train / 8 eval pairs", "FusedCPOTrainer", "sigmoid loss"):
        assert words in opening, (words, opening)
    for words in ("fused loss on the torch backend", "batch_layout padded", "cpu, fp32, 1 process", "2 steps"):
        assert words in opening, (words, opening)
    closing = lines[-1]
    assert closing.startswith("Done: eval_rewards/accuracies ") and "(step 0 -> 2)" in closing, closing
    assert closing.endswith(f"Saved model and tokenizer to {tmp_path / 'out'}."), closing
    # The final metrics reuse the evaluation Trainer ran at the last step (before, a second pass: steps [0, 2, 2]).
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    assert [h["step"] for h in history if "eval_loss" in h] == [0, 2]


def test_final_metrics_are_the_best_models_under_load_best_model_at_end(tmp_path):
    """With load_best_model_at_end, Trainer loads the best checkpoint after training and the final evaluation is of
    that model; reusing the last step's evaluation reported the last model's metrics next to the best model saved."""
    from trl_fused_cpo.train import main

    extra = ["--eval_steps", "1", "--save_strategy", "steps", "--save_steps", "1", "--eval_on_start", "false"]
    extra += ["--load_best_model_at_end", "true", "--metric_for_best_model", "eval_loss", "--greater_is_better", "true"]
    metrics = main(*_tiny(tmp_path, *extra))
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    by_step = {}  # the evaluations during training: the first at each step (the final one may repeat the last step)
    for h in state["log_history"]:
        if "eval_loss" in h:
            by_step.setdefault(h["step"], h["eval_loss"])
    assert by_step[1] != by_step[2] and state["best_global_step"] == max(by_step, key=by_step.get)  # not the last
    assert metrics["eval_loss"] == pytest.approx(by_step[state["best_global_step"]], rel=1e-6)


def _conversational(rows: list[dict], explicit: bool) -> list[dict]:
    """TRL's conversational formats of standard rows: explicit prompt (a prompt column) or implicit (in both sides)."""
    out = []
    for r in rows:
        prompt = [{"role": "user", "content": r["prompt"]}]
        chosen = [{"role": "assistant", "content": r["chosen"].strip()}]
        rejected = [{"role": "assistant", "content": r["rejected"].strip()}]
        if explicit:
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        else:
            out.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
    return out


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit prompt", "implicit prompt"])
def test_conversational_data_trains_with_the_cpu_recipe_as_its_standard_form(tmp_path, explicit):
    """The toy tokenizer's chat template renders a conversation to the same tokens as the standard row: one step on
    either gives the same loss. (Before, the toy tokenizer had no chat template and this data was refused.)"""
    from trl_fused_cpo.train import main

    rows = load_toy_preferences("train")[:8]
    losses = {}
    for form, data in (("standard", rows), ("conversational", _conversational(rows, explicit))):
        path = tmp_path / f"{form}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
        args = _tiny(tmp_path / form, "--dataset_name", str(path), "--max_steps", "1", "--eval_on_start", "false")
        losses[form] = main(*args)["train_loss"]
    assert losses["conversational"] == pytest.approx(losses["standard"], rel=1e-6), losses


def test_chat_template_setting_gives_a_tokenizer_without_one_a_template(tmp_path):
    from trl_fused_cpo.models import load_model_and_tokenizer
    from trl_fused_cpo.toy import toy_model, toy_tokenizer

    folder = tmp_path / "base"
    tokenizer = toy_tokenizer()
    tokenizer.chat_template = None
    toy_model().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for message in messages %}{{ message['role'] }} {{ message['content'] }} {% endfor %}")
    for value in (str(template), template.read_text()):
        args = _tiny(tmp_path, "--model_name_or_path", str(folder), "--chat_template", value)
        _, loaded = load_model_and_tokenizer(*args)
        assert loaded.chat_template == template.read_text()
