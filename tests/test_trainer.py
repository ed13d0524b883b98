"""FusedCPOTrainer against stock CPOTrainer on the same batch: loss, metric keys and values, gradients."""

from __future__ import annotations

import logging

import pytest
import torch
from datasets import Dataset
from trl.experimental.cpo import CPOConfig, CPOTrainer

from trl_fused_cpo import FusedCPOConfig, FusedCPOTrainer
from trl_fused_cpo.toy import load_toy_preferences, toy_model, toy_tokenizer


def make_trainer(cls, tmp_path, *, tie=False, config_cls=CPOConfig, model=None, peft_config=None, **overrides):
    args = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        bf16=False,
        report_to=[],
        max_length=64,
        gradient_checkpointing=False,
        use_cpu=True,
        save_strategy="no",
    )
    args.update(overrides)
    data = Dataset.from_list(load_toy_preferences("train")[:16])
    return cls(
        model=model if model is not None else toy_model(tie_word_embeddings=tie),
        args=config_cls(**args),
        train_dataset=data,
        eval_dataset=Dataset.from_list(load_toy_preferences("test")[:8]),
        processing_class=toy_tokenizer(),
        peft_config=peft_config,
    )


def loss_metrics_grads(trainer, rows=range(4)):
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in rows]))
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


def assert_close_norm(got, want, name, rtol=1e-5):
    """Relative error in norm: fp32 elementwise noise on near-zero entries is not a difference."""
    err = ((got - want).norm() / want.norm().clamp(min=1e-30)).item()
    assert err <= rtol, f"{name}: relative error {err:.2e}"


def assert_same(stock, fused, grad_rtol=1e-5):
    torch.testing.assert_close(fused[0], stock[0])
    assert fused[1].keys() == stock[1].keys()
    for key, value in stock[1].items():
        assert fused[1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert fused[2].keys() == stock[2].keys()
    for name, g in stock[2].items():
        assert_close_norm(fused[2][name], g, name, grad_rtol)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "opts",
    [dict(), dict(loss_type="ipo", beta=0.5), dict(loss_type="simpo", cpo_alpha=0.3), dict(loss_type="alphapo")],
    ids=["sigmoid", "ipo", "simpo", "alphapo"],
)
def test_same_batch_same_loss_metrics_grads(tmp_path, tie, opts):
    stock = loss_metrics_grads(make_trainer(CPOTrainer, tmp_path, tie=tie, **opts))
    fused = loss_metrics_grads(make_trainer(FusedCPOTrainer, tmp_path, tie=tie, **opts))
    assert_same(stock, fused)
    if tie:
        assert "lm_head.weight" not in fused[2]  # the head's gradient landed in embed_tokens


def test_fused_config_and_plain_config_agree(tmp_path):
    plain = loss_metrics_grads(make_trainer(FusedCPOTrainer, tmp_path))
    fused_cfg = loss_metrics_grads(
        make_trainer(
            FusedCPOTrainer, tmp_path, config_cls=FusedCPOConfig, fused_backend="torch", fused_chunk_bytes=4096
        )
    )
    assert_same(plain, fused_cfg)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_lean_memory_matches_stock(tmp_path, tie):
    stock = loss_metrics_grads(make_trainer(CPOTrainer, tmp_path, tie=tie))
    lean = make_trainer(FusedCPOTrainer, tmp_path, tie=tie, config_cls=FusedCPOConfig, fused_memory="lean")
    assert_same(stock, loss_metrics_grads(lean))


def test_gradient_accumulation_matches_stock(tmp_path):
    """Two micro-batches of 2 accumulated: TRL averages per micro-batch (its NLL is a per-micro-batch mean)."""

    def accumulated(cls):
        trainer = make_trainer(cls, tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2)
        for rows in (range(0, 2), range(2, 4)):
            batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in rows]))
            trainer.compute_loss(trainer.model, batch).div(2).backward()
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    stock, fused = accumulated(CPOTrainer), accumulated(FusedCPOTrainer)
    for name, g in stock.items():
        assert_close_norm(fused[name], g, name)


