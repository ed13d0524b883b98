"""fused_cpo_varlen on CUDA: its kernels (PyTorch's flash varlen, the default; cuDNN ragged over square segments) over
the segment tables against the dense-mask reference in bf16, both layouts, forward and backward (the gathers' summed
gradients); the default through a Llama and through the trainer.

Budget: the error against an fp32 dense-mask run is no worse than the bf16 dense-mask run's own, twice over, with a
floor of 4e-3 (bf16 keeps 8 bits). The CPU side (tables, reference, trainer in fp32) is tests/test_varlen_attention.py.
Skipped without CUDA.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_packing_cuda import PAD, random_batch, small_llama

from trl_fused_cpo.attention import dense_visibility, packed_attention_mask
from trl_fused_cpo.packing import pack_pairs
from trl_fused_cpo.varlen_attention import (
    IMPLEMENTATION,
    TABLES_KWARG,
    _varlen_attn_parameters,
    varlen_attention,
    varlen_tables,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
FLOOR = 4e-3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def dense(q, k, v, visible):
    """The whole row through sdpa with the dense mask: ``[N, H, D]`` in, ``[N, H, D]`` out."""
    groups = q.shape[1] // k.shape[1]
    qq, kk, vv = (t.transpose(0, 1) for t in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=visible).transpose(0, 1)


def fwd_bwd(fn, q, k, v, grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def test_torch_has_varlen_attn():
    assert _varlen_attn_parameters() is not None, f"torch {torch.__version__}: no torch.nn.attention.varlen"


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])  # varlen_attention.CUDA_KERNELS
@pytest.mark.parametrize("heads", [(32, 8, 64), (32, 8, 128), (4, 4, 64)], ids=["1b-heads", "8b-heads", "mha"])
@pytest.mark.parametrize("layout", ["padding_free", "prefix_shared"])
def test_varlen_kernel_matches_dense_mask(layout, heads, kernel):
    hq, hkv, d = heads
    packed = pack_pairs(random_batch(6, seed=hq + d), layout, pad_token_id=PAD, pad_to_multiple_of=64)
    tables = varlen_tables(packed).to("cuda")
    visible = dense_visibility(packed).cuda()
    n = packed.num_tokens
    q, k, v, grad = (torch.randn(n, h, d, device="cuda") for h in (hq, hkv, hkv, hq))
    truth = fwd_bwd(lambda *a: dense(*a, visible), q, k, v, grad)
    bf16 = [t.bfloat16() for t in (q, k, v, grad)]
    plain = fwd_bwd(lambda *a: dense(*a, visible), *bf16)
    got = fwd_bwd(lambda *a: varlen_attention(*a, tables, kernel=kernel), *bf16)
    for name, g, p, t in zip(("out", "dq", "dk", "dv"), got, plain, truth, strict=True):
        assert g.dtype == torch.bfloat16 and torch.isfinite(g).all(), name
        err, budget = rel(g, t), max(2 * rel(p, t), FLOOR)
        print(f"{kernel} {layout} {heads} {name}: rel error {err:.2e} (dense bf16 {rel(p, t):.2e})")
        assert err <= budget, f"{name}: {err:.2e} > {budget:.2e}"


@pytest.mark.parametrize("layout", ["padding_free", "prefix_shared"])
def test_llama_hidden_states_match_the_dense_mask(layout):
    """A 2-layer Llama with attn_implementation=fused_cpo_varlen: hidden states at every real position."""
    batch = random_batch(8)
    packed = pack_pairs(batch, layout, pad_token_id=PAD).to("cuda")
    tables = varlen_tables(packed).to("cuda")

    def states(model, implementation, **kwargs):
        model.set_attn_implementation(implementation)
        mask = packed_attention_mask(packed, dtype=model.dtype, implementation=implementation)
        with torch.no_grad():
            out = model.model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=mask,
                              use_cache=False, **kwargs)  # fmt: skip
        return out.last_hidden_state[0]

    truth = states(small_llama(torch.float32), "sdpa")
    model16 = small_llama(torch.bfloat16)
    plain = states(model16, "sdpa")
    got = states(model16, IMPLEMENTATION, **{TABLES_KWARG: tables})
    err, budget = rel(got, truth), max(2 * rel(plain, truth), FLOOR)
    assert err <= budget, f"{err:.2e} > {budget:.2e}"


@pytest.mark.parametrize("layout", ["padding_free", "prefix_shared"])
def test_trainer_loss_and_grads_in_bf16(tmp_path, layout):
    """FusedCPOTrainer on CUDA in bf16 with fused_cpo_varlen: loss and gradients against the fp32 sdpa packed run,
    within twice the bf16 sdpa packed run's own error."""
    pytest.importorskip("trl")
    from test_trainer import loss_metrics_grads, make_trainer

    from trl_fused_cpo import FusedCPOConfig, FusedCPOTrainer
    from trl_fused_cpo.toy import toy_config

    torch.manual_seed(0)
    from transformers import LlamaForCausalLM

    config = toy_config(4099, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8)
    base = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16)

    def run(model, **cuda):
        trainer = make_trainer(FusedCPOTrainer, tmp_path, model=model, config_cls=FusedCPOConfig,
                               batch_layout=layout, use_cpu=False, **cuda)  # fmt: skip
        return loss_metrics_grads(trainer)

    truth = run(copy.deepcopy(base).float())
    plain = run(copy.deepcopy(base), bf16=True)
    varlen_model = copy.deepcopy(base)
    varlen_model.set_attn_implementation(IMPLEMENTATION)
    got = run(varlen_model, bf16=True)
    flat = lambda grads: torch.cat([g.double().flatten() for _, g in sorted(grads.items())])  # noqa: E731
    for what, g, p, t in (
        ("loss", got[0], plain[0], truth[0]),
        ("grads", flat(got[2]), flat(plain[2]), flat(truth[2])),
    ):
        err, budget = rel(g, t), max(2 * rel(p, t), FLOOR)
        print(f"{layout} {what}: rel error {err:.2e} (sdpa packed bf16 {rel(p, t):.2e})")
        assert err <= budget, f"{what}: {err:.2e} > {budget:.2e}"
    assert got[1].keys() == truth[1].keys()
