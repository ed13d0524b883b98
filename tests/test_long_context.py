"""Long pairs: max_length against the model's context, the tiled MLP through the trainer, and a long row's masks."""

from __future__ import annotations

import pytest
import torch
from test_trainer import make_trainer
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, Qwen2Config

import trl_fused_cpo.attention as attention
from trl_fused_cpo import FusedCPOConfig, FusedCPOTrainer
from trl_fused_cpo.attention import packed_attention_mask, packed_block_mask, packed_mask_mod
from trl_fused_cpo.collator import PACKED_KEY, PackingCollator
from trl_fused_cpo.context_length import max_length_refusal, model_context_length
from trl_fused_cpo.loss import fused_linear_cpo_loss_packed
from trl_fused_cpo.packing import pack_pairs
from trl_fused_cpo.toy import toy_model

LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_model_context_length():
    assert model_context_length(LlamaConfig(max_position_embeddings=131_072, rope_parameters=LLAMA31_ROPE)) == 131_072
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32_768, "rope_theta": 1e6}
    assert model_context_length(Qwen2Config(max_position_embeddings=32_768, rope_parameters=yarn)) == 131_072
    assert model_context_length(toy_model(max_position_embeddings=96)) == 96
    assert model_context_length(object()) is None


def test_max_length_refusal_names_the_limit_and_the_fix():
    config = LlamaConfig(max_position_embeddings=131_072, rope_parameters=LLAMA31_ROPE)
    assert max_length_refusal(config, 131_072) is None and max_length_refusal(config, None) is None
    reason = max_length_refusal(config, 131_073)
    assert "max_length=131073" in reason and "131072 positions" in reason and "RoPE scaling" in reason
    assert "Set max_length <= 131072" in reason


def _trainer(tmp_path, **overrides):
    return make_trainer(FusedCPOTrainer, tmp_path, config_cls=FusedCPOConfig, **overrides)


def test_trainer_refuses_max_length_beyond_the_context(tmp_path):
    with pytest.raises(ValueError, match=r"max_length=65 is beyond the model's context.*Set max_length <= 64"):
        _trainer(tmp_path, model=toy_model(max_position_embeddings=64), max_length=65)
    _trainer(tmp_path, model=toy_model(max_position_embeddings=64), max_length=64)  # the limit itself is fine


def test_tiled_mlp_config_is_checked():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="tiled_mlp_tokens"):
            FusedCPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to=[], tiled_mlp_tokens=bad)
    with pytest.raises(ValueError, match="use_liger_kernel"):
        FusedCPOConfig(
            output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to=[], tiled_mlp_tokens=8, use_liger_kernel=True
        )


def _loss_and_grads(trainer):
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    loss.backward()
    return (
        loss.detach(),
        metrics,
        {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None},
    )


@pytest.mark.parametrize(
    "layout,policy", [("padded", None), ("prefix_shared", None), ("prefix_shared", "offload"), ("padded", 1)]
)
def test_trainer_with_tiled_mlp_matches_untiled_lora_and_checkpointing(tmp_path, layout, policy):
    """tiled_mlp_tokens=7 (no row length is a multiple) under LoRA and the model's gradient checkpointing (or an
    activation_policy: offloaded checkpoints, one checkpointed layer): the same loss, metrics and adapter gradients
    as the model's own MLP."""
    from peft import LoraConfig

    policy_args = {} if policy is None else {"activation_policy": policy}

    def run(tiled):
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
        trainer = _trainer(
            tmp_path,
            model=toy_model(seed=3, dtype=torch.float64),
            peft_config=lora,
            batch_layout=layout,
            gradient_checkpointing=True,
            tiled_mlp_tokens=tiled,
            **policy_args,
            fused_backend="torch",
        )
        tiled_mlps = [m for m in trainer.model.modules() if "_tiled_mlp_tokens" in m.__dict__]
        assert len(tiled_mlps) == (2 if tiled else 0)
        return _loss_and_grads(trainer)

    ref, got = run(None), run(7)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-12, atol=1e-12)
    assert got[1] == pytest.approx(ref[1], rel=1e-10, abs=1e-12)
    assert got[2].keys() == ref[2].keys() and any(".mlp." in n and "lora_" in n for n in got[2])
    for name, g in got[2].items():
        torch.testing.assert_close(g, ref[2][name], rtol=1e-9, atol=1e-12, msg=name)


