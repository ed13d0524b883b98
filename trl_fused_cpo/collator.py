"""The trainer's collator for packed layouts: TRL's padded batch plus its ``PackedBatch``, built on the host.

Packing in the collator keeps the bookkeeping (which tokens are real, where each pair's prompt ends) on the CPU,
in the data loader, before the batch moves to the device: no host sync in the training step.
"""

from __future__ import annotations

from collections.abc import Callable

from .attention import FLEX_BLOCK_SIZE
from .packing import PackedBatch, pack_pairs
from .varlen_attention import IMPLEMENTATION as FUSED_VARLEN_IMPLEMENTATION
from .varlen_attention import TABLES_KWARG, varlen_tables

PACKED_KEY = "fused_cpo_packed"  # the batch key of the PackedBatch


class PackingCollator:
    """``collate(features)`` plus ``batch[PACKED_KEY] = pack_pairs(batch, layout)`` (and, for the
    ``fused_cpo_varlen`` attention, ``batch[TABLES_KWARG]``: its segment tables, built here on the host).

    Args:
        collate: TRL's collator (``DPODataCollatorWithPadding``), whose padded batch is kept as it is.
        layout: ``"padding_free"`` or ``"prefix_shared"``.
        pad_token_id: the token of the tail padding flex_attention gets.
        attn_implementation: the model's; flex_attention gets the row padded to its block size (shapes torch.compile
            sees stay few).
    """

    def __init__(self, collate: Callable, layout: str, pad_token_id: int, attn_implementation: str):
        self.collate, self.layout, self.pad_token_id = collate, layout, pad_token_id
        self.pad_to_multiple_of = FLEX_BLOCK_SIZE if attn_implementation == "flex_attention" else None
        self.varlen = attn_implementation == FUSED_VARLEN_IMPLEMENTATION

    def __call__(self, features: list[dict]) -> dict:
        batch = self.collate(features)
        batch[PACKED_KEY] = self.pack(batch)
        if self.varlen:
            batch[TABLES_KWARG] = varlen_tables(batch[PACKED_KEY])
        return batch

    def pack(self, batch: dict) -> PackedBatch:
        """The ``PackedBatch`` of a collated batch, with this collator's layout and padding."""
        return pack_pairs(
            batch, self.layout, pad_token_id=self.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of
        )
