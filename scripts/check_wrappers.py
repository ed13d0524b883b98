"""Distributed-correctness checks of FusedCPOTrainer under whatever `accelerate launch` configures.

    accelerate launch --config_file configs/fsdp2.yaml --num_processes 1 --mixed_precision no \\
        scripts/check_wrappers.py --check parity --out outputs/fsdp2.json

Checks:
  parity  one training step through the wrapped model (DDP / FSDP2 / ZeRO-3 / none) against the same batch through
          the unwrapped model: loss and every parameter's full gradient (FSDP2 DTensor grads are gathered, ZeRO-3
          grads read with deepspeed.utils.safe_get_full_grad).
  lora    LoRA on all linear layers: only adapter weights train and the head's weight-gradient GEMM never runs.
  qlora   a 4-bit (bitsandbytes NF4) base model with LoRA steps with finite losses.
Writes a JSON verdict to --out and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import torch
from datasets import Dataset
from transformers import LlamaForCausalLM, TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trl_fused_cpo import FusedCPOConfig, FusedCPOTrainer  # noqa: E402
from trl_fused_cpo.ops import gemm  # noqa: E402
from trl_fused_cpo.toy import load_toy_preferences, toy_config, toy_tokenizer  # noqa: E402


def small_llama(tie: bool, dtype: torch.dtype) -> LlamaForCausalLM:
    """The toy Llama-3 architecture, wider and with a 32k vocabulary so the head is a real GEMM."""
    torch.manual_seed(0)
    config = toy_config(32_000, tie_word_embeddings=tie, hidden_size=256, intermediate_size=512)
    return LlamaForCausalLM(config).to(dtype)


def full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    if hasattr(param, "ds_id"):  # ZeRO-3
        from deepspeed.utils import safe_get_full_grad

        return safe_get_full_grad(param)
    grad = param.grad
    if grad is not None and hasattr(grad, "full_tensor"):  # FSDP2 DTensor
        grad = grad.full_tensor()
    return grad


class GradCapture(TrainerCallback):
    def __init__(self, trainer_ref):
        self.trainer_ref, self.grads = trainer_ref, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        model = self.trainer_ref[0].model_wrapped
        self.grads = {}
        for name, p in model.named_parameters():
            g = full_grad(p)
            if g is not None:
                self.grads[_canonical(name)] = g.detach().float().cpu()


def _canonical(name: str) -> str:
    for prefix in ("module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name


def make_trainer(model, out_dir, *, backend, steps=1, lr=0.0, peft_config=None, bf16=False):
    args = FusedCPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=lr,
        max_grad_norm=0.0,
        bf16=bf16,
        report_to=[],
        logging_steps=1,
        gradient_checkpointing=False,
        save_strategy="no",
        max_length=64,
        fused_backend=backend,
        seed=0,
        dataloader_drop_last=True,
    )
    data = Dataset.from_list(load_toy_preferences("train")[:4])
    return FusedCPOTrainer(
        model=model, args=args, train_dataset=data, processing_class=toy_tokenizer(), peft_config=peft_config
    )


def check_parity(args) -> dict:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    trainer = make_trainer(small_llama(args.tie, dtype), args.tmp, backend=args.backend)
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    trainer.model.to(trainer.accelerator.device)
    loss, _ = trainer.get_batch_loss_metrics(trainer.model, batch)
    loss.backward()
    ref = {n: p.grad.detach().float().cpu() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad(set_to_none=True)
    ref_loss = loss.item()
    ref_trainer = [trainer]
    capture = GradCapture(ref_trainer)
    trainer.add_callback(capture)
    trainer.train()
    wrapped_loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    errors = {}
    for name, g in ref.items():
        got = capture.grads.get(name) if capture.grads else None
        errors[name] = None if got is None else ((got - g).norm() / g.norm().clamp(min=1e-30)).item()
    missing = [n for n, e in errors.items() if e is None]
    worst = max((e for e in errors.values() if e is not None), default=float("nan"))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    ok = not missing and worst <= tol and abs(wrapped_loss - ref_loss) <= 1e-3 * max(1.0, abs(ref_loss))
    return dict(
        ok=ok,
        distributed_type=str(trainer.accelerator.distributed_type),
        unwrapped_loss=ref_loss,
        wrapped_loss=wrapped_loss,
        worst_grad_rel_error=worst,
        missing_grads=missing,
        grad_tolerance=tol,
        grad_errors=errors,
    )


def check_lora(args) -> dict:
    from peft import LoraConfig

    calls = []
    original = gemm.accumulate_mm
    gemm.accumulate_mm = lambda *a, **k: (calls.append(1), original(*a, **k))
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    cuda = torch.cuda.is_available()
    model = small_llama(args.tie, torch.bfloat16 if cuda else torch.float32)
    trainer = make_trainer(model, args.tmp, backend=args.backend, steps=3, lr=1e-3, peft_config=lora, bf16=cuda)
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    trainer.train()
    gemm.accumulate_mm = original
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    only_adapters = bool(trainable) and all("lora_" in n for n in trainable)
    return dict(
        ok=only_adapters and not calls and all(map(lambda x: x == x, losses)),
        trainable_params=len(trainable),
        only_adapters=only_adapters,
        head_weight_gemm_calls=len(calls),
        losses=losses,
    )


def check_qlora(args) -> dict:
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    path = os.path.join(args.tmp, "base")
    small_llama(args.tie, torch.bfloat16).save_pretrained(path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.bfloat16, device_map={"": 0})
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    trainer = make_trainer(model, args.tmp, backend=args.backend, steps=3, lr=1e-3, peft_config=lora, bf16=True)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return dict(
        ok=len(losses) == 3 and all(math.isfinite(x) and abs(x) < 1e4 for x in losses),
        losses=losses,
        head_dtype=str(trainer.model.get_output_embeddings().weight.dtype),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", choices=["parity", "lora", "qlora"], default="parity")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--tie", action="store_true", help="tied embeddings")
    p.add_argument("--backend", default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        result = {"parity": check_parity, "lora": check_lora, "qlora": check_qlora}[args.check](args)
    result.update(check=args.check, dtype=args.dtype, tie=args.tie, backend=args.backend)
    summary = {k: v for k, v in result.items() if k != "grad_errors"}
    print("CHECK", json.dumps(summary))
    if args.out and int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
