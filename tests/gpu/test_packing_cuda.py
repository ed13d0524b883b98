"""Packed layouts on CUDA: flex_attention with the BlockMask against sdpa with the dense mask and the padded rows.

No trl needed (the GPU machine has none): batches are built in the collator's format by hand, with prompts and
completions of random lengths over several 128-tiles. Budget in bf16: flex's error against the fp32 padded run is
no worse than the padded bf16 run's own (1.5x margin for rounding luck). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trl_fused_cpo.attention import packed_attention_mask
from trl_fused_cpo.packing import IGNORE_INDEX, pack_pairs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
PAD, BOS, EOS, VOCAB = 0, 1, 2, 512


def random_batch(num_pairs: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded ``chosen_*``/``rejected_*`` as CPOTrainer's collator gives them (bos, prompt, answer, eos)."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int, n: int = 1) -> list[int]:
        return torch.randint(lo, hi, (n,), generator=g).tolist()

    batch = {}
    rows: dict[str, list[tuple[list[int], int]]] = {"chosen": [], "rejected": []}
    for _ in range(num_pairs):
        prompt = [BOS] + randint(3, VOCAB, randint(10, 200)[0])
        for side in rows:
            answer = randint(3, VOCAB, randint(1, 250)[0]) + [EOS]
            rows[side].append((prompt + answer, len(prompt)))
    for side, seqs in rows.items():
        width = max(len(ids) for ids, _ in seqs)
        ids = torch.full((num_pairs, width), PAD)
        mask = torch.zeros((num_pairs, width), dtype=torch.int64)
        labels = torch.full((num_pairs, width), IGNORE_INDEX)
        for i, (seq, n_prompt) in enumerate(seqs):
            ids[i, : len(seq)] = torch.tensor(seq)
            mask[i, : len(seq)] = 1
            labels[i, n_prompt : len(seq)] = torch.tensor(seq[n_prompt:])
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels})
    return batch


def small_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=500_000.0,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config).to("cuda", dtype).eval()


def padded_states(model, batch) -> torch.Tensor:
    """TRL's layout: chosen and rejected padded to one width, stacked: ``[2B, T, H]``."""
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])

    def stacked(key: str, value: int) -> torch.Tensor:
        parts = [batch[f"{side}_{key}"] for side in ("chosen", "rejected")]
        return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value) for p in parts]).cuda()

    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        out = model.model(stacked("input_ids", PAD), attention_mask=stacked("attention_mask", 0), use_cache=False)
    return out.last_hidden_state


def packed_states(model, packed, implementation: str) -> torch.Tensor:
    model.set_attn_implementation(implementation)
    mask = packed_attention_mask(packed, dtype=model.dtype, implementation=implementation)
    with torch.no_grad():
        out = model.model(
            input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=mask, use_cache=False
        )
    return out.last_hidden_state[0]


def on_padded_grid(packed, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed states at the branch positions, with their (row, position) in the padded grid."""
    keep = packed.sequence >= 0
    return states[keep].float(), packed.sequence[keep], packed.position_ids[0, keep]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("layout", ["padding_free", "prefix_shared"])
def test_flex_block_mask_matches_dense_and_padded(layout):
    batch = random_batch(8)
    packed = pack_pairs(batch, layout, pad_token_id=PAD, pad_to_multiple_of=128).to("cuda")
    assert packed.num_tokens >= 8 * 128

    model32 = small_llama(torch.float32)
    reference = padded_states(model32, batch)
    flex32, rows, pos = on_padded_grid(packed, packed_states(model32, packed, "flex_attention"))
    dense32, _, _ = on_padded_grid(packed, packed_states(model32, packed, "sdpa"))
    assert rel(flex32, reference[rows, pos]) < 1e-5
    assert rel(dense32, reference[rows, pos]) < 1e-5

    model16 = small_llama(torch.bfloat16)
    padded16 = padded_states(model16, batch)[rows, pos].float()
    flex16, _, _ = on_padded_grid(packed, packed_states(model16, packed, "flex_attention"))
    budget = rel(padded16, reference[rows, pos])
    assert rel(flex16, reference[rows, pos]) <= 1.5 * budget + 1e-6, budget
