"""Experiment (v13 candidate in docs/kernel-notes.md): a frozen head's exponentials in a Triton logits GEMM's epilogue.

    python scripts/sweep_exp_epilogue.py --tokens 1023,1228,2046 --json sweep.json

A frozen call spends ≈ 5% of its floor on ``shifted_exp_``: a read and a write of each slice's logits to turn them
into ``E = exp(z − c)`` (c: the row's target logit). Here the logits GEMM does it while each ``[BM, BN]`` tile is
still in registers: it rounds the tile to bf16 (the logits torch would store), writes ``E`` with the target
column 0, and stores per-tile partials (``Σ E``, the row's logit sum, the raw target logit); a small kernel folds
them into the four per-token outputs of ``shifted_exp_``. The shift must be known before the GEMM: here a gathered
dot product ``x · W[target]`` (timed as part of the fused path). A tile whose max exceeds ``c + 64`` would overflow;
it raises a flag, on which the op would redo the slice the safe way (the inputs here never do).

v6 measured Triton 3.6's GEMM here at 590-650 TFLOP/s against cuBLAS's 675-716 without warp specialisation. Triton
has had Hopper warp specialisation (``tl.range(..., warp_specialize=True)``) since mid-2025; each config is tried
with it off and on. For each token count: cuBLAS ``x·Wᵀ`` alone, cuBLAS + ``shifted_exp_`` (the op's path), then
per config the Triton GEMM alone (plain bf16 store) and the fused exp path; ms, TFLOP/s of the product, and the
largest differences from the op's path.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from trl_fused_cpo.ops import rows_triton
from trl_fused_cpo.ops.frozen_grad_kernels import SHIFT_LIMIT

COMBINE_ROWS, COMBINE_TILES = 64, 64
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_STAGES, NUM_WARPS, WARP_SPECIALIZE, PERSISTENT); Hopper's warp
# specialisation needs the tile loop unflattened, so FLATTEN = not WARP_SPECIALIZE. Not persistent: one program a
# tile, and programs small enough that two share an SM (one's epilogue under the other's products).
CONFIGS = [
    (128, 256, 64, 8, 3, 8, False, True),  # v6's best
    (128, 256, 64, 8, 3, 8, True, True),
    (128, 256, 64, 8, 4, 8, True, True),
    (128, 256, 64, 8, 3, 4, True, True),
    (128, 128, 64, 8, 4, 4, True, True),
    (128, 128, 64, 8, 5, 8, True, True),
    (256, 128, 64, 8, 3, 8, True, True),
    (128, 256, 64, 16, 3, 8, True, True),
    (128, 128, 64, 8, 2, 4, False, False),
    (128, 128, 64, 8, 2, 8, False, False),
    (64, 256, 64, 8, 2, 4, False, False),
    (128, 128, 64, 8, 3, 4, False, False),
]
NAMES = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "NUM_STAGES", "NUM_WARPS", "WARP_SPECIALIZE", "PERSISTENT")


@triton.jit
def _logits_exp_kernel(
    x_desc,
    w_desc,
    out_desc,
    shift_ptr,
    targets_ptr,
    part_ptr,
    target_logit_ptr,
    flag_ptr,
    M,
    N,
    K,
    LIMIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    LEVEL: tl.constexpr,  # 0: the plain GEMM (bf16 logits); 1: + exp; 2: + the target's zero; 3: + sums; 4: + flag
    WS: tl.constexpr,
):
    start = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    per_group = GROUP * tiles_n
    plane = tiles_n * M
    for tile in tl.range(start, tiles_m * tiles_n, NUM_PROGRAMS, flatten=not WS, warp_specialize=WS):
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
        if LEVEL > 0:
            z = acc.to(out_desc.dtype).to(tl.float32)  # the logits torch would store
            rows = off_m + tl.arange(0, BM)
            cols = off_n + tl.arange(0, BN)
            in_rows = rows < M
            in_vocab = (cols < N)[None, :]
            c = tl.load(shift_ptr + rows, mask=in_rows, other=0.0)
            e = tl.exp(z - c[:, None])
            if LEVEL > 1:
                target = tl.load(targets_ptr + rows, mask=in_rows, other=-1).to(tl.int32)
                hit = cols[None, :] == target[:, None]
                e = tl.where(hit | ~in_vocab, 0.0, e)
                if LEVEL > 2:
                    part = pid_n.to(tl.int64) * M + rows
                    tl.store(part_ptr + part, tl.sum(e, axis=1), mask=in_rows)
                    tl.store(part_ptr + plane + part, tl.sum(tl.where(in_vocab, z, 0.0), axis=1), mask=in_rows)
                    target_here = in_rows & (target >= off_n) & (target < off_n + BN)
                    tl.store(target_logit_ptr + rows, tl.sum(tl.where(hit, z, 0.0), axis=1), mask=target_here)
                    if LEVEL > 3:
                        over = tl.max(tl.where(in_vocab, z, float("-inf")), axis=1) > c + LIMIT
                        if tl.max(over.to(tl.int32), axis=0) > 0:  # rare: the op would redo the slice the safe way
                            tl.store(flag_ptr, 1)
            out_desc.store([off_m, off_n], e.to(out_desc.dtype))
        else:
            out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


@triton.jit
def _combine_kernel(
    part_ptr,
    target_logit_ptr,
    shift_ptr,
    logp_ptr,
    row_sum_ptr,
    keep_ptr,
    inv_ptr,
    M,
    TILES,
    ROWS: tl.constexpr,
    BT: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_rows = rows < M
    s_other = tl.zeros((ROWS,), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    for t0 in range(0, TILES, BT):
        t = t0 + tl.arange(0, BT)
        offs = t.to(tl.int64)[:, None] * M + rows[None, :]
        mask = (t < TILES)[:, None] & in_rows[None, :]
        s_other += tl.sum(tl.load(part_ptr + offs, mask=mask, other=0.0), axis=0)
        total += tl.sum(tl.load(part_ptr + TILES * M + offs, mask=mask, other=0.0), axis=0)
    c = tl.load(shift_ptr + rows, mask=in_rows, other=0.0)
    zt = tl.load(target_logit_ptr + rows, mask=in_rows, other=0.0)
    s = s_other + tl.exp(zt - c)
    tl.store(logp_ptr + rows, zt - (c + tl.log(s)), mask=in_rows)
    tl.store(row_sum_ptr + rows, total, mask=in_rows)
    tl.store(keep_ptr + rows, s_other / s, mask=in_rows)
    tl.store(inv_ptr + rows, 1.0 / s, mask=in_rows)


def target_shift(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's target logit ``x · W[target]`` in fp32, rounded as the stored logits are (the GEMM's shift)."""
    w_t = weight.index_select(0, targets)
    return torch.bmm(x[:, None, :], w_t[:, :, None])[:, 0, 0].float()


