"""The CPO math and the functional (torch backend) against TRL's own methods and the reference spec."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from conftest import make_batch
from trl.experimental.cpo import CPOTrainer

from trl_fused_cpo import fused_linear_cpo_loss
from trl_fused_cpo.ops import gemm
from trl_fused_cpo.ops.cpo_math import CPOHyperparams
from trl_fused_cpo.ops.grad_scale import GradScaleGuess
from trl_fused_cpo.ops.reference import reference_linear_cpo_loss

OPTIONS = [
    dict(loss_type="sigmoid"),
    dict(loss_type="sigmoid", label_smoothing=0.2, beta=0.3),
    dict(loss_type="sigmoid", cpo_alpha=0.0),
    dict(loss_type="hinge", beta=0.05),
    dict(loss_type="ipo", beta=0.5),
    dict(loss_type="simpo", simpo_gamma=0.8, beta=2.0),
    dict(loss_type="simpo", cpo_alpha=0.5, label_smoothing=0.1),
    dict(loss_type="alphapo", alpha=0.25, beta=2.5),
    dict(loss_type="sigmoid", alpha=0.05),
    dict(loss_type="ipo", alpha=-0.3),
]


def trl_reference(hidden, weight, bias, labels, **opts):
    """TRL 1.16's CPOTrainer math, called on materialised float64 logits (labels unshifted, as TRL takes them)."""
    hp = CPOHyperparams.create(**opts)
    fake = SimpleNamespace(
        beta=hp.beta,
        loss_type=hp.loss_type,
        label_smoothing=hp.label_smoothing,
        simpo_gamma=hp.simpo_gamma,
        alpha=hp.alpha,
        accelerator=SimpleNamespace(device=hidden.device),
    )
    logits = hidden.double() @ weight.double().t() + bias.double()
    # TRL shifts inside get_batch_logps: our labels[:, t] is its labels[:, t + 1], so it never scores our last
    # position, which the trainer always leaves unlabelled.
    assert (labels[:, -1] == -100).all()
    trl_labels = torch.nn.functional.pad(labels, (1, 0), value=-100)[:, :-1]
    logps = CPOTrainer.get_batch_logps(logits, trl_labels, average_log_prob=hp.average_log_prob)
    b = hidden.shape[0] // 2
    losses, cr, rr = CPOTrainer.cpo_loss(fake, logps[:b], logps[b:])
    if hp.cpo_alpha == 0:
        nll = torch.zeros((), dtype=torch.float64)
    else:
        nll = torch.nn.functional.cross_entropy(
            logits[:b].reshape(-1, logits.shape[-1]), labels[:b].reshape(-1), ignore_index=-100
        )
    return hp, losses.mean() + hp.cpo_alpha * nll, logps[:b], logps[b:], cr, rr, nll


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


def test_incoming_gradient_scales_every_gradient():
    hidden, weight, bias, labels = make_batch(4, 9, 5, 17)
    a = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    b = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    (0.25 * fused_linear_cpo_loss(a[0], a[1], labels, bias=a[2], backend="torch").loss).backward()
    fused_linear_cpo_loss(b[0], b[1], labels, bias=b[2], backend="torch").loss.backward()
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.grad, 0.25 * y.grad)


