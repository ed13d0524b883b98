"""tiled_mlp.py on CUDA in bf16: no worse than the untiled MLP against fp32, and its peak memory well below.

No trl needed. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from trl_fused_cpo.tiled_mlp import apply_tiled_mlp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
N, H, FF, TILE = 16_384, 1024, 4096, 4096


def _mlp(dtype: torch.dtype) -> LlamaMLP:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=H, intermediate_size=FF, hidden_act="silu", mlp_bias=False)
    return LlamaMLP(config).to("cuda", dtype)


def _step(mlp: LlamaMLP, x: torch.Tensor, weights: torch.Tensor, autocast: bool = False):
    """Output, dx and every weight gradient, in fp32 for the comparison; the peak above the inputs in bytes."""
    mlp.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = mlp(x)
    (out.float() * weights).sum().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    grads = [x.grad] + [p.grad for p in mlp.parameters()]
    return [out.float()] + [g.float() for g in grads], peak


def _error(got, want) -> float:
    return max(((g - w).norm() / w.norm()).item() for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "fp32-weights-autocast"])
def test_tiled_bf16_no_worse_than_untiled_and_lighter(autocast):
    x = torch.randn(1, N, H, device="cuda")
    weights = torch.randn(1, N, H, device="cuda")
    reference, _ = _step(_mlp(torch.float32), x, weights)
    dtype = torch.float32 if autocast else torch.bfloat16
    plain = _mlp(dtype)
    untiled, untiled_peak = _step(plain, x.to(dtype), weights, autocast)
    apply_tiled_mlp(torch.nn.ModuleDict({"mlp": plain}), TILE)
    tiled, tiled_peak = _step(plain, x.to(dtype), weights, autocast)
    assert _error(tiled, reference) <= 1.5 * _error(untiled, reference) + 1e-6
    # untiled keeps ~4 [N, FF] bf16 tensors for its backward (512 MiB here); tiled keeps x and works per tile
    assert tiled_peak < untiled_peak / 2, (tiled_peak / 2**20, untiled_peak / 2**20)
