"""Packed preference layouts: every pair of a CPO batch in one row, without padding, optionally sharing its prompt.

TRL's ``concatenated_inputs`` pads chosen and rejected to one length ``T`` and stacks ``[chosen; rejected]``
(``2B`` rows), so the backbone runs ``2B·T`` positions and every prompt twice. Two packed layouts run only the
real tokens:

- ``padding_free``: chosen ``i`` and rejected ``i`` are separate segments of one row ``[c_0 | r_0 | c_1 | ...]``;
  position ids restart at 0 in each segment and no token attends across segments.
- ``prefix_shared``: per pair ``[shared_i | chosen branch_i | rejected branch_i]``; the rejected branch continues
  the prompt's position ids (as in the padded row) and attends to the shared prefix and to itself, never to chosen.

One code path builds both. With ``S = min(common prefix of the two sequences, first labelled index of each)``
(indexes in the unshifted sequence), the shared segment is positions ``0..S-2`` (no label in either sequence:
position ``t`` predicts ``t + 1 <= S - 1``), and each branch is its sequence from ``S - 1`` on: the last shared
token is duplicated into both branches because it predicts the first completion token, which differs. Every
labelled position of the padded layout then occurs exactly once, at position id = its index in its sequence, so
its hidden state is the padded one's exactly (tests/test_packing.py: 1e-10 in float64). ``padding_free`` is
``S = 1``: nothing shared. The attention rule (attention.py) is: key ``k`` is visible to query ``q`` iff same
``group``, ``k <= q`` in the row, and not (``q`` rejected branch and ``k`` chosen branch).

Example, one pair with prompt ``[b p q]``, chosen ``[x y]``, rejected ``[z]`` (``S = 3``)::

    prefix_shared   input_ids  b p | q x y | q z       padding_free   b p q x y | b p q z
                    positions  0 1 | 2 3 4 | 2 3                      0 1 2 3 4 | 0 1 2 3
                    branch     0 0 | 1 1 1 | 2 2                      1 1 1 1 1 | 2 2 2 2
                    labels     - - | x y - | z -                      - - x y - | - - z -
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

import torch

Layout = Literal["padded", "padding_free", "prefix_shared"]
PADDED, PADDING_FREE, PREFIX_SHARED = "padded", "padding_free", "prefix_shared"  # the values of Layout
BATCH_LAYOUTS: tuple[str, ...] = (PADDED, PADDING_FREE, PREFIX_SHARED)  # the one list (config.batch_layout's choices)
PACKED_LAYOUTS: tuple[str, ...] = (PADDING_FREE, PREFIX_SHARED)  # what pack_pairs packs
IGNORE_INDEX = -100
SHARED, CHOSEN, REJECTED = 0, 1, 2  # values of PackedBatch.branch


@dataclass
class PackedBatch:
    """One packed row holding every pair of a CPO batch, and the bookkeeping to map it back onto TRL's rows.

    ``N`` is the packed length: the real tokens, plus the tail padding asked for by ``pad_to_multiple_of``.

    Attributes:
        input_ids: ``[1, N]`` int64, the tokens of every pair's segments.
        position_ids: ``[1, N]`` int64. On a branch or shared position it is the index of that token in its own
            (unpadded) sequence, so ``(sequence, position_ids)`` addresses TRL's padded ``[2B, T]`` grid.
        group: ``[N]`` int64 attention group: the pair index for ``prefix_shared``, the segment index for
            ``padding_free`` (chosen ``i`` -> ``2i``, rejected ``i`` -> ``2i + 1``); tail padding has its own group.
        branch: ``[N]`` int64: 0 shared prefix (and tail padding), 1 chosen branch, 2 rejected branch.
        labels: ``[N]`` int64, already shifted: the token position ``t`` predicts in its own sequence
            (``labels[t + 1]`` of TRL's row), -100 where none (prompt, last token, shared prefix, tail padding).
        sequence: ``[N]`` int64, TRL's row in ``concatenated_inputs`` order: ``i`` for chosen of pair ``i``,
            ``B + i`` for rejected, -1 on shared positions and tail padding.
        num_pairs: ``B``.
        row_lengths: ``[2B]`` int64, the unpadded length of each TRL row (a shared prefix counts in both rows).
        layout: the layout this batch was packed for.

    What the loss reads is derived here, once: ``shared_pair`` and ``loss_arguments()``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    group: torch.Tensor
    branch: torch.Tensor
    labels: torch.Tensor
    sequence: torch.Tensor
    num_pairs: int
    row_lengths: torch.Tensor
    layout: str = PREFIX_SHARED

    @property
    def num_tokens(self) -> int:
        """``N``, the packed row's length."""
        return self.input_ids.shape[-1]

    @property
    def shares_prompts(self) -> bool:
        """Whether a pair's prompt is one segment both its sequences attend to (``prefix_shared``); else every
        attention group is one sequence (``padding_free``)."""
        return self.layout == PREFIX_SHARED

    @property
    def shared_pair(self) -> torch.Tensor:
        """``[N]``: the pair whose prompt position ``t`` is, where both sequences of that pair share it; -1
        elsewhere (every position of ``padding_free``, and tail padding, whose group is its own)."""
        if not self.shares_prompts:
            return torch.full_like(self.group, -1)
        shared = (self.branch == SHARED) & (self.group < self.num_pairs)
        return torch.where(shared, self.group, -1)

    def loss_arguments(self) -> dict[str, torch.Tensor]:
        """The packed arguments of ``loss.fused_linear_cpo_loss_packed``: ``labels``, ``sequence``, ``row_lengths``
        and ``shared_pair``."""
        return {
            "labels": self.labels,
            "sequence": self.sequence,
            "row_lengths": self.row_lengths,
            "shared_pair": self.shared_pair,
        }

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on ``device`` (non-blocking where the source is pinned)."""
        return map_tensor_fields(self, lambda t: t.to(device, non_blocking=True))

    def pin_memory(self, device: torch.device | str | None = None) -> PackedBatch:
        """A copy in pinned host memory: the DataLoader's ``pin_memory=True`` (Trainer's default) calls this in its
        pinning thread, so the step's ``to(device)`` is an asynchronous copy, not a host stall."""
        return map_tensor_fields(self, lambda t: t.pin_memory() if device is None else t.pin_memory(device))


