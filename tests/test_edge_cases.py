"""Bad input and degenerate batches: a clear error or a documented, finite answer, never a silent wrong one."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from conftest import DEVICE, make_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_fused_cpo import fused_linear_cpo_loss
from trl_fused_cpo.ops.cpo_math import LOSS_TYPES, CPOHyperparams
from trl_fused_cpo.ops.reference import reference_linear_cpo_loss

BACKENDS = ["torch"] + (["triton"] if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" else [])


def batch(rows=4, seq_len=9, h=5, v=17, dtype=torch.float32, **kw):
    return make_batch(rows, seq_len, h, v, dtype=dtype, device=DEVICE, **kw)


@pytest.mark.parametrize(
    "mutate,error,match",
    [
        (lambda h, w, y, b: (h[0], w, y, b), ValueError, r"hidden must be \[2B, T, H\]"),
        (lambda h, w, y, b: (h, w[:, :-1], y, b), ValueError, "weight must be"),
        (lambda h, w, y, b: (h, w, y[:, :-1], b), ValueError, "labels must be"),
        (lambda h, w, y, b: (h[:3], w, y[:3], b), ValueError, "even"),
        (lambda h, w, y, b: (h, w, y.float(), b), TypeError, "labels must be int64"),
        (lambda h, w, y, b: (h, w.double(), y, b), TypeError, "same dtype"),
        (lambda h, w, y, b: (h, w, y, b[:-1]), ValueError, "bias must be"),
        (lambda h, w, y, b: (h.long(), w.long(), y, b), TypeError, "floating point"),
    ],
)
def test_bad_shapes_and_dtypes_raise_naming_the_tensors(mutate, error, match):
    hidden, weight, bias, labels = batch()
    h, w, y, b = mutate(hidden, weight, labels, bias)
    with pytest.raises(error, match=match):
        fused_linear_cpo_loss(h, w, y, bias=b, backend="torch")


def test_device_mismatch_raises():
    if not torch.cuda.is_available():
        pytest.skip("needs two devices")
    hidden, weight, _, labels = batch()
    with pytest.raises(ValueError, match="one device"):
        fused_linear_cpo_loss(hidden, weight.cpu(), labels)


@pytest.mark.parametrize("bad", [17, 1000, -5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_label_ids_outside_the_vocabulary_raise(bad, backend):
    hidden, weight, _, labels = batch()
    labels[1, 5] = bad
    with pytest.raises(ValueError, match=r"outside \[0, 17\)"):
        fused_linear_cpo_loss(hidden, weight, labels, backend=backend)


def test_unknown_backend_and_loss_type_raise():
    hidden, weight, _, labels = batch()
    with pytest.raises(ValueError, match="backend"):
        fused_linear_cpo_loss(hidden, weight, labels, backend="cuda")
    with pytest.raises(ValueError, match="loss_type"):
        fused_linear_cpo_loss(hidden, weight, labels, loss_type="dpo")


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_equal_contiguous(backend):
    hidden, weight, bias, labels = batch(rows=4, seq_len=12, h=6, v=23)
    wide = torch.randn(4, 12, 12, device=DEVICE)
    wide[..., ::2] = hidden  # hidden as a strided view
    h_strided = wide[..., ::2]
    w_strided = weight.t().contiguous().t()  # [V, H] with column-major strides
    l_strided = torch.stack([labels, labels], -1)[..., 0]
    a = fused_linear_cpo_loss(hidden, weight, labels, bias=bias, backend=backend)
    b = fused_linear_cpo_loss(h_strided, w_strided, l_strided, bias=bias, backend=backend)
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.chosen_logps, b.chosen_logps)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
def test_pair_with_an_empty_completion_is_finite_and_warns_where_trl_is_nan(backend, loss_type):
    hidden, weight, bias, labels = batch(rows=6, seq_len=10)
    labels[1] = -100  # chosen row of pair 1: prompt fills max_length
    labels[5] = -100  # rejected row of pair 2
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fused_linear_cpo_loss(h, w, labels, loss_type=loss_type, backend=backend)
    average = loss_type in ("ipo", "simpo")
    assert any("no labelled token" in str(c.message) for c in caught) == average
    assert out.chosen_logps[1] == 0 and out.rejected_logps[2] == 0
    gh, gw = torch.autograd.grad(out.loss, (h, w))
    assert torch.isfinite(out.loss) and torch.isfinite(gh).all() and torch.isfinite(gw).all()
    ref = reference_linear_cpo_loss(
        h, w, labels, CPOHyperparams.create(loss_type=loss_type), compute_dtype=torch.float64
    )
    torch.testing.assert_close(out.loss, ref.loss.float(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_micro_batch_without_any_label(backend):
    hidden, weight, bias, labels = batch()
    labels[:] = -100
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    with pytest.warns(UserWarning, match="nll_loss is 0"):
        out = fused_linear_cpo_loss(h, w, labels, backend=backend)
    out.loss.backward()
    torch.testing.assert_close(out.loss, torch.log(torch.tensor(2.0, device=DEVICE)))  # -logσ(0)
    assert (h.grad == 0).all() and (w.grad == 0).all() and out.nll_loss == 0


def test_long_sequences_split_within_a_pair():
    """T = 32,768: a pair (65k tokens) far over the chunk budget is split into slices and recomputed."""
    hidden, weight, bias, labels = make_batch(2, 32_768, 4, 11, dtype=torch.float32, prompt_frac=0.05)
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    out = fused_linear_cpo_loss(h, w, labels, backend="torch", chunk_bytes=8192 * 11 * 4)
    ref = reference_linear_cpo_loss(h, w, labels, CPOHyperparams(), compute_dtype=torch.float64)
    torch.testing.assert_close(out.loss, ref.loss.float(), rtol=1e-4, atol=1e-4)
    for g, gr in zip(torch.autograd.grad(out.loss, (h, w)), torch.autograd.grad(ref.loss, (h, w)), strict=True):
        assert ((g.double() - gr).norm() / gr.norm()) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_non_finite_hidden_gives_a_non_finite_loss(backend, bad_value):
    hidden, weight, _, labels = batch()
    labels[2, 3] = 4
    hidden[2, 3, 0] = bad_value
    out = fused_linear_cpo_loss(hidden, weight, labels, backend=backend)
    assert not torch.isfinite(out.loss)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs_are_finite(dtype):
    hidden, weight, _, labels = batch(rows=4, seq_len=33, h=16, v=97, dtype=dtype)
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
    out = fused_linear_cpo_loss(h, w, labels, backend="torch")
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    assert h.grad.dtype == dtype and w.grad.dtype == dtype


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pairs=st.integers(1, 4),
    seq_len=st.integers(2, 24),
    h=st.integers(1, 9),
    v=st.integers(2, 40),
    loss_type=st.sampled_from(LOSS_TYPES),
    beta=st.floats(0.05, 3.0),
    smoothing=st.sampled_from([0.0, 0.15]),
    cpo_alpha=st.sampled_from([0.0, 1.0, 0.4]),
    chunk_tokens=st.integers(1, 60),
    with_bias=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_property_torch_backend_equals_reference(
    pairs, seq_len, h, v, loss_type, beta, smoothing, cpo_alpha, chunk_tokens, with_bias, seed
):
    hidden, weight, bias, labels = make_batch(2 * pairs, seq_len, h, v, seed=seed, prompt_frac=0.6)
    opts = dict(loss_type=loss_type, beta=beta, label_smoothing=smoothing, cpo_alpha=cpo_alpha)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    b = leaves[2] if with_bias else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fused_linear_cpo_loss(
            leaves[0], leaves[1], labels, bias=b, backend="torch", chunk_bytes=chunk_tokens * v * 8, **opts
        )
    ref = reference_linear_cpo_loss(
        leaves[0], leaves[1], labels, CPOHyperparams.create(**opts), bias=b, compute_dtype=torch.float64
    )
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out.chosen_rewards, ref.chosen_rewards.float())
    wrt = leaves if with_bias else leaves[:2]
    for g, gr in zip(torch.autograd.grad(out.loss, wrt), torch.autograd.grad(ref.loss, wrt), strict=True):
        torch.testing.assert_close(g, gr, rtol=1e-8, atol=1e-10)


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs CUDA or TRITON_INTERPRET=1")
@settings(max_examples=12, deadline=None)
@given(pairs=st.integers(1, 3), seq_len=st.integers(2, 12), v=st.integers(2, 300), seed=st.integers(0, 1000))
def test_property_triton_backend_equals_torch_backend(pairs, seq_len, v, seed):
    hidden, weight, _, labels = make_batch(2 * pairs, seq_len, 4, v, dtype=torch.float32, device=DEVICE, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = fused_linear_cpo_loss(hidden, weight, labels, backend="torch")
        b = fused_linear_cpo_loss(hidden, weight, labels, backend="triton")
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.chosen_logps, a.chosen_logps, rtol=1e-5, atol=1e-4)


def test_auto_backend_keeps_float64_off_the_float32_kernels():
    """The Triton kernels compute in float32: float64 inputs on CUDA get the torch backend (float64 throughout)."""
    from trl_fused_cpo.ops.backend import resolve_backend

    cuda = torch.device("cuda", 0)
    assert resolve_backend("auto", cuda, torch.float64) == "torch"
    assert resolve_backend("auto", cuda, torch.bfloat16) == "triton"
    with pytest.raises(ValueError, match="float64"):
        resolve_backend("triton", cuda, torch.float64)


def test_triton_backend_takes_a_frozen_non_contiguous_weight():
    """The torch backend took it; the Triton backend refused ("frozen_dx_ needs contiguous ... weight")."""
    hidden, weight, _, labels = make_batch(4, 9, 8, 37, dtype=torch.float32, device=DEVICE)
    strided = weight.t().contiguous().t()  # same values, column-major
    assert not strided.is_contiguous()
    outs = []
    for backend, w in (("torch", weight), ("triton", strided)):
        h = hidden.clone().requires_grad_(True)
        out = fused_linear_cpo_loss(h, w, labels, backend=backend)
        outs.append((out.loss, torch.autograd.grad(out.loss, h)[0]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-4, atol=1e-6)
