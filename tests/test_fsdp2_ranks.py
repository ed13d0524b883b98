"""FSDP2 with 2 ranks on CPU (gloo): the fused loss's gradients equal a 1-process run over the global batch.

One process cannot catch a missing cross-rank reduction: there, reduce-scatter is a copy. With `lm_head` in its
own FSDP unit a direct read of its weight sees the sharded DTensor, and `full_tensor()` gives each rank its own
unreduced gradient (96% off before `call_through_head` routed FSDP2 heads through their own forward).
Groupings: accelerate's (`final norm + lm_head` as one unit, `embed + norm + lm_head` when tied) and `lm_head` alone.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trl_fused_cpo.distributed import install_fused_forward
from trl_fused_cpo.loss import fused_linear_cpo_loss
from trl_fused_cpo.toy import toy_model

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 40, (8, 12), generator=g)  # 4 pairs: chosen rows 0-3, rejected rows 4-7
    input_ids[4:, :4] = input_ids[:4, :4]  # each pair's prompt (the first 4 tokens): a prefix_shared layout shares it
    labels = input_ids.clone()
    labels[:, :4] = -100
    labels[1, 9:] = -100  # ragged completions
    return input_ids, labels


def _loss(model, input_ids, labels, memory: str = "fast", layout: str = "padded") -> torch.Tensor:
    """The trainer's route: the patched causal-LM forward, the head through `call_through_head`; a packed layout
    packs the rows as the trainer's collator does (``labels`` then as TRL's, unshifted)."""
    if layout != "padded":
        return _packed_loss(model, input_ids, labels, memory, layout)

    def loss_fn(hidden, weight, bias, fused_labels):
        # cpo_alpha = 0: a sigmoid loss is a mean over pairs, so the rank-mean equals the global mean
        return fused_linear_cpo_loss(
            hidden, weight, fused_labels, bias=bias, cpo_alpha=0.0, backend="torch", memory=memory
        )

    install_fused_forward(model, loss_fn)
    return model(input_ids=input_ids, fused_cpo_labels=labels).loss


def _packed_loss(model, input_ids, labels, memory: str, layout: str) -> torch.Tensor:
    from trl_fused_cpo.attention import packed_attention_mask
    from trl_fused_cpo.packing import pack_pairs
    from trl_fused_cpo.trainer import FusedHead

    b = input_ids.shape[0] // 2
    ones = torch.ones_like(input_ids)
    batch = {f"{side}_{key}": t[rows] for side, rows in (("chosen", slice(0, b)), ("rejected", slice(b, None)))
             for key, t in (("input_ids", input_ids), ("attention_mask", ones), ("labels", labels))}  # fmt: skip
    packed = pack_pairs(batch, layout, pad_token_id=0)
    mask = packed_attention_mask(packed, dtype=torch.float32, implementation=model.config._attn_implementation)
    install_fused_forward(model, FusedHead(dict(cpo_alpha=0.0, backend="torch", memory=memory)))
    out = model(
        input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=mask, fused_cpo_labels=packed
    )
    return out.loss


def _rank_rows(rank: int, num_pairs: int) -> list[int]:
    pairs = list(range(rank * num_pairs // WORLD, (rank + 1) * num_pairs // WORLD))
    return pairs + [num_pairs + i for i in pairs]


def _worker(rank: int, store: str, grouping: str, tie: bool, memory: str, layout: str, out: str) -> None:
    # A file rendezvous, not a TCP port: a port picked free and released can be taken by another socket before
    # rank 0 binds it (the likely cause of a rare failure of this test on a 2-core machine).
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (WORLD,))
        model = toy_model(seed=0, tie_word_embeddings=tie)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if grouping == "accelerate":  # accelerate.utils.fsdp_utils.fsdp2_prepare_model's units
            embed, norm, head = model.model.embed_tokens, model.model.norm, model.lm_head
            if not tie:
                fully_shard(embed, mesh=mesh)
            fully_shard([norm, embed, head] if tie else [norm, head], mesh=mesh, reshard_after_forward=False)
        else:
            fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        input_ids, labels = _batch()
        rows = _rank_rows(rank, input_ids.shape[0] // 2)
        _loss(model, input_ids[rows], labels[rows], memory, layout).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        if rank == 0:
            torch.save(grads, out)
        dist.barrier()  # no rank tears gloo down while the other still talks to it (an abort at exit otherwise)
    finally:
        dist.destroy_process_group()
    # Done: leave without interpreter finalisation. There, gloo's worker threads can still hold FSDP2's async work
    # and its tensors, whose destruction aborts the process ("terminate called without an active exception",
    # SIGABRT): 1 run in 24 of this file on 2 loaded cores, after every result was written. A rank that fails
    # raises above and never gets here, so its error still reaches mp.spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.parametrize(
    ("grouping", "tie", "memory", "layout"),
    [
        ("accelerate", False, "fast", "padded"),
        ("accelerate", True, "fast", "padded"),
        ("head-alone", False, "fast", "padded"),
        ("accelerate", False, "lean", "padded"),
        ("accelerate", False, "fast", "prefix_shared"),
        ("accelerate", True, "fast", "padding_free"),
    ],
)
def test_fsdp2_two_ranks_match_one_process(tmp_path, grouping, tie, memory, layout):
    model = toy_model(seed=0, tie_word_embeddings=tie)
    _loss(model, *_batch(), memory, layout).backward()
    want = {n: p.grad for n, p in model.named_parameters()}

    out = str(tmp_path / "grads.pt")
    args = (str(tmp_path / "store"), grouping, tie, memory, layout, out)
    mp.spawn(_worker, args=args, nprocs=WORLD, join=True)
    got = torch.load(out)
    assert got.keys() == want.keys(), f"parameters without a gradient: {sorted(want.keys() - got.keys())}"
    for name, grad in want.items():
        torch.testing.assert_close(
            got[name], grad, rtol=1e-4, atol=1e-6, msg=f"{grouping}, tie={tie}, {memory}, {layout}: {name}"
        )
