"""use_liger_kernel and torch_compile with FusedCPOTrainer (issue 29): everything that can be checked on a CPU.

Liger's kernels are Triton and need CUDA (its RMSNorm fails even under the interpreter), so a stand-in does here what
liger-kernel 0.8.5's ``apply_liger_kernel_to_llama(model=...)`` does to an instance when ``Trainer.train`` applies
it (transformers/trainer.py, ``apply_liger_kernel``): bind new forwards on the RMSNorm and MLP modules and, with
``fused_linear_cross_entropy`` (its default), replace the causal LM's own forward. The real patch is checked where
liger-kernel is installed; the parity with its kernels is tests/gpu/test_liger_compile_cuda.py.
"""

from __future__ import annotations

import logging
import types
from collections import Counter

import pytest
import torch
import transformers.trainer
from test_trainer import PACKED, assert_same, loss_metrics_grads, make_trainer
from transformers.models.llama import modeling_llama
from trl.experimental.cpo import CPOTrainer

from trl_fused_cpo import FusedCPOConfig, FusedCPOTrainer
from trl_fused_cpo.toy import toy_model

IDS = torch.tensor([[1, 5, 6, 7]])


class StandInLiger:
    """``apply_liger_kernel(model, kernel_config)`` as Liger does it to a Llama instance, counting every call."""

    def __init__(self):
        self.configs: list[dict] = []
        self.calls: Counter[str] = Counter()

    def __call__(self, model, kernel_config=None):
        config = dict(kernel_config or {})
        self.configs.append(config)
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        for module in lm.modules():
            if isinstance(module, (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)):
                self._bind(module, type(module).__name__)
        if config.get("fused_linear_cross_entropy", True):  # Liger's llama lce_forward: logits as usual without labels
            self._bind(lm, "lce_forward")

    def _bind(self, module, name: str) -> None:
        forward, calls = type(module).forward, self.calls

        def patched(self_, *args, **kwargs):
            calls[name] += 1
            return forward(self_, *args, **kwargs)

        module.forward = types.MethodType(patched, module)


@pytest.fixture
def liger(monkeypatch):
    stand_in = StandInLiger()
    monkeypatch.setattr(transformers.trainer, "apply_liger_kernel", stand_in)
    return stand_in


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test's models are new objects: without a reset their recompiles pile up to Dynamo's limit (then eager)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def train_losses(cls, tmp_path, **overrides) -> tuple[list[float], object]:
    trainer = make_trainer(cls, tmp_path, max_steps=2, logging_steps=1, learning_rate=1e-3, seed=0, **overrides)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


# ------------------------------------------------------------------------------------------------- use_liger_kernel


def test_liger_runs_the_backbone_kernels_under_the_fused_head(tmp_path, liger, caplog):
    plain, _ = train_losses(FusedCPOTrainer, tmp_path)
    with caplog.at_level(logging.INFO, logger="trl_fused_cpo"):
        fused, trainer = train_losses(FusedCPOTrainer, tmp_path, use_liger_kernel=True)
    assert liger.configs == [{"fused_linear_cross_entropy": False}]
    assert liger.calls["LlamaRMSNorm"] and liger.calls["LlamaMLP"]  # the backbone ran Liger's modules
    assert liger.calls["lce_forward"] == 0  # and the fused head, not Liger's forward, made the loss
    assert sum("use_liger_kernel" in r.getMessage() for r in caplog.records) == 1
    assert fused == pytest.approx(plain, rel=1e-6)
    assert trainer.model(IDS).logits.shape == (1, 4, trainer.model.config.vocab_size)  # generation: the class forward

    stock, _ = train_losses(CPOTrainer, tmp_path, use_liger_kernel=True)
    assert liger.configs[-1] == {} and liger.calls["lce_forward"]  # stock CPOTrainer: Liger's forward, no labels
    assert fused == pytest.approx(stock, rel=1e-4)


