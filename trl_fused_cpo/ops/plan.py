"""Token plan: the labelled positions in pair order, cut into pair-aligned chunks that fit the logits budget.

Only labelled positions get logits (prompt and padding are 30-60% of real preference batches). Tokens are laid out
pair by pair — chosen row i's labelled tokens, then rejected row B+i's — so a chunk that holds whole pairs knows
every sequence log-prob it depends on and can finish its loss and gradients without a second pass.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import ModuleType

import torch

from . import rows_torch


@dataclass(frozen=True)
class ChunkGroup:
    """Pairs ``[pair_start, pair_end)`` whose tokens are ``[tok_start, tok_end)`` of the plan.

    A group is one logits buffer when its tokens fit the budget; a single pair longer than the budget is a group
    of several slices (``function.py``: a frozen head scales their products afterwards, a trainable one computes
    their logits twice, once for the log-probs and once for the gradients).
    """

    pair_start: int
    pair_end: int
    tok_start: int
    tok_end: int

    def slices(self, max_tokens: int) -> list[tuple[int, int]]:
        """At most ``max_tokens`` each, as even as possible: 1,228 tokens in 1,046 are 614 + 614, not 1,046 + 182."""
        n = self.tok_end - self.tok_start
        count = -(-n // max_tokens)
        if count == 0:
            return []
        cuts = [self.tok_start + i * n // count for i in range(count + 1)]
        return list(itertools.pairwise(cuts))


@dataclass(frozen=True)
class TokenPlan:
    """Where the labelled tokens are and how they are chunked.

    Attributes:
        token_index: ``[N]`` int64, each labelled token's position in the flattened ``[2B * T]`` batch, pair order.
        token_row: ``[N]`` int64, the row (sequence) each token belongs to.
        targets: ``[N]`` int64, the label of each token.
        row_counts: ``[2B]`` integer, on the device: labelled tokens per row.
        row_counts_host: the same on the host.
        groups: the pair-aligned chunks, in token order.
        max_tokens: the logits buffer's row budget the groups were cut for.
    """

    token_index: torch.Tensor
    token_row: torch.Tensor
    targets: torch.Tensor
    row_counts: torch.Tensor
    row_counts_host: list[int]
    groups: list[ChunkGroup]
    max_tokens: int

    @property
    def num_tokens(self) -> int:
        return int(self.token_index.numel())

    @property
    def num_chosen_tokens(self) -> int:
        return sum(self.row_counts_host[: len(self.row_counts_host) // 2])


def plan_tokens(
    labels: torch.Tensor,
    *,
    ignore_index: int,
    vocab_size: int,
    max_tokens: int,
    whole_batch_tokens: int | None = None,
    ops: ModuleType = rows_torch,
) -> TokenPlan:
    """Compact the labelled positions of ``labels`` ``[2B, T]`` into pair-ordered, budgeted chunks.

    One host synchronisation: the per-row counts (and the count of out-of-range labels, checked here so that a
    bad id raises instead of reading past the weight matrix).

    Args:
        whole_batch_tokens: a batch with at most this many labelled tokens is one chunk whatever ``max_tokens``
            says (the caller's larger budget for a single GEMM, which needs no fp32 weight-gradient accumulator).
        ops: ``rows_torch`` or ``rows_triton``, for ``label_counts`` and ``compact_labels``.
    """
    rows = labels.shape[0]
    num_pairs = rows // 2
    counts = ops.label_counts(labels, ignore_index, vocab_size)
    host = counts.tolist()  # the one sync
    row_counts_host, num_bad = host[0], sum(host[1])
    if num_bad:
        mask = labels != ignore_index
        bad_ids = labels[mask & ((labels < 0) | (labels >= vocab_size))][:5].tolist()
        raise ValueError(
            f"labels hold {num_bad} id(s) outside [0, {vocab_size}) other than ignore_index={ignore_index}, "
            f"e.g. {bad_ids}. The tokenizer and the lm_head disagree on the vocabulary size."
        )
    num_tokens = sum(row_counts_host)
    if whole_batch_tokens is not None and num_tokens <= whole_batch_tokens:
        max_tokens = max(max_tokens, num_tokens)
    row_counts = counts[0]
    token_index, token_row, targets = ops.compact_labels(labels, row_counts, num_tokens, ignore_index)

    groups: list[ChunkGroup] = []
    start_pair, start_tok, tok = 0, 0, 0
    for i in range(num_pairs):
        n = row_counts_host[i] + row_counts_host[num_pairs + i]
        if tok + n - start_tok > max_tokens and i > start_pair:
            groups.append(ChunkGroup(start_pair, i, start_tok, tok))
            start_pair, start_tok = i, tok
        tok += n
    groups.append(ChunkGroup(start_pair, num_pairs, start_tok, tok))
    return TokenPlan(token_index, token_row, targets, row_counts, row_counts_host, groups, max_tokens)
