"""The default schedule (ops/chunks.py): no work it need not do, bounded memory, chunking that changes nothing."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import OPTIONS, make_batch

from trl_fused_cpo import fused_linear_cpo_loss
from trl_fused_cpo.ops import gemm
from trl_fused_cpo.ops.cpo_math import CPOHyperparams
from trl_fused_cpo.ops.reference import reference_linear_cpo_loss


def test_frozen_weight_gets_no_gradient_and_no_weight_gemm(monkeypatch):
    calls = []
    monkeypatch.setattr(gemm, "accumulate_mm", lambda *a, **k: calls.append(1))
    hidden, weight, _, labels = make_batch(4, 9, 5, 17)
    hidden.requires_grad_(True)
    out = fused_linear_cpo_loss(hidden, weight, labels, backend="torch")
    out.loss.backward()
    assert weight.grad is None and hidden.grad is not None
    assert calls == []


@pytest.mark.parametrize("opts", [OPTIONS[0], OPTIONS[5], OPTIONS[9]], ids=["sigmoid", "simpo", "ipo-alpha"])
def test_frozen_head_splits_pairs_without_recomputing(monkeypatch, opts):
    """A budget shorter than a pair: a frozen head scales each slice's product afterwards, one logits GEMM per token."""
    rows, seq_len, h, v = 6, 23, 7, 41
    hidden, weight, _, labels = make_batch(rows, seq_len, h, v, dtype=torch.float64, seed=9)
    leaf = hidden.clone().requires_grad_(True)
    logits_rows = []
    real = gemm.logits
    monkeypatch.setattr(gemm, "logits", lambda x, *a: (logits_rows.append(x.shape[0]), real(x, *a))[1])
    out = fused_linear_cpo_loss(leaf, weight, labels, backend="torch", chunk_bytes=5 * v * 8, **opts)
    (grad,) = torch.autograd.grad(out.loss * 0.7, [leaf])  # an incoming gradient other than the guess
    assert max(logits_rows) <= 5 + rows  # slices of 5 tokens (the first also carries the 2B unlabelled-sum rows)
    assert sum(logits_rows) == int((labels != -100).sum()) + rows  # each labelled token once: no recompute
    ref_leaf = hidden.clone().requires_grad_(True)
    ref = reference_linear_cpo_loss(
        ref_leaf, weight, labels, CPOHyperparams.create(**opts), compute_dtype=torch.float64
    )
    (ref_grad,) = torch.autograd.grad(ref.loss * 0.7, [ref_leaf])
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(grad, ref_grad)


def test_no_grad_forward_does_no_gradient_work(monkeypatch):
    calls = []
    from trl_fused_cpo.ops import torch_backend

    monkeypatch.setattr(torch_backend, "softmax_grad_", lambda *a, **k: calls.append(1))
    hidden, weight, bias, labels = make_batch(4, 9, 5, 17)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    with torch.no_grad():
        out = fused_linear_cpo_loss(hidden, weight, labels, bias=bias, backend="torch")
    assert calls == [] and not out.loss.requires_grad
    ref = reference_linear_cpo_loss(hidden, weight, labels, CPOHyperparams(), bias=bias, compute_dtype=torch.float64)
    torch.testing.assert_close(out.loss, ref.loss)


class _LargestTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_torch_backend_never_allocates_full_logits():
    rows, seq_len, h, v = 8, 64, 16, 512
    hidden, weight, bias, labels = make_batch(rows, seq_len, h, v, dtype=torch.float32, prompt_frac=0.0)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    chunk_bytes = 200 * v * 4  # 200 tokens of fp32 logits; a full pair is at most 128
    with _LargestTensor() as probe:
        out = fused_linear_cpo_loss(hidden, weight, labels, bias=bias, backend="torch", chunk_bytes=chunk_bytes)
        out.loss.backward()
    full = rows * seq_len * v
    assert probe.largest <= 200 * v < full, (probe.largest, full)
    # The probe sees the reference's logits: it does detect [2B, T, V].
    with _LargestTensor() as probe:
        reference_linear_cpo_loss(hidden, weight, labels, CPOHyperparams(), bias=bias)
    assert probe.largest >= full


def test_chunk_size_does_not_change_the_result():
    hidden, weight, bias, labels = make_batch(8, 21, 6, 53, dtype=torch.float32, seed=5)
    results = []
    for tokens in (1, 17, 60, 10_000):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        out = fused_linear_cpo_loss(*leaves[:2], labels, bias=leaves[2], backend="torch", chunk_bytes=tokens * 53 * 4)
        results.append((out.loss, *torch.autograd.grad(out.loss, leaves)))
    for a, b in itertools.pairwise(results):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-6)
