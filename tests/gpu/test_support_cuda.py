"""The construction probe on CUDA in bf16: no false refusal of an exact model on sdpa or flex_attention, in every
layout; a head the fused loss does not compute still refused at bf16's tolerance."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fused_cpo.support import check_model_runs_exactly

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def llama(implementation: str) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, pad_token_id=0)  # fmt: skip
    config._attn_implementation = implementation
    torch.manual_seed(0)
    with torch.device("cuda"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


@pytest.mark.parametrize("implementation", ["sdpa", "flex_attention"])
@pytest.mark.parametrize("layout", ["padded", "padding_free", "prefix_shared"])
def test_the_probe_accepts_an_exact_model_in_bf16(layout, implementation):
    check_model_runs_exactly(llama(implementation), layout, pad_token_id=0, implementation=implementation)


def test_the_probe_refuses_an_undeclared_logit_scale_in_bf16():
    model = llama("sdpa")
    model.lm_head.register_forward_hook(lambda module, args, out: out * 0.5)
    with pytest.raises(ValueError, match="use_fused_loss=False"):
        check_model_runs_exactly(model, "padded", pad_token_id=0, implementation="sdpa")
