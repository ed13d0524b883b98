"""Padded and packed layouts (ops/rows.py) through the whole op: the same pairs give the same loss, log-probs,
rewards, NLL and gradients whether they come padded, packed without padding, or packed with each prompt once."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import DEVICE, OPTIONS

from trl_fused_cpo import fused_linear_cpo_loss, fused_linear_cpo_loss_packed


def _pairs(num_pairs, seq_len, hidden_size, vocab, *, seed, dtype=torch.float64, device="cpu"):
    """A padded batch whose pair i shares its first ``shared[i]`` positions (hidden states and unlabelled), with
    ragged lengths, a prompt, and padding; plus its packed forms."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * num_pairs
    hidden = torch.randn(rows, seq_len, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64) * (2.0 / hidden_size**0.5)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64) * 0.1
    labels = torch.full((rows, seq_len), -100)
    lengths = torch.randint(3, seq_len + 1, (rows,), generator=g)
    shared = []
    for i in range(num_pairs):
        prompt = int(torch.randint(1, int(min(lengths[i], lengths[num_pairs + i])), (), generator=g))
        shared.append(prompt)
        hidden[num_pairs + i, :prompt] = hidden[i, :prompt]  # the same prompt: the same hidden states
        for r in (i, num_pairs + i):
            labels[r, prompt - 1 : lengths[r] - 1] = torch.randint(0, vocab, (int(lengths[r]) - prompt,), generator=g)
    padded = dict(hidden=hidden, labels=labels)
    packed = {}
    for layout in ("padding_free", "prefix_shared"):
        xs, ls, seqs, pairs = [], [], [], []
        for i in range(num_pairs):
            start = shared[i] - 1 if layout == "prefix_shared" else 0  # positions [0, start) shared
            if start:
                xs.append(hidden[i, :start]), ls.append(labels[i, :start])
                seqs.append(torch.full((start,), -1)), pairs.append(torch.full((start,), i))
            for r in (i, num_pairs + i):
                n = int(lengths[r]) - start
                xs.append(hidden[r, start : start + n]), ls.append(labels[r, start : start + n])
                seqs.append(torch.full((n,), r)), pairs.append(torch.full((n,), -1))
        packed[layout] = dict(
            hidden=torch.cat(xs), labels=torch.cat(ls), sequence=torch.cat(seqs), shared_pair=torch.cat(pairs)
        )
    to = dict(dtype=dtype, device=device)
    for d in (padded, *packed.values()):
        d["hidden"] = d["hidden"].to(**to)
        for k in ("labels", "sequence", "shared_pair"):
            if k in d:
                d[k] = d[k].to(device)
    return padded, packed, weight.to(**to), bias.to(**to), lengths.to(device)


def _run(batch, weight, bias, lengths, *, packed, frozen=False, **opts):
    hidden = batch["hidden"].clone().requires_grad_(True)
    w = weight.clone().requires_grad_(not frozen)
    b = bias.clone().requires_grad_(not frozen)
    if packed:
        out = fused_linear_cpo_loss_packed(
            hidden, w, batch["labels"], batch["sequence"], row_lengths=lengths, shared_pair=batch["shared_pair"],
            bias=b, **opts,
        )  # fmt: skip
    else:
        out = fused_linear_cpo_loss(hidden, w, batch["labels"], bias=b, **opts)
    leaves = [t for t in (hidden, w, b) if t.requires_grad]
    return out, dict(zip(("hidden", "weight", "bias"), torch.autograd.grad(out.loss, leaves), strict=False))


