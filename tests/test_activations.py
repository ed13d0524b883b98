"""activation_policy: every policy gives the gradients of no checkpointing; auto's choice from a memory budget; the
estimate against the tensors autograd really saves; config checks and the logged line."""

from __future__ import annotations

import logging

import pytest
import torch
from test_trainer import loss_metrics_grads, make_trainer

from trl_fused_cpo import FusedCPOConfig, FusedCPOTrainer
from trl_fused_cpo.activations import (
    ActivationEstimate,
    decoder_layers,
    estimate_for,
    plan_for_budget,
    plan_for_training,
    resolve_plan,
)
from trl_fused_cpo.toy import toy_model

GIB = 1 << 30


def _lora():
    from peft import LoraConfig

    return LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def _grads_and_recomputes(tmp_path, policy: str, peft_config=None, num_hidden_layers: int = 3):
    """Gradients of one batch under ``policy``, and how many times each layer's MLP ran (2: recomputed)."""
    model = toy_model(num_hidden_layers=num_hidden_layers)
    trainer = make_trainer(
        FusedCPOTrainer, tmp_path, config_cls=FusedCPOConfig, model=model, peft_config=peft_config,
        activation_policy=policy,
    )  # fmt: skip
    trainer.model.train()
    calls = []
    for index, layer in enumerate(decoder_layers(trainer.model)):
        layer.mlp.register_forward_pre_hook(lambda *_, i=index: calls.append(i))  # a recompute stops early
    loss, _, grads = loss_metrics_grads(trainer)
    return loss, grads, [calls.count(i) for i in range(num_hidden_layers)], trainer


