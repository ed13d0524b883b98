"""Attention masks for packed preference rows (packing.py), per attention implementation; support.py says who packs.

The rule, over the packed row: key ``k`` is visible to query ``q`` iff ``group[k] == group[q]``, ``k <= q``, and
not (``branch[q] == REJECTED`` and ``branch[k] == CHOSEN``).

What the model's ``attention_mask=`` gets (transformers 5.x, ``masking_utils._preprocess_mask_arguments``: a 4D
tensor or a ``BlockMask`` is used as it is, so the position ids only drive RoPE):

- ``eager`` / ``sdpa``: a dense additive ``[1, 1, N, N]`` mask (0 visible, dtype-min hidden). O(N²) memory and
  keeps sdpa off its flash kernel: the CPU/test path.
- ``flex_attention``: a ``BlockMask`` with ``Q_BLOCK = KV_BLOCK = 128``, built block-sparse from each query's
  visible key intervals (no ``[N, N]`` tensor; ``create_block_mask`` would evaluate the mask_mod over the whole
  grid unless compiled, and recompile for every new ``N``). Its ``mask_mod`` is the rule above over
  ``group``/``branch`` and is applied on the partial blocks only.
- ``flash_attention_*`` (varlen): ``None`` for ``padding_free``; the caller passes ``position_ids`` and
  transformers cuts the row where they restart at 0 (``prepare_fa_kwargs_from_position_ids``). ``prefix_shared``
  needs a mask varlen cannot express: refused.

Call the model as ``model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=mask,
use_cache=False)`` (as TRL does): with a cache, transformers also skips its own packed-sequence detection from
``position_ids``, so sdpa/eager/flex called with ``attention_mask=None`` would let the segments attend to each other
(tests/test_attention.py runs padding_free that way, exactly, only with ``use_cache=False``).
"""

from __future__ import annotations

import torch

from .packing import CHOSEN, REJECTED, PackedBatch
from .varlen_attention import IMPLEMENTATION as FUSED_VARLEN_IMPLEMENTATION
from .varlen_attention import TABLES_KWARG, VarlenTables, varlen_tables