def test_liger_config_asking_for_its_fused_linear_cross_entropy_is_overridden(tmp_path, liger, caplog):
    with caplog.at_level(logging.WARNING, logger="trl_fused_cpo"):
        trainer = make_trainer(
            FusedCPOTrainer,
            tmp_path,
            use_liger_kernel=True,
            liger_kernel_config={"fused_linear_cross_entropy": True, "rope": False},
        )
    assert trainer.args.liger_kernel_config == {"fused_linear_cross_entropy": False, "rope": False}
    assert any("fused_linear_cross_entropy" in r.getMessage() for r in caplog.records)


def test_liger_keeps_mixed_precision_autocast(tmp_path, liger):
    """bf16 on fp32 weights: Accelerate's autocast wraps the forward at train(). Liger's forward swap used to drop the
    fused forward, the next batch put it back above the autocast wrapper, and the backbone ran in fp32."""
    plain, _ = train_losses(FusedCPOTrainer, tmp_path, bf16=True)
    fused, _ = train_losses(FusedCPOTrainer, tmp_path, bf16=True, use_liger_kernel=True)
    assert liger.calls["LlamaRMSNorm"]
    assert fused == pytest.approx(plain, rel=1e-6)


@pytest.mark.parametrize("when", ["before", "after"])
def test_instance_forward_of_another_library_keeps_the_fused_path(tmp_path, when):
    """An instance-level forward (Liger's, with its fused cross-entropy on) installed before the trainer patches the
    model or after it: the loss still comes from the fused head and equals stock CPOTrainer's; a call without
    ``fused_cpo_labels`` still reaches that forward."""
    stand_in, model = StandInLiger(), toy_model()
    if when == "before":
        stand_in(model)
    trainer = make_trainer(FusedCPOTrainer, tmp_path, model=model)
    stand_in.calls.clear()  # the construction probe (support.py) ran the model's own forward: count from here
    if when == "after":
        stand_in(trainer.model)
    stock = loss_metrics_grads(make_trainer(CPOTrainer, tmp_path))
    fused = loss_metrics_grads(trainer)
    assert_same(stock, fused)
    assert stand_in.calls["LlamaRMSNorm"] and stand_in.calls["lce_forward"] == 0
    trainer.model(IDS)
    assert stand_in.calls["lce_forward"] == 1


def test_real_liger_patch_leaves_the_fused_forward(tmp_path, monkeypatch):
    """liger-kernel's own patch (not run: its kernels need CUDA) with the config FusedCPOTrainer hands it."""
    pytest.importorskip("liger_kernel.transformers")
    from liger_kernel.transformers.model.llama import lce_forward
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from transformers.integrations.liger import apply_liger_kernel

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):  # Liger also patches the module: put it back
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    trainer = make_trainer(FusedCPOTrainer, tmp_path, use_liger_kernel=True)
    fused_forward = trainer.model.__dict__["forward"]
    apply_liger_kernel(trainer.model, trainer.args.liger_kernel_config)  # what Trainer.train does
    assert trainer.model.__dict__["forward"] is fused_forward
    assert trainer.model.model.norm.forward.__func__ is LigerRMSNorm.forward

    plain = toy_model()
    apply_liger_kernel(plain, None)  # Liger's default, as stock CPOTrainer gets it: its own forward
    assert plain.__dict__["forward"].__func__ is lce_forward


# ---------------------------------------------------------------------------------------------------- torch_compile


@pytest.mark.slow
def test_torch_compile_trains_like_eager(tmp_path, caplog):
    """Trainer.train compiles the model (Accelerate's ``torch.compile(model)``): the backbone compiles, the fused
    head runs eagerly behind one graph break, the losses are eager's, nothing is logged, and a call without labels
    (generation) still works. Before: the fused forward was patched onto the compiled wrapper, so the backbone ran
    uncompiled and a call without labels recursed until RecursionError."""
    from torch._dynamo.utils import counters

    eager, _ = train_losses(FusedCPOTrainer, tmp_path)
    counters.clear()
    with caplog.at_level(logging.WARNING):
        compiled, trainer = train_losses(FusedCPOTrainer, tmp_path, torch_compile=True)
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert compiled == pytest.approx(eager, rel=1e-5)
    assert counters["stats"]["unique_graphs"] >= 1  # the backbone really compiled
    assert counters["graph_break"] and all("disable" in reason for reason in counters["graph_break"])
    assert not [r for r in caplog.records if r.name.startswith(("torch._dynamo", "torch._inductor"))]
    assert trainer.model_wrapped(IDS).logits.shape == (1, 4, trainer.model.config.vocab_size)
    assert trainer.model(IDS).logits.shape == (1, 4, trainer.model.config.vocab_size)


