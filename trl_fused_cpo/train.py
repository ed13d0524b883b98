"""CPO training with FusedCPOTrainer from a flat YAML recipe: the launcher's ``main()`` and its command line.

    # CPU demo (toy Llama-3, shipped data; the time it takes: docs/results/README.md, "Recipes"):
    trl-fused-cpo --config recipes/dev/tiny_cpo.yaml
    python -m trl_fused_cpo.train --config recipes/dev/tiny_cpo.yaml        # the same

    # Real run: topology from configs/, everything else from the recipe; any field can be overridden on the CLI.
    accelerate launch --config_file configs/single_gpu.yaml -m trl_fused_cpo.train \\
        --config recipes/llama3/8B_lora_cpo_single_device.yaml --beta 0.2 --max_steps 200
    # (scripts/train_cpo.py is the same entry point as a file, for `accelerate launch ... scripts/train_cpo.py`)

Lifecycle: parse (:func:`make_parser`: ``TrlParser`` over ``CPOScriptArguments``, ``FusedCPOConfig``, ``ModelConfig``;
unknown keys or flags, values of the wrong type and bad choices fail by name) → load model + tokenizer (toy
in-process, or ``from_pretrained`` with dtype/QLoRA) → load and validate the preference data → ``FusedCPOTrainer``
(LoRA through ``get_peft_config``) → train → evaluate when an eval split exists (without one, evaluation is off,
with one logged line) → save the model (the adapter under LoRA) and tokenizer to ``output_dir``.
"""

from __future__ import annotations

import logging
import os
import sys

from .cli import CPOScriptArguments, make_parser
from .config import FusedCPOConfig
from .data import load_preference_dataset, validate_preference_dataset
from .errors import DEBUG_ENV, LauncherError
from .models import load_model_and_tokenizer
from .run_summary import closing_line, opening_line

__all__ = ["cli_main", "main", "make_parser"]

logger = logging.getLogger("trl_fused_cpo.train")

# Below this many pairs, datasets' "Map:" bars (6 of them: prompt extraction, chat template, tokenization, per split)
# each finish in well under a second (the toy data's 576 pairs: 0.1 s) and only bury the training log. Above it,
# tokenization takes long enough (UltraFeedback's 61k pairs: minutes) that its progress is worth seeing.
SMALL_DATASET_ROWS = 10_000


def main(script_args: CPOScriptArguments, training_args: FusedCPOConfig, model_args) -> dict[str, float]:
    """Train, evaluate and save one recipe; returns the final metrics (``train_*``; ``eval_*`` with an eval split)."""
    import transformers
    from trl import get_peft_config

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    log_level = training_args.get_process_log_level()
    logger.setLevel(min(log_level, logging.WARNING))  # the launcher's own warnings, whatever the global verbosity
    transformers.utils.logging.set_verbosity(log_level)

    refuse_one_process_cpu_launch(os.environ)
    _cpu_keeps_the_recipe_precision(training_args)
    model, tokenizer = load_model_and_tokenizer(script_args, training_args, model_args)
    peft_config = get_peft_config(model_args)
    train_dataset, eval_dataset = _load_splits(script_args, training_args, tokenizer)
    trainer = _build_trainer(script_args, training_args, model, tokenizer, peft_config, train_dataset, eval_dataset)
    n_eval = len(eval_dataset) if eval_dataset is not None else None
    opening = opening_line(trainer, script_args, model_args, len(train_dataset), n_eval, eval_dataset is not None)
    trainer.accelerator.print(opening)
    metrics = _train_and_evaluate(trainer, training_args, evaluate=eval_dataset is not None)

    # Save: the full model, or only the adapter under LoRA; the tokenizer goes with it (Trainer saves
    # processing_class).
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    what = "adapter" if peft_config is not None else "model"
    trainer.accelerator.print(closing_line(trainer.state.log_history, what, training_args.output_dir))
    # Destroy the process group before exit, as torch asks: without it NCCL warns "process group has NOT been
    # destroyed" on every rank. No-op in one process.
    trainer.accelerator.end_training()
    return metrics


