"""memory="lean" (ops/slabs.py): vocabulary slabs, logits twice, no fp32 dW accumulator; the same results."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch

from trl_fused_cpo import fused_linear_cpo_loss
from trl_fused_cpo.ops.schedule import Chunks, NeedGrads, Slabs, choose_schedule
from trl_fused_cpo.ops.slabs import slab_bounds

OPTIONS = [
    dict(),
    dict(loss_type="hinge", cpo_alpha=0.0),
    dict(loss_type="ipo", beta=0.3),
    dict(loss_type="simpo", simpo_gamma=0.7, cpo_alpha=0.5),
    dict(loss_type="sigmoid", label_smoothing=0.2),
    dict(loss_type="alphapo", alpha=0.4),
]
FIELDS = ("loss", "chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards", "nll_loss")
METRICS = ("chosen_logits_mean", "rejected_logits_mean")


def _run(leaves, labels, **kw):
    out = fused_linear_cpo_loss(leaves[0], leaves[1], labels, bias=leaves[2], backend="torch", **kw)
    return out, torch.autograd.grad(out.loss, leaves)


def test_slab_bounds_cover_the_vocabulary_in_aligned_slabs():
    assert slab_bounds(1000, 10, 2, 10 * 2 * 300) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert slab_bounds(100, 10, 2, 1) == [(0, 100)]  # never narrower than one 128-column tile
    assert slab_bounds(128_256, 16_400, 2, 1 << 28)[0] == (0, 8064)


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("slab_columns", [128, 10_000])  # several slabs (V = 300: 128, 128, 44), and one
def test_lean_equals_the_default_schedule(opts, slab_columns):
    hidden, weight, bias, labels = make_batch(6, 11, 5, 300, seed=3)
    if opts.get("alpha"):
        hidden = hidden * 0.1
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    fast, g_fast = _run(leaves, labels, **opts)
    rows = int((labels != -100).sum()) + labels.shape[0]
    lean, g_lean = _run(leaves, labels, memory="lean", chunk_bytes=rows * 8 * slab_columns, **opts)
    for name in FIELDS + METRICS:
        torch.testing.assert_close(getattr(lean, name), getattr(fast, name), rtol=1e-9, atol=1e-11, msg=name)
    for a, b in zip(g_lean, g_fast, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_lean_without_labels_incoming_gradient_and_eval():
    hidden, weight, bias, labels = make_batch(4, 9, 5, 300, seed=5)
    labels[0] = -100  # a chosen row with no label
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    with pytest.warns(UserWarning):
        fast = fused_linear_cpo_loss(*leaves[:2], labels, bias=leaves[2], backend="torch", loss_type="ipo")
        lean = fused_linear_cpo_loss(
            *leaves[:2], labels, bias=leaves[2], backend="torch", loss_type="ipo", memory="lean", chunk_bytes=1
        )
    want = torch.autograd.grad(0.3 * fast.loss, leaves)
    got = torch.autograd.grad(0.3 * lean.loss, leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    with torch.no_grad(), pytest.warns(UserWarning, match="no labelled token"):
        eval_lean = fused_linear_cpo_loss(
            *leaves[:2], labels, bias=leaves[2], backend="torch", loss_type="ipo", memory="lean"
        )
    torch.testing.assert_close(eval_lean.loss, fast.loss.detach())
    empty = torch.full_like(labels, -100)
    none = fused_linear_cpo_loss(*leaves[:2], empty, bias=leaves[2], backend="torch", memory="lean", cpo_alpha=0)
    ref = fused_linear_cpo_loss(*leaves[:2], empty, bias=leaves[2], backend="torch", cpo_alpha=0)
    for name in FIELDS + METRICS:
        torch.testing.assert_close(getattr(none, name), getattr(ref, name), msg=name)


def test_a_frozen_head_keeps_the_default_schedule_and_bad_modes_are_refused():
    w = torch.zeros(300, 5)
    frozen, trainable, none = (
        NeedGrads(True, False, False),
        NeedGrads(True, True, False),
        NeedGrads(False, False, False),
    )
    assert isinstance(choose_schedule(w, None, "lean", frozen), Chunks)
    assert isinstance(choose_schedule(w, None, "lean", trainable), Slabs)
    assert isinstance(choose_schedule(w, None, "lean", none), Slabs)  # eval
    assert isinstance(choose_schedule(w, None, "fast", trainable), Chunks)
    with pytest.raises(ValueError, match="memory="):
        choose_schedule(w, None, "tiny", trainable)
