"""Experiment: the two row passes with one block reduction per iteration instead of three or four.

    python scripts/sweep_exp_pass.py --rows 1023,2046,4092 --json exp_pass.json

The shipped kernels (``logsumexp_kernel.py``, ``frozen_grad_kernels.py``) reduce every 2,048-column block to
scalars as they go: max, Σ exp and the sum for log-sum-exp; max, Σ E, Σ E without the target and the sum for the
exponentials. Each reduction crosses warps through shared memory with a barrier. Here only the block max (the
overflow guard of the exponentials, the running max of log-sum-exp) is reduced per block; the sums stay
``[BLOCK]`` vectors in registers and are reduced once per segment. Same partials, same combine kernels.

Prints ms and TB/s (bytes read + written) of each pass, shipped and variant, at each row count, and the largest
difference between their outputs. The shipped passes reach 2.7–3.4 TB/s against a 4.0–4.25 TB/s copy
(``docs/results/row_passes.json``).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from trl_fused_cpo.ops import frozen_grad_kernels, logsumexp_kernel


@triton.jit
def _segment_stats_vec_kernel(
    logits_ptr,
    targets_ptr,
    part_ptr,
    target_logit_ptr,
    rows,
    V,
    stride_row,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    start = seg * SEGMENT
    offsets = tl.arange(0, BLOCK)
    m = float("-inf")
    s = tl.zeros([BLOCK], dtype=tl.float32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for off in tl.range(0, SEGMENT, BLOCK):
        cols = start + off + offsets
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))  # the one reduction of the block
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        total += tl.where(cols < V, x, 0.0)
        m = m_new
    part = seg.to(tl.int64) * rows + row
    segments = tl.num_programs(1)
    tl.store(part_ptr + part, m)
    tl.store(part_ptr + segments * rows + part, tl.sum(s, axis=0))
    tl.store(part_ptr + 2 * segments * rows + part, tl.sum(total, axis=0))
    target = tl.load(targets_ptr + row)
    if (target >= start) & (target < start + SEGMENT):
        tl.store(target_logit_ptr + row, tl.load(row_ptr + target).to(tl.float32))


@triton.jit
def _shifted_exp_vec_kernel(
    logits_ptr,
    targets_ptr,
    part_ptr,
    rows,
    V,
    stride_row,
    LIMIT: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    start = seg * SEGMENT
    offsets = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row)
    c = tl.load(row_ptr + target).to(tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    s_other = tl.zeros([BLOCK], dtype=tl.float32)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for off in tl.range(0, SEGMENT, BLOCK):
        cols = start + off + offsets
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, axis=0)  # the one reduction of the block: the overflow guard
        if block_max > c + LIMIT:
            factor = tl.exp(c - block_max)
            for prev in tl.range(0, off, BLOCK):
                pcols = start + prev + offsets
                e = tl.load(row_ptr + pcols, mask=pcols < V, other=0.0).to(tl.float32)
                e = tl.where(pcols == target, e, e * factor)
                tl.store(row_ptr + pcols, e.to(logits_ptr.dtype.element_ty), mask=pcols < V)
            s *= factor
            s_other *= factor
            c = block_max
        e = tl.exp(x - c)
        is_target = cols == target
        s += e
        s_other += tl.where(is_target, 0.0, e)
        total += tl.where(cols < V, x, 0.0)
        tl.store(row_ptr + cols, tl.where(is_target, x, e).to(logits_ptr.dtype.element_ty), mask=cols < V)
    part = seg.to(tl.int64) * rows + row
    plane = tl.num_programs(1) * rows
    tl.store(part_ptr + part, c)
    tl.store(part_ptr + plane + part, tl.sum(s, axis=0))
    tl.store(part_ptr + 2 * plane + part, tl.sum(s_other, axis=0))
    tl.store(part_ptr + 3 * plane + part, tl.sum(total, axis=0))


def token_logps_vec_(logits, targets, token_logp, row_sum) -> torch.Tensor:
    """``logsumexp_kernel.token_logps_`` with the variant segment kernel (bf16/fp32/fp16 logits)."""
    rows, vocab = logits.shape
    segment, block = logsumexp_kernel.SEGMENT_COLS, min(logsumexp_kernel.BLOCK_V, logsumexp_kernel.SEGMENT_COLS)
    segments = triton.cdiv(vocab, segment)
    lse, target_logit = (torch.empty(rows, device=logits.device) for _ in range(2))
    part = torch.empty(3, segments, rows, device=logits.device)
    _segment_stats_vec_kernel[(rows, segments)](
        logits, targets, part, target_logit, rows, vocab, logits.stride(0),
        SEGMENT=segment, BLOCK=block, num_warps=logsumexp_kernel.NUM_WARPS,
    )  # fmt: skip
    logsumexp_kernel._combine_kernel[(triton.cdiv(rows, logsumexp_kernel.COMBINE_ROWS),)](
        part, lse, row_sum, target_logit, token_logp, rows, segments, ROWS=logsumexp_kernel.COMBINE_ROWS,
        SEGMENTS=triton.next_power_of_2(segments), WRITE_LOGP=True,
    )  # fmt: skip
    return lse


def shifted_exp_vec_(logits, targets, token_logp, row_sum, keep, inv) -> None:
    """``frozen_grad_kernels.shifted_exp_`` with the variant main kernel (bf16/fp32 logits: the target shift)."""
    rows, vocab = logits.shape
    segment, block = (
        frozen_grad_kernels.SEGMENT_COLS,
        min(frozen_grad_kernels.EXP_BLOCK, frozen_grad_kernels.SEGMENT_COLS),
    )
    segments = triton.cdiv(vocab, segment)
    part = torch.empty(4, segments, rows, device=logits.device)
    _shifted_exp_vec_kernel[(rows, segments)](
        logits, targets, part, rows, vocab, logits.stride(0),
        LIMIT=frozen_grad_kernels.SHIFT_LIMIT, SEGMENT=segment, BLOCK=block, num_warps=frozen_grad_kernels.EXP_WARPS,
    )  # fmt: skip
    frozen_grad_kernels._shifted_exp_combine_kernel[(rows,)](
        logits, targets, part, row_sum, token_logp, row_sum, keep, inv, rows, segments, vocab, logits.stride(0),
        SEGMENT=segment, SEGMENTS=triton.next_power_of_2(segments), BLOCK=block, SHIFT_IS_TARGET=True, num_warps=1,
    )  # fmt: skip


def compare(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Largest differences between the shipped passes and the variants on the same logits."""
    rows = logits.shape[0]
    diffs = {}
    outs = [torch.empty(2, rows, device=logits.device) for _ in range(2)]
    lses = [
        fn(logits, targets, *out)
        for fn, out in zip((logsumexp_kernel.token_logps_, token_logps_vec_), outs, strict=True)
    ]
    diffs["lse"] = float((lses[0] - lses[1]).abs().max())
    diffs["lse_logp_sum"] = float((outs[0] - outs[1]).abs().max())
    es = [logits.clone() for _ in range(2)]
    outs = [torch.empty(4, rows, device=logits.device) for _ in range(2)]
    frozen_grad_kernels.shifted_exp_(es[0], targets, *outs[0])
    shifted_exp_vec_(es[1], targets, *outs[1])
    diffs["exp_E"] = float((es[0].float() - es[1].float()).abs().max())
    diffs["exp_outputs"] = float(((outs[0] - outs[1]).abs() / outs[0].abs().clamp(min=1)).max())
    return diffs


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=300, return_mode="median")