def _load_splits(script_args: CPOScriptArguments, training_args: FusedCPOConfig, tokenizer):
    """``(train, eval or None)``, capped and validated: the train split is required; evaluation runs when the eval
    split exists (without one it is turned off, saying so)."""
    from transformers.trainer_utils import IntervalStrategy

    dataset = load_preference_dataset(script_args)
    if script_args.dataset_train_split not in dataset:
        raise LauncherError(
            f"dataset_train_split={script_args.dataset_train_split!r} is not in {script_args.dataset_name!r}; "
            f"its splits are {list(dataset)}."
        )
    train_dataset = dataset[script_args.dataset_train_split]
    eval_dataset = dataset[script_args.dataset_test_split] if script_args.dataset_test_split in dataset else None
    if training_args.eval_strategy == IntervalStrategy.NO and not training_args.eval_on_start:
        eval_dataset = None  # eval_strategy: 'no' means no evaluation, the final one included
        training_args.do_eval = False
    elif eval_dataset is None:
        _turn_evaluation_off(training_args, script_args, list(dataset), IntervalStrategy.NO)
    if script_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(script_args.max_train_samples, len(train_dataset))))
    if eval_dataset is not None and script_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(min(script_args.max_eval_samples, len(eval_dataset))))
    try:
        validate_preference_dataset(train_dataset, tokenizer, split=script_args.dataset_train_split)
        if eval_dataset is not None:
            validate_preference_dataset(eval_dataset, tokenizer, split=script_args.dataset_test_split)
    except LauncherError as err:
        raise LauncherError(f"dataset_name={script_args.dataset_name!r}: {err}") from err
    return train_dataset, eval_dataset


def _build_trainer(script_args, training_args, model, tokenizer, peft_config, train_dataset, eval_dataset):
    """``FusedCPOTrainer`` (it tokenizes both splits: their progress bars only where that takes a while)."""
    import datasets

    from .trainer import FusedCPOTrainer

    bars = datasets.is_progress_bar_enabled()
    rows = len(train_dataset) + (len(eval_dataset) if eval_dataset is not None else 0)
    if training_args.disable_tqdm or rows < SMALL_DATASET_ROWS:
        datasets.disable_progress_bars()
    try:
        trainer = FusedCPOTrainer(
            model=model,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
        )
    except ValueError as err:  # the trainer's refusals say what, why and the fix (a LoRA adapter on lm_head, ...)
        raise LauncherError(f"FusedCPOTrainer refuses this setup: {err}") from err
    finally:
        if bars:
            datasets.enable_progress_bars()
    if script_args.ignore_bias_buffers:  # DDP cannot broadcast bool buffers (transformers#22482)
        import torch

        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]
    return trainer


def _train_and_evaluate(trainer, training_args: FusedCPOConfig, *, evaluate: bool) -> dict[str, float]:
    """Train, then evaluate once at the end (besides any eval_strategy evaluations); the metrics of both."""
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = {f"train_{k}" if not k.startswith("train_") else k: v for k, v in train_result.metrics.items()}
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    if evaluate:
        eval_metrics = _eval_at_the_last_step(trainer) or trainer.evaluate()
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
        trainer.accelerator.print(
            f"Final eval: rewards/accuracies {eval_metrics.get('eval_rewards/accuracies', float('nan')):.3f}, "
            f"rewards/margins {eval_metrics.get('eval_rewards/margins', float('nan')):.4f}, "
            f"loss {eval_metrics.get('eval_loss', float('nan')):.4f}"
        )
    peak = peak_memory_line()
    if peak:
        trainer.accelerator.print(peak)
    return metrics


def _eval_at_the_last_step(trainer) -> dict[str, float] | None:
    """The evaluation Trainer already ran at the last step (eval_strategy steps does, at the end of training), so
    that the final metrics do not cost a second pass over the eval split; None when it did not run one, or when
    load_best_model_at_end replaced the last step's model with the best checkpoint's after it."""
    if trainer.args.load_best_model_at_end:
        return None
    last = next((h for h in reversed(trainer.state.log_history) if "eval_loss" in h), None)
    if last is None or last.get("step") != trainer.state.global_step:
        return None
    return {k: v for k, v in last.items() if k.startswith("eval_") or k == "epoch"}


def peak_memory_line() -> str | None:
    """This process's peak GPU memory over the run, for sizing the micro-batch (None without CUDA in use).

    ``allocated`` is what tensors held (what a larger micro-batch grows); ``reserved`` adds the caching allocator's
    slack, the figure ``nvidia-smi`` and an out-of-memory error are closer to.
    """
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    gib = 2**30
    return (
        f"Peak GPU memory (this process): {torch.cuda.max_memory_allocated() / gib:.1f} GiB allocated, "
        f"{torch.cuda.max_memory_reserved() / gib:.1f} GiB reserved, "
        f"of {torch.cuda.get_device_properties().total_memory / gib:.0f} GiB"  # the current device, like the peaks
    )


