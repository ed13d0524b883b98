"""activation_policy=offload on CUDA: the gradients of no checkpointing, the saved layer inputs in pinned host memory
and off the device. The CPU side (every policy exact, auto's choice) is tests/test_activations.py. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch

from trl_fused_cpo.activations import ActivationPlan, apply_plan
from trl_fused_cpo.toy import toy_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LAYERS, HIDDEN, ROWS, T = 4, 256, 2, 512


def _run(plan: ActivationPlan):
    """Device bytes the forward leaves for the backward, the loss and every gradient (fp32, so the rerun is exact)."""
    model = toy_model(
        hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=T,
    ).cuda()  # fmt: skip
    model.train()
    apply_plan(model, plan)
    ids = torch.randint(4, 60, (ROWS, T), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = model(ids, use_cache=False).logits.float().square().mean()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    return held, loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_offload_is_exact_and_keeps_the_layer_inputs_in_pinned_host_memory(monkeypatch):
    packed = []

    class Spy(torch.autograd.graph.save_on_cpu):  # records what offloaded_checkpoint hands to the host
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pack = self.pack_hook
            self.pack_hook = lambda t: packed.append(pack(t)) or packed[-1]

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Spy)
    ref_held, ref_loss, ref_grads = _run(ActivationPlan(0))
    full_held, _, _ = _run(ActivationPlan(LAYERS))
    assert not packed
    held, loss, grads = _run(ActivationPlan(LAYERS, offload=True))

    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    inputs = [t for _, t in packed if isinstance(t, torch.Tensor) and t.numel() == ROWS * T * HIDDEN]
    assert len(inputs) == LAYERS and all(t.device.type == "cpu" and t.is_pinned() for t in inputs)
    layer_input = ROWS * T * HIDDEN * 4
    assert full_held - held >= 0.9 * LAYERS * layer_input  # the inputs full checkpointing keeps are off the device
    assert full_held < ref_held  # and checkpointing itself holds less than keeping everything
