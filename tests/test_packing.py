"""Packed layouts (packing.py) against TRL's padded batch: the same hidden state at every position, the same labels.

The batches come through the real data path (CPOTrainer's tokenize_row and collator on the toy data); the padded
reference runs TRL's ``concatenated_inputs`` as ``concatenated_forward`` does. float64: "the same" is 1e-10 under
sdpa, 2e-6 under eager (its softmax runs in float32).
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest
import torch
from datasets import Dataset
from trl.experimental.cpo import CPOConfig, CPOTrainer

from trl_fused_cpo.attention import packed_attention_mask
from trl_fused_cpo.packing import CHOSEN, IGNORE_INDEX, REJECTED, SHARED, PackedBatch, pack_pairs, shared_prefix_length
from trl_fused_cpo.toy import load_toy_preferences, toy_model, toy_tokenizer

PAD = toy_tokenizer().pad_token_id
LAYOUTS = ("padding_free", "prefix_shared")
# sdpa in float64 is exact to rounding; Llama's eager attention takes its softmax in float32
# (modeling_llama.eager_attention_forward), whose sums run over rows of other lengths: 4.8e-7 measured.
TOL = {"sdpa": 1e-10, "eager": 2e-6}
ROWS = load_toy_preferences("train")[:16]


@functools.cache
def trainer(max_length: int) -> CPOTrainer:
    args = CPOConfig(
        output_dir="/tmp/test_packing",
        per_device_train_batch_size=4,
        bf16=False,
        report_to=[],
        max_length=max_length,
        gradient_checkpointing=False,
        use_cpu=True,
        save_strategy="no",
        remove_unused_columns=False,
    )
    data = Dataset.from_list(ROWS)
    return CPOTrainer(model=toy_model(), args=args, train_dataset=data, processing_class=toy_tokenizer())


def collate(max_length: int, rows) -> dict:
    t = trainer(max_length)
    return t.data_collator([t.train_dataset[i] for i in rows])


@functools.cache
def model64():
    return toy_model(dtype=torch.float64).eval()


def run_padded(model, batch):
    """TRL's layout, as ``concatenated_forward`` builds and runs it: ``([2B, T] batch, [2B, T, H] hidden)``."""
    cat = CPOTrainer.concatenated_inputs(batch, padding_value=PAD)
    with torch.no_grad():
        out = model.model(
            cat["concatenated_input_ids"], attention_mask=cat["concatenated_attention_mask"], use_cache=False
        )
    return cat, out.last_hidden_state


def run_packed(model, packed: PackedBatch, implementation: str) -> torch.Tensor:
    model.set_attn_implementation(implementation)
    mask = packed_attention_mask(packed, dtype=model.dtype, implementation=implementation)
    with torch.no_grad():
        out = model.model(
            input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=mask, use_cache=False
        )
    return out.last_hidden_state[0]


def padded_cells(packed: PackedBatch) -> list[tuple[int, int, int]]:
    """``(packed index, TRL row, position)`` for every real packed position; a shared one maps to both rows."""
    b = packed.num_pairs
    cells = []
    for p, (seq, pos, br, grp) in enumerate(
        zip(
            packed.sequence.tolist(),
            packed.position_ids[0].tolist(),
            packed.branch.tolist(),
            packed.group.tolist(),
            strict=True,
        )
    ):
        if seq >= 0:
            assert br == (CHOSEN if seq < b else REJECTED)
            cells.append((p, seq, pos))
        elif br == SHARED and packed.layout == "prefix_shared" and grp < b:  # else tail padding
            cells += [(p, grp, pos), (p, grp + b, pos)]
    return cells