FLEX_BLOCK_SIZE = 128  # torch's default sparse block (flex_attention's kernels tile by it)
_MASK_SLAB_ELEMENTS = 1 << 22  # [queries, kv blocks] counted at a time by packed_block_mask: 16 MiB of int32
DENSE_IMPLEMENTATIONS = ("eager", "sdpa")
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def _visible(group: torch.Tensor, branch: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The rule, broadcast over query indexes ``q`` and key indexes ``k``."""
    return (group[q] == group[k]) & (k <= q) & ~((branch[q] == REJECTED) & (branch[k] == CHOSEN))


def dense_visibility(packed: PackedBatch) -> torch.Tensor:
    """``[N, N]`` bool, ``[q, k]`` True where key ``k`` is visible to query ``q``."""
    idx = torch.arange(packed.num_tokens, device=packed.group.device)
    return _visible(packed.group, packed.branch, idx[:, None], idx[None, :])


def packed_mask_mod(packed: PackedBatch):
    """flex_attention's ``mask_mod(b, h, q_idx, kv_idx)`` for ``packed`` (tensors captured on their device)."""
    group, branch = packed.group, packed.branch

    def mask_mod(b, h, q_idx, kv_idx):
        return _visible(group, branch, q_idx, kv_idx)

    return mask_mod


def _visible_intervals(packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query's visible keys as two half-open intervals ``[lo1, hi1) ∪ [lo2, hi2)`` of the row, ``[N]`` each.

    A group is contiguous and laid out ``shared, chosen, rejected``: a query sees ``[group start, q]``, except a
    rejected query, which skips its group's chosen branch ``[chosen start, chosen end)``.
    """
    group, branch = packed.group, packed.branch
    n = packed.num_tokens
    idx = torch.arange(n, device=group.device)
    starts = torch.ones(n, dtype=torch.bool, device=group.device)
    starts[1:] = group[1:] != group[:-1]
    group_start = torch.cummax(torch.where(starts, idx, 0), 0).values
    is_chosen = branch == CHOSEN
    # Chosen start/end per position, carried forward within the group: the branch is contiguous in its group.
    chosen_start_here = is_chosen & (starts | ~torch.cat([starts.new_zeros(1), is_chosen[:-1]]))
    chosen_start = torch.cummax(torch.where(chosen_start_here, idx, -1), 0).values
    chosen_end = torch.cummax(torch.where(is_chosen, idx + 1, -1), 0).values
    skips = (branch == REJECTED) & (chosen_start >= group_start) & (chosen_end > chosen_start)
    lo1 = group_start
    hi1 = torch.where(skips, chosen_start, idx + 1)
    lo2 = torch.where(skips, chosen_end, idx + 1)
    hi2 = idx + 1
    return lo1, hi1, lo2, hi2


def packed_block_mask(packed: PackedBatch, *, block_size: int = FLEX_BLOCK_SIZE):
    """The flex_attention ``BlockMask`` of ``packed``: which ``block_size²`` tiles are empty, full or partial.

    Counts each tile's visible pairs from the per-query intervals, a slab of query blocks at a time (never
    ``[N, N]``, nor ``[N, N / block_size]``): 0 -> skipped, all ``block_size²`` -> full (the kernel skips
    mask_mod), else partial (mask_mod applied).
    Equal to ``create_block_mask(packed_mask_mod(packed), 1, 1, N, N)`` (tests/test_attention.py).
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = packed.num_tokens
    device = packed.group.device
    nb = -(-n // block_size)
    lo1, hi1, lo2, hi2 = (x.to(torch.int32) for x in _visible_intervals(packed))
    k_lo = torch.arange(nb, device=device, dtype=torch.int32) * block_size
    k_hi = (k_lo + block_size).clamp(max=n)

    def overlap(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        return (torch.minimum(hi[:, None], k_hi[None]) - torch.maximum(lo[:, None], k_lo[None])).clamp(min=0)

    pad = nb * block_size - n
    lo1, hi1, lo2, hi2 = (torch.nn.functional.pad(x, (0, pad)) for x in (lo1, hi1, lo2, hi2))  # [0, 0): none
    # Query blocks a slab at a time: the [queries, nb] counts of a whole row are quadratic (2 GiB of temporaries at
    # N = 128k); a slab keeps them near _MASK_SLAB_ELEMENTS whatever N (the [nb, nb] block tables stay).
    slab = max(1, _MASK_SLAB_ELEMENTS // (block_size * nb)) * block_size
    counts = torch.cat(
        [
            (overlap(lo1[q : q + slab], hi1[q : q + slab]) + overlap(lo2[q : q + slab], hi2[q : q + slab]))
            .view(-1, block_size, nb)
            .sum(1)
            for q in range(0, nb * block_size, slab)
        ]
    )  # [q block, kv block]
    # Tiles cut by the row's end are never full (torch pads them with hidden positions): the kernels apply
    # mask_mod there, as on create_block_mask's.
    full = counts == block_size * block_size
    partial = (counts > 0) & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Listed blocks first, ascending (a stable sort of the 0/1 flags, descending).
        num = blocks.sum(-1).to(torch.int32)
        indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num[None, None], indices[None, None]

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=packed_mask_mod(packed), seq_lengths=(n, n)
    )


def packed_attention_mask(packed: PackedBatch, *, dtype: torch.dtype, implementation: str):
    """What the model's ``attention_mask=`` must get to honour ``packed``'s layout under ``implementation``.

    Pass it with ``input_ids=packed.input_ids`` and ``position_ids=packed.position_ids`` (both ``[1, N]``).

    Args:
        packed: the packed batch (on the model's device).
        dtype: the attention's compute dtype (the model's dtype): the dense mask is additive in it.
        implementation: ``model.config._attn_implementation``.

    Returns:
        ``eager``/``sdpa``: ``[1, 1, N, N]`` ``dtype`` tensor, 0 visible and ``finfo(dtype).min`` hidden.
        ``flex_attention``: a ``BlockMask`` (see :func:`packed_block_mask`).
        ``flash_attention_*``: ``None`` for ``padding_free`` (varlen from ``position_ids``).
        ``fused_cpo_varlen``: ``None`` (the segments travel as ``varlen_attention.VarlenTables``).

    Raises:
        ValueError: ``prefix_shared`` with flash attention, or an implementation this module does not know.
    """
    if implementation in DENSE_IMPLEMENTATIONS:
        hidden = torch.finfo(dtype).min
        mask = torch.zeros((), dtype=dtype, device=packed.group.device).masked_fill(~dense_visibility(packed), hidden)
        return mask[None, None]
    if implementation == "flex_attention":
        return packed_block_mask(packed)
    if implementation == FUSED_VARLEN_IMPLEMENTATION:
        return None
    if implementation in VARLEN_IMPLEMENTATIONS:
        if not packed.shares_prompts:  # every group one sequence: varlen's segments
            return None
        raise ValueError(_varlen_refusal(implementation))
    raise ValueError(
        f"attn_implementation={implementation!r}: packed layouts need an attention that takes a prepared mask "
        f"({DENSE_IMPLEMENTATIONS + ('flex_attention',)}) or, for padding_free, flash-attention varlen. "
        "Load the model with attn_implementation='flex_attention' (or 'sdpa'), or use layout 'padded'."
    )


def packed_model_inputs(
    packed: PackedBatch, *, dtype: torch.dtype, implementation: str, tables: VarlenTables | None = None
) -> dict:
    """The model's forward keywords for ``packed`` under ``implementation``: the one way a packed row is called.

    ``input_ids``, ``position_ids``, ``attention_mask`` (:func:`packed_attention_mask`), ``use_cache=False`` (with a
    cache transformers skips its packed-sequence detection), and for ``fused_cpo_varlen`` the segment tables
    (``tables`` from the collator, else built here), on ``packed``'s device.
    """
    inputs = dict(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=packed_attention_mask(packed, dtype=dtype, implementation=implementation),
        use_cache=False,
    )
    if implementation == FUSED_VARLEN_IMPLEMENTATION:
        inputs[TABLES_KWARG] = (tables if tables is not None else varlen_tables(packed)).to(packed.input_ids.device)
    return inputs


def _varlen_refusal(implementation: str) -> str:
    return (
        f"layout 'prefix_shared' cannot run on attn_implementation={implementation!r}: flash-attention varlen cuts "
        "the row into independent causal segments, but the rejected branch must see the shared prompt and skip "
        "the chosen branch before it. Load the model with attn_implementation='fused_cpo_varlen' (this package's "
        "varlen form of the shared prompt) or 'flex_attention', or use layout 'padding_free'."
    )
