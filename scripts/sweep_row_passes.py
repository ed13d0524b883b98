"""Sweep the tile constants of the memory-bound row passes (log-sum-exp, a frozen head's shifted exponentials).

    python scripts/sweep_row_passes.py --rows 1023,2046,4092 --json outputs/row_passes.json

For each (segment columns, block columns, warps) it times ``logsumexp_target`` and ``shifted_exp_`` on bf16
``[rows, V]`` logits of std ≈ 2 and prints the bandwidth they reach (bytes read + written over the time): the
passes are pure streams, so the target is the copy bandwidth (``copy`` row, ≈ 3.9–4.0 TB/s on an H200).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from trl_fused_cpo.ops import frozen_grad_kernels, logsumexp_kernel

# (SEGMENT_COLS, BLOCK_V, NUM_WARPS), both passes at once; the first is the log-sum-exp pass's shipped default.
CONFIGS = [
    (8192, 2048, 4),
    (8192, 1024, 4),
    (8192, 2048, 8),
    (8192, 4096, 8),
    (8192, 8192, 8),
    (8192, 8192, 16),
    (4096, 4096, 8),
    (16384, 4096, 8),
    (16384, 8192, 16),
    (32768, 4096, 8),
]


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def use(config: tuple[int, int, int]) -> None:
    """Point both kernels' launchers at ``config`` (they read the module constants at call time)."""
    logsumexp_kernel.SEGMENT_COLS, logsumexp_kernel.BLOCK_V, logsumexp_kernel.NUM_WARPS = config
    frozen_grad_kernels.SEGMENT_COLS, frozen_grad_kernels.EXP_BLOCK, frozen_grad_kernels.EXP_WARPS = config


def sweep_rows(rows: int, vocab: int) -> list[dict]:
    torch.manual_seed(0)
    logits = (torch.randn(rows, vocab, device="cuda") * 2).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    scratch = torch.empty_like(logits)
    outs = torch.empty(4, rows, device="cuda")  # token log-prob, row sum, keep, inv
    nbytes = logits.numel() * logits.element_size()
    copy_ms = bench(lambda: scratch.copy_(logits))
    print(f"rows {rows}: copy {copy_ms:.3f} ms = {2 * nbytes / copy_ms / 1e9:.2f} TB/s")
    results = []
    for config in CONFIGS:
        use(config)
        lse_ms = bench(lambda: logsumexp_kernel.logsumexp_target(logits, targets))
        exp_ms = bench(lambda: frozen_grad_kernels.shifted_exp_(scratch.copy_(logits), targets, *outs)) - copy_ms
        row = {"rows": rows, "segment": config[0], "block": config[1], "warps": config[2]}
        row |= {"lse_ms": lse_ms, "lse_tbs": nbytes / lse_ms / 1e9, "exp_ms": exp_ms}
        row["exp_tbs"] = 2 * nbytes / exp_ms / 1e9
        results.append(row)
        print(
            f"  segment {config[0]:5d} block {config[1]:4d} warps {config[2]:2d}: log-sum-exp {lse_ms:.3f} ms "
            f"({row['lse_tbs']:.2f} TB/s), shifted exp {exp_ms:.3f} ms ({row['exp_tbs']:.2f} TB/s)"
        )
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=str, default="1023,2046,4092")
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    shipped_lse = (logsumexp_kernel.SEGMENT_COLS, logsumexp_kernel.BLOCK_V, logsumexp_kernel.NUM_WARPS)
    shipped_exp = (frozen_grad_kernels.SEGMENT_COLS, frozen_grad_kernels.EXP_BLOCK, frozen_grad_kernels.EXP_WARPS)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        results += sweep_rows(rows, args.vocab)
    logsumexp_kernel.SEGMENT_COLS, logsumexp_kernel.BLOCK_V, logsumexp_kernel.NUM_WARPS = shipped_lse
    frozen_grad_kernels.SEGMENT_COLS, frozen_grad_kernels.EXP_BLOCK, frozen_grad_kernels.EXP_WARPS = shipped_exp
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