def check_layout(packed: PackedBatch, cat: dict) -> None:
    """Every real position of the padded batch occurs once (shared: once for both rows), same token and label."""
    ids, mask = cat["concatenated_input_ids"], cat["concatenated_attention_mask"].bool()
    shifted = torch.cat([cat["concatenated_labels"][:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], 1)
    shifted = shifted.masked_fill(~mask, IGNORE_INDEX)
    cells = padded_cells(packed)
    covered = torch.zeros_like(mask, dtype=torch.int64)
    for p, row, pos in cells:
        covered[row, pos] += 1
        assert packed.input_ids[0, p] == ids[row, pos], (p, row, pos)
        assert packed.labels[p] == shifted[row, pos], (p, row, pos)
    assert torch.equal(covered, mask.long()), "packing cut or duplicated positions of the padded rows"
    torch.testing.assert_close(packed.row_lengths, mask.sum(1))
    for row in range(2 * packed.num_pairs):  # labels gathered per sequence, in order
        got = packed.labels[packed.sequence == row]
        assert torch.equal(got[got != IGNORE_INDEX], shifted[row][shifted[row] != IGNORE_INDEX]), row
    n_labelled = (shifted != IGNORE_INDEX).sum()
    assert (packed.labels != IGNORE_INDEX).sum() == n_labelled, "a labelled position is packed twice or lost"


def check_hidden(packed: PackedBatch, hidden: torch.Tensor, padded_hidden: torch.Tensor, tol: float) -> None:
    cells = padded_cells(packed)
    p, row, pos = (torch.tensor(c) for c in zip(*cells, strict=True))
    err = (hidden[p] - padded_hidden[row, pos]).abs().max().item()
    assert err <= tol, f"packed hidden states differ from the padded ones by {err:.2e}"


def check_batch(batch: dict, layouts=LAYOUTS, implementations=("eager", "sdpa")) -> dict[str, PackedBatch]:
    model = model64()
    packed = {}
    for implementation in implementations:
        model.set_attn_implementation(implementation)
        cat, padded_hidden = run_padded(model, batch)
        for layout in layouts:
            packed[layout] = pack_pairs(batch, layout, pad_token_id=PAD)
            check_layout(packed[layout], cat)
            check_hidden(
                packed[layout], run_packed(model, packed[layout], implementation), padded_hidden, TOL[implementation]
            )
    return packed


def untruncated_lengths(rows) -> list[int]:
    """Chosen/rejected lengths before TRL's truncation: bos + prompt + completion + eos."""
    tok = toy_tokenizer()
    return [
        2 + len(tok(ROWS[i]["prompt"] + ROWS[i][side], add_special_tokens=False)["input_ids"])
        for side in ("chosen", "rejected")
        for i in rows
    ]


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_hidden_states_and_labels_match_padded(layout, implementation):
    """Four pairs, max_length 12: prompts of different lengths, two pairs cut at max_length."""
    batch = collate(12, range(4))
    lengths = batch["chosen_attention_mask"].sum(1).tolist() + batch["rejected_attention_mask"].sum(1).tolist()
    truncated = [n == 12 and full > 12 for n, full in zip(lengths, untruncated_lengths(range(4)), strict=True)]
    assert any(truncated) and not all(truncated)
    assert len(set((batch["chosen_labels"] != IGNORE_INDEX).int().argmax(1).tolist())) > 1  # prompt lengths differ
    packed = check_batch(batch, (layout,), (implementation,))[layout]
    real = int(batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum())
    if layout == "padding_free":
        assert packed.num_tokens == real
        assert (packed.position_ids[0] == 0).sum() == 8  # every segment restarts: varlen cuts the row there
    else:
        assert packed.num_tokens < real  # the prompts ran once
        assert torch.equal(packed.group.unique_consecutive(), torch.arange(4))


def test_single_pair():
    check_batch(collate(12, [3]))


def test_prompt_fills_max_length_empty_completion():
    """Rows 4 and 6 have 7-token prompts (with bos): max_length 7 leaves them no completion token."""
    batch = collate(7, [0, 4, 6, 2])
    empty = (batch["chosen_labels"] != IGNORE_INDEX).sum(1) == 0
    assert empty.tolist() == [False, True, True, False]
    packed = check_batch(batch)["prefix_shared"]
    # An empty pair still runs its prompt (TRL computes its 0/0 log-prob), once: shared prefix + one token each.
    pair = packed.group == 1
    assert packed.branch[pair].tolist() == [SHARED] * 6 + [CHOSEN, REJECTED]


def handmade_batch(pairs: list[tuple[list[int], int, list[int], int]]) -> dict:
    """A collated batch from ``(chosen ids, chosen prompt length, rejected ids, rejected prompt length)``."""

    def row(ids, n_prompt):
        return dict(input_ids=ids, attention_mask=[1] * len(ids), labels=[IGNORE_INDEX] * n_prompt + ids[n_prompt:])

    features = []
    for c, nc, r, nr in pairs:
        n = min(nc, nr)
        feature = {"prompt_input_ids": c[:n], "prompt_attention_mask": [1] * n}
        feature.update({f"chosen_{k}": v for k, v in row(c, nc).items()})
        feature.update({f"rejected_{k}": v for k, v in row(r, nr).items()})
        features.append(feature)
    return trainer(12).data_collator(features)


def test_merged_last_prompt_token_and_unshared_pairs():
    """TRL's merge case (the prompt's last token differs between chosen and rejected), a pair differing at its
    first token (S = 0), identical chosen and rejected, and a pair whose only shared token is bos (S = 1)."""
    merged = ([1, 10, 11, 12, 30, 31, 2], 4, [1, 10, 11, 13, 32, 2], 3)  # rejected merged 12+answer into 13
    first_differs = ([5, 20, 21, 2], 1, [6, 22, 2], 1)
    identical = ([1, 10, 40, 41, 2], 2, [1, 10, 40, 41, 2], 2)
    bos_only = ([1, 50, 51, 2], 1, [1, 52, 2], 1)
    batch = handmade_batch([merged, first_differs, identical, bos_only])
    prefixes = [
        shared_prefix_length(
            batch["chosen_input_ids"][i],
            batch["chosen_labels"][i],
            batch["rejected_input_ids"][i],
            batch["rejected_labels"][i],
        )
        for i in range(4)
    ]
    assert prefixes[0] == 3 and prefixes[1] == 0 and prefixes[2] == 2 and prefixes[3] == 1
    packed = check_batch(batch)["prefix_shared"]
    assert (packed.branch == SHARED).sum() == 2 + 0 + 1 + 0


def test_loss_arguments_name_each_shared_prompt_position_once():
    """The functional's packed arguments, read by hand: pair 0 shares ``[1 10]`` (its third token is duplicated
    into both branches), pair 1 shares nothing; tail padding and ``padding_free`` share nothing."""
    batch = handmade_batch([([1, 10, 11, 30, 2], 3, [1, 10, 11, 31, 2], 3), ([1, 50, 2], 1, [1, 52, 2], 1)])
    packed = pack_pairs(batch, "prefix_shared", pad_token_id=PAD, pad_to_multiple_of=16)
    args = packed.loss_arguments()
    assert sorted(args) == ["labels", "row_lengths", "sequence", "shared_pair"]
    assert args["labels"] is packed.labels and args["sequence"] is packed.sequence
    assert args["row_lengths"].tolist() == [5, 3, 5, 3]
    #            shared | chosen 0     | rejected 0   | chosen 1 | rejected 1 | tail
    assert args["shared_pair"].tolist() == [0, 0] + [-1] * 6 + [-1] * 6 + [-1] * 2
    assert packed.group[-2:].tolist() == [2, 2]  # the tail's own group is past the pairs: not a shared prompt
    free = pack_pairs(batch, "padding_free", pad_token_id=PAD).loss_arguments()
    assert (free["shared_pair"] == -1).all() and free["row_lengths"].tolist() == [5, 3, 5, 3]


def test_dataloader_pinning_reaches_every_tensor(monkeypatch):
    """Trainer's DataLoader pins its batches (``dataloader_pin_memory``): the PackedBatch in the batch is pinned
    whole, so the step's non-blocking copy does not stall the host. Pinning needs CUDA: a stand-in records it."""
    from torch.utils.data._utils.pin_memory import pin_memory

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: pinned.append(t) or t.clone())
    batch = handmade_batch([([1, 10, 11, 30, 2], 3, [1, 10, 11, 31, 2], 3)])
    packed = pack_pairs(batch, "prefix_shared", pad_token_id=PAD)
    out = pin_memory({"fused_cpo_packed": packed})["fused_cpo_packed"]
    tensors = [v for v in vars(packed).values() if isinstance(v, torch.Tensor)]
    assert isinstance(out, PackedBatch) and len(pinned) == len(tensors) == 7
    assert all(torch.equal(getattr(out, k), v) for k, v in vars(packed).items() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mask_hides_exactly_what_the_rule_says(layout):
    """Spot checks of the dense mask against hand-read positions (the hidden-state tests check it as a whole)."""
    packed = pack_pairs(collate(12, range(2)), layout, pad_token_id=PAD)
    mask = packed_attention_mask(packed, dtype=torch.float64, implementation="eager")[0, 0]
    visible = mask == 0
    first_rejected = int((packed.branch == REJECTED).nonzero()[0, 0])
    first_chosen = int((packed.branch == CHOSEN).nonzero()[0, 0])
    assert not visible[first_rejected, first_chosen]  # rejected never sees chosen
    assert visible[first_rejected, first_rejected] and not visible[0, 1]  # causal, and itself
    second_pair = int((packed.sequence == 1).nonzero()[0, 0])
    assert not visible[second_pair, :second_pair].any() or layout == "prefix_shared"
    assert not visible[second_pair, : int((packed.group == packed.group[second_pair]).nonzero()[0, 0])].any()
    assert (mask[~visible] == torch.finfo(torch.float64).min).all()


def test_pad_to_multiple_of_adds_an_inert_tail():
    batch = collate(12, range(4))
    plain = pack_pairs(batch, "prefix_shared", pad_token_id=PAD)
    padded = pack_pairs(batch, "prefix_shared", pad_token_id=PAD, pad_to_multiple_of=32)
    assert padded.num_tokens % 32 == 0 and padded.num_tokens > plain.num_tokens
    n = plain.num_tokens
    tail = slice(n, None)
    assert (padded.input_ids[0, tail] == PAD).all() and (padded.labels[tail] == IGNORE_INDEX).all()
    assert (padded.sequence[tail] == -1).all() and (padded.group[tail] == 4).all()
    assert padded.position_ids[0, n] == 0  # a segment of its own for varlen too
    for name in ("input_ids", "position_ids"):
        assert torch.equal(getattr(padded, name)[:, :n], getattr(plain, name))
    model = model64()
    model.set_attn_implementation("sdpa")
    cat, padded_hidden = run_padded(model, batch)
    check_layout(padded, cat)
    check_hidden(padded, run_packed(model, padded, "sdpa"), padded_hidden, 1e-10)


def test_refuses_what_it_cannot_pack():
    batch = collate(12, range(2))
    with pytest.raises(ValueError, match="padded"):
        pack_pairs(batch, "padded", pad_token_id=PAD)
    left = dict(batch, chosen_attention_mask=batch["chosen_attention_mask"].flip(1))
    with pytest.raises(ValueError, match="ones followed by zeros"):
        pack_pairs(left, "prefix_shared", pad_token_id=PAD)
