"""The token plan (ops/plan.py): pair-aligned groups as few as the budget allows and as even as possible."""

from __future__ import annotations

import itertools

import pytest


@pytest.mark.parametrize(
    ("pair_tokens", "budget", "sizes"),
    [
        ([1228] * 16, 6278, [4912] * 4),  # greedy would make 5 + 5 + 5 + 1 pairs: a 6,140-token buffer
        ([2046] * 16, 4185, [4092] * 8),  # already even
        ([1228] * 16, 4185, [3684] * 5 + [1228]),  # 6 groups need 3 pairs somewhere: no smaller buffer exists
        ([5000, 10, 10, 3000, 3000], 4185, [5000, 3020, 3000]),  # a pair over the budget is a group alone
        ([0, 0], 4185, [0]),
    ],
)
def test_chunk_groups_are_as_few_as_greedy_and_no_larger_than_needed(pair_tokens, budget, sizes):
    from trl_fused_cpo.ops.plan import _pack, balanced_groups

    groups = balanced_groups(pair_tokens, budget)
    assert [g.tok_end - g.tok_start for g in groups] == sizes
    assert len(groups) == len(_pack(pair_tokens, budget))
    assert groups[0].pair_start == 0 and groups[-1].pair_end == len(pair_tokens)
    for a, b in itertools.pairwise(groups):
        assert (a.pair_end, a.tok_end) == (b.pair_start, b.tok_start)