def test_train_and_evaluate_log_the_same_metrics(tmp_path):
    logs = {}
    for cls in (CPOTrainer, FusedCPOTrainer):
        trainer = make_trainer(cls, tmp_path, max_steps=2, logging_steps=1, learning_rate=1e-3, seed=0)
        trainer.train()
        logs[cls] = (trainer.state.log_history, trainer.evaluate())
    (stock_hist, stock_eval), (fused_hist, fused_eval) = logs[CPOTrainer], logs[FusedCPOTrainer]
    assert fused_eval.keys() == stock_eval.keys()
    assert "eval_logits/chosen" in fused_eval and "eval_rewards/accuracies" in fused_eval
    for key, value in stock_eval.items():
        if "runtime" in key or "per_second" in key:
            continue
        assert fused_eval[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    stock_losses = [h["loss"] for h in stock_hist if "loss" in h]
    fused_losses = [h["loss"] for h in fused_hist if "loss" in h]
    assert fused_losses == pytest.approx(stock_losses, rel=1e-4)


def test_lora_adapter_on_lm_head_is_refused(tmp_path):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="lm_head"):
        make_trainer(FusedCPOTrainer, tmp_path, peft_config=LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))


def test_prompt_learning_peft_is_refused(tmp_path):
    from peft import PromptTuningConfig, TaskType

    with pytest.raises(ValueError, match="prompt learning"):
        make_trainer(
            FusedCPOTrainer,
            tmp_path,
            peft_config=PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4),
        )


def test_logit_softcap_is_refused(tmp_path):
    model = toy_model()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="softcap"):
        make_trainer(FusedCPOTrainer, tmp_path, model=model)


def test_lora_trains_adapters_only_and_matches_stock(tmp_path):
    from peft import LoraConfig

    def run(cls):
        torch.manual_seed(0)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
        return loss_metrics_grads(make_trainer(cls, tmp_path, peft_config=lora))

    stock, fused = run(CPOTrainer), run(FusedCPOTrainer)
    assert fused[2] and all("lora_" in name for name in fused[2])
    assert_same(stock, fused)


def test_stock_path_when_disabled(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        trainer = make_trainer(FusedCPOTrainer, tmp_path, config_cls=FusedCPOConfig, use_fused_loss=False)
    assert not trainer.use_fused_loss
    stock = loss_metrics_grads(make_trainer(CPOTrainer, tmp_path))
    assert_same(stock, loss_metrics_grads(trainer))


def test_generation_is_unchanged_by_the_patch(tmp_path):
    trainer = make_trainer(FusedCPOTrainer, tmp_path)
    ids = torch.tensor([[1, 5, 6, 7]])
    out = trainer.model(ids)
    assert out.logits.shape == (1, 4, trainer.model.config.vocab_size)


def test_rebuilt_model_is_patched_again(tmp_path):
    """model_init / hyperparameter search replace trainer.model after __init__: the fused forward follows."""
    trainer = make_trainer(FusedCPOTrainer, tmp_path)
    first = trainer.model.forward
    loss_metrics_grads(trainer)
    assert trainer.model.forward is first  # not re-installed on every step
    trainer.model = toy_model()
    stock = loss_metrics_grads(make_trainer(CPOTrainer, tmp_path))
    assert_same(stock, loss_metrics_grads(trainer))


# ------------------------------------------------------------------------------------------- packed layouts

PACKED = ["padding_free", "prefix_shared"]
NOT_LOGITS = lambda metrics: {k: v for k, v in metrics.items() if "logits/" not in k}  # noqa: E731


def assert_same_but_logit_means(stock, packed, grad_rtol=1e-5):
    """Loss, every metric but logits/* (a packed batch has no padding to average) and every gradient."""
    torch.testing.assert_close(packed[0], stock[0], rtol=1e-5, atol=1e-6)
    assert packed[1].keys() == stock[1].keys()
    for key, value in NOT_LOGITS(stock[1]).items():
        assert packed[1][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert packed[2].keys() == stock[2].keys()
    for name, g in stock[2].items():
        assert_close_norm(packed[2][name], g, name, grad_rtol)


@pytest.mark.parametrize("layout", PACKED)
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize(
    "opts",
    [dict(), dict(loss_type="hinge"), dict(loss_type="ipo", beta=0.5), dict(loss_type="simpo", cpo_alpha=0.3),
     dict(loss_type="alphapo"), dict(label_smoothing=0.2)],
    ids=["sigmoid", "hinge", "ipo", "simpo", "alphapo", "smoothing"],
)  # fmt: skip
def test_packed_layouts_match_the_stock_trainer(tmp_path, layout, tie, opts):
    stock = loss_metrics_grads(make_trainer(CPOTrainer, tmp_path, tie=tie, **opts))
    trainer = make_trainer(FusedCPOTrainer, tmp_path, tie=tie, config_cls=FusedCPOConfig, batch_layout=layout, **opts)
    shapes = []
    trainer.model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    assert_same_but_logit_means(stock, loss_metrics_grads(trainer))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    padded = 2 * max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    real = int(batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum())
    assert len(shapes) == 1 and shapes[0][0] == 1  # one packed row
    assert shapes[0][1] == real if layout == "padding_free" else shapes[0][1] < real  # prompts once
    assert shapes[0][1] < 4 * padded


@pytest.mark.parametrize("layout", PACKED)
def test_packed_layouts_with_lora_and_gradient_accumulation(tmp_path, layout):
    from peft import LoraConfig

    def accumulated(cls, **kw):
        torch.manual_seed(0)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
        trainer = make_trainer(
            cls, tmp_path, peft_config=lora, per_device_train_batch_size=2, gradient_accumulation_steps=2, **kw
        )
        for rows in (range(0, 2), range(2, 4)):
            batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in rows]))
            trainer.compute_loss(trainer.model, batch).div(2).backward()
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    stock = accumulated(CPOTrainer)
    packed = accumulated(FusedCPOTrainer, config_cls=FusedCPOConfig, batch_layout=layout)
    assert stock and stock.keys() == packed.keys() and all("lora_" in n for n in packed)
    for name, g in stock.items():
        assert_close_norm(packed[name], g, name)


