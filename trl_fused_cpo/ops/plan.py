"""Token plan: the labelled positions in pair order, cut into pair-aligned chunks that fit the logits budget.

Only labelled positions get logits (prompt and padding are 30-60% of real preference batches). Tokens are laid out
pair by pair — chosen row i's labelled tokens, then rejected row B+i's — so a chunk that holds whole pairs knows
every sequence log-prob it depends on and can finish its loss and gradients without a second pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkGroup:
    """Pairs ``[pair_start, pair_end)`` whose tokens are ``[tok_start, tok_end)`` of the plan.

    A group is one logits buffer when its tokens fit the budget; a single pair longer than the budget is a group
    of several slices, whose logits are computed twice (once for the log-probs, once for the gradients).
    """

    pair_start: int
    pair_end: int
    tok_start: int
    tok_end: int

    def slices(self, max_tokens: int) -> list[tuple[int, int]]:
        return [(s, min(s + max_tokens, self.tok_end)) for s in range(self.tok_start, self.tok_end, max_tokens)]


@dataclass(frozen=True)
class TokenPlan:
    """Where the labelled tokens are and how they are chunked.

    Attributes:
        token_index: ``[N]`` int64, each labelled token's position in the flattened ``[2B * T]`` batch, pair order.
        token_row: ``[N]`` int64, the row (sequence) each token belongs to.
        targets: ``[N]`` int64, the label of each token.
        row_counts: ``[2B]`` int64 on the device, labelled tokens per row.
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
    labels: torch.Tensor, *, ignore_index: int, vocab_size: int, max_tokens: int, whole_batch_tokens: int | None = None
) -> TokenPlan:
    """Compact the labelled positions of ``labels`` ``[2B, T]`` into pair-ordered, budgeted chunks.

    ``whole_batch_tokens``: a batch with at most this many labelled tokens is one chunk whatever ``max_tokens``
    says (the caller's larger budget for a single GEMM, which needs no fp32 weight-gradient accumulator).

    One host synchronisation: the per-row counts (and the count of out-of-range labels, checked here so that a
    bad id raises instead of reading past the weight matrix).
    """
    rows, seq_len = labels.shape
    num_pairs = rows // 2
    mask = labels != ignore_index
    row_counts = mask.sum(dim=1)
    bad = (mask & ((labels < 0) | (labels >= vocab_size))).sum()
    host = torch.cat([row_counts, bad.view(1)]).tolist()  # the one sync
    row_counts_host, num_bad = host[:-1], host[-1]
    if num_bad:
        bad_ids = labels[mask & ((labels < 0) | (labels >= vocab_size))][:5].tolist()
        raise ValueError(
            f"labels hold {num_bad} id(s) outside [0, {vocab_size}) other than ignore_index={ignore_index}, "
            f"e.g. {bad_ids}. The tokenizer and the lm_head disagree on the vocabulary size."
        )

    device = labels.device
    pair = torch.arange(num_pairs, device=device)
    row_order = torch.stack([pair, pair + num_pairs], dim=1).flatten()  # chosen i, rejected i, ...
    ordered_mask = mask[row_order].flatten()
    # The labelled positions in order, without the host sync of boolean indexing: N is known from the counts, and
    # a stable sort puts the True entries first, in order.
    num_tokens = sum(row_counts_host)
    if whole_batch_tokens is not None and num_tokens <= whole_batch_tokens:
        max_tokens = max(max_tokens, num_tokens)
    flat = torch.sort((~ordered_mask).to(torch.uint8), stable=True).indices[:num_tokens]
    token_row = row_order[flat // seq_len]
    token_index = token_row * seq_len + flat % seq_len
    targets = labels.reshape(-1)[token_index].long()

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