def _long_pair_batch(prompt: int, chosen: int, rejected: int) -> dict[str, torch.Tensor]:
    """One pair as CPOTrainer's collator gives it: [prompt | completion] rows, labels -100 on the prompt."""
    g = torch.Generator().manual_seed(0)
    head = torch.randint(4, 40, (prompt,), generator=g)
    batch = {}
    for side, n in (("chosen", chosen), ("rejected", rejected)):
        ids = torch.cat([head, torch.randint(4, 40, (n,), generator=g)])[None]
        labels = ids.clone()
        labels[:, :prompt] = -100
        batch.update(
            {f"{side}_input_ids": ids, f"{side}_attention_mask": torch.ones_like(ids), f"{side}_labels": labels}
        )
    return batch


class _LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op returns while active (what the mask builder allocates)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_long_row_flex_mask_allocates_no_quadratic_tensor():
    """A 32k-position prefix_shared row (16k : 8k : 8k): the collator's packing, its flex BlockMask and the fused
    head's loss, metrics and backward allocate at most 2**22 elements at a time (the [N, N] mask would be 2**30,
    and the whole row's [N, N / 128] block counts were 2**23 before they were counted a slab at a time); the dense
    path of the same builder does allocate [N, N]."""
    batch = _long_pair_batch(16_384, 8_191, 8_191)  # shared 16,383 + two branches of 8,192, one tail pad
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(32_768, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, requires_grad=True)
    with _LargestTensor() as flex:
        packed = PackingCollator(lambda rows: rows[0], "prefix_shared", 0, "flex_attention")([batch])[PACKED_KEY]
        block_mask = packed_attention_mask(packed, dtype=torch.bfloat16, implementation="flex_attention")
        out = fused_linear_cpo_loss_packed(  # the head and its metrics on the same row: no [N, N] either
            hidden, weight, **packed.loss_arguments(), backend="torch"
        )
        out.loss.backward()
    n = packed.num_tokens
    assert n == 32_768 and block_mask.seq_lengths == (n, n) and hidden.grad.abs().sum() > 0
    assert flex.largest <= 1 << 22, flex.largest
    small = pack_pairs(_long_pair_batch(30, 10, 11), "prefix_shared", pad_token_id=0)
    with _LargestTensor() as dense:
        packed_attention_mask(small, dtype=torch.float32, implementation="sdpa")
    assert dense.largest == small.num_tokens**2


@pytest.mark.parametrize("layout", ["padding_free", "prefix_shared"])
def test_block_mask_counted_in_slabs_equals_torch(monkeypatch, layout):
    """Slabs of one and of three query blocks give create_block_mask's tiles exactly (the row's end mid-slab)."""
    from torch.nn.attention.flex_attention import create_block_mask

    packed = pack_pairs(_long_pair_batch(70, 41, 52), layout, pad_token_id=0)
    n = packed.num_tokens
    want = create_block_mask(packed_mask_mod(packed), 1, 1, n, n, device="cpu", BLOCK_SIZE=16)
    for slab_blocks in (1, 3):
        monkeypatch.setattr(attention, "_MASK_SLAB_ELEMENTS", slab_blocks * 16 * (-(-n // 16)))
        got = packed_block_mask(packed, block_size=16)
        assert torch.equal(got.kv_num_blocks, want.kv_num_blocks)
        assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks)
        assert torch.equal(got.to_dense(), want.to_dense())