@pytest.mark.parametrize("layout", PACKED)
def test_packed_layouts_train_and_evaluate_like_stock(tmp_path, layout):
    logs = {}
    for cls, extra in ((CPOTrainer, {}), (FusedCPOTrainer, dict(config_cls=FusedCPOConfig, batch_layout=layout))):
        trainer = make_trainer(cls, tmp_path, max_steps=2, logging_steps=1, learning_rate=1e-3, seed=0, **extra)
        trainer.train()
        logs[cls] = (trainer.state.log_history, trainer.evaluate())
    (stock_hist, stock_eval), (packed_hist, packed_eval) = logs[CPOTrainer], logs[FusedCPOTrainer]
    assert packed_eval.keys() == stock_eval.keys()
    for key, value in NOT_LOGITS(stock_eval).items():
        if "runtime" in key or "per_second" in key:
            continue
        assert packed_eval[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    stock_losses = [h["loss"] for h in stock_hist if "loss" in h]
    assert [h["loss"] for h in packed_hist if "loss" in h] == pytest.approx(stock_losses, rel=1e-4)


def test_packed_layouts_are_refused_without_the_fused_loss(tmp_path):
    with pytest.raises(ValueError, match="needs use_fused_loss"):
        make_trainer(FusedCPOTrainer, tmp_path, config_cls=FusedCPOConfig, batch_layout="prefix_shared",
                     use_fused_loss=False)  # fmt: skip


@pytest.mark.parametrize("layout", PACKED)
@pytest.mark.parametrize(
    "case",
    [dict(max_length=12), dict(max_length=7), dict(rows=range(1)), dict(gradient_checkpointing=True)],
    ids=["truncated-at-max-length", "one-completion-token-left", "single-pair", "gradient-checkpointing"],
)
def test_packed_layouts_edge_cases_match_the_stock_trainer(tmp_path, layout, case):
    """Pairs TRL truncates (down to one completion token), a batch of one pair, gradient checkpointing. (An empty
    completion: tests/ops/test_rows.py; TRL's truncation always leaves one token.)"""
    case = dict(case)
    rows = case.pop("rows", range(4))
    stock = loss_metrics_grads(make_trainer(CPOTrainer, tmp_path, **case), rows)
    packed = make_trainer(FusedCPOTrainer, tmp_path, config_cls=FusedCPOConfig, batch_layout=layout, **case)
    if case.get("max_length") == 7:
        batch = packed.data_collator([packed.train_dataset[i] for i in rows])
        assert (batch["chosen_labels"] != -100).sum(1).min() == 1  # the case is really there
    assert_same_but_logit_means(stock, loss_metrics_grads(packed, rows))