@pytest.mark.parametrize("keep_guess", [False, True], ids=["per-call", "kept-guess"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_changing_incoming_gradients_are_all_applied(backend, keep_guess):
    """A kept guess of grad_loss (ops/grad_scale.py, as the trainer keeps one): right, wrong, zero, back to 1."""
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    hidden, weight, bias, labels = make_batch(4, 9, 5, 17, dtype=torch.float32, device=device)
    ref = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    fused_linear_cpo_loss(ref[0], ref[1], labels, bias=ref[2], backend="torch").loss.backward()
    guess = GradScaleGuess() if keep_guess else None
    for scale in (0.25, 0.25, 3.0, 0.0, 0.0, 1.0, 1.0):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        out = fused_linear_cpo_loss(
            leaves[0], leaves[1], labels, bias=leaves[2], backend=backend, grad_scale_guess=guess
        )
        (scale * out.loss).backward()
        for got, want in zip(leaves, ref, strict=True):
            torch.testing.assert_close(got.grad, scale * want.grad, rtol=1e-5, atol=1e-7)


def test_default_budgets_put_the_benchmarks_masked_b16_batch_in_one_gemm_and_keep_the_frozen_pair_whole():
    from trl_fused_cpo.ops.schedule import NeedGrads, choose_schedule

    trainable_need, frozen_need = NeedGrads(True, True, False), NeedGrads(True, False, False)
    # Llama-3 8B head in bf16 (meta: no memory). Trainable: 1.5 GiB = 6,278 tokens, one GEMM up to 10,374, which
    # holds the 40%-unlabelled B = 16 batch (9,824 tokens) but not the full one (16,368). Frozen: 384 MiB = 1,569
    # tokens, a masked T = 1024 pair (1,228) whole. Eval: 1 GiB = 4,185.
    weight = torch.empty(128_256, 4096, dtype=torch.bfloat16, device="meta")
    trainable = choose_schedule(weight, None, "fast", trainable_need)
    assert (trainable.max_tokens, trainable.whole_batch_tokens) == (6278, 10374)
    assert 9824 <= trainable.whole_batch_tokens < 16368
    frozen = choose_schedule(weight, None, "fast", frozen_need)
    assert frozen.max_tokens == 1569 and frozen.max_tokens >= 1228
    assert choose_schedule(weight, None, "fast", NeedGrads(False, False, False)).max_tokens == 4185


def test_whole_batch_budget_makes_one_gemm_only_for_a_trainable_low_precision_head(monkeypatch):
    from trl_fused_cpo.ops import torch_backend
    from trl_fused_cpo.ops.function import FusedOpOptions, LinearCPOFunction
    from trl_fused_cpo.ops.plan import plan_tokens
    from trl_fused_cpo.ops.schedule import Chunks, NeedGrads, whole_batch_tokens

    # Llama-3 8B: a 1 GiB budget holds 4,185 tokens; one GEMM needs no 2 GiB fp32 accumulator, so it may hold 8,281.
    assert whole_batch_tokens(128_256, 4096, torch.bfloat16, 4185) == 4185 + 4096
    assert whole_batch_tokens(128_256, 4096, torch.float32, 2093) == 2093
    hidden, weight, _, labels = make_batch(4, 9, 5, 17, dtype=torch.float32)
    n = int((labels != -100).sum())
    plan_args = dict(ignore_index=-100, vocab_size=17, max_tokens=3, backend=torch_backend)
    one = plan_tokens(labels, **plan_args, whole_batch_tokens=n)
    assert len(one.groups) == 1 and one.max_tokens == n
    assert len(plan_tokens(labels, **plan_args, whole_batch_tokens=n - 1).groups) > 1

    firsts = []
    real = gemm.accumulate_mm
    monkeypatch.setattr(gemm, "accumulate_mm", lambda *a, first: (firsts.append(first), real(*a, first=first)))
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    options = FusedOpOptions(CPOHyperparams(), -100, Chunks(3, n), torch_backend, NeedGrads(True, True, False))
    loss = LinearCPOFunction.apply(*leaves, None, labels, options)
    loss[0].backward()
    assert firsts == [True]  # one dW GEMM, written directly


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


def test_hyperparams_normalise_alphapo_and_reject_unknown():
    hp = CPOHyperparams.create(loss_type="alphapo", cpo_alpha=1.0)
    assert (hp.loss_type, hp.cpo_alpha) == ("simpo", 0.0)
    with pytest.raises(ValueError, match="loss_type"):
        CPOHyperparams.create(loss_type="kto_pair")


def test_chunk_size_does_not_change_the_result():
    hidden, weight, bias, labels = make_batch(8, 21, 6, 53, dtype=torch.float32, seed=5)
    results = []
    for tokens in (1, 17, 60, 10_000):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
        out = fused_linear_cpo_loss(*leaves[:2], labels, bias=leaves[2], backend="torch", chunk_bytes=tokens * 53 * 4)
        results.append((out.loss, *_grads(out.loss, leaves)))
    for a, b in itertools.pairwise(results):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize(
    ("pair_tokens", "budget", "sizes"),
    [
        ([1228] * 16, 6278, [4912] * 4),  # greedy would make 5 + 5 + 5 + 1 pairs: a 6,140-token buffer
        ([2046] * 16, 4185, [4092] * 8),  # already even
        ([1228] * 16, 4185, [3684] * 5 + [1228]),  # 6 groups need 3 pairs somewhere: no smaller buffer exists
        ([5000, 10, 10, 3000, 3000], 4185, [5000, 3020, 3000]),  # a pair over the budget is a group alone
        ([0, 0], 4185, [0]),
    ],
)
def test_chunk_groups_are_as_few_as_greedy_and_no_larger_than_needed(pair_tokens, budget, sizes):
    from trl_fused_cpo.ops.plan import _pack, balanced_groups

    groups = balanced_groups(pair_tokens, budget)
    assert [g.tok_end - g.tok_start for g in groups] == sizes
    assert len(groups) == len(_pack(pair_tokens, budget))
    assert groups[0].pair_start == 0 and groups[-1].pair_end == len(pair_tokens)
    for a, b in itertools.pairwise(groups):
        assert (a.pair_end, a.tok_end) == (b.pair_start, b.tok_start)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_double_backward_is_refused(backend):
    """The gradients are computed in the forward: a second-order product would silently miss the fused term."""
    hidden, weight, _, labels = make_batch(4, 9, 5, 17, dtype=torch.float32)
    hidden.requires_grad_(True)
    out = fused_linear_cpo_loss(hidden, weight, labels, backend=backend)
    with pytest.raises(RuntimeError, match="twice|second-order|create_graph"):
        torch.autograd.grad(out.loss + (hidden**2).sum(), hidden, create_graph=True)


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