def logits_exp(x, weight, targets, cfg, *, level: int = 4):
    """``(E [C, V], (logp, row_sum, keep, inv), flag)`` of the fused path; ``level`` < 4: part of the epilogue only."""
    bm, bn, bk, group, stages, warps, ws, persistent = cfg
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, _ = x.shape
    vocab = weight.shape[0]
    stride = -(-vocab // 8) * 8  # 16-byte rows for the copy engine
    out = torch.empty(rows, stride, device=x.device, dtype=x.dtype)[:, :vocab]
    tiles_n = triton.cdiv(vocab, bn)
    part = torch.empty(2, tiles_n, rows, device=x.device, dtype=torch.float32)
    stats = torch.empty(6, rows, device=x.device, dtype=torch.float32)  # shift, target logit, the four outputs
    flag = torch.zeros(1, device=x.device, dtype=torch.int32)
    if level:
        stats[0] = target_shift(x, weight, targets)
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    out_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), [bm, bn])
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4  # 4: the interpreter
    tiles = triton.cdiv(rows, bm) * tiles_n
    programs = min(sms, tiles) if persistent else tiles
    _logits_exp_kernel[(programs,)](
        x_desc, w_desc, out_desc, stats[0], targets, part, stats[1], flag, rows, vocab, x.shape[1],
        LIMIT=SHIFT_LIMIT, BM=bm, BN=bn, BK=bk, GROUP=group, NUM_PROGRAMS=programs, LEVEL=level, WS=ws,
        num_stages=stages, num_warps=warps,
    )  # fmt: skip
    if level > 2:
        _combine_kernel[(triton.cdiv(rows, COMBINE_ROWS),)](
            part, stats[1], stats[0], stats[2], stats[3], stats[4], stats[5], rows, tiles_n,
            ROWS=COMBINE_ROWS, BT=COMBINE_TILES, num_warps=4,
        )  # fmt: skip
    return out, tuple(stats[2:]), flag


