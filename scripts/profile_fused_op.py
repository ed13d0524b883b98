"""Where the fused op's time goes: each stage of one chunk timed alone, and the whole op against the floor.

    python scripts/profile_fused_op.py --batch 16 --chunk-tokens 4096        # H200: ≈ 1 minute
    python scripts/profile_fused_op.py --batch 2 --timeline                  # + the GPU timeline of 3 calls
    python scripts/profile_fused_op.py --quick                               # toy shapes, CPU (interpreter) or GPU

Prints ms per stage for one chunk (logits GEMM, log-sum-exp kernel, softmax-grad kernel, dX GEMM, dW GEMM into
fp32, a frozen head's exponentials pass and its fp32 ``G = E·W`` GEMM), the whole op (forward + backward) for
trainable and frozen heads at their default and a larger budget, and the cuBLAS floor on the same tokens.
``--timeline`` adds a GPU timeline of three back-to-back calls (busy time, idle gaps and which kernels end them):
what the v7 and v15/v16 entries of docs/kernel-notes.md were predicted from. The inputs are the kernel benchmark's
(``bench_common.make_batch``); the side-by-side with peers is scripts/benchmark_kernel.py. A maintained tool: run
it (``gpu_run.sh profile``) before predicting what a kernel change will save.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile

import bench_common as bc
import torch

from trl_fused_cpo import fused_linear_cpo_loss
from trl_fused_cpo.ops import kernels as triton_backend
from trl_fused_cpo.ops.gemm import accumulate_mm, mm_into


def gpu_timeline(fn, name: str, batch: int, calls: int = 3) -> dict:
    """Kernels of ``calls`` back-to-back calls (as do_bench runs them): GPU busy time, span and the idle gaps.

    The op syncs once on the host per call (the token plan), so each call starts with the GPU idle while the host
    plans and launches; the gaps say how long, and which kernel ends them.
    """
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e),
        key=lambda e: e["ts"],
    )
    busy = sum(e["dur"] for e in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    gaps = []
    for prev, nxt in itertools.pairwise(kernels):
        gap = nxt["ts"] - (prev["ts"] + prev["dur"])
        if gap > 5:
            gaps.append((gap, prev["name"][:60], nxt["name"][:60]))
    idle = sum(g for g, _, _ in gaps)
    print(
        f"--- timeline: {name}, B = {batch}, {calls} calls: span {span / 1e3:.3f} ms, kernels {busy / 1e3:.3f} ms, "
        f"{len(kernels)} kernels, idle gaps > 5 us {idle / 1e3:.3f} ms"
    )
    for gap, before, after in sorted(gaps, reverse=True)[:12]:
        print(f"  {gap:8.1f} us idle  after {before}  before {after}")
    top: dict[str, float] = {}
    for e in kernels:
        top[e["name"][:70]] = top.get(e["name"][:70], 0.0) + e["dur"]
    for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {v / 1e3 / calls:8.3f} ms/call  {k}")
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_gaps_ms": idle / 1e3, "calls": calls}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=None, help="sequences, B/2 pairs (default 16)")
    p.add_argument("--seq-len", type=int, default=None, help="T (default 1024)")
    p.add_argument("--hidden", type=int, default=None, help="H (default 4096)")
    p.add_argument("--vocab", type=int, default=None, help="V (default 128256)")
    p.add_argument("--chunk-tokens", type=int, default=None, help="tokens of the one-chunk stage timings (≤ B·T)")
    p.add_argument("--json", default=None, help="write the numbers here")
    p.add_argument(
        "--masked",
        action="store_true",
        help="the benchmark's 40%%-unlabelled labels: each row's first 25%% (prompt) and last 15%% (padding) -100",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="also print a torch.profiler table of one trainable, frozen and no-grad call (CUDA)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also print the GPU timeline of three back-to-back trainable, frozen and no-grad calls: busy time, idle "
        "gaps and time per kernel (CUDA)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: B=2, T=16, H=32, V=512, 16-token chunk")
    args = p.parse_args(argv)
    shape = {"batch": 2, "seq_len": 16, "hidden": 32, "vocab": 512, "chunk_tokens": 16} if args.quick else {}
    shape = {"batch": 16, "seq_len": 1024, "hidden": 4096, "vocab": 128_256, "chunk_tokens": 4096, **shape}
    for key, value in shape.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    dev = bc.pick_device(None)
    cuda = dev.type == "cuda"
    # Off CUDA the kernels run through TRITON_INTERPRET=1, which has no bf16 arithmetic (docs/design.md §5).
    dt = torch.bfloat16 if cuda else torch.float32
    b, t, h, v = args.batch, args.seq_len, args.hidden, args.vocab
    c = min(args.chunk_tokens, b * t)
    weight = bc.make_weight(v, h, dt, dev, seed=0)
    hidden, labels = bc.make_batch(b, t, h, v, dt, dev, masked=args.masked)
    n = int((labels != -100).sum())
    default_warmup, default_rep = (5, 20) if args.quick else (25, 200)

    def bench(fn, warmup: int = default_warmup, rep: int = default_rep) -> float:
        """Median ms (``do_bench`` on CUDA; one timed call after an untimed one on a CPU)."""
        return bc.time_ms(fn, dev, warmup=warmup, rep=rep, cpu_reps=1)

    x = hidden.reshape(-1, h)[:c].contiguous()
    targets = labels.reshape(-1)[:c].clamp(min=0)
    logits = x @ weight.t()
    lse = triton_backend.logsumexp_target(logits, targets)[0]
    coef = torch.full((c,), -1e-3, device=dev)
    acc = torch.zeros(v, h, device=dev, dtype=torch.float32)
    stage = {
        "logits_gemm": bench(lambda: torch.mm(x, weight.t())),
        "logsumexp_kernel": bench(lambda: triton_backend.logsumexp_target(logits, targets)),
        "softmax_grad_kernel": bench(lambda: triton_backend.softmax_grad_(logits, lse, targets, coef)),
        "dx_gemm": bench(lambda: torch.mm(logits, weight)),
        "dw_gemm_fp32_acc": bench(lambda: accumulate_mm(acc, logits.t(), x)),
        "dw_gemm_bf16": bench(lambda: torch.mm(logits.t(), x)),
        "index_select": bench(lambda: hidden.reshape(-1, h).index_select(0, torch.arange(c, device=dev))),
    }
    # A frozen head's one-pass gradient (frozen_grad_kernels.py): exponentials in place, then G = E·W in fp32.
    # shifted_exp_ overwrites its input, so each timed call starts from a copy of the logits (the copy is timed
    # alone and subtracted).
    scratch, products = torch.empty_like(logits), torch.empty(c, h, device=dev, dtype=torch.float32)
    outs = torch.empty(4, c, device=dev)  # token log-prob, row sum, keep, inv
    copy_ms = bench(lambda: scratch.copy_(logits))
    stage["frozen_shifted_exp_kernel"] = (
        bench(lambda: triton_backend.shifted_exp_(scratch.copy_(logits), targets, *outs)) - copy_ms
    )
    stage["frozen_g_gemm_fp32_out"] = bench(lambda: mm_into(products, scratch, weight))
    flops_chunk = 2 * c * v * h
    for k in ("logits_gemm", "dx_gemm", "dw_gemm_fp32_acc", "dw_gemm_bf16", "frozen_g_gemm_fp32_out"):
        stage[k + "_tflops"] = flops_chunk / stage[k] / 1e9

    x_all, w_all = hidden.reshape(-1, h), weight
    g_buf = torch.empty(n, v, device=dev, dtype=dt) if n * v * 2 < 40e9 else None
    floor = {}
    if g_buf is not None:
        xs = x_all[:n]
        floor["trainable"] = bench(
            lambda: (torch.mm(xs, w_all.t(), out=g_buf), torch.mm(g_buf, w_all), torch.mm(g_buf.t(), xs))
        )
        floor["frozen"] = bench(lambda: (torch.mm(xs, w_all.t(), out=g_buf), torch.mm(g_buf, w_all)))
        floor["forward"] = bench(lambda: torch.mm(xs, w_all.t(), out=g_buf))
        del g_buf
    bc.free_memory(dev, collect=False)

    def step(frozen: bool, chunk_bytes=None):
        def fn():
            hidden.requires_grad_(True).grad = None
            weight.requires_grad_(not frozen).grad = None
            fused_linear_cpo_loss(hidden, weight, labels, backend="triton", chunk_bytes=chunk_bytes).loss.backward()

        return fn

    whole = {}
    variants = [("trainable", False, None), ("frozen", True, None)]
    if not args.quick:  # a larger budget than the default: fewer chunks, more memory
        variants += [("trainable_2GiB", False, 2 << 30), ("frozen_1GiB", True, 1 << 30)]
    for name, frozen, cb in variants:
        fn = step(frozen, cb)
        whole[name] = {"ms": bench(fn, warmup=5, rep=40), "peak_gib": bc.peak_gib(fn, dev, (hidden, weight))}
    if (args.trace or args.timeline) and not cuda:
        print("--trace and --timeline need CUDA: skipped")
    if args.trace and cuda:

        def forward_only():
            with torch.no_grad():
                fused_linear_cpo_loss(hidden, weight, labels, backend="triton")

        for name, fn in [("trainable", step(False)), ("frozen", step(True)), ("forward", forward_only)]:
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            ) as prof:
                fn()
                torch.cuda.synchronize()
            print(f"--- trace: {name}, B = {b}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=70))
            if args.json:
                prof.export_chrome_trace(args.json.replace(".json", f"_{name}_trace.json"))
    if args.timeline and cuda:

        def no_grad_call():
            with torch.no_grad():
                fused_linear_cpo_loss(hidden, weight, labels, backend="triton")

        for name, fn in [("trainable", step(False)), ("frozen", step(True)), ("forward", no_grad_call)]:
            whole[name + "_timeline"] = gpu_timeline(fn, name, b)
    with torch.no_grad():
        whole["forward"] = {"ms": bench(lambda: fused_linear_cpo_loss(hidden, weight, labels, backend="triton"), 5, 40)}
    result = {
        **bc.run_record(dev),
        "shape": vars(args),
        "labelled_tokens": n,
        "stage_ms_one_chunk": stage,
        "floor_ms": floor,
        "fused": whole,
    }
    for k, f in floor.items():
        if k in whole:
            whole[k]["x_floor"] = whole[k]["ms"] / f
    print(json.dumps(result, indent=1))
    if args.json:
        bc.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
