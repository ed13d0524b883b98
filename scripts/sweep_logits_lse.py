"""Experiment (v6 in docs/kernel-notes.md): the logits GEMM with the log-sum-exp pass in its epilogue, in Triton.

    python scripts/sweep_logits_lse.py --tokens 2046,4092,8184 --json sweep.json

The op keeps each chunk's row statistics (log-sum-exp, target logit, sum) in a separate pass over the stored
logits: 1 GiB read per 4,096 Llama-3 tokens, 0.31-0.35 ms, ≈ 5% of the logits GEMM. Here a persistent,
TMA-fed Triton GEMM computes them from each ``[BM, BN]`` accumulator tile while it is still in registers (per-row
max, ``Σ exp(z − max)`` and sum per vocabulary tile; a tiny kernel folds the ``V / BN`` partials), and eval need
not write the logits at all. It is not in the op: on the H200 (Triton 3.6, no warp specialisation on Hopper)
the GEMM runs at 590-650 TFLOP/s against cuBLAS's 675-716, and that 7-12% outweighs the pass it removes: the
fused kernel measured 0.98-1.06× cuBLAS + pass (``docs/results/logits_lse_sweep/``). Kept, with its sweep, to
re-measure when Triton's Hopper GEMM catches up or on a GPU where it has warp specialisation.

For each token count: cuBLAS ``x·Wᵀ`` alone, cuBLAS + the op's log-sum-exp pass, then the fused kernel, writing
the logits and not (eval), at each tile config; ms, TFLOP/s of the product, and the largest error of
lse / target logit / sum against torch on the same bf16 logits.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from trl_fused_cpo.ops import rows_triton

# The defaults: the best at 4,092 tokens in the first sweep (the second's best was within 0.3%); CONFIGS overrides them.
BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, NUM_WARPS = 128, 256, 64, 8, 3, 8
STORE_MODE, FLATTEN = 1, True  # how the logits are written (the kernel's STORE), and whether tiles pipeline
EVAL_STAGES = 4  # no logits tile in shared memory: room for one more stage
COMBINE_ROWS, COMBINE_TILES = 64, 64


@triton.jit
def _logits_lse_kernel(
    x_desc,
    w_desc,
    out_desc,
    bias_ptr,
    targets_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_total_ptr,
    target_logit_ptr,
    M,
    N,
    K,
    num_targets,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STORE: tl.constexpr,  # 0: no logits (eval), 1: through the copy engine (shared memory), 2: plain stores
    FLATTEN: tl.constexpr,
    out_ptr,
    stride_out,
):
    start = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    per_group = GROUP * tiles_n
    # Rows fastest within a group of GROUP row tiles: the programs in flight share a few W slabs and GROUP·BM rows
    # of x, so W is read from memory about once per group.
    for tile in tl.range(start, tiles_m * tiles_n, NUM_PROGRAMS, flatten=FLATTEN):
        group = tile // per_group
        first_m = group * GROUP
        size_m = min(tiles_m - first_m, GROUP)
        pid_m = first_m + (tile % per_group) % size_m
        pid_n = (tile % per_group) // size_m
        off_m = pid_m * BM
        off_n = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(k_steps):
            a = x_desc.load([off_m, k * BK])
            b = w_desc.load([off_n, k * BK])
            acc = tl.dot(a, b.T, acc)
        cols = off_n + tl.arange(0, BN)
        rows = off_m + tl.arange(0, BM)
        in_vocab = (cols < N)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        # The statistics of the rounded logits, as torch computes them: the gradient pass reads the rounded ones,
        # and a softmax normalised by the exact log-sum-exp would not sum to one over them (≈ 3e-3 off in bf16).
        rounded = acc.to(x_desc.dtype)
        in_rows = rows < M
        if STORE == 1:
            out_desc.store([off_m, off_n], rounded)  # the copy engine clips the tails
        if STORE == 2:
            ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
            tl.store(ptrs, rounded, mask=in_rows[:, None] & in_vocab)
        acc = rounded.to(tl.float32)
        z = tl.where(in_vocab, acc, float("-inf"))
        tile_max = tl.max(z, axis=1)
        tile_sum = tl.sum(tl.exp(z - tile_max[:, None]), axis=1)
        tile_total = tl.sum(tl.where(in_vocab, acc, 0.0), axis=1)
        target = tl.load(targets_ptr + rows, mask=rows < num_targets, other=-1)
        hit = cols[None, :] == target[:, None]
        target_here = in_rows & (target >= off_n) & (target < off_n + BN)
        part = pid_n.to(tl.int64) * M + rows
        tl.store(part_max_ptr + part, tile_max, mask=in_rows)
        tl.store(part_sum_ptr + part, tile_sum, mask=in_rows)
        tl.store(part_total_ptr + part, tile_total, mask=in_rows)
        tl.store(target_logit_ptr + rows, tl.sum(tl.where(hit, acc, 0.0), axis=1), mask=target_here)


@triton.jit
def _combine_kernel(
    part_max_ptr,
    part_sum_ptr,
    part_total_ptr,
    lse_ptr,
    row_sum_ptr,
    M,
    TILES,
    ROWS: tl.constexpr,
    BT: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < M
    m = tl.full((ROWS,), float("-inf"), tl.float32)
    s = tl.zeros((ROWS,), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    for t0 in range(0, TILES, BT):
        t = t0 + tl.arange(0, BT)
        offs = t.to(tl.int64)[:, None] * M + rows[None, :]
        mask = (t < TILES)[:, None] & in_rows[None, :]
        pm = tl.load(part_max_ptr + offs, mask=mask, other=float("-inf"))
        ps = tl.load(part_sum_ptr + offs, mask=mask, other=0.0)
        total += tl.sum(tl.load(part_total_ptr + offs, mask=mask, other=0.0), axis=0)
        m_new = tl.maximum(m, tl.max(pm, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(ps * tl.exp(pm - m_new[None, :]), axis=0)
        m = m_new
    tl.store(lse_ptr + rows, m + tl.log(s), mask=in_rows)
    tl.store(row_sum_ptr + rows, total, mask=in_rows)


def logits_logsumexp(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    store_logits: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits [C, V] or None, lse, target_logit, row_sum)`` (float32 ``[C]``) of ``x [C, H] · weightᵀ (+ bias)``.

    ``targets`` holds the first ``T ≤ C`` rows' labels; the rest (the unlabelled-sum rows, which only need their
    sum) have none, and their target logit is left unset. The logits buffer's rows are padded to 16 bytes (a view
    of ``[C, V]``, row stride ``≥ V``).
    """
    rows, hidden = x.shape
    vocab = weight.shape[0]
    device = x.device
    stride = -(-vocab // 8) * 8
    logits = torch.empty(rows, stride, device=device, dtype=x.dtype)[:, :vocab] if store_logits else None
    tiles_n = triton.cdiv(vocab, BLOCK_N)
    part = torch.empty(3, tiles_n, rows, device=device, dtype=torch.float32)
    lse = torch.empty(rows, device=device, dtype=torch.float32)
    target_logit = torch.empty_like(lse)
    row_sum = torch.empty_like(lse)
    if rows == 0:
        return logits, lse, target_logit, row_sum
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # the copy engine wants 16-byte aligned rows
    from triton.tools.tensor_descriptor import TensorDescriptor

    x_desc = TensorDescriptor.from_tensor(x, [BLOCK_M, BLOCK_K])
    w_desc = TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K])
    # Eval writes nothing through out_desc: any valid descriptor of the right block shape will do.
    out = logits if store_logits else torch.empty(BLOCK_M, BLOCK_N, device=device, dtype=x.dtype)
    out_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), [BLOCK_M, BLOCK_N])
    tiles = triton.cdiv(rows, BLOCK_M) * tiles_n
    sms = torch.cuda.get_device_properties(device).multi_processor_count if x.is_cuda else 4  # 4: the interpreter
    programs = min(sms, tiles)
    _logits_lse_kernel[(programs,)](
        x_desc,
        w_desc,
        out_desc,
        bias if bias is not None else x,
        targets,
        part[0],
        part[1],
        part[2],
        target_logit,
        rows,
        vocab,
        hidden,
        targets.shape[0],
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
        GROUP=GROUP_M,
        NUM_PROGRAMS=programs,
        HAS_BIAS=bias is not None,
        STORE=STORE_MODE if store_logits else 0,
        FLATTEN=FLATTEN,
        out_ptr=out,
        stride_out=out.stride(0),
        num_stages=NUM_STAGES if store_logits else EVAL_STAGES,
        num_warps=NUM_WARPS,
    )
    _combine_kernel[(triton.cdiv(rows, COMBINE_ROWS),)](
        part[0], part[1], part[2], lse, row_sum, rows, tiles_n, ROWS=COMBINE_ROWS, BT=COMBINE_TILES, num_warps=4
    )
    return logits, lse, target_logit, row_sum


CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, NUM_WARPS, STORE_MODE, FLATTEN, EVAL_STAGES)
    (128, 256, 64, 8, 3, 8, 1, True, 4),
    (128, 256, 64, 8, 4, 8, 2, True, 3),
    (128, 256, 64, 8, 3, 8, 2, True, 4),
    (128, 256, 64, 8, 3, 8, 1, False, 4),
    (128, 256, 64, 16, 3, 8, 1, True, 5),
    (128, 256, 64, 4, 3, 8, 1, True, 4),
    (256, 128, 64, 8, 4, 8, 2, True, 4),
]
NAMES = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "NUM_STAGES", "NUM_WARPS", "STORE_MODE", "FLATTEN", "EVAL_STAGES")


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2046,4092,8184")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--configs", type=int, default=len(CONFIGS), help="how many of CONFIGS to try")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dev, dt, h, v = "cuda", torch.bfloat16, args.hidden, args.vocab
    torch.manual_seed(0)
    weight = (torch.randn(v, h, device=dev) * (2 / h**0.5)).to(dt)
    module = sys.modules[__name__]
    default = tuple(getattr(module, n) for n in NAMES)
    results = []
    for c in (int(s) for s in args.tokens.split(",")):
        x = torch.randn(c, h, device=dev, dtype=dt)
        targets = torch.randint(0, v, (c,), device=dev)
        flop = 2 * c * v * h
        ref = (x @ weight.t()).float()
        ref_stats = (torch.logsumexp(ref, -1), ref.gather(1, targets[:, None])[:, 0], ref.sum(-1))
        logits = torch.mm(x, weight.t())
        row = {"tokens": c, "cublas_ms": bench(lambda x=x: torch.mm(x, weight.t()))}
        row["cublas_lse_ms"] = bench(lambda x=x, t=targets: rows_triton.logsumexp_target(torch.mm(x, weight.t()), t))
        row["lse_pass_ms"] = bench(lambda z=logits, t=targets: rows_triton.logsumexp_target(z, t))
        del logits
        print(
            f"C={c}: cuBLAS {row['cublas_ms']:.3f} ms ({flop / row['cublas_ms'] / 1e9:.0f} TFLOP/s), "
            f"+ lse pass {row['cublas_lse_ms']:.3f} ms (pass alone {row['lse_pass_ms']:.3f})"
        )
        row["configs"] = []
        for cfg in CONFIGS[: args.configs]:
            for name, value in zip(NAMES, cfg, strict=True):
                setattr(module, name, value)
            entry = {"config": cfg}
            try:
                out, *stats = logits_logsumexp(x, weight, None, targets)
                entry["max_err"] = [float((a - b).abs().max()) for a, b in zip(stats, ref_stats, strict=True)]
                entry["logits_err"] = float((out.float() - ref).abs().max())
                del out
                entry["fused_ms"] = bench(lambda x=x, t=targets: logits_logsumexp(x, weight, None, t))
                entry["fused_eval_ms"] = bench(
                    lambda x=x, t=targets: logits_logsumexp(x, weight, None, t, store_logits=False)
                )
            except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
                entry["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"  {cfg}: {entry['error']}")
                row["configs"].append(entry)
                continue
            print(
                f"  {cfg}: fused {entry['fused_ms']:.3f} ms ({flop / entry['fused_ms'] / 1e9:.0f} TFLOP/s, "
                f"{entry['fused_ms'] / row['cublas_lse_ms']:.3f}× cuBLAS+pass), eval {entry['fused_eval_ms']:.3f} ms; "
                f"err lse/target/sum {entry['max_err'][0]:.1e}/{entry['max_err'][1]:.1e}/{entry['max_err'][2]:.1e}, "
                f"logits {entry['logits_err']:.1e}"
            )
            row["configs"].append(entry)
        results.append(row)
    for name, value in zip(NAMES, default, strict=True):
        setattr(module, name, value)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    report["results"] = results
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
