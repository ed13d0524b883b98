"""Masks for packed rows (attention.py): the BlockMask against torch's own, flex_attention and varlen against the
dense mask, and the models that packing refuses."""

from __future__ import annotations

import pytest
import torch
from test_packing import (
    LAYOUTS,
    PAD,
    check_hidden,
    check_layout,
    collate,
    run_packed,
    run_padded,
)
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask
from transformers import LlamaConfig, MambaConfig, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from trl_fused_cpo.attention import (
    dense_visibility,
    packed_attention_mask,
    packed_block_mask,
    packed_mask_mod,
)
from trl_fused_cpo.packing import pack_pairs
from trl_fused_cpo.support import packing_unsupported_reason
from trl_fused_cpo.toy import toy_model, toy_vocab


def full_tiles(block_mask) -> torch.Tensor:
    """``[q block, kv block]`` bool: the tiles the kernels run without mask_mod."""
    num, idx = block_mask.full_kv_num_blocks[0, 0], block_mask.full_kv_indices[0, 0]
    tiles = torch.zeros(idx.shape, dtype=torch.bool)
    for q_block in range(len(num)):
        tiles[q_block, idx[q_block, : num[q_block]].long()] = True
    return tiles


@pytest.mark.parametrize("pad_to", [None, 128])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_mask_equals_torch_create_block_mask(layout, pad_to):
    """Empty, partial and full tiles at several block sizes, N a multiple of the block or not."""
    packed = pack_pairs(collate(64, range(12)), layout, pad_token_id=PAD, pad_to_multiple_of=pad_to)
    n = packed.num_tokens
    assert n > 200
    for block in (8, 32, 128):
        got = packed_block_mask(packed, block_size=block)
        want = create_block_mask(packed_mask_mod(packed), 1, 1, n, n, device="cpu", BLOCK_SIZE=block)
        assert torch.equal(got.kv_num_blocks, want.kv_num_blocks), block
        assert torch.equal(got.full_kv_num_blocks, want.full_kv_num_blocks), block
        assert torch.equal(got.to_dense(), want.to_dense()), block  # the partial tiles
        assert torch.equal(full_tiles(got), full_tiles(want)), block
        assert 0 < int(got.kv_num_blocks.sum()) and (block > 8 or 0 < int(got.full_kv_num_blocks.sum()))
    q, k = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    assert torch.equal(packed_mask_mod(packed)(0, 0, q, k), dense_visibility(packed))


@pytest.mark.slow
def test_flex_attention_matches_dense_mask_on_cpu():
    """transformers' flex_attention path (torch.compile'd flex on CPU, ~20 s; float32 only there) with the
    BlockMask gives the dense mask's hidden states, over several 128-tiles."""
    batch = collate(64, range(16))
    packed = pack_pairs(batch, "prefix_shared", pad_token_id=PAD, pad_to_multiple_of=128)
    assert packed.num_tokens >= 3 * 128
    model = toy_model(dtype=torch.float32).eval()
    dense = run_packed(model, packed, "sdpa")
    flex = run_packed(model, packed, "flex_attention")
    cat, padded_hidden = run_padded(model, batch)
    check_layout(packed, cat)
    real = packed.group < packed.num_pairs  # the tail padding's states are free
    assert (flex - dense)[real].abs().max() <= 1e-5
    check_hidden(packed, flex, padded_hidden, 1e-5)


