"""Token plan: the labelled positions in pair order, cut into pair-aligned chunks that fit the logits budget.

Only labelled positions get logits (prompt and padding are 30-60% of real preference batches). Tokens are laid out
pair by pair — chosen row i's labelled tokens, then rejected row B+i's — so a chunk that holds whole pairs knows
every sequence log-prob it depends on and can finish its loss and gradients without a second pass.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(frozen=True)
class ChunkGroup:
    """Pairs ``[pair_start, pair_end)`` whose tokens are ``[tok_start, tok_end)`` of the plan.

    A group is one logits buffer when its tokens fit the budget; a single pair longer than the budget is a group
    of several slices (``chunks.py``: a frozen head scales their products afterwards, a trainable one computes
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

    @property
    def one_gemm(self) -> bool:
        """Whether every token is in one slice: one logits GEMM, one dW GEMM."""
        return len(self.groups) == 1 and len(self.groups[0].slices(self.max_tokens)) == 1


@dataclass(frozen=True)
class LabelLayout:
    """The labelled positions in pair order, launched on the device and not yet read by the host.

    Sized for every position (``[2B * T]``): the first N entries are the labelled tokens (N is known only after
    the plan's host sync), and the rest of ``token_index`` holds valid positions, so that a gather over any prefix
    can be queued before the sync (``chunks.py`` gathers the first chunk's hidden states that way).
    """

    counts: torch.Tensor  # [2, 2B] int32: labelled tokens per row, out-of-range labels per row (packed: a third
    # row, labelled positions that name no sequence)
    token_index: torch.Tensor
    token_row: torch.Tensor
    targets: torch.Tensor
    counts_host: torch.Tensor | None = None  # on CUDA: pinned, filled by a copy queued right after the counts
    counts_ready: torch.cuda.Event | None = None  # recorded after that copy


def lay_out_labels(labels: torch.Tensor, *, ignore_index: int, vocab_size: int, backend: ModuleType) -> LabelLayout:
    """Queue the label counts and the pair-ordered compaction: no host synchronisation.

    On CUDA the counts are copied to pinned host memory as soon as they exist, behind an event: the plan's sync
    then waits for them only, not for the compaction and the gathers queued after, which run while the host plans.
    """
    counts = backend.label_counts(labels, ignore_index, vocab_size)
    token_index, token_row, targets = backend.compact_labels(labels, counts[0], labels.numel(), ignore_index)
    return LabelLayout(counts, token_index, token_row, targets, *_copy_counts_to_host(counts))


def lay_out_packed_labels(
    labels: torch.Tensor, sequence: torch.Tensor, num_rows: int, *, ignore_index: int, vocab_size: int
) -> LabelLayout:
    """``lay_out_labels`` for a packed batch: ``labels`` ``[N]`` (already shifted) and ``sequence`` ``[N]``, the
    row (``i`` chosen of pair ``i``, ``B + i`` its rejected) each position's label scores. The same pair order;
    torch ops on any device (a stable sort: positions within a row keep their order), no host synchronisation."""
    num_pairs = num_rows // 2
    labelled = labels != ignore_index
    named = labelled & (sequence >= 0)
    row = torch.where(named, sequence, num_rows)  # row num_rows: a bin for the rest, dropped below
    bad = named & ((labels < 0) | (labels >= vocab_size))
    unnamed = labelled & (sequence < 0)
    counts = torch.stack(
        [
            torch.bincount(row, minlength=num_rows + 1)[:num_rows],
            torch.bincount(torch.where(bad, sequence, num_rows), minlength=num_rows + 1)[:num_rows],
            torch.bincount(torch.where(unnamed, 0, num_rows), minlength=num_rows + 1)[:num_rows],
        ]
    ).int()
    rank = torch.where(named, (row % num_pairs) * 2 + (row >= num_pairs), num_rows)  # chosen i, rejected B+i, ...
    token_index = torch.sort(rank, stable=True).indices
    token_row = row[token_index].clamp(max=num_rows - 1)
    targets = labels[token_index].clamp(min=0)  # past the labelled tokens: any valid id (never read)
    return LabelLayout(counts, token_index, token_row, targets, *_copy_counts_to_host(counts))


def _copy_counts_to_host(counts: torch.Tensor) -> tuple[torch.Tensor | None, torch.cuda.Event | None]:
    """On CUDA, the counts copied to pinned memory behind an event, queued now: the plan's sync waits for this copy
    only, not for the compaction and the gathers queued after it. ``(None, None)`` elsewhere."""
    counts_host = counts_ready = None
    if counts.is_cuda:
        counts_host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        counts_host.copy_(counts, non_blocking=True)
        counts_ready = torch.cuda.Event()
        # On the counts' device, where the copy was queued: the current device may be another one (the torch backend
        # runs on any device), and an event there would not wait for the copy.
        counts_ready.record(torch.cuda.current_stream(counts.device))
    return counts_host, counts_ready


def plan_tokens(
    labels: torch.Tensor,
    *,
    ignore_index: int,
    vocab_size: int,
    max_tokens: int | Callable[[int], int],
    backend: ModuleType,
    layout: LabelLayout | None = None,
) -> TokenPlan:
    """Compact the labelled positions of ``labels`` ``[2B, T]`` into pair-ordered chunks of the given size.

    One host synchronisation: the per-row counts (and the count of out-of-range labels, checked here so that a
    bad id raises before anything indexes the weight matrix with it). The plan counts and cuts; the budget is the
    schedule's (``schedule.py``).

    Args:
        max_tokens: tokens per chunk, or what gives them from the labelled count once it is known (a schedule's
            ``chunk_tokens``).
        backend: ``torch_backend`` or ``kernels`` (``backend.py``), for ``label_counts`` and ``compact_labels``.
        layout: ``lay_out_labels``' result, where the caller queued work on it before this sync.
    """
    if layout is None:
        layout = lay_out_labels(labels, ignore_index=ignore_index, vocab_size=vocab_size, backend=backend)
    rows = layout.counts.shape[1]
    num_pairs = rows // 2
    if layout.counts_ready is not None:  # the one sync
        layout.counts_ready.synchronize()
        host = layout.counts_host.tolist()
    else:
        host = layout.counts.tolist()
    row_counts_host, num_bad = host[0], sum(host[1])
    if len(host) > 2 and sum(host[2]):
        raise ValueError(
            f"{sum(host[2])} labelled position(s) name no sequence (sequence = -1): a packed batch's labels must "
            "belong to a chosen or rejected row (shared prompt positions carry no label)."
        )
    if num_bad:
        mask = labels != ignore_index
        bad_ids = labels[mask & ((labels < 0) | (labels >= vocab_size))][:5].tolist()
        raise ValueError(
            f"labels hold {num_bad} id(s) outside [0, {vocab_size}) other than ignore_index={ignore_index}, "
            f"e.g. {bad_ids}. The tokenizer and the lm_head disagree on the vocabulary size."
        )
    num_tokens = sum(row_counts_host)
    if callable(max_tokens):
        max_tokens = max_tokens(num_tokens)

    pair_tokens = [row_counts_host[i] + row_counts_host[num_pairs + i] for i in range(num_pairs)]
    groups = balanced_groups(pair_tokens, max_tokens)
    token_index, token_row, targets = (t[:num_tokens] for t in (layout.token_index, layout.token_row, layout.targets))
    return TokenPlan(token_index, token_row, targets, layout.counts[0], row_counts_host, groups, max_tokens)


def _pack(pair_tokens: list[int], capacity: int) -> list[ChunkGroup]:
    """Greedy: each group takes pairs while its tokens stay within ``capacity`` (a longer pair is a group alone)."""
    groups: list[ChunkGroup] = []
    start_pair, start_tok, tok = 0, 0, 0
    for i, n in enumerate(pair_tokens):
        if tok + n - start_tok > capacity and i > start_pair:
            groups.append(ChunkGroup(start_pair, i, start_tok, tok))
            start_pair, start_tok = i, tok
        tok += n
    groups.append(ChunkGroup(start_pair, len(pair_tokens), start_tok, tok))
    return groups


def balanced_groups(pair_tokens: list[int], max_tokens: int) -> list[ChunkGroup]:
    """As few groups as the budget allows, as even as possible: 16 pairs of 1,228 tokens in a 6,278-token budget are
    4 + 4 + 4 + 4 pairs, not 5 + 5 + 5 + 1, so the logits buffer (sized for the largest group) is 20% smaller.

    Greedy packing gives the fewest contiguous groups; the smallest capacity that still gives that many is found
    by bisection (the group count only falls as the capacity grows), between the mean and greedy's largest group:
    no search at all for one group or groups already even, since this runs between the plan's sync and the first
    GEMM. Host work: O(pairs · log(largest − mean)).
    """
    groups = _pack(pair_tokens, max_tokens)
    count, total = len(groups), sum(pair_tokens)
    lo = -(-total // count)  # no capacity under the mean fits in `count` groups
    hi = min(max_tokens, max(g.tok_end - g.tok_start for g in groups))  # greedy's own groups fit: feasible
    # `groups` is greedy's packing at `hi` too (each group stops where it stopped at `max_tokens`), so it stands for
    # the packing at `hi` until a smaller feasible capacity is found: no pack is ever computed twice.
    while lo < hi:
        mid = (lo + hi) // 2
        packed = _pack(pair_tokens, mid)
        if len(packed) <= count:
            hi, groups = mid, packed
        else:
            lo = mid + 1
    return groups
