"""The public functional (loss.py) against TRL's own math and the reference spec: values, gradients, dtypes, autocast."""

from __future__ import annotations

import pytest
import torch
from conftest import OPTIONS, make_batch, trl_reference

from trl_fused_cpo import fused_linear_cpo_loss
from trl_fused_cpo.ops.cpo_math import CPOHyperparams
from trl_fused_cpo.ops.reference import reference_linear_cpo_loss


def _grads(out_loss, tensors):
    return torch.autograd.grad(out_loss, tensors)


@pytest.mark.parametrize(
    "opts,shape,chunk_tokens",
    [
        (OPTIONS[0], (2, 7, 5, 13), None),
        (OPTIONS[1], (6, 31, 3, 47), 40),  # several pairs per chunk
        (OPTIONS[4], (8, 17, 6, 123), 1),  # every pair alone, longer than the budget: multi-slice recompute
        (OPTIONS[5], (4, 47, 8, 31), 25),
        (OPTIONS[7], (6, 13, 4, 37), 9),
        (OPTIONS[8], (10, 9, 5, 61), 1000),
        (OPTIONS[2], (4, 23, 7, 19), 12),
        (OPTIONS[3], (6, 5, 3, 11), 4),
    ],
)
def test_functional_matches_trl_and_reference(opts, shape, chunk_tokens):
    rows, seq_len, h, v = shape
    hidden, weight, bias, labels = make_batch(rows, seq_len, h, v, seed=rows * seq_len)
    labels[:, -1] = -100
    if opts.get("alpha", 0) != 0:
        hidden = hidden * 0.1
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    chunk_bytes = None if chunk_tokens is None else chunk_tokens * v * 8
    out = fused_linear_cpo_loss(*leaves[:2], labels, bias=leaves[2], backend="torch", chunk_bytes=chunk_bytes, **opts)
    hp, loss, c, r, cr, rr, nll = trl_reference(hidden, weight, bias, labels, **opts)
    torch.testing.assert_close(out.loss, loss)
    torch.testing.assert_close(out.chosen_logps, c)
    torch.testing.assert_close(out.rejected_logps, r)
    torch.testing.assert_close(out.chosen_rewards, cr.float())
    torch.testing.assert_close(out.rejected_rewards, rr.float())
    torch.testing.assert_close(out.nll_loss, nll)
    ref_leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    ref = reference_linear_cpo_loss(*ref_leaves[:2], labels, hp, bias=ref_leaves[2], compute_dtype=torch.float64)
    torch.testing.assert_close(out.chosen_logits_mean, ref.chosen_logits_mean.float())
    torch.testing.assert_close(out.rejected_logits_mean, ref.rejected_logits_mean.float())
    for got, want in zip(_grads(out.loss, leaves), _grads(ref.loss, ref_leaves), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_no_worse_than_torch(dtype):
    """Against float64 ground truth, the fused gradients are within torch's own error at the same dtype."""
    hidden, weight, bias, labels = make_batch(4, 33, 32, 257, seed=11)
    truth = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    ref = reference_linear_cpo_loss(*truth, labels, CPOHyperparams(), compute_dtype=torch.float64)
    g_truth = _grads(ref.loss, truth)
    low = [t.to(dtype).requires_grad_(True) for t in (hidden, weight)]
    g_fused = _grads(fused_linear_cpo_loss(*low, labels, backend="torch").loss, low)
    plain = [t.to(dtype).requires_grad_(True) for t in (hidden, weight)]
    # Plain torch at this dtype: logits in the input dtype, log-softmax upcast to fp32 (TRL's path).
    g_plain = _grads(
        reference_linear_cpo_loss(*[p for p in plain], labels, CPOHyperparams(), compute_dtype=dtype).loss, plain
    )
    for gf, gp, gt in zip(g_fused, g_plain, g_truth, strict=True):
        err_fused = ((gf.double() - gt).norm() / gt.norm()).item()
        err_plain = ((gp.double() - gt).norm() / gt.norm()).item()
        assert err_fused <= 1.25 * err_plain + 1e-6, (err_fused, err_plain)


@pytest.mark.parametrize("memory", ["fast", "lean"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_caller_autocast_is_honoured(memory, frozen):
    """Under the caller's autocast the op computes as lm_head would (in the autocast dtype), as the trainer does.

    Was: ``index_copy_(): ... Float and BFloat16`` with an fp32 trainable head and memory="fast"."""
    hidden, weight, bias, labels = make_batch(4, 9, 16, 33, dtype=torch.float32)
    results = []
    for autocast in (True, False):
        leaves = [hidden.clone().requires_grad_(True), weight.clone().requires_grad_(not frozen), bias.clone()]
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = fused_linear_cpo_loss(*leaves[:2], labels, bias=leaves[2], backend="torch", memory=memory)
        else:  # what autocast means for a linear layer: its inputs in bf16
            cast = [t.to(torch.bfloat16) for t in leaves]
            out = fused_linear_cpo_loss(*cast[:2], labels, bias=cast[2], backend="torch", memory=memory)
        out.loss.backward()
        grads = [t.grad for t in leaves[:2] if t.requires_grad]
        results.append((out, grads))
    (got, got_grads), (want, want_grads) = results
    assert got.loss.dtype == want.loss.dtype
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    torch.testing.assert_close(got.chosen_logps, want.chosen_logps, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=0)
