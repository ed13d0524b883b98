"""Schedule choice and budgets (ops/schedule.py): the defaults and the one-GEMM exception, decided once."""

from __future__ import annotations

import torch
from conftest import make_batch

from trl_fused_cpo.ops import gemm
from trl_fused_cpo.ops.cpo_math import CPOHyperparams


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
    from trl_fused_cpo.ops.rows import PaddedRows
    from trl_fused_cpo.ops.schedule import Chunks, NeedGrads, whole_batch_tokens

    # Llama-3 8B: a 1 GiB budget holds 4,185 tokens; one GEMM needs no 2 GiB fp32 accumulator, so it may hold 8,281.
    assert whole_batch_tokens(128_256, 4096, torch.bfloat16, 4185) == 4185 + 4096
    assert whole_batch_tokens(128_256, 4096, torch.float32, 2093) == 2093
    hidden, weight, _, labels = make_batch(4, 9, 5, 17, dtype=torch.float32)
    n = int((labels != -100).sum())
    plan_args = dict(ignore_index=-100, vocab_size=17, backend=torch_backend)
    one = plan_tokens(labels, **plan_args, max_tokens=Chunks(3, n).chunk_tokens)
    assert len(one.groups) == 1 and one.max_tokens == n and one.one_gemm
    several = plan_tokens(labels, **plan_args, max_tokens=Chunks(3, n - 1).chunk_tokens)
    assert len(several.groups) > 1 and not several.one_gemm
    assert Chunks(3, n).first_slice_bound(10**6) == n and Chunks(3, None).first_slice_bound(10**6) == 3
    assert Chunks(3, n).first_slice_bound(2) == 2  # no more rows than positions

    firsts = []
    real = gemm.accumulate_mm
    monkeypatch.setattr(gemm, "accumulate_mm", lambda *a, first: (firsts.append(first), real(*a, first=first)))
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    options = FusedOpOptions(CPOHyperparams(), Chunks(3, n), torch_backend, NeedGrads(True, True, False))
    loss = LinearCPOFunction.apply(*leaves, None, PaddedRows(labels, -100), options)
    loss[0].backward()
    assert firsts == [True]  # one dW GEMM, written directly
