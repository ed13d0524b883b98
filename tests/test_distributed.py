"""The ZeRO-3 route (the fused loss run as lm_head's own forward) on CPU, with a stand-in ZeRO-3 marker."""

from __future__ import annotations

import torch

from trl_fused_cpo.distributed import call_through_head
from trl_fused_cpo.loss import fused_linear_cpo_loss


def test_call_through_head_equals_direct_read_and_restores_forward():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 23, bias=False)
    hidden = torch.randn(4, 7, 8, requires_grad=True)
    labels = torch.randint(0, 23, (4, 7))
    fn = lambda h, w, b: fused_linear_cpo_loss(h, w, labels, bias=b, backend="torch")

    direct = call_through_head(head, fn, hidden)
    g_direct = torch.autograd.grad(direct.loss, (hidden, head.weight))
    head.weight.ds_id = 0  # what ZeRO-3 puts on partitioned parameters: take the head-forward route
    calls = []
    head.register_forward_pre_hook(lambda *a: calls.append(1))  # ZeRO-3 fetches parameters in such a hook
    routed = call_through_head(head, fn, hidden)
    g_routed = torch.autograd.grad(routed.loss, (hidden, head.weight))
    assert calls == [1] and type(routed) is type(direct)
    torch.testing.assert_close(routed.loss, direct.loss)
    torch.testing.assert_close(routed.chosen_logps, direct.chosen_logps)
    for a, b in zip(g_routed, g_direct, strict=True):
        torch.testing.assert_close(a, b)
    assert "forward" not in head.__dict__  # the swap is undone
    assert head(hidden).shape == (4, 7, 23)
