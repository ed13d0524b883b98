"""Where TRL's 2B rows (B chosen, then B rejected sequences) are among the hidden states: padded or packed.

The schedules only need four things from a layout: how many positions and rows there are, the labelled tokens in
pair order (``plan.LabelLayout``), each row's sum of hidden states over its unlabelled positions (the ``logits/*``
metrics ride on the first GEMM as those sums), and each row's position count (``row_positions``: the backend's
``finish_`` divides the per-row logit sums by it, one formula for every layout).

- ``PaddedRows``: TRL's layout, ``hidden [2B, T, H]``, ``labels [2B, T]``; the means are TRL's ``logits.mean()`` of
  each half, padding included.
- ``PackedRows``: one packed row of ``N`` positions (``trl_fused_cpo.packing``): ``labels [N]`` (already shifted)
  and ``sequence [N]`` (the row each label scores). A shared prompt position belongs to both rows of its pair. The
  means are over the positions each half's sequences have, with no padding (``row_lengths``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from .plan import LabelLayout, lay_out_labels, lay_out_packed_labels
from .sequence import unlabelled_hidden_sums


@dataclass(frozen=True)
class PaddedRows:
    """TRL's padded layout: row ``r`` is ``hidden[r]``."""

    labels: torch.Tensor  # [2B, T], already shifted
    ignore_index: int

    @property
    def num_rows(self) -> int:
        return self.labels.shape[0]

    @property
    def num_positions(self) -> int:
        return self.labels.numel()

    def lay_out(self, vocab_size: int, backend: ModuleType) -> LabelLayout:
        return lay_out_labels(self.labels, ignore_index=self.ignore_index, vocab_size=vocab_size, backend=backend)

    def unlabelled_hidden_sums(self, x_all: torch.Tensor) -> torch.Tensor:
        hidden = x_all.view(*self.labels.shape, x_all.shape[-1])
        return unlabelled_hidden_sums(hidden, self.labels, self.ignore_index)

    @property
    def row_positions(self) -> torch.Tensor:
        """``[2B]``: every row has ``T`` positions, padding included (TRL's means average it)."""
        rows, seq_len = self.labels.shape
        return torch.full((rows,), seq_len, device=self.labels.device, dtype=torch.int64)


@dataclass(frozen=True)
class PackedRows:
    """A packed batch: every position ``t`` of ``[N]`` belongs to ``member[0, t]`` and ``member[1, t]`` (rows, or
    ``-1``); a branch position to one row, a shared prompt position to both rows of its pair."""

    labels: torch.Tensor  # [N], already shifted
    sequence: torch.Tensor  # [N]: the row each label scores, -1 where none
    member: torch.Tensor  # [2, N]
    row_lengths: torch.Tensor  # [2B]: positions of each row
    ignore_index: int

    @classmethod
    def create(cls, labels, sequence, shared_pair, row_lengths, ignore_index: int) -> PackedRows:
        num_pairs = row_lengths.numel() // 2
        shared = shared_pair >= 0
        member = torch.stack(
            [torch.where(shared, shared_pair, sequence), torch.where(shared, shared_pair + num_pairs, -1)]
        )
        return cls(labels, sequence, member, row_lengths, ignore_index)

    @property
    def num_rows(self) -> int:
        return self.row_lengths.numel()

    @property
    def num_positions(self) -> int:
        return self.labels.numel()

    def lay_out(self, vocab_size: int, backend: ModuleType) -> LabelLayout:
        del backend  # torch ops: a sort and three bincounts over [N]
        return lay_out_packed_labels(
            self.labels, self.sequence, self.num_rows, ignore_index=self.ignore_index, vocab_size=vocab_size
        )

    def unlabelled_hidden_sums(self, x_all: torch.Tensor) -> torch.Tensor:
        """``[2B, H]`` as one GEMM with a ``[2B, N]`` 0/1 membership matrix: fp32 accumulation, as the padded bmm."""
        rows, n = self.num_rows, self.num_positions
        unlabelled = (self.labels == self.ignore_index).to(x_all.dtype)
        membership = torch.zeros(rows + 1, n, device=x_all.device, dtype=x_all.dtype)  # row `rows`: no row
        positions = torch.arange(n, device=x_all.device)
        for k in range(2):
            membership[self.member[k].where(self.member[k] >= 0, rows), positions] = unlabelled
        return torch.mm(membership[:rows], x_all)

    @property
    def row_positions(self) -> torch.Tensor:
        """``[2B]``: the real positions of each row, its shared prompt included (no padding exists)."""
        return self.row_lengths
