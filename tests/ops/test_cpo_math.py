"""The CPO math (ops/cpo_math.py) and the reference spec (ops/reference.py) against TRL's own methods."""

from __future__ import annotations

import pytest
import torch
from conftest import OPTIONS, make_batch, trl_reference

from trl_fused_cpo.ops.cpo_math import CPOHyperparams
from trl_fused_cpo.ops.reference import reference_linear_cpo_loss


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_reference_equals_trl_math(opts):
    hidden, weight, bias, labels = make_batch(6, 11, 8, 29, seed=3)
    labels[:, -1] = -100
    if opts.get("alpha", 0) != 0:  # TRL's exp(s).pow(-alpha) underflows for long sums: keep s moderate
        hidden = hidden * 0.1
    hp, loss, c, r, cr, rr, nll = trl_reference(hidden, weight, bias, labels, **opts)
    ref = reference_linear_cpo_loss(hidden, weight, labels, hp, bias=bias, compute_dtype=torch.float64)
    torch.testing.assert_close(ref.loss, loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ref.chosen_logps, c)
    torch.testing.assert_close(ref.rejected_logps, r)
    torch.testing.assert_close(ref.chosen_rewards, cr)
    torch.testing.assert_close(ref.rejected_rewards, rr)
    torch.testing.assert_close(ref.nll_loss, nll.to(ref.nll_loss.dtype))


def test_hyperparams_normalise_alphapo_and_reject_unknown():
    hp = CPOHyperparams.create(loss_type="alphapo", cpo_alpha=1.0)
    assert (hp.loss_type, hp.cpo_alpha) == ("simpo", 0.0)
    with pytest.raises(ValueError, match="loss_type"):
        CPOHyperparams.create(loss_type="kto_pair")