def _turn_evaluation_off(training_args: FusedCPOConfig, script_args: CPOScriptArguments, splits: list[str], no) -> None:
    """No eval split: train without evaluation (a user's one local file is one 'train' split), saying so once.

    Every shipped recipe evaluates; refusing here would make each of them fail on a single file, and the obvious fix
    (eval_strategy: 'no') would then fail in Trainer on the recipe's eval_on_start.
    """
    if training_args.load_best_model_at_end:
        raise LauncherError(
            f"load_best_model_at_end needs evaluation, but dataset_test_split={script_args.dataset_test_split!r} is "
            f"not in {script_args.dataset_name!r} (splits {splits}). Give a test split (a folder with train.jsonl and "
            "test.jsonl) or set dataset_test_split to one of the splits, or set load_best_model_at_end: false."
        )
    evaluating = training_args.eval_strategy != no or training_args.eval_on_start
    training_args.eval_strategy = no
    training_args.eval_on_start = False
    training_args.do_eval = False
    if evaluating and training_args.should_log:
        logger.warning(
            "No evaluation: dataset_test_split=%r is not in %r (splits %s). For evaluation, give a test split (a "
            "folder with train.jsonl and test.jsonl) or set dataset_test_split to one of the splits.",
            script_args.dataset_test_split,
            script_args.dataset_name,
            splits,
        )


def _cpu_keeps_the_recipe_precision(training_args: FusedCPOConfig) -> None:
    """On CPU, the accelerate config's mixed precision gives way to the recipe's, saying so.

    ``accelerate launch --config_file configs/single_gpu.yaml`` exports ``ACCELERATE_MIXED_PRECISION=bf16``, which the
    Trainer's Accelerator reads when the recipe sets neither bf16 nor fp16: a CPU recipe (bf16: false) then ran bf16
    autocast on CPU, 4.6x slower, without a word. A recipe that asks for bf16 on CPU still gets it.
    """
    import torch

    from_config = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    on_cpu = training_args.use_cpu or not torch.cuda.is_available()
    if on_cpu and from_config in ("bf16", "fp16") and not (training_args.bf16 or training_args.fp16):
        os.environ["ACCELERATE_MIXED_PRECISION"] = "no"  # what the Accelerator reads by default
        if getattr(training_args, "mixed_precision", None) is not None:
            training_args.mixed_precision = "no"  # transformers 5.25 copied it in __post_init__
        if training_args.should_log:
            logger.warning(
                "The accelerate config's mixed_precision: %s is off: this run is on CPU and the recipe says bf16: "
                "false (CPU autocast ran the toy recipe 4.6x slower). For two CPU processes use "
                "configs/cpu_ddp.yaml; set bf16: true in the recipe to autocast on CPU anyway.",
                from_config,
            )


def refuse_one_process_cpu_launch(env) -> None:
    """``accelerate launch --cpu --num_processes N`` (N > 1) starts one process, not N: refuse it, naming what works.

    accelerate's CPU launcher starts N processes only through mpirun (``--mpirun_hostfile``); without it, it runs the
    script once, with ``MASTER_PORT`` set (for N > 1) but no ``WORLD_SIZE``, and training would silently use one.
    """
    on_cpu = str(env.get("ACCELERATE_USE_CPU", "")).lower() in ("1", "true", "yes")
    launched_for_several = "MASTER_PORT" in env and "WORLD_SIZE" not in env
    mpi = any(k in env for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"))
    if on_cpu and launched_for_several and not mpi:
        raise LauncherError(
            "`accelerate launch --cpu --num_processes N` starts one process on CPU, not N (accelerate needs mpirun "
            "for more). For two CPU processes: accelerate launch --config_file configs/cpu_ddp.yaml scripts/train_cpo.py"
            " --config RECIPE.yaml, or torchrun --nproc_per_node 2 scripts/train_cpo.py --config RECIPE.yaml."
        )


_USAGE_LINE = "usage: trl-fused-cpo --config RECIPE.yaml [--FIELD VALUE ...]   (--help: the main flags)"


def cli_main(argv: list[str] | None = None) -> None:
    """The ``trl-fused-cpo`` command: parse ``argv`` (default ``sys.argv[1:]``) and run :func:`main`.

    A refusal (a :class:`LauncherError`: the recipe, the command line, the data, the model or the machine) prints one
    ``error:`` line (no traceback) and exits with status 2, as argparse does for its own errors; with
    ``TRL_FUSED_CPO_DEBUG=1`` it is raised with its traceback instead. Without ``--config``: the usage, and that.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(DEBUG_ENV, "").lower() in ("1", "true", "yes")
    if "--config" not in argv and not {"--help", "-h", "--help-all"} & set(argv):
        print(_USAGE_LINE, file=sys.stderr)
        print("error: --config RECIPE.yaml is required (recipes/dev/tiny_cpo.yaml runs on CPU).", file=sys.stderr)
        raise SystemExit(2)
    try:
        main(*make_parser().parse_args_and_config(argv))
    except LauncherError as err:
        if debug:
            raise
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli_main()
