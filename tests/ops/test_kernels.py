"""The Triton kernels on the CPU through TRITON_INTERPRET=1 (set in conftest), tiny fp32/fp16 shapes.

The interpreter cannot do bf16 arithmetic (docs/design.md §5); bf16 runs in tests/gpu. On a CUDA machine these run
the compiled kernels on the GPU instead.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DEVICE, make_batch

from trl_fused_cpo import fused_linear_cpo_loss
from trl_fused_cpo.ops import torch_backend

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="needs CUDA or TRITON_INTERPRET=1"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 4097), (3, 8193), (7, 123)])
def test_row_kernels_match_torch(dtype, rows, vocab):
    from trl_fused_cpo.ops import kernels

    g = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=g) * 2).to(dtype).to(DEVICE)
    targets = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    coef = torch.randn(rows, generator=g).to(DEVICE)
    lse, tgt, row_sum = kernels.logsumexp_target(logits, targets)
    lse_ref, tgt_ref, row_sum_ref = torch_backend.logsumexp_target(logits, targets)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(tgt, tgt_ref)
    torch.testing.assert_close(row_sum, row_sum_ref, rtol=1e-5, atol=1e-3)
    got = kernels.softmax_grad_(logits.clone(), lse_ref, targets, coef)
    want = torch_backend.softmax_grad_(logits.clone(), lse_ref, targets, coef)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("rows,seq_len", [(2, 5), (6, 37), (4, 2500)])  # 2500: two blocks of 2048 per row
def test_plan_kernels_match_torch(rows, seq_len):
    from trl_fused_cpo.ops import kernels

    g = torch.Generator().manual_seed(rows + seq_len)
    labels = torch.randint(0, 50, (rows, seq_len), generator=g)
    labels[torch.rand(rows, seq_len, generator=g) < 0.4] = -100
    labels[1] = -100  # a row with no label
    labels[0, 0] = 50  # out of range
    labels = labels.to(DEVICE)
    counts = kernels.label_counts(labels, -100, 50)
    torch.testing.assert_close(counts.long(), torch_backend.label_counts(labels, -100, 50).long())
    n = int(counts[0].sum())
    got = kernels.compact_labels(labels, counts[0], n, -100)
    want = torch_backend.compact_labels(labels, counts[0], n, -100)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    strided = torch.zeros(rows, seq_len + 3, dtype=labels.dtype, device=DEVICE)[:, :seq_len]
    strided.copy_(labels)  # a view with row stride T + 3
    assert torch.equal(kernels.compact_labels(strided, counts[0], n, -100)[0], want[0])
    # Sized for every position (plan.LabelLayout, queued before the count is known): the same first n entries,
    # and a token_index tail of valid positions, which a gather queued before the sync reads.
    for ops in (kernels, torch_backend):
        every = ops.compact_labels(labels, counts[0], labels.numel(), -100)
        for a, b in zip(every, want, strict=True):
            assert a.shape == (labels.numel(),) and torch.equal(a[:n], b)
        assert 0 <= int(every[0].min()) and int(every[0].max()) < labels.numel()


def test_kernels_reject_bad_shapes():
    from trl_fused_cpo.ops import kernels

    logits = torch.randn(4, 9, device=DEVICE)
    with pytest.raises(ValueError, match="targets"):
        kernels.logsumexp_target(logits, torch.zeros(3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="row-major"):
        kernels.logsumexp_target(logits.t(), torch.zeros(9, dtype=torch.long, device=DEVICE))
    # frozen_dx_'s per-token tensors: the shape and contiguity a kernel indexing ptr + token relies on
    g, weight, dx = (torch.randn(4, 8, device=DEVICE) for _ in range(3))
    per_token = torch.zeros(2, 4, dtype=torch.long, device=DEVICE)
    keep, inv, coef = torch.ones(4, device=DEVICE), torch.ones(4, device=DEVICE), torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match="keep must be contiguous"):
        strided = torch.ones(8, device=DEVICE)[::2]
        kernels.frozen_dx_(dx, per_token[0], g, weight, per_token[1], coef, per_token[0], strided, inv)
    with pytest.raises(ValueError, match="targets must be"):
        kernels.frozen_dx_(dx, per_token[0], g, weight, per_token[1, :3], coef, per_token[0], keep, inv)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "simpo"])
@pytest.mark.parametrize(
    "with_bias,frozen,memory",  # lean: 3 vocabulary slabs of V = 300; frozen: pairs split into scaled slices
    [
        (False, False, "fast"),
        (True, False, "fast"),
        (False, False, "lean"),
        (True, False, "lean"),
        (False, True, "fast"),
    ],
)
def test_triton_backend_matches_torch_backend(loss_type, with_bias, frozen, memory):
    hidden, weight, bias, labels = make_batch(4, 19, 8, 300, dtype=torch.float32, device=DEVICE, seed=7)
    bias = bias if with_bias else None
    results = []
    for backend in ("torch", "triton"):
        leaves = [hidden.clone(), weight.clone()] + ([bias.clone()] if with_bias else [])
        for t in leaves[:1] if frozen else leaves:
            t.requires_grad_(True)
        out = fused_linear_cpo_loss(
            leaves[0],
            leaves[1],
            labels,
            bias=leaves[2] if with_bias else None,
            loss_type=loss_type,
            backend=backend,
            chunk_bytes=30 * 300 * 4,
            memory=memory,
        )
        results.append((out, torch.autograd.grad(out.loss, [t for t in leaves if t.requires_grad])))
    (a, ga), (b, gb) = results
    for name in ("loss", "chosen_logps", "rejected_logps", "nll_loss", "chosen_logits_mean"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-5, atol=1e-5)
    for x, y in zip(gb, ga, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_scale_cast_kernel(dtype):
    from trl_fused_cpo.ops.kernels.backward_scale import scale_cast

    src = torch.randn(3, 10_001, device=DEVICE)
    scale = torch.tensor(0.37, device=DEVICE)
    torch.testing.assert_close(scale_cast(src, scale, dtype), (src * 0.37).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rescale_kernel_scales_in_place_and_skips_a_ratio_of_one(dtype):
    from trl_fused_cpo.ops.kernels.backward_scale import rescale_

    t = torch.randn(5, 7_001, device=DEVICE).to(dtype)  # several grid-stride steps of 8192 elements
    want = (t.float() * 0.37).to(dtype)
    out = rescale_(t, torch.tensor(0.37, device=DEVICE))
    assert out.data_ptr() == t.data_ptr()
    torch.testing.assert_close(t, want)
    before = t.clone()
    rescale_(t, torch.tensor(1.0, device=DEVICE))
    assert torch.equal(t, before)
    with pytest.raises(ValueError, match="contiguous"):
        rescale_(t.t(), torch.tensor(2.0, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spread", [2.0, 100.0])  # 100: logits far above the target's, the rescaling path
def test_frozen_grad_kernels_match_torch(dtype, spread):
    """shifted_exp_ (E · inv = softmax without the target column) and frozen_dx_ against torch_backend."""
    from trl_fused_cpo.ops import kernels

    g = torch.Generator().manual_seed(int(spread))
    rows, vocab, hidden = 4, 8193 + 4096, 24  # two segments of 8,192, the second partly filled
    logits = torch.randn(rows, vocab, generator=g) * 2
    targets = torch.randint(0, vocab, (rows,), generator=g)
    if spread > 64:
        logits[0, 5000] = spread  # a later block of segment 0: rescale its earlier blocks
        logits[1, 9000] = spread  # segment 1 only: the combine brings segment 0 to its shift
        logits[2, 100] = spread / 2  # the first block
        logits[2, 8200] = spread  # both segments, different shifts
    logits = logits.to(dtype).to(DEVICE)
    targets = targets.to(DEVICE)
    got, want = logits.clone(), logits.clone()
    # Into views of larger per-token buffers, as function.py passes them (nothing else in them may change).
    bufs, bufs_r = (torch.full((4, rows + 3), 7.0, device=DEVICE) for _ in range(2))
    kernels.shifted_exp_(got, targets, *bufs[:, 1 : rows + 1])
    torch_backend.shifted_exp_(want, targets, *bufs_r[:, 1 : rows + 1])
    assert bool((bufs[:, 0] == 7).all() and (bufs[:, rows + 1 :] == 7).all())
    (logp, row_sum, keep, inv), (logp_r, row_sum_r, keep_r, inv_r) = bufs[:, 1 : rows + 1], bufs_r[:, 1 : rows + 1]
    torch.testing.assert_close(logp, logp_r, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(row_sum, row_sum_r, rtol=1e-5, atol=1e-2)
    assert bool((got[torch.arange(rows), targets.cpu()] == 0).all())  # E's target column
    torch.testing.assert_close(keep, keep_r, rtol=1e-5, atol=1e-7)
    rtol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float() * inv[:, None], want.float() * inv_r[:, None], rtol=rtol, atol=1e-7)

    weight = torch.randn(vocab, hidden, generator=g).to(dtype).to(DEVICE)
    products = got.float() @ weight.float()
    coef = torch.randn(2, generator=g).to(DEVICE)
    token_row = torch.tensor([0, 1, 1, 0], device=DEVICE)
    token_index = torch.tensor([5, 0, 2, 7], device=DEVICE)
    dx, dx_r = (torch.zeros(9, hidden, dtype=dtype, device=DEVICE) for _ in range(2))
    args = (products, weight, targets, coef, token_row, keep, inv)
    kernels.frozen_dx_(dx, token_index, *args)
    torch_backend.frozen_dx_(dx_r, token_index, *args)
    torch.testing.assert_close(dx, dx_r, rtol=1e-5 if dtype == torch.float32 else 1e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_token_logps_kernel_writes_into_the_callers_buffers(dtype):
    from trl_fused_cpo.ops import kernels

    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 9000, generator=g) * 2).to(dtype).to(DEVICE)
    targets = torch.randint(0, 9000, (5,), generator=g).to(DEVICE)
    results = []
    for ops in (kernels, torch_backend):
        buf = torch.full((2, 8), 7.0, device=DEVICE)
        lse = ops.token_logps_(logits, targets, buf[0, 2:7], buf[1, 2:7])
        results.append((lse, buf))
    (lse, buf), (lse_r, buf_r) = results
    torch.testing.assert_close(lse, lse_r, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(buf, buf_r, rtol=1e-5, atol=1e-2)
    assert bool((buf[:, :2] == 7).all() and (buf[:, 7:] == 7).all())
    with pytest.raises(ValueError, match="contiguous"):
        kernels.token_logps_(logits, targets, torch.empty(10, device=DEVICE)[::2], buf[1, 2:7])


TAIL_OPTIONS = [
    dict(loss_type="sigmoid"),
    dict(loss_type="sigmoid", label_smoothing=0.2, beta=0.3),
    dict(loss_type="hinge", beta=0.05, cpo_alpha=0.0),
    dict(loss_type="hinge", beta=40.0),  # 1 − βu on both sides of the kink
    dict(loss_type="ipo", beta=0.5),
    dict(loss_type="simpo", simpo_gamma=0.8, beta=2.0, label_smoothing=0.1),
    dict(loss_type="alphapo", alpha=0.4),
    dict(loss_type="alphapo", alpha=1e-4, beta=3.0),  # AlphaPO's expm1 near 0
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("opts", TAIL_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_sequence_tail_kernels_match_torch(opts, grad, dtype):
    """pair_tail_ / finish_ (closed forms, one launch each) against the torch spec (autograd), group by group; the
    logit means for padded rows (``T`` positions each) and packed ones (a length per row)."""
    from trl_fused_cpo.ops import kernels
    from trl_fused_cpo.ops import plan as plan_mod
    from trl_fused_cpo.ops.cpo_math import CPOHyperparams
    from trl_fused_cpo.ops.sequence import SequenceStats

    hp = CPOHyperparams.create(**opts)
    g = torch.Generator().manual_seed(len(str(opts)))
    rows, seq_len, vocab = 10, 23, 50
    labels = torch.randint(0, vocab, (rows, seq_len), generator=g)
    labels[torch.rand(rows, seq_len, generator=g) < 0.3] = -100
    labels[2] = -100  # a chosen row with no label: s = 0 (TRL: NaN with mean log-probs)
    labels = labels.to(DEVICE)
    plan = plan_mod.plan_tokens(labels, ignore_index=-100, vocab_size=vocab, max_tokens=40, backend=torch_backend)
    assert len(plan.groups) > 1
    n = plan.num_tokens
    token_logp = (-3 * torch.rand(n, generator=g, dtype=torch.float64)).to(dtype).to(DEVICE)
    token_sum = (5 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype).to(DEVICE)
    unlabelled = torch.randn(rows, generator=g, dtype=torch.float64).to(dtype).to(DEVICE)
    bias = torch.randn(vocab, generator=g).to(DEVICE)
    guess = torch.tensor(0.5, dtype=dtype, device=DEVICE)
    padded = torch.full((rows,), seq_len, device=DEVICE)
    packed = plan.row_counts + 1 + torch.randint(0, 9, (rows,), generator=g).to(DEVICE)  # real lengths: each its own
    positions = (padded, packed)
    results = []
    for ops in (torch_backend, kernels):
        stats = SequenceStats.empty(rows, torch.device(DEVICE), dtype)
        coef = torch.full((rows,), float("nan"), dtype=dtype, device=DEVICE) if grad else None
        for group in plan.groups:
            ops.pair_tail_(stats, plan, token_logp, token_sum, group, hp, coef, guess if grad else None)
        finished = [ops.finish_(stats, plan, hp, unlabelled, b, n, vocab) for b in (None, bias) for n in positions]
        results.append((stats, coef, finished))
    (want, want_coef, want_fin), (got, got_coef, got_fin) = results
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-6, atol=1e-6)
    for field in SequenceStats.__dataclass_fields__:
        torch.testing.assert_close(getattr(got, field), getattr(want, field), **tol, msg=field)
    if grad:
        torch.testing.assert_close(got_coef, want_coef, **tol)
    for a, b in zip(got_fin, want_fin, strict=True):
        for x, y in zip(a, b, strict=True):  # loss, nll, then the two logit means (float32 whatever the dtype)
            torch.testing.assert_close(x, y, **(tol if x.dtype == dtype else dict(rtol=1e-6, atol=1e-7)))
