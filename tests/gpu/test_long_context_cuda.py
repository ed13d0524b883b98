"""Long packed rows on CUDA: the flex BlockMask of a 128k-position row is built in bounded memory, and flex attention
with it matches sdpa on the dense mask of a row short enough to hold one.

No trl needed. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from trl_fused_cpo.attention import packed_attention_mask
from trl_fused_cpo.packing import pack_pairs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _pair(prompt: int, chosen: int, rejected: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    head = torch.randint(3, 500, (prompt,), generator=g)
    batch = {}
    for side, n in (("chosen", chosen), ("rejected", rejected)):
        ids = torch.cat([head, torch.randint(3, 500, (n,), generator=g)])[None]
        labels = ids.clone()
        labels[:, :prompt] = -100
        batch.update(
            {f"{side}_input_ids": ids, f"{side}_attention_mask": torch.ones_like(ids), f"{side}_labels": labels}
        )
    return {k: v.cuda() for k, v in batch.items()}


def test_block_mask_of_a_128k_row_in_bounded_memory():
    packed = pack_pairs(_pair(65_536, 32_767, 32_767), "prefix_shared", pad_token_id=0, pad_to_multiple_of=128)
    assert packed.num_tokens == 131_072
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    mask = packed_attention_mask(packed, dtype=torch.bfloat16, implementation="flex_attention")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    # the [N, N] bool mask would be 16 GiB; the slabs keep the counts near 16 MiB of int32, the tables are (N/128)²
    assert peak < 256 * 2**20, peak / 2**20
    assert mask.seq_lengths == (131_072, 131_072)


def test_flex_with_the_block_mask_matches_dense_sdpa_on_a_long_row():
    from torch.nn.attention.flex_attention import flex_attention

    packed = pack_pairs(_pair(4_000, 2_000, 2_100), "prefix_shared", pad_token_id=0, pad_to_multiple_of=128)
    n = packed.num_tokens
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 4, n, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    block = packed_attention_mask(packed, dtype=torch.bfloat16, implementation="flex_attention")
    dense = packed_attention_mask(packed, dtype=torch.float32, implementation="sdpa")
    flex = torch.compile(flex_attention)(q, k, v, block_mask=block)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=dense)
    real = packed.group < packed.num_pairs  # the tail padding's outputs are free
    assert (flex.float() - ref)[..., real, :].abs().max() < 2e-2