@pytest.mark.slow
def test_compiled_model_same_loss_metrics_grads(tmp_path):
    """One batch through ``torch.compile(model)`` and through the eager model: same loss, metrics and gradients;
    Dynamo compiles the backbone and stops at the fused head (traced, the op broke into 29 graphs)."""
    from torch._dynamo.utils import counters

    eager = loss_metrics_grads(make_trainer(FusedCPOTrainer, tmp_path))
    counters.clear()
    trainer = make_trainer(FusedCPOTrainer, tmp_path)
    compiled_model = torch.compile(trainer.model, backend="aot_eager")  # Dynamo + AOTAutograd, no codegen: 4x faster
    trainer.model_wrapped = compiled_model
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    loss, metrics = trainer.get_batch_loss_metrics(compiled_model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert_same(eager, (loss.detach(), metrics, grads), grad_rtol=1e-4)
    assert counters["stats"]["unique_graphs"] == 1
    assert list(counters["graph_break"]) and all("disable" in reason for reason in counters["graph_break"])


@pytest.mark.slow
def test_liger_and_torch_compile_together(tmp_path, liger):
    from torch._dynamo.utils import counters

    eager, _ = train_losses(FusedCPOTrainer, tmp_path)
    counters.clear()
    both, trainer = train_losses(FusedCPOTrainer, tmp_path, use_liger_kernel=True, torch_compile=True)
    assert liger.calls["LlamaRMSNorm"] and liger.calls["lce_forward"] == 0
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert counters["stats"]["unique_graphs"] >= 1
    assert both == pytest.approx(eager, rel=1e-5)


@pytest.mark.slow
def test_regional_compilation_trains_like_eager(tmp_path, monkeypatch):
    """ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1: Accelerate compiles each decoder layer (and lm_head) in a shallow
    copy of the model whose methods it rebinds; the fused forward is rebound with them and reads lm_head's weight
    through the compiled wrapper. aot_eager: Dynamo and AOTAutograd without codegen."""
    eager, _ = train_losses(FusedCPOTrainer, tmp_path)
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "1")
    regional, trainer = train_losses(FusedCPOTrainer, tmp_path, torch_compile=True, torch_compile_backend="aot_eager")
    assert type(trainer.model_wrapped.model.layers[0]).__name__ == "OptimizedModule"
    assert regional == pytest.approx(eager, rel=1e-5)
    assert trainer.model_wrapped(IDS).logits.shape == (1, 4, trainer.model.config.vocab_size)


# --------------------------------------------------------------------------------------------- with packed layouts


@pytest.mark.slow
@pytest.mark.parametrize("layout", PACKED)
def test_packed_layouts_with_liger_and_compile(tmp_path, liger, layout):
    """A packed batch (issue 28) through Liger's backbone modules and a compiled model: one forward per step over the
    packed row, the backbone compiled, and the padded eager run's losses."""
    from torch._dynamo.utils import counters

    eager, _ = train_losses(FusedCPOTrainer, tmp_path)
    counters.clear()
    packed, trainer = train_losses(
        FusedCPOTrainer,
        tmp_path,
        config_cls=FusedCPOConfig,
        batch_layout=layout,
        use_liger_kernel=True,
        torch_compile=True,
        torch_compile_backend="aot_eager",
    )
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert counters["stats"]["unique_graphs"] >= 1
    norms_per_forward = 2 * trainer.model.config.num_hidden_layers + 1
    assert liger.calls["LlamaRMSNorm"] == 2 * norms_per_forward and liger.calls["lce_forward"] == 0  # 2 steps
    assert packed == pytest.approx(eager, rel=1e-5)