def map_tensor_fields(obj, fn):
    """A copy of the dataclass ``obj`` with ``fn`` applied to its tensor fields (the others kept): the device moves
    and pinning of the batch's dataclasses (``PackedBatch``, ``varlen_attention.VarlenTables``)."""
    return type(obj)(
        **{f.name: (fn(v) if isinstance(v := getattr(obj, f.name), torch.Tensor) else v) for f in fields(obj)}
    )


def _unpadded_rows(batch: Mapping[str, torch.Tensor], side: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The real tokens and labels of each ``{side}_*`` row: the collator pads on the right, mask 0 on padding."""
    ids, mask, labels = (batch[f"{side}_{k}"].detach().cpu() for k in ("input_ids", "attention_mask", "labels"))
    if ids.shape != mask.shape or ids.shape != labels.shape or ids.dim() != 2:
        raise ValueError(
            f"{side}_input_ids {tuple(ids.shape)}, {side}_attention_mask {tuple(mask.shape)} and {side}_labels "
            f"{tuple(labels.shape)} must be one [B, T] shape, as CPOTrainer's collator makes them."
        )
    lengths = mask.sum(-1)
    right_padded = mask.bool() == (torch.arange(mask.shape[1]) < lengths[:, None])
    if not bool(right_padded.all()):
        raise ValueError(
            f"{side}_attention_mask is not ones followed by zeros in every row. Packing keeps each row's first "
            "mask.sum() tokens, as TRL's right-padding collator (DPODataCollatorWithPadding) lays them out; a mask "
            "with holes or left padding would be packed wrongly. Use CPOTrainer's default data collator."
        )
    ids_rows = [ids[i, :n] for i, n in enumerate(lengths.tolist())]
    label_rows = [labels[i, :n] for i, n in enumerate(lengths.tolist())]
    return ids_rows, label_rows


def _first_labelled(labels: torch.Tensor) -> int:
    hits = (labels != IGNORE_INDEX).nonzero()
    return int(hits[0, 0]) if len(hits) else len(labels)


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0, 0]) if len(differ) else n


def shared_prefix_length(
    chosen_ids: torch.Tensor, chosen_labels: torch.Tensor, rejected_ids: torch.Tensor, rejected_labels: torch.Tensor
) -> int:
    """``S``: the common prefix of the two sequences, cut at the first labelled index of either.

    Positions ``0..S-2`` are shared (identical tokens, and no label in either sequence after the shift). ``S`` is
    0 when the sequences differ at their first token (or one is empty); ``S <= 1`` shares nothing.

    Args:
        chosen_ids: ``[Lc]`` the chosen row's real tokens.
        chosen_labels: ``[Lc]`` its unshifted labels (-100 on the prompt).
        rejected_ids: ``[Lr]``.
        rejected_labels: ``[Lr]``.
    """
    return min(
        _common_prefix(chosen_ids, rejected_ids), _first_labelled(chosen_labels), _first_labelled(rejected_labels)
    )


class _Row:
    """The packed row under construction: per-position pieces, concatenated once at the end."""

    def __init__(self) -> None:
        self.pieces: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("ids", "pos", "group", "branch", "labels", "sequence")
        }
        self.length = 0

    def add(self, ids: torch.Tensor, labels: torch.Tensor, start: int, group: int, branch: int, sequence: int):
        """Positions ``start..`` of one sequence (``ids``/``labels`` ``[L]``: the whole sequence, labels unshifted);
        their position ids are their indexes ``start..L-1``, their labels ``labels[t + 1]`` (-100 past the end)."""
        n = len(ids) - start
        if n <= 0:
            return
        shifted = torch.cat([labels[start + 1 :], labels.new_full((1,), IGNORE_INDEX)])
        for key, value in (
            ("ids", ids[start:]),
            ("pos", torch.arange(start, len(ids))),
            ("group", torch.full((n,), group)),
            ("branch", torch.full((n,), branch)),
            ("labels", shifted),
            ("sequence", torch.full((n,), sequence)),
        ):
            self.pieces[key].append(value)
        self.length += n

    def cat(self, key: str) -> torch.Tensor:
        parts = self.pieces[key]
        return (torch.cat(parts) if parts else torch.zeros(0)).to(torch.int64)


def pack_pairs(
    batch: Mapping[str, torch.Tensor],
    layout: Layout,
    *,
    pad_token_id: int,
    pad_to_multiple_of: int | None = None,
) -> PackedBatch:
    """Pack a CPOTrainer batch into one row in ``layout``.

    Args:
        batch: what CPOTrainer's collator gives ``get_batch_loss_metrics``: ``chosen_input_ids``,
            ``chosen_attention_mask``, ``chosen_labels`` ``[B, Tc]`` and the ``rejected_*`` ``[B, Tr]``, right
            padded (other keys are ignored). TRL truncated each row to ``max_length`` in ``tokenize_row``; packing
            keeps exactly the tokens the padded path runs (each row's ``attention_mask.sum()`` first tokens).
            CPU or device tensors: the bookkeeping runs on CPU and the result lands on the device of
            ``chosen_input_ids``.
        layout: ``"padding_free"`` or ``"prefix_shared"`` (``"padded"`` is TRL's own path: nothing to pack).
        pad_token_id: the token of tail padding.
        pad_to_multiple_of: pad the row with ``pad_token_id`` to a multiple of this (e.g. 128, flex_attention's
            block size, to bound the shapes torch.compile sees). The tail is a group of its own with position ids
            ``0, 1, ...`` (a segment of its own for flash-attention varlen too), label -100, sequence -1, branch 0.
            torch >= 2.6's flex_attention does not need it for correctness.

    Returns:
        The :class:`PackedBatch`, pairs in batch order.
    """
    if layout not in PACKED_LAYOUTS:
        raise ValueError(f"layout={layout!r}: pack_pairs packs {PACKED_LAYOUTS}; {PADDED!r} is TRL's own batch.")
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of={pad_to_multiple_of} must be a positive integer or None.")
    device = batch["chosen_input_ids"].device
    chosen_ids, chosen_labels = _unpadded_rows(batch, "chosen")
    rejected_ids, rejected_labels = _unpadded_rows(batch, "rejected")
    num_pairs = len(chosen_ids)
    if len(rejected_ids) != num_pairs:
        raise ValueError(f"{num_pairs} chosen rows but {len(rejected_ids)} rejected rows.")

    row = _Row()
    for i in range(num_pairs):
        c_ids, c_lab, r_ids, r_lab = chosen_ids[i], chosen_labels[i], rejected_ids[i], rejected_labels[i]
        if layout == PREFIX_SHARED:
            split = max(shared_prefix_length(c_ids, c_lab, r_ids, r_lab), 1) - 1  # branches start here
            row.add(c_ids[:split], torch.full((split,), IGNORE_INDEX), 0, i, SHARED, -1)
            groups = (i, i)
        else:
            split = 0
            groups = (2 * i, 2 * i + 1)
        row.add(c_ids, c_lab, split, groups[0], CHOSEN, i)
        row.add(r_ids, r_lab, split, groups[1], REJECTED, num_pairs + i)
    if pad_to_multiple_of is not None and row.length % pad_to_multiple_of:
        n_pad = pad_to_multiple_of - row.length % pad_to_multiple_of
        tail_group = num_pairs if layout == PREFIX_SHARED else 2 * num_pairs
        row.add(torch.full((n_pad,), pad_token_id), torch.full((n_pad,), IGNORE_INDEX), 0, tail_group, SHARED, -1)

    row_lengths = torch.tensor([len(x) for x in chosen_ids + rejected_ids], dtype=torch.int64)
    packed = PackedBatch(
        input_ids=row.cat("ids")[None],
        position_ids=row.cat("pos")[None],
        group=row.cat("group"),
        branch=row.cat("branch"),
        labels=row.cat("labels"),
        sequence=row.cat("sequence"),
        num_pairs=num_pairs,
        row_lengths=row_lengths,
        layout=layout,
    )
    return packed if device.type == "cpu" else packed.to(device)
