"""The Triton backend on CUDA: odd shapes, dtypes, masks, options, against float64 ground truth.

Budget: the fused loss and gradients are no worse than plain torch's at the same input dtype (torch: logits in
the input dtype, log-softmax in fp32 — TRL's path), with a 10% margin for rounding luck. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch

from trl_fused_cpo import fused_linear_cpo_loss
from trl_fused_cpo.ops.cpo_math import CPOHyperparams
from trl_fused_cpo.ops.reference import reference_linear_cpo_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def errors(dtype, shape, opts, *, bias=False, frozen=False, chunk_bytes=None, memory="fast", seed=0):
    rows, seq_len, h, v = shape
    hidden, weight, b, labels = make_batch(rows, seq_len, h, v, dtype=torch.float64, device="cuda", seed=seed)
    hp = CPOHyperparams.create(**opts)
    names = ["hidden"] + ([] if frozen else ["weight"]) + (["bias"] if bias else [])

    def run(fn, cast):
        leaves = {"hidden": hidden.to(cast), "weight": weight.to(cast), "bias": b.to(cast)}
        for n in names:
            leaves[n].requires_grad_(True)
        out = fn(leaves)
        grads = torch.autograd.grad(out.loss, [leaves[n] for n in names])
        return out, dict(zip(names, grads, strict=True))

    bias_of = lambda lv: lv["bias"] if bias else None
    truth, g_truth = run(
        lambda lv: reference_linear_cpo_loss(
            lv["hidden"], lv["weight"], labels, hp, bias=bias_of(lv), compute_dtype=torch.float64
        ),
        torch.float64,
    )
    plain, g_plain = run(
        lambda lv: reference_linear_cpo_loss(
            lv["hidden"], lv["weight"], labels, hp, bias=bias_of(lv), compute_dtype=dtype
        ),
        dtype,
    )
    fused, g_fused = run(
        lambda lv: fused_linear_cpo_loss(
            lv["hidden"],
            lv["weight"],
            labels,
            bias=bias_of(lv),
            backend="triton",
            chunk_bytes=chunk_bytes,
            memory=memory,
            **opts,
        ),
        dtype,
    )
    out = {"loss": (rel(fused.loss, truth.loss), rel(plain.loss, truth.loss))}
    for n in names:
        out[n] = (rel(g_fused[n], g_truth[n]), rel(g_plain[n], g_truth[n]))
        assert torch.isfinite(g_fused[n]).all()
    out["logps"] = (rel(fused.chosen_logps, truth.chosen_logps), rel(plain.chosen_logps, truth.chosen_logps))
    return out


def assert_no_worse(errs, margin=1.1, floor=1e-6):
    table = ", ".join(f"{n}: fused {f:.2e} / torch {p:.2e}" for n, (f, p) in errs.items())
    for name, (fused, plain) in errs.items():
        assert fused <= margin * plain + floor, f"{name} worse than torch; {table}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 47, 64, 123), (6, 129, 128, 4097), (4, 300, 256, 32_003)])
def test_no_worse_than_torch(dtype, shape):
    assert_no_worse(errors(dtype, shape, dict(loss_type="sigmoid")))


@pytest.mark.parametrize(
    "opts",
    [
        dict(loss_type="hinge"),
        dict(loss_type="ipo", beta=0.5),
        dict(loss_type="simpo", cpo_alpha=0.5),
        dict(loss_type="alphapo", alpha=0.2),
        dict(loss_type="sigmoid", label_smoothing=0.1, cpo_alpha=0.0),
    ],
    ids=lambda o: o["loss_type"],
)
def test_every_loss_type(opts):
    assert_no_worse(errors(torch.bfloat16, (4, 61, 128, 5003), opts, seed=1))


@pytest.mark.parametrize("bias,frozen", [(True, False), (False, True), (True, True)])
def test_bias_and_frozen(bias, frozen):
    assert_no_worse(errors(torch.bfloat16, (4, 77, 64, 3001), dict(), bias=bias, frozen=frozen, seed=2))


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("chunk_tokens", [16, 100, 10_000])
def test_chunking(chunk_tokens, frozen):
    # 16 tokens is shorter than a pair: multi-slice groups (recomputed logits; frozen: products scaled afterwards).
    errs = errors(torch.bfloat16, (6, 90, 64, 2049), dict(), frozen=frozen, chunk_bytes=chunk_tokens * 2049 * 2, seed=3)
    assert_no_worse(errs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_lean_memory_no_worse_than_torch(dtype, bias):
    # 4 MB slabs of a 32k vocabulary over ~1k rows: 16 slabs, the last one partial.
    errs = errors(dtype, (4, 300, 256, 32_003), dict(), bias=bias, chunk_bytes=4 << 20, memory="lean", seed=4)
    assert_no_worse(errs)


def test_h_of_llama3_family_and_long_rows():
    for h in (2048, 3072):
        assert_no_worse(errors(torch.bfloat16, (2, 64, h, 1000), dict(), seed=h))


def test_eval_forward_matches_training_forward():
    hidden, weight, _, labels = make_batch(4, 200, 256, 20_000, dtype=torch.bfloat16, device="cuda")
    train = fused_linear_cpo_loss(hidden.requires_grad_(True), weight.requires_grad_(True), labels, backend="triton")
    with torch.no_grad():
        evald = fused_linear_cpo_loss(hidden, weight, labels, backend="triton")
    torch.testing.assert_close(evald.loss, train.loss.detach())
    torch.testing.assert_close(evald.chosen_logps, train.chosen_logps)


def test_large_vocab_rows_past_int32():
    """rows x V > 2^31: the kernels' int64 offsets (16,900 tokens x 128,256 > 2.1e9)."""
    rows, seq_len, h, v = 2, 8_500, 64, 128_256
    hidden, weight, _, labels = make_batch(rows, seq_len, h, v, dtype=torch.bfloat16, device="cuda", prompt_frac=0)
    labels[:, -1] = -100
    from trl_fused_cpo.ops import kernels, torch_backend

    x = hidden.reshape(-1, h)[:16_900]
    logits = x @ weight.t()
    t = labels.reshape(-1)[:16_900].clamp(min=0)
    lse, tgt, _ = kernels.logsumexp_target(logits, t)
    lse_ref, tgt_ref, _ = torch_backend.logsumexp_target(logits[-64:], t[-64:])
    torch.testing.assert_close(lse[-64:], lse_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(tgt[-64:], tgt_ref)


def test_plan_counts_after_a_busy_queue():
    """The plan reads its counts only once the GPU wrote them: each batch queued behind a long matmul (so the
    counts are late) and with its own mask gives the plan that the CPU computes from the same labels."""
    from trl_fused_cpo.ops import kernels, plan, torch_backend

    busy = torch.randn(4096, 4096, device="cuda")
    for seed in range(4):
        *_, labels = make_batch(6, 257, 8, 1000, dtype=torch.float32, device="cuda", seed=seed)
        args = dict(ignore_index=-100, vocab_size=1000, max_tokens=300)
        for _ in range(3):
            busy = busy @ busy / 64  # a few ms queued ahead of the counts (137 GFLOP each)
        on_gpu = plan.plan_tokens(labels, backend=kernels, **args)
        on_cpu = plan.plan_tokens(labels.cpu(), backend=torch_backend, **args)
        assert on_gpu.row_counts_host == on_cpu.row_counts_host
        assert on_gpu.groups == on_cpu.groups
        torch.testing.assert_close(on_gpu.token_index.cpu(), on_cpu.token_index)
        torch.testing.assert_close(on_gpu.targets.cpu(), on_cpu.targets)
