"""CPO training with FusedCPOTrainer from a flat YAML recipe: the ``accelerate launch`` target.

    # CPU demo (toy Llama-3, shipped data, ~1 minute on 2 cores):
    python scripts/train_cpo.py --config recipes/dev/tiny_cpo.yaml

    # Real run: topology from configs/, everything else from the recipe; any field can be overridden on the CLI.
    accelerate launch --config_file configs/single_gpu.yaml scripts/train_cpo.py \\
        --config recipes/llama3/8B_lora_cpo_single_device.yaml --beta 0.2 --max_steps 200

Lifecycle: parse (``TrlParser`` over ``CPOScriptArguments``, ``FusedCPOConfig``, ``ModelConfig``; unknown recipe keys
fail by name) → load model + tokenizer (toy in-process, or ``from_pretrained`` with dtype/QLoRA) → load and validate
the preference data → ``FusedCPOTrainer`` (LoRA through ``get_peft_config``) → train → evaluate when an eval split
exists → save the model (the adapter under LoRA) and tokenizer to ``output_dir``.
"""

from __future__ import annotations

import logging
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # CPOTrainer lives in trl.experimental

try:
    import trl_fused_cpo  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trl_fused_cpo.cli import (  # noqa: E402
    CPOScriptArguments,
    load_model_and_tokenizer,
    load_preference_dataset,
    make_parser,
    validate_preference_dataset,
)

logger = logging.getLogger("train_cpo")


def main(script_args: CPOScriptArguments, training_args, model_args) -> dict[str, float]:
    """Train, evaluate and save one recipe; returns the final metrics (``train_*`` and, with an eval split, ``eval_*``)."""
    import transformers
    from trl import get_peft_config

    from trl_fused_cpo.trainer import FusedCPOTrainer

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)

    # Model and tokenizer.
    model, tokenizer = load_model_and_tokenizer(script_args, training_args, model_args)
    peft_config = get_peft_config(model_args)

    # Data: the train split is required; evaluation runs when the eval split exists.
    dataset = load_preference_dataset(script_args)
    if script_args.dataset_train_split not in dataset:
        raise ValueError(
            f"dataset_train_split={script_args.dataset_train_split!r} is not in {script_args.dataset_name!r}; "
            f"its splits are {list(dataset)}."
        )
    train_dataset = dataset[script_args.dataset_train_split]
    eval_dataset = dataset[script_args.dataset_test_split] if script_args.dataset_test_split in dataset else None
    if eval_dataset is None and training_args.eval_strategy != "no":
        raise ValueError(
            f"eval_strategy={training_args.eval_strategy.value!r} needs an eval split, but "
            f"dataset_test_split={script_args.dataset_test_split!r} is not in {list(dataset)}. Set "
            "dataset_test_split to one of them, or eval_strategy: 'no'."
        )
    if script_args.max_train_samples is not None:
        train_dataset = train_dataset.select(range(min(script_args.max_train_samples, len(train_dataset))))
    if eval_dataset is not None and script_args.max_eval_samples is not None:
        eval_dataset = eval_dataset.select(range(min(script_args.max_eval_samples, len(eval_dataset))))
    validate_preference_dataset(train_dataset, tokenizer, split=script_args.dataset_train_split)
    if eval_dataset is not None:
        validate_preference_dataset(eval_dataset, tokenizer, split=script_args.dataset_test_split)

    trainer = FusedCPOTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if script_args.ignore_bias_buffers:  # DDP cannot broadcast bool buffers (transformers#22482)
        import torch

        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]

    # Train, then evaluate once at the end (besides any eval_strategy evaluations).
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = {f"train_{k}" if not k.startswith("train_") else k: v for k, v in train_result.metrics.items()}
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    if eval_dataset is not None:
        eval_metrics = trainer.evaluate()
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
        trainer.accelerator.print(
            f"Final eval: rewards/accuracies {eval_metrics.get('eval_rewards/accuracies', float('nan')):.3f}, "
            f"rewards/margins {eval_metrics.get('eval_rewards/margins', float('nan')):.4f}, "
            f"loss {eval_metrics.get('eval_loss', float('nan')):.4f}"
        )

    # Save: the full model, or only the adapter under LoRA; the tokenizer goes with it (Trainer saves
    # processing_class).
    trainer.save_model(training_args.output_dir)
    trainer.save_state()
    what = "adapter" if peft_config is not None else "model"
    trainer.accelerator.print(f"Saved {what} and tokenizer to {training_args.output_dir}")
    # Destroy the process group before exit, as torch asks: without it NCCL warns "process group has NOT been
    # destroyed" on every rank. No-op in one process.
    trainer.accelerator.end_training()
    return metrics


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
