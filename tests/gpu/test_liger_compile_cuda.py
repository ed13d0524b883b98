"""use_liger_kernel and torch_compile under FusedCPOTrainer on CUDA: Liger's Triton kernels and Inductor, in bf16.

Budget: against the same batch through the fused trainer in fp32 (same bf16-rounded weights), the loss and the
gradients with Liger and/or compile are no worse than the fused trainer's own bf16 error, twice over, with a floor
(bf16 keeps 8 bits: 2**-8 = 3.9e-3 per rounding). The CPU side (what Liger's patch does to the forward, compile's
graph break, the Accelerate wrapper order) is tests/test_liger_compile.py. Skipped without CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_trainer import loss_metrics_grads, make_trainer
from transformers import LlamaForCausalLM
from transformers.models.llama import modeling_llama

from trl_fused_cpo import FusedCPOTrainer
from trl_fused_cpo.toy import toy_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = dict(use_cpu=False, bf16=True)


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    """Liger patches modeling_llama itself (RoPE, the RMSNorm and MLP classes): put them back after each test; and a
    fresh Dynamo, so that recompiles of earlier tests' models never reach its limit."""
    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def base_model() -> LlamaForCausalLM:
    """A small Llama-3 (GQA, SwiGLU, RMSNorm) in bf16; vocab 4,099 (odd: a partial last tile), the toy ids below 78."""
    torch.manual_seed(0)
    config = toy_config(4099, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8)
    return LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)


def with_liger(trainer):
    """What ``Trainer.train`` does with ``use_liger_kernel`` (transformers/trainer.py), here for one batch."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from transformers.integrations.liger import apply_liger_kernel

    apply_liger_kernel(trainer.model, trainer.args.liger_kernel_config)
    assert trainer.model.model.norm.forward.__func__ is LigerRMSNorm.forward
    return trainer


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.double().flatten() for _, g in sorted(grads.items())])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def assert_no_worse(name, got, plain, truth, floor):
    """``got``'s error against fp32 ``truth`` is within 2x the plain fused trainer's (or ``floor``)."""
    for what, g, p, t in (
        ("loss", got[0], plain[0], truth[0]),
        ("grads", flat(got[2]), flat(plain[2]), flat(truth[2])),
    ):
        err, budget = rel(g, t), max(2 * rel(p, t), floor)
        print(f"{name} {what}: rel error {err:.2e} (plain bf16 {rel(p, t):.2e}, budget {budget:.2e})")
        assert err <= budget, f"{name} {what}: rel error {err:.2e} > {budget:.2e}"
    assert got[1].keys() == plain[1].keys()


def one_batch(tmp_path, base_model, **overrides):
    return make_trainer(FusedCPOTrainer, tmp_path, model=copy.deepcopy(base_model), **CUDA, **overrides)


@pytest.fixture(scope="module")
def references(tmp_path_factory, base_model):
    """The same batch through the fused trainer in fp32 (ground truth) and in bf16 (the error to be no worse than)."""
    tmp = tmp_path_factory.mktemp("ref")
    truth = make_trainer(FusedCPOTrainer, tmp, model=copy.deepcopy(base_model).float(), use_cpu=False)
    return loss_metrics_grads(truth), loss_metrics_grads(one_batch(tmp, base_model))


def compiled_batch(trainer):
    trainer.model_wrapped = compiled = torch.compile(trainer.model)
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    loss, metrics = trainer.get_batch_loss_metrics(compiled, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


def test_liger_backbone_with_fused_head(tmp_path, base_model, references):
    pytest.importorskip("liger_kernel")
    truth, plain = references
    liger = loss_metrics_grads(with_liger(one_batch(tmp_path, base_model, use_liger_kernel=True)))
    assert_no_worse("fused+liger", liger, plain, truth, floor=1e-2)


def test_compiled_backbone_with_fused_head(tmp_path, base_model, references):
    truth, plain = references
    compiled = compiled_batch(one_batch(tmp_path, base_model))
    assert_no_worse("fused+compile", compiled, plain, truth, floor=1e-2)


def test_liger_and_compile_with_fused_head(tmp_path, base_model, references):
    pytest.importorskip("liger_kernel")
    truth, plain = references
    both = compiled_batch(with_liger(one_batch(tmp_path, base_model, use_liger_kernel=True)))
    assert_no_worse("fused+liger+compile", both, plain, truth, floor=1e-2)


@pytest.mark.parametrize(
    "options",
    [dict(use_liger_kernel=True), dict(torch_compile=True), dict(use_liger_kernel=True, torch_compile=True)],
    ids=["liger", "compile", "liger+compile"],
)
def test_trains_like_fused_alone(tmp_path, base_model, options):
    """Three optimizer steps through ``Trainer.train`` (Liger applied there, the model compiled by Accelerate)."""
    if options.get("use_liger_kernel"):
        pytest.importorskip("liger_kernel")

    def losses(**extra):
        trainer = one_batch(tmp_path, base_model, max_steps=3, logging_steps=1, learning_rate=1e-4, seed=0, **extra)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer

    plain, _ = losses()
    got, trainer = losses(**options)
    print(f"{options}: losses {got} vs fused alone {plain}")
    assert got == pytest.approx(plain, rel=2e-2)
    if options.get("torch_compile"):
        assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    if options.get("use_liger_kernel"):
        from liger_kernel.transformers.rms_norm import LigerRMSNorm

        assert trainer.model.model.norm.forward.__func__ is LigerRMSNorm.forward