def sweep_rows(rows: int, vocab: int) -> dict:
    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda") * 2).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    scratch = torch.empty_like(logits)
    outs = torch.empty(4, rows, device="cuda")
    nbytes = logits.numel() * logits.element_size()
    copy_ms = bench(lambda: scratch.copy_(logits))
    row = {"rows": rows, "copy_tbs": 2 * nbytes / copy_ms / 1e9, **compare(logits, targets)}
    for name, fn in (("lse", logsumexp_kernel.token_logps_), ("lse_vec", token_logps_vec_)):
        row[name + "_ms"] = ms = bench(lambda fn=fn: fn(logits, targets, outs[0], outs[1]))
        row[name + "_tbs"] = nbytes / ms / 1e9
    for name, fn in (("exp", frozen_grad_kernels.shifted_exp_), ("exp_vec", shifted_exp_vec_)):
        row[name + "_ms"] = ms = bench(lambda fn=fn: fn(scratch.copy_(logits), targets, *outs)) - copy_ms
        row[name + "_tbs"] = 2 * nbytes / ms / 1e9
    print(
        f"rows {rows}: copy {row['copy_tbs']:.2f} TB/s | log-sum-exp {row['lse_ms']:.3f} ms "
        f"({row['lse_tbs']:.2f} TB/s) -> variant {row['lse_vec_ms']:.3f} ({row['lse_vec_tbs']:.2f}) | exp "
        f"{row['exp_ms']:.3f} ms ({row['exp_tbs']:.2f} TB/s) -> variant {row['exp_vec_ms']:.3f} "
        f"({row['exp_vec_tbs']:.2f}) | max diff lse {row['lse']:.1e}, E {row['exp_E']:.1e}, "
        f"outputs {row['exp_outputs']:.1e}",
        flush=True,
    )
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=str, default="1023,2046,4092")
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    results = [sweep_rows(int(r), args.vocab) for r in args.rows.split(",")]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