@pytest.mark.parametrize("lora", [False, True], ids=["full-finetune", "lora"])
@pytest.mark.parametrize(("policy", "runs"), [("full", [2, 2, 2]), ("2", [2, 2, 1]), ("offload", [2, 2, 2])])
def test_every_policy_gives_the_gradients_of_no_checkpointing(tmp_path, lora, policy, runs):
    peft = _lora() if lora else None
    ref_loss, ref_grads, ref_runs, _ = _grads_and_recomputes(tmp_path, "none", peft)
    loss, grads, got_runs, trainer = _grads_and_recomputes(tmp_path, policy, peft)
    assert ref_runs == [1, 1, 1] and got_runs == runs  # the policy really recomputed the layers it names
    assert not trainer.args.gradient_checkpointing  # the policy is the only checkpointing: transformers' is off
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    assert all(("lora_" in name) == lora for name in grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def _one_billion(positions: int) -> ActivationEstimate:
    """Llama-3.2-1B's widths, bf16."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64,
    )  # fmt: skip
    return estimate_for(config, positions=positions, dtype_bytes=2)


def test_auto_keeps_everything_when_it_fits_else_the_fewest_layers_else_offloads():
    estimate = _one_billion(positions=2 * 16 * 1024)  # 16 pairs at max_length 1024
    everything = estimate.bytes_with(0)
    assert 50 * GIB < everything < 56 * GIB  # 106 KiB x 16 layers x 32,768 positions
    assert plan_for_budget(estimate, everything).checkpointed == 0
    for budget in (everything - 1, 30 * GIB, 10 * GIB):
        plan = plan_for_budget(estimate, budget)
        k = plan.checkpointed
        assert 0 < k <= 16 and not plan.offload
        assert estimate.bytes_with(k) <= budget < estimate.bytes_with(k - 1)  # the fewest layers that fit
    plan = plan_for_budget(estimate, estimate.bytes_with(16) - 1)
    assert plan.offload and plan.checkpointed == 16 and "offload" in plan.describe(16)


def test_auto_reads_the_budget_from_the_free_memory():
    estimate = _one_billion(positions=2 * 16 * 1024)
    kwargs = dict(num_layers=16, checkpointing_explicit=False, estimate=estimate, fraction=0.85)
    card = 80 * GIB
    # weights in use (3 GiB), state to come (7.5 GiB): 0.85 x 80 - 3 - 7.5 = 57.5 GiB left, the 53 GiB fit
    plan = resolve_plan("auto", memory=(card - 3 * GIB, card), reserved_bytes=int(7.5 * GIB), **kwargs)
    assert plan.checkpointed == 0 and not plan.delegate and "57.5 GiB left" in plan.reason
    plan = resolve_plan("auto", memory=(card - 40 * GIB, card), reserved_bytes=int(7.5 * GIB), **kwargs)
    assert 0 < plan.checkpointed < 16  # another process holds 40 GiB: some layers recompute
    assert resolve_plan("auto", memory=None, **kwargs).delegate  # off CUDA: gradient_checkpointing decides
    explicit = {**kwargs, "checkpointing_explicit": True}
    assert resolve_plan("auto", memory=(card, card), **explicit).delegate  # an explicit choice wins over auto
    assert resolve_plan("none", memory=(card, card), **explicit).checkpointed == 0  # a named policy wins over it


def test_plan_for_training_reads_the_trainer_config(tmp_path):
    """On the toy model with an injected memory figure, as on a CUDA device: plenty keeps everything, a few MiB
    offload; a gradient_checkpointing set by the user is kept."""
    model = toy_model()
    args = FusedCPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], max_length=64)
    plenty = plan_for_training(model, args, max_length=64, sharded=False, memory=(80 * GIB, 80 * GIB))
    assert plenty.checkpointed == 0 and not plenty.delegate
    tight = plan_for_training(model, args, max_length=64, sharded=False, memory=(int(0.86 * GIB), GIB))
    assert tight.offload
    assert plan_for_training(model, args, max_length=64, sharded=True, memory=(80 * GIB, 80 * GIB)).delegate
    explicit = FusedCPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=True)
    assert plan_for_training(model, explicit, max_length=64, sharded=False, memory=(80 * GIB, 80 * GIB)).delegate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimate_matches_what_autograd_saves(dtype):
    """Bytes of the activation tensors one decoder layer saves (parameters excluded, shared storages once) on the toy
    model with sdpa: the estimate is within 5% of them."""
    model = toy_model(dtype=dtype)
    model.set_attn_implementation("sdpa")
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    inside = [False]

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if inside[0] and key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    layer = model.model.layers[0]
    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    positions = 2 * 64
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(4, 50, (2, 64)), use_cache=False)
    measured = sum(saved.values()) / positions
    estimate = estimate_for(model.config, positions=positions, dtype_bytes=dtype.itemsize).layer_bytes_per_position
    assert measured == pytest.approx(estimate, rel=0.05)


def test_config_checks_the_policy(tmp_path):
    make = lambda **kw: FusedCPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], **kw)
    assert make().activation_policy == "auto" and make().gradient_checkpointing is True  # TRL's default kept
    assert make(activation_policy=8).activation_policy == "8" and make(activation_policy="OFFLOAD").activation_policy
    for bad in ("some", "-1", "1.5", True):
        with pytest.raises(ValueError, match="activation_policy"):
            make(activation_policy=bad)
    assert (
        not make()._gradient_checkpointing_explicit
        and make(gradient_checkpointing=True)._gradient_checkpointing_explicit
    )
    with pytest.raises(ValueError, match="more layers than the model's 2"):
        make_trainer(FusedCPOTrainer, tmp_path, config_cls=FusedCPOConfig, activation_policy="3")


def test_the_choice_is_logged_and_cpu_keeps_gradient_checkpointing(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="trl_fused_cpo.trainer"):
        trainer = make_trainer(
            FusedCPOTrainer, tmp_path, config_cls=FusedCPOConfig, gradient_checkpointing=None, activation_policy="auto"
        )
    assert trainer.args.gradient_checkpointing is True  # CPU: auto leaves TRL's default to transformers
    assert not any(layer.gradient_checkpointing for layer in decoder_layers(trainer.model))  # until train() sets it
    lines = [r.getMessage() for r in caplog.records if "activations:" in r.getMessage()]
    assert lines == ["FusedCPOTrainer: activations: gradient_checkpointing as configured; activation_policy=auto off "
                     "a single CUDA device's memory."]  # fmt: skip
    with caplog.at_level(logging.INFO, logger="trl_fused_cpo.trainer"):
        make_trainer(FusedCPOTrainer, tmp_path, config_cls=FusedCPOConfig, activation_policy="1")
    assert "the first 1 of 2 layers checkpointed; activation_policy=1." in caplog.text


@pytest.mark.parametrize("layout", ["padded", "padding_free", "prefix_shared"])
def test_auto_sizes_the_longest_micro_batch_the_data_can_give(tmp_path, layout):
    """From the tokenized columns' lengths: exactly the B longest pairs as the collator packs them (+ flex's tail),
    or 2·B·the longest sequence padded; never more than 2·B·max_length."""
    from trl_fused_cpo.activations import largest_batch_positions
    from trl_fused_cpo.collator import PACKED_KEY

    trainer = make_trainer(FusedCPOTrainer, tmp_path, config_cls=FusedCPOConfig, batch_layout=layout)
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    got = largest_batch_positions(trainer.train_dataset, 4, layout)
    if layout == "padded":
        longest = max(max(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])) for r in rows)
        assert got == 2 * 4 * longest
    else:
        per_pair = sorted(trainer.data_collator([r])[PACKED_KEY].num_tokens for r in rows)
        assert got == sum(per_pair[-4:]) + 128
    assert got <= 2 * 4 * trainer.max_length + 128
    assert largest_batch_positions([{"prompt": "no columns"}], 4, layout) is None