def op_path(x, weight, targets):
    """The op's path: cuBLAS logits, then ``shifted_exp_`` in place."""
    logits = torch.mm(x, weight.t())
    outs = tuple(torch.empty(x.shape[0], device=x.device, dtype=torch.float32) for _ in range(4))
    rows_triton.shifted_exp_(logits, targets, *outs)
    return logits, outs


def bench(fn, rep: int) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1023,1228,2046")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--configs", type=int, default=len(CONFIGS), help="how many of CONFIGS to try")
    p.add_argument("--config-ids", default="", help="which of CONFIGS to try (comma-separated indices)")
    p.add_argument("--levels", default="", help="epilogue levels 1-3 to time too (1: exp, 2: + zero, 3: + sums)")
    p.add_argument("--rep", type=int, default=400, help="ms per timing")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.levels = [int(lv) for lv in args.levels.split(",") if lv]
    configs = [CONFIGS[int(i)] for i in args.config_ids.split(",")] if args.config_ids else CONFIGS[: args.configs]
    dev, dt, h, v = "cuda", torch.bfloat16, args.hidden, args.vocab
    torch.manual_seed(0)
    weight = (torch.randn(v, h, device=dev) * (2 / h**0.5)).to(dt)  # logits with std ≈ 2, as the benchmark's
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    report["names"], report["results"] = NAMES, []
    warm = torch.randn(2046, h, device=dev, dtype=dt)
    bench(
        lambda warm=warm: torch.mm(warm, weight.t()), 2000
    )  # the clocks settle under sustained load before anything is timed
    del warm
    for c in (int(s) for s in args.tokens.split(",")):
        x = torch.randn(c, h, device=dev, dtype=dt)
        targets = torch.randint(0, v, (c,), device=dev)
        flop = 2 * c * v * h
        ref_e, ref_stats = op_path(x, weight, targets)
        row = {"tokens": c, "cublas_ms": bench(lambda x=x: torch.mm(x, weight.t()), args.rep)}
        row["op_path_ms"] = bench(lambda x=x, t=targets: op_path(x, weight, t), args.rep)
        row["shift_ms"] = bench(lambda x=x, t=targets: target_shift(x, weight, t), args.rep)
        print(
            f"C={c}: cuBLAS {row['cublas_ms']:.3f} ms ({flop / row['cublas_ms'] / 1e9:.0f} TFLOP/s), + shifted_exp_ "
            f"{row['op_path_ms']:.3f} ms; the shift's dot products {row['shift_ms']:.3f} ms"
        )
        row["configs"] = []
        for cfg in configs:
            entry = {"config": cfg}
            try:
                e, stats, flag = logits_exp(x, weight, targets, cfg)
                entry["flag"] = int(flag.item())
                entry["e_err"] = float((e.float() - ref_e.float()).abs().max())
                entry["stat_err"] = [float((a - b).abs().max()) for a, b in zip(stats, ref_stats, strict=True)]
                del e
                entry["gemm_ms"] = bench(
                    lambda x=x, t=targets, cfg=cfg: logits_exp(x, weight, t, cfg, level=0), args.rep
                )
                for level in args.levels:  # the epilogue's pieces: what each costs
                    entry[f"level{level}_ms"] = bench(
                        lambda x=x, t=targets, cfg=cfg, lv=level: logits_exp(x, weight, t, cfg, level=lv), args.rep
                    )
                entry["fused_ms"] = bench(lambda x=x, t=targets, cfg=cfg: logits_exp(x, weight, t, cfg), args.rep)
            except Exception as err:  # a config that does not compile (shared memory, WS) is reported, not fatal
                entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                print(f"  {cfg}: {entry['error']}")
                row["configs"].append(entry)
                continue
            print(
                f"  {cfg}: GEMM {entry['gemm_ms']:.3f} ms ({flop / entry['gemm_ms'] / 1e9:.0f} TFLOP/s, "
                f"{entry['gemm_ms'] / row['cublas_ms']:.3f}× cuBLAS); "
                + "".join(f"level {lv} {entry[f'level{lv}_ms']:.3f} ms; " for lv in args.levels)
                + f"fused {entry['fused_ms']:.3f} ms "
                f"({entry['fused_ms'] / row['op_path_ms']:.3f}× the op's path); E err {entry['e_err']:.1e}, "
                f"logp/sum/keep/inv err " + "/".join(f"{s:.1e}" for s in entry["stat_err"]) + f", flag {entry['flag']}"
            )
            row["configs"].append(entry)
        report["results"].append(row)
        if args.json:  # after each token count: a call cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