def test_padding_free_varlen_and_position_id_packing():
    """padding_free needs no mask: flash-attention varlen cuts the row where position ids restart (transformers'
    prepare_fa_kwargs_from_position_ids), and sdpa with attention_mask=None detects the same segments."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    batch = collate(12, range(4))
    packed = pack_pairs(batch, "padding_free", pad_token_id=PAD)
    assert packed_attention_mask(packed, dtype=torch.float32, implementation="flash_attention_2") is None
    (cu_q, _), _ = prepare_fa_kwargs_from_position_ids(packed.position_ids)
    lengths = packed.row_lengths.view(2, -1).t().reshape(-1)  # c_0, r_0, c_1, r_1, ...
    assert cu_q.tolist() == [0] + lengths.cumsum(0).tolist()

    model = toy_model(dtype=torch.float64).eval()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():  # use_cache=False: with a cache, transformers skips the packed-sequence detection
        no_mask = model.model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
        no_mask = no_mask.last_hidden_state[0]
    cat, padded_hidden = run_padded(model, batch)
    check_hidden(packed, no_mask, padded_hidden, 1e-10)

    shared = pack_pairs(batch, "prefix_shared", pad_token_id=PAD)
    with pytest.raises(ValueError, match="flex_attention"):
        packed_attention_mask(shared, dtype=torch.float32, implementation="flash_attention_2")
    with pytest.raises(ValueError, match="attn_implementation='my_kernel'"):
        packed_attention_mask(shared, dtype=torch.float32, implementation="my_kernel")


def tiny(cls, config_cls, **kw):
    config = config_cls(
        vocab_size=len(toy_vocab()),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        **kw,
    )
    return cls(config)


class NoPositions(nn.Module):
    """A causal LM whose forward takes no position_ids (it would number the packed row 0..N-1)."""

    def __init__(self):
        super().__init__()
        self.config = LlamaConfig(vocab_size=8, hidden_size=8, num_attention_heads=2, num_hidden_layers=1)

    def forward(self, input_ids, attention_mask=None):
        return input_ids


class StandIn(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return input_ids


@pytest.mark.parametrize("layout", LAYOUTS)
def test_llama_is_accepted(layout):
    model = toy_model()
    for implementation in ("eager", "sdpa", "flex_attention"):
        model.config._attn_implementation = implementation
        assert packing_unsupported_reason(model, layout) is None
        assert packing_unsupported_reason(model, layout, max_length=4096) is None
    model.config._attn_implementation = "flash_attention_2"
    assert packing_unsupported_reason(model, "padding_free") is None
    reason = packing_unsupported_reason(model, "prefix_shared")
    assert reason is not None and "flash_attention_2" in reason and "flex_attention" in reason
    model.config._attn_implementation = "my_kernel"
    assert "my_kernel" in packing_unsupported_reason(model, layout)
    assert packing_unsupported_reason(model, "padded") is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_refusals_name_what_and_the_fix(layout):
    mistral = tiny(MistralForCausalLM, MistralConfig, sliding_window=8)
    reason = packing_unsupported_reason(mistral, layout, max_length=12)
    assert "sliding_window=8" in reason and "max_length <= 8" in reason and "'padded'" in reason
    assert "sliding" in packing_unsupported_reason(mistral, layout)  # max_length unknown: refused
    assert packing_unsupported_reason(mistral, layout, max_length=8) is None

    qwen = tiny(Qwen2ForCausalLM, Qwen2Config, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert "sliding_window=8" in packing_unsupported_reason(qwen, layout, max_length=64)
    assert packing_unsupported_reason(tiny(Qwen2ForCausalLM, Qwen2Config), layout, max_length=64) is None

    reason = packing_unsupported_reason(NoPositions(), layout)
    assert "NoPositions.forward takes no position_ids" in reason and "'padded'" in reason

    hybrid = LlamaConfig(layer_types=["full_attention", "linear_attention"], num_hidden_layers=2)
    assert "linear_attention" in packing_unsupported_reason(StandIn(hybrid), layout)
    assert "carry state" in packing_unsupported_reason(StandIn(MambaConfig(num_hidden_layers=1)), layout)
    encdec = LlamaConfig()
    encdec.is_encoder_decoder = True
    assert "encoder-decoder" in packing_unsupported_reason(StandIn(encdec), layout)
    assert packing_unsupported_reason(StandIn(LlamaConfig()), layout) is None  # the stand-ins are not refused per se


def test_window_that_fits_max_length_is_exact():
    """What the window check allows: a Mistral whose window covers max_length packs exactly (float64, sdpa)."""
    batch = collate(12, range(4))
    config = MistralConfig(
        vocab_size=len(toy_vocab()),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=12,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config).to(torch.float64).eval()
    assert packing_unsupported_reason(model, "prefix_shared", max_length=12) is None
    model.set_attn_implementation("sdpa")
    cat, padded_hidden = run_padded(model, batch)
    for layout in LAYOUTS:
        packed = pack_pairs(batch, layout, pad_token_id=PAD)
        check_hidden(packed, run_packed(model, packed, "sdpa"), padded_hidden, 1e-10)
