"""The varlen form of packed attention (varlen_attention.py): the segment tables against the dense visibility rule,
the per-segment reference against the dense-mask sdpa (outputs and gradients, the K/V gather's included), and the
``fused_cpo_varlen`` implementation through the trainer against the padded layout and the sdpa packed layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_packing import LAYOUTS, PAD, collate
from test_trainer import assert_close_norm, assert_same_but_logit_means, loss_metrics_grads, make_trainer
from trl.experimental.cpo import CPOTrainer

from trl_fused_cpo import FusedCPOConfig, FusedCPOTrainer
from trl_fused_cpo.attention import dense_visibility, packed_attention_mask
from trl_fused_cpo.collator import PACKED_KEY
from trl_fused_cpo.packing import IGNORE_INDEX, pack_pairs
from trl_fused_cpo.support import packing_unsupported_reason
from trl_fused_cpo.toy import toy_model
from trl_fused_cpo.varlen_attention import (
    IMPLEMENTATION,
    SEQLEN_BUCKET,
    TABLES_KWARG,
    VarlenTables,
    fused_cpo_varlen_attention,
    varlen_attention,
    varlen_attention_reference,
    varlen_tables,
)


def table_visibility(tables: VarlenTables, n: int) -> torch.Tensor:
    """``[N, N]`` bool read off the tables alone: segment ``s``'s query ``j`` sees its key ``i`` iff
    ``i <= j + Lk - Lq`` (bottom-right), key ``i`` being row position ``key_index[cu_k[s] + i]``."""
    key_index = tables.key_index if tables.key_index is not None else torch.arange(n)
    cu_q, cu_k = tables.cu_seqlens_q.tolist(), tables.cu_seqlens_k.tolist()
    assert cu_q[-1] == n and cu_k[-1] == len(key_index)
    for cu, bound in ((cu_q, tables.max_seqlen_q), (cu_k, tables.max_seqlen_k)):  # an upper bound, bucketed
        longest = max(b - a for a, b in zip(cu, cu[1:], strict=False))
        assert bound % SEQLEN_BUCKET == 0 and longest <= bound < longest + SEQLEN_BUCKET
    visible = torch.zeros(n, n, dtype=torch.bool)
    for s in range(len(cu_q) - 1):
        lq, lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        keys = key_index[cu_k[s] : cu_k[s + 1]]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        visible[cu_q[s] : cu_q[s + 1]][:, keys] |= mask
    return visible


def random_batch(draw_lengths: list[tuple[int, int, int]], seed: int) -> dict:
    """A right-padded CPO batch: per pair a prompt of ``p`` tokens and completions of ``c`` / ``r`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    batch = {}
    for side, length in (("chosen", 1), ("rejected", 2)):
        rows = []
        for i, lens in enumerate(draw_lengths):
            p, n = lens[0], lens[length]
            prompt = torch.randint(5, 50, (p,), generator=torch.Generator().manual_seed(seed + i))
            rows.append((torch.cat([prompt, torch.randint(5, 50, (n,), generator=gen)]), p))
        width = max(len(ids) for ids, _ in rows)
        ids = torch.full((len(rows), width), PAD)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), IGNORE_INDEX)
        for i, (row, p) in enumerate(rows):
            ids[i, : len(row)], mask[i, : len(row)] = row, 1
            labels[i, p : len(row)] = row[p:]
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels})
    return batch


PAIR = st.tuples(st.integers(0, 7), st.integers(1, 7), st.integers(1, 7))


@settings(max_examples=60, deadline=None)
@given(st.lists(PAIR, min_size=1, max_size=5), st.sampled_from(LAYOUTS), st.sampled_from([None, 8]), st.integers(0, 99))
def test_tables_equal_the_dense_rule_on_random_rows(lengths, layout, pad_to, seed):
    packed = pack_pairs(random_batch(lengths, seed), layout, pad_token_id=PAD, pad_to_multiple_of=pad_to)
    tables = varlen_tables(packed)
    assert torch.equal(table_visibility(tables, packed.num_tokens), dense_visibility(packed))
    assert tables.cu_seqlens_q.dtype == tables.cu_seqlens_k.dtype == torch.int32
    if layout == "padding_free":
        assert tables.key_index is None and torch.equal(tables.cu_seqlens_q, tables.cu_seqlens_k)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tables_of_real_batches(layout):
    """The toy data through TRL's collator: prefix_shared gathers each prompt twice, padding_free nothing."""
    packed = pack_pairs(collate(64, range(8)), layout, pad_token_id=PAD)
    tables = varlen_tables(packed)
    assert torch.equal(table_visibility(tables, packed.num_tokens), dense_visibility(packed))
    segments = len(tables.cu_seqlens_q) - 1
    assert segments == 2 * packed.num_pairs
    if layout == "prefix_shared":
        shared = int((packed.sequence == -1).sum())
        assert shared > 0 and len(tables.key_index) == packed.num_tokens + shared


def dense_reference(q, k, v, packed, scale=None):
    """The whole row through sdpa with the dense ``[N, N]`` rule, K/V heads expanded: ``[N, H, D]``."""
    groups = q.shape[1] // k.shape[1]
    qq, kk, vv = (t.transpose(0, 1) for t in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)))
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=dense_visibility(packed), scale=scale).transpose(0, 1)


@settings(max_examples=25, deadline=None)
@given(st.lists(PAIR, min_size=1, max_size=4), st.sampled_from(LAYOUTS), st.sampled_from([(4, 2), (2, 2), (6, 1)]),
       st.sampled_from([None, 0.3]), st.integers(0, 99))  # fmt: skip
def test_reference_equals_dense_mask_with_gradients(lengths, layout, heads, scale, seed):
    """fp64: the output and the gradients of q, k and v (the gather's backward sums the prompt's two)."""
    packed = pack_pairs(random_batch(lengths, seed), layout, pad_token_id=PAD, pad_to_multiple_of=8)
    n, (hq, hkv) = packed.num_tokens, heads
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, 8, generator=gen, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv))
    grad = torch.randn(n, hq, 8, generator=gen, dtype=torch.float64)
    got = varlen_attention(q, k, v, varlen_tables(packed), scale=scale)
    want = dense_reference(q, k, v, packed, scale)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=name)


def test_reference_in_float32():
    packed = pack_pairs(collate(64, range(6)), "prefix_shared", pad_token_id=PAD)
    q, k, v = (torch.randn(packed.num_tokens, h, 16) for h in (4, 2, 2))
    err = (varlen_attention_reference(q, k, v, varlen_tables(packed)) - dense_reference(q, k, v, packed)).abs().max()
    assert err < 1e-6


def test_attention_function_refuses_a_call_without_tables():
    q = torch.randn(1, 4, 5, 8)
    with pytest.raises(ValueError, match="got no segment tables"):
        fused_cpo_varlen_attention(None, q, q[:, :2], q[:, :2], None, scaling=None)
    packed = pack_pairs(collate(64, range(2)), "padding_free", pad_token_id=PAD)
    with pytest.raises(ValueError, match="one packed row"):
        fused_cpo_varlen_attention(None, q.expand(2, -1, -1, -1), q, q, None, **{TABLES_KWARG: varlen_tables(packed)})


def test_tables_refuse_a_row_not_in_pack_pairs_layout():
    packed = pack_pairs(collate(64, range(2)), "prefix_shared", pad_token_id=PAD)
    packed.branch = packed.branch.flip(0)  # rejected before shared
    with pytest.raises(ValueError, match="not laid out"):
        varlen_tables(packed)


# ------------------------------------------------------------------------------------------- through the trainer


def varlen_model(**overrides):
    model = toy_model(**overrides)
    model.set_attn_implementation(IMPLEMENTATION)
    return model


@pytest.mark.parametrize("layout", LAYOUTS)
def test_implementation_is_accepted_and_builds_no_mask(layout):
    model = varlen_model()
    assert packing_unsupported_reason(model, layout, max_length=64) is None
    packed = pack_pairs(collate(64, range(2)), layout, pad_token_id=PAD)
    assert packed_attention_mask(packed, dtype=torch.float32, implementation=IMPLEMENTATION) is None


def test_padded_layout_on_the_varlen_implementation_is_refused_at_construction(tmp_path):
    """It has no segment tables to attend with: refused with the fix, not a ValueError in the first step."""
    with pytest.raises(ValueError, match="runs packed rows only.*batch_layout: prefix_shared"):
        make_trainer(FusedCPOTrainer, tmp_path, model=varlen_model(), config_cls=FusedCPOConfig, batch_layout="padded")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "gradient-checkpointing"])
def test_trainer_matches_padded_and_sdpa_packed(tmp_path, layout, checkpointing):
    """Loss, metrics and every parameter gradient: fused_cpo_varlen equals the stock padded trainer (all but the
    logits/* means, as every packed layout) and the sdpa dense-mask packed layout (everything)."""
    opts = dict(gradient_checkpointing=checkpointing)
    stock = loss_metrics_grads(make_trainer(CPOTrainer, tmp_path, **opts))
    packed_opts = dict(config_cls=FusedCPOConfig, batch_layout=layout, **opts)
    sdpa = loss_metrics_grads(make_trainer(FusedCPOTrainer, tmp_path, **packed_opts))
    trainer = make_trainer(FusedCPOTrainer, tmp_path, model=varlen_model(), **packed_opts)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    assert isinstance(batch[TABLES_KWARG], VarlenTables) and PACKED_KEY in batch  # built in the collator
    calls = []
    layer = trainer.model.model.layers[0].self_attn
    layer.register_forward_pre_hook(lambda m, args, kwargs: calls.append(kwargs.get(TABLES_KWARG)), with_kwargs=True)
    varlen = loss_metrics_grads(trainer)
    assert calls and all(isinstance(t, VarlenTables) for t in calls)  # the tables reached the attention
    assert_same_but_logit_means(stock, varlen)
    torch.testing.assert_close(varlen[0], sdpa[0], rtol=1e-5, atol=1e-6)  # fp32: summation order differs
    assert varlen[1] == pytest.approx(sdpa[1], rel=1e-5, abs=1e-6)
    for name, g in sdpa[2].items():
        assert_close_norm(varlen[2][name], g, name, 1e-5)


def test_trainer_trains_and_evaluates(tmp_path):
    """A short train and evaluate run (the eval batches come through the same collator)."""
    logs = {}
    for model in (toy_model(), varlen_model()):
        trainer = make_trainer(FusedCPOTrainer, tmp_path, model=model, config_cls=FusedCPOConfig,
                               batch_layout="prefix_shared", max_steps=2, logging_steps=1, learning_rate=1e-3, seed=0)  # fmt: skip
        trainer.train()
        logs[model.config._attn_implementation] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        logs[model.config._attn_implementation].append(trainer.evaluate()["eval_loss"])
    assert logs[IMPLEMENTATION] == pytest.approx(logs["sdpa"], rel=1e-5)


def test_benchmark_script_runs_at_toy_size(tmp_path):
    """scripts/benchmark_attention.py end to end on the CPU (--quick): the varlen route checked and timed."""
    import json

    from conftest import load_script

    assert load_script("benchmark_attention").main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "attention.json").read_text())["results"]
    varlen = next(r for r in results if r["route"] == "varlen")
    assert varlen["status"] == "ok" and max(varlen["rel_error"].values()) < 1e-6
    assert (tmp_path / "attention.md").read_text().count("| prefix_shared |") >= 2


@settings(max_examples=25, deadline=None)
@given(st.lists(PAIR, min_size=1, max_size=4), st.sampled_from(LAYOUTS), st.integers(0, 99))
def test_square_segment_form_equals_dense_mask(lengths, layout, seed):
    """The cuDNN kernel's form, on CPU: queries gathered like the keys (every segment square, plain causal), each
    row position's output read back at square_out_index; fp64 outputs and q/k/v gradients equal the dense mask's."""
    packed = pack_pairs(random_batch(lengths, seed), layout, pad_token_id=PAD)
    tables = varlen_tables(packed)
    square = VarlenTables(tables.cu_seqlens_k, tables.cu_seqlens_k, tables.max_seqlen_k, tables.max_seqlen_k)

    def square_form(q, k, v):
        index = tables.key_index if tables.key_index is not None else torch.arange(packed.num_tokens)
        out = varlen_attention_reference(*(t.index_select(0, index) for t in (q, k, v)), square)
        return out if tables.square_out_index is None else out.index_select(0, tables.square_out_index)

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(packed.num_tokens, h, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2))  # fmt: skip
    grad = torch.randn(packed.num_tokens, 4, 8, generator=gen, dtype=torch.float64)
    got, want = square_form(q, k, v), dense_reference(q, k, v, packed)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def _signature_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip
    """torch 2.12+'s varlen_attn, computed by the reference over the keys it is handed."""
    assert window_size == (-1, 0) and (enable_gqa or key.shape[1] == query.shape[1])
    return varlen_attention_reference(query, key, value, VarlenTables(cu_seq_q, cu_seq_k, max_q, max_k), scale=scale)


def _signature_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.10's varlen_attn: is_causal=, no scale=, no GQA."""
    assert is_causal and key.shape[1] == query.shape[1]
    return varlen_attention_reference(query, key, value, VarlenTables(cu_seq_q, cu_seq_k, max_q, max_k))


@pytest.mark.parametrize("signature", [_signature_2_13, _signature_2_10], ids=["torch-2.13", "torch-2.10"])
@pytest.mark.parametrize("gqa", ["auto", "native", "expand"])
def test_flash_call_across_varlen_attn_signatures(monkeypatch, signature, gqa):
    """What flash_varlen_attention hands torch's varlen_attn (causal flag, scale, GQA, gathered keys, tables) in each
    release's signature, the kernel stood in by the reference: fp64 outputs and gradients equal the dense mask's."""
    import torch.nn.attention.varlen as varlen

    from trl_fused_cpo.varlen_attention import _varlen_attn_parameters, flash_varlen_attention

    if signature is _signature_2_10 and gqa == "native":
        pytest.skip("2.10 has no GQA: native heads are refused there (the stand-in asserts equal heads)")
    monkeypatch.setattr(varlen, "varlen_attn", signature)
    _varlen_attn_parameters.cache_clear()
    try:
        packed = pack_pairs(collate(64, range(5)), "prefix_shared", pad_token_id=PAD)
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(packed.num_tokens, h, 8, generator=gen, dtype=torch.float64, requires_grad=True)
                   for h in (4, 2, 2))  # fmt: skip
        got = flash_varlen_attention(q, k, v, varlen_tables(packed), scale=0.2, gqa=gqa)
        want = dense_reference(q, k, v, packed, scale=0.2)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        grad = torch.randn_like(got)
        for g, w in zip(
            torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad), strict=True
        ):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    finally:
        _varlen_attn_parameters.cache_clear()


def test_end_to_end_benchmark_runs_the_varlen_variant(tmp_path):
    """benchmark_e2e's ``+attn=fused_cpo_varlen`` in a fresh interpreter: its model is built before anything imports
    the trainer, so the name must be registered by then (bench_common.build_model does)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    argv = ["--model", "toy", "--micro-batches", "2", "--steps", "1", "--warmup", "1", "--variants",
            f"fused+prefix+attn={IMPLEMENTATION}", "--no-process-warmup", "--no-plots", "--out", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, str(root / "scripts/benchmark_e2e.py"), *argv], check=True, env=env, cwd=root)
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert run["ok"], run.get("error")
