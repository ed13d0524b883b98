"""tiled_mlp.py: the MLP over sequence tiles equals the untiled MLP, output and every gradient (LoRA included)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from trl_fused_cpo.tiled_mlp import apply_tiled_mlp, is_gated_mlp
from trl_fused_cpo.toy import toy_model


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _run(model: nn.Module, x: torch.Tensor, seed: int = 0):
    """Output and the gradients of x and every parameter, for a loss that weights each output element."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    torch.manual_seed(seed)
    out = model(x)
    weights = torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)
    (out * weights).sum().backward()
    return out.detach(), x.grad.clone(), _grads(model)


def _mlp(dtype: torch.dtype) -> nn.Module:
    return toy_model(seed=1, dtype=dtype).model.layers[0].mlp


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("tile", [1, 7, 16, 73])  # 2 * 37 = 74 positions: no tile size divides it
def test_tiled_equals_untiled(dtype, tol, tile):
    mlp = _mlp(dtype)
    x = torch.randn(2, 37, mlp.gate_proj.in_features, dtype=dtype, generator=torch.Generator().manual_seed(0))
    ref_out, ref_dx, ref_grads = _run(mlp, x)
    tiled = copy.deepcopy(mlp)
    apply_tiled_mlp(nn.ModuleDict({"mlp": tiled}), tile)
    out, dx, grads = _run(tiled, x)
    assert set(grads) == set(ref_grads) == {n for n, _ in mlp.named_parameters()}
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(dx, ref_dx, rtol=tol, atol=tol)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=tol, atol=tol, msg=name)


def test_recompute_runs_one_tile_at_a_time():
    """The backward sees tiles of tile_tokens rows, and the forward keeps no [N, intermediate] tensor for it."""
    mlp = _mlp(torch.float64)
    shapes = []
    mlp.up_proj.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    apply_tiled_mlp(nn.ModuleDict({"mlp": mlp}), 10)
    x = torch.randn(1, 25, mlp.gate_proj.in_features, dtype=torch.float64, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mlp(x)
    assert shapes == [(10, 128), (10, 128), (5, 128)]
    assert saved == [(25, 64)]  # what autograd keeps for the backward: the input only
    out.sum().backward()
    assert shapes[3:] == [(10, 128), (10, 128), (5, 128)]


def test_short_rows_run_untiled():
    mlp = _mlp(torch.float64)
    apply_tiled_mlp(nn.ModuleDict({"mlp": mlp}), 64)
    out = mlp(torch.randn(1, 64, 64, dtype=torch.float64, requires_grad=True))
    assert "TiledMLPFunction" not in type(out.grad_fn).__name__


def _lora_model(dropout: float):
    from peft import LoraConfig, get_peft_model

    model = toy_model(seed=2, dtype=torch.float64)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", init_lora_weights=False)
    return get_peft_model(model, config)


def _model_loss(model: nn.Module, input_ids: torch.Tensor, seed: int = 0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), _grads(model)


@pytest.mark.parametrize("checkpointing", [None, {"use_reentrant": True}, {"use_reentrant": False}])
def test_whole_model_lora_with_gradient_checkpointing(checkpointing):
    """A LoRA model, tiled under the model's own gradient checkpointing: same loss, and every adapter gets the
    untiled gradient (the frozen base gets none)."""
    model = _lora_model(dropout=0.0)
    model.train()
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        model.enable_input_require_grads()
    input_ids = torch.randint(4, 40, (2, 29), generator=torch.Generator().manual_seed(3))
    ref_loss, ref_grads = _model_loss(model, input_ids)
    assert apply_tiled_mlp(model, 9) == 2
    loss, grads = _model_loss(model, input_ids)
    assert set(grads) == set(ref_grads) and all("lora_" in n for n in grads)
    assert any(".mlp." in n for n in grads)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_lora_dropout_recompute_replays_the_masks():
    """With LoRA dropout the recompute draws the forward's masks: the gradients equal plain autograd through the same
    tiles (the untiled MLP draws other masks, so it is not the reference here)."""
    model = _lora_model(dropout=0.3)
    model.train()
    mlp = model.base_model.model.model.layers[0].mlp
    x = torch.randn(1, 23, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    class NaiveTiles(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, h):
            flat = h.reshape(-1, h.shape[-1])
            return torch.cat([self.inner(t) for t in flat.split(5)]).view(*h.shape[:-1], -1)

    naive = NaiveTiles(mlp)
    ref_out, ref_dx, ref_grads = _run(naive, x, seed=11)
    apply_tiled_mlp(nn.ModuleDict({"mlp": mlp}), 5)
    out, dx, grads = _run(naive, x, seed=11)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-12, atol=1e-12)
    assert set(grads) == set(ref_grads) and grads
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-12, atol=1e-12, msg=name)


def test_apply_undo_and_deepcopy():
    model = toy_model(seed=0)
    assert apply_tiled_mlp(model, 8) == 2
    assert apply_tiled_mlp(model, 4) == 2 and model.model.layers[1].mlp._tiled_mlp_tokens == 4
    clone = copy.deepcopy(model)
    assert clone.model.layers[0].mlp.forward.__self__ is clone.model.layers[0].mlp  # bound to the copy
    assert set(model.state_dict()) == set(toy_model(seed=0).state_dict())
    assert apply_tiled_mlp(model, None) == 0
    assert "forward" not in model.model.layers[0].mlp.__dict__


def test_refuses_what_it_does_not_recognise():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
            self.experts = nn.ModuleList()

    assert not is_gated_mlp(Experts())
    with pytest.raises(ValueError, match="no decoder MLP.*tiled_mlp_tokens: null"):
        apply_tiled_mlp(nn.ModuleDict({"mlp": Experts()}), 8)
    for bad in (0, -3, 2.5, True):
        with pytest.raises((TypeError, ValueError), match="tiled_mlp_tokens"):
            apply_tiled_mlp(toy_model(), bad)
