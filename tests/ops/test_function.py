"""The autograd Function (ops/function.py): what it refuses."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, make_batch

from trl_fused_cpo import fused_linear_cpo_loss


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_double_backward_is_refused(backend):
    """The gradients are computed in the forward: a second-order product would silently miss the fused term."""
    hidden, weight, _, labels = make_batch(4, 9, 5, 17, dtype=torch.float32, device=DEVICE)
    hidden.requires_grad_(True)
    out = fused_linear_cpo_loss(hidden, weight, labels, backend=backend)
    with pytest.raises(RuntimeError, match="twice|second-order|create_graph"):
        torch.autograd.grad(out.loss + (hidden**2).sum(), hidden, create_graph=True)