FIELDS = ("loss", "chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards", "nll_loss")


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
@pytest.mark.parametrize("layout", ["padding_free", "prefix_shared"])
def test_packed_equals_padded_float64(opts, layout):
    padded, packed, weight, bias, lengths = _pairs(3, 13, 6, 41, seed=hash(layout) % 1000)
    want, want_grads = _run(padded, weight, bias, lengths, packed=False, backend="torch", **opts)
    got, got_grads = _run(packed[layout], weight, bias, lengths, packed=True, backend="torch", **opts)
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-9, atol=1e-12, msg=name)
    for name in ("weight", "bias"):
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-9, atol=1e-12, msg=name)
    # The hidden gradient: each packed position's equals its padded position's (shared: either row's, both zero).
    seq, pos_grad = packed[layout]["sequence"], got_grads["hidden"]
    n = padded["hidden"].shape[0] // 2
    offsets = torch.zeros(2 * n, dtype=torch.long)
    for r in range(2 * n):
        rows_at = (seq == r).nonzero().squeeze(1)
        start = int(lengths[r]) - rows_at.numel()
        torch.testing.assert_close(pos_grad[rows_at], want_grads["hidden"][r, start : int(lengths[r])])
        offsets[r] = start
    assert torch.count_nonzero(want_grads["hidden"][:, -1]) == 0 or lengths.max() < 13


@pytest.mark.parametrize("layout", ["padding_free", "prefix_shared"])
def test_packed_metric_means_are_over_real_positions_and_layout_free(layout):
    padded, packed, weight, bias, lengths = _pairs(3, 11, 5, 29, seed=5)
    out, _ = _run(packed[layout], weight, bias, lengths, packed=True, backend="torch")
    logits = padded["hidden"] @ weight.t() + bias
    real = torch.arange(11)[None, :] < lengths[:, None]
    n = 3
    for half, got in ((slice(0, n), out.chosen_logits_mean), (slice(n, 2 * n), out.rejected_logits_mean)):
        want = logits[half][real[half]].mean()
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
@pytest.mark.parametrize("memory", ["fast", "lean"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_equals_padded_every_path(backend, memory, frozen):
    device = DEVICE if backend == "triton" else "cpu"
    padded, packed, weight, bias, lengths = _pairs(4, 17, 8, 300, seed=11, dtype=torch.float32, device=device)
    opts = dict(backend=backend, memory=memory, chunk_bytes=30 * 300 * 4, frozen=frozen)
    want, want_grads = _run(padded, weight, bias, lengths, packed=False, **opts)
    got, got_grads = _run(packed["prefix_shared"], weight, bias, lengths, packed=True, **opts)
    for name in FIELDS:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5, msg=name)
    for name in ("weight", "bias"):
        if name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_a_pair_with_an_empty_completion(loss_type):
    """A chosen row with no labelled token: the same (finite) result padded and packed."""
    padded, packed, weight, bias, lengths = _pairs(3, 12, 5, 31, seed=4)
    padded["labels"][1] = -100
    for batch in packed.values():
        batch["labels"] = torch.where(batch["sequence"] == 1, -100, batch["labels"])
    with pytest.warns(UserWarning) if loss_type == "simpo" else contextlib.nullcontext():
        want, want_grads = _run(padded, weight, bias, lengths, packed=False, backend="torch", loss_type=loss_type)
    for layout in ("padding_free", "prefix_shared"):
        with pytest.warns(UserWarning) if loss_type == "simpo" else contextlib.nullcontext():
            got, got_grads = _run(
                packed[layout], weight, bias, lengths, packed=True, backend="torch", loss_type=loss_type
            )
        assert torch.isfinite(got.loss)
        for name in FIELDS:
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-9, atol=1e-12, msg=name)
        torch.testing.assert_close(got_grads["weight"], want_grads["weight"], rtol=1e-9, atol=1e-12)


def test_a_label_without_a_sequence_is_refused():
    _, packed, weight, bias, lengths = _pairs(2, 9, 4, 17, seed=2)
    batch = dict(packed["padding_free"])
    labelled = (batch["labels"] != -100).nonzero()[0, 0]
    batch["sequence"] = batch["sequence"].clone()
    batch["sequence"][labelled] = -1
    with pytest.raises(ValueError, match="name no sequence"):
        _run(batch, weight, bias, lengths, packed=True, backend="torch")
