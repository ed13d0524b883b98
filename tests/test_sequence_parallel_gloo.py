"""The sequence-parallel plan (docs/design.md §7), on two CPU ranks over gloo: Ulysses' all-to-all around attention.

Each rank holds N/2 positions of a packed prefix_shared row with every head; an all-to-all trades them for the whole
row and half the heads, attention runs there with the mask built once on the full row, and a second all-to-all goes
back. The output and the gradients of each rank's slice equal the unsharded attention's, in float64. This is the
exchange DeepSpeed's Ulysses (through Accelerate) runs; the test checks that the packed row's mask survives it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from trl_fused_cpo.attention import dense_visibility
from trl_fused_cpo.packing import pack_pairs

WORLD, HEADS, HEAD_DIM = 2, 4, 8


def _exchange(x: torch.Tensor) -> torch.Tensor:
    """``all_to_all_single`` over dim 0 (one equal chunk per rank: chunk j goes to rank j)."""
    x = x.contiguous()
    out = torch.empty_like(x)  # of the contiguous input: empty_like keeps a transposed view's strides
    dist.all_to_all_single(out, x)
    return out


class SequenceToHeads(torch.autograd.Function):
    """``[N/P, H, d]`` (this rank's positions, every head) -> ``[N, H/P, d]`` (every position, this rank's heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        n, h, d = x.shape
        chunks = x.view(n, WORLD, h // WORLD, d).transpose(0, 1)  # [P, n, H/P, d]: head group j for rank j
        return _exchange(chunks).reshape(WORLD * n, h // WORLD, d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return HeadsToSequence.apply(grad)  # the exchange's inverse


class HeadsToSequence(torch.autograd.Function):
    """``[N, H/P, d]`` -> ``[N/P, H, d]``: the inverse of :class:`SequenceToHeads`."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        big_n, hp, d = y.shape
        back = _exchange(y.view(WORLD, big_n // WORLD, hp, d))  # [P, n, H/P, d]: rank i's heads, my positions
        return back.transpose(0, 1).reshape(big_n // WORLD, WORLD * hp, d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return SequenceToHeads.apply(grad)


def _packed_row():
    """A prefix_shared row of three pairs (shared prompts, branches that must not see each other), N even."""
    g = torch.Generator().manual_seed(0)
    batch = {}
    prompts = [torch.randint(4, 40, (n,), generator=g) for n in (5, 9, 3)]
    for side, lengths in (("chosen", (4, 2, 6)), ("rejected", (3, 5, 2))):
        rows = [torch.cat([p, torch.randint(4, 40, (n,), generator=g)]) for p, n in zip(prompts, lengths, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, (row, p) in enumerate(zip(rows, prompts, strict=True)):
            ids[i, : len(row)], mask[i, : len(row)] = row, 1
            labels[i, len(p) : len(row)] = row[len(p) :]
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels})
    return pack_pairs(batch, "prefix_shared", pad_token_id=0, pad_to_multiple_of=WORLD)


def _attention(q, k, v, visible):
    """``[N, h, d]`` inputs, sdpa over the heads with the packed row's ``[N, N]`` visibility."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible)
    return out.transpose(0, 1)


def _worker(rank: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        packed = _packed_row()
        visible = dense_visibility(packed)  # built once on the full row, the same on every rank
        n = packed.num_tokens
        g = torch.Generator().manual_seed(1)
        q, k, v, w = (torch.randn(n, HEADS, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(4))
        ref_inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = _attention(*ref_inputs, visible)
        (ref * w).sum().backward()

        mine = slice(rank * n // WORLD, (rank + 1) * n // WORLD)  # this rank's contiguous positions
        local = [t[mine].clone().requires_grad_(True) for t in (q, k, v)]
        out = HeadsToSequence.apply(_attention(*(SequenceToHeads.apply(t) for t in local), visible))
        (out * w[mine]).sum().backward()
        torch.testing.assert_close(out, ref[mine], rtol=1e-12, atol=1e-12)
        for got, want in zip(local, ref_inputs, strict=True):
            torch.testing.assert_close(got.grad, want.grad[mine], rtol=1e-12, atol=1e-12)
    finally:
        dist.destroy_process_group()


def test_ulysses_exchange_around_packed_attention_equals_unsharded(tmp_path):
    assert _packed_row().num_tokens % WORLD == 0
    mp.spawn(_worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=True)
