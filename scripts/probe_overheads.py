"""What the fused op spends beyond its GEMMs, measured under the benchmark's sustained timing (H200 diagnostics).

    python scripts/probe_overheads.py --json probe.json

Three questions, each answered with numbers rather than a profiler trace (CUPTI slows the host and inflates
every launch gap):
- Is a call host-bound? The host's time to enqueue one call (from its start to its return, the GPU idle at the
  start) against the GPU time of the same call under ``do_bench``.
- What does the plan's one host sync cost? The same op with the plan of the first call reused (no sync: the
  host runs ahead). Only valid because the labels do not change between calls; a diagnostic, not a mode.
- How fast is each GEMM of a slice at M rows? cuBLAS picks its kernel by shape: ``M = 1024`` ran 3% slower per row
  than 1026 (first run, 2026-12-04), and ``M = 2048 + 2`` costs what 2048 does (the 2B extra rows are free).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import triton

from trl_fused_cpo import fused_linear_cpo_loss
from trl_fused_cpo.ops import function
from trl_fused_cpo.ops.gemm import mm_into


def bench(fn, warmup: int, rep: int) -> float:
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def host_enqueue_ms(fn, calls: int = 30) -> float:
    """Median host time of one call that starts on an idle GPU (its own sync included, not the GPU's tail)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


class ReusedPlan:
    """Patch ``function.plan_tokens`` to return the first call's plan: no host sync after the first call."""

    def __init__(self):
        self.plan = None
        self.original = function.plan_tokens

    def __call__(self, *args, **kwargs):
        if self.plan is None:
            self.plan = self.original(*args, **kwargs)
        return self.plan

    def __enter__(self):
        function.plan_tokens = self
        return self

    def __exit__(self, *exc):
        function.plan_tokens = self.original


def probe_batch(b: int, args: argparse.Namespace, weight: torch.Tensor, result: dict) -> None:
    """Frozen and forward at one B: floor, op, op without the plan's sync, host enqueue time."""
    dev = weight.device
    dt = weight.dtype
    hidden = torch.randn(b, args.seq_len, args.hidden, device=dev).to(dt)
    labels = torch.randint(0, args.vocab, (b, args.seq_len), device=dev)
    xs = hidden.detach().reshape(-1, args.hidden)
    logits = torch.empty(xs.shape[0], args.vocab, device=dev, dtype=dt)
    dx = torch.empty_like(xs)

    def frozen():
        hidden.requires_grad_(True).grad = None
        fused_linear_cpo_loss(hidden, weight, labels, beta=0.1, cpo_alpha=1.0, backend="triton").loss.backward()

    def forward():
        with torch.no_grad():
            fused_linear_cpo_loss(hidden.detach(), weight, labels, beta=0.1, cpo_alpha=1.0, backend="triton")

    floors = {
        "frozen": lambda: (torch.mm(xs, weight.t(), out=logits), torch.mm(logits, weight, out=dx)),
        "forward": lambda: torch.mm(xs, weight.t(), out=logits),
    }
    for name, fn in (("frozen", frozen), ("forward", forward)):
        row = {"workload": name, "B": b, "floor_ms": bench(floors[name], args.warmup, args.rep)}
        row["ms"] = bench(fn, args.warmup, args.rep)
        row["host_ms"] = host_enqueue_ms(fn)
        with ReusedPlan():
            row["no_sync_ms"] = bench(fn, args.warmup, args.rep)
            row["no_sync_host_ms"] = host_enqueue_ms(fn)
        row["floor_again_ms"] = bench(floors[name], args.warmup, args.rep)
        row["x_floor"] = row["ms"] / row["floor_ms"]
        row["no_sync_x_floor"] = row["no_sync_ms"] / row["floor_ms"]
        result["ops"].append(row)
        if b == args.profile_batch:
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                fn()
                torch.cuda.synchronize()
            print(f"--- host profile: {name}, B = {b}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(
            f"{name:8s} B={b:2d}  floor {row['floor_ms']:.3f} (again {row['floor_again_ms']:.3f})  "
            f"op {row['ms']:.3f} (x{row['x_floor']:.3f})  no-sync {row['no_sync_ms']:.3f} "
            f"(x{row['no_sync_x_floor']:.3f})  host {row['host_ms']:.3f} / no-sync host "
            f"{row['no_sync_host_ms']:.3f} ms",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="2,4,8")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--rep", type=int, default=1500)
    ap.add_argument("--gemm-rows", default="896,960,1008,1016,1024,1032,1040,1056,1228,2048,2064,4096,4112")
    ap.add_argument("--profile-batch", type=int, default=4, help="print a host-side profile of one call at this B")
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    torch.manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, device=dev) * (2 / args.hidden**0.5)).to(dt)
    result: dict = {"ops": [], "gemm_rows": {}}

    for b in [int(s) for s in args.batches.split(",") if s]:
        probe_batch(b, args, weight, result)
        torch.cuda.empty_cache()

    # Both GEMMs of a frozen slice: logits [M, H]·[H, V] (bf16 out) and the products [M, V]·[V, H] (fp32 out).
    row_counts = [int(s) for s in args.gemm_rows.split(",") if s]
    x_all = torch.randn(max(row_counts, default=1), args.hidden, device=dev).to(dt)
    for m in row_counts:
        x = x_all[:m]
        out = torch.empty(m, args.vocab, device=dev, dtype=dt)
        prod = torch.empty(m, args.hidden, device=dev, dtype=torch.float32)
        ms = bench(lambda x=x, out=out: torch.mm(x, weight.t(), out=out), 100, 600)
        prod_ms = bench(lambda out=out, prod=prod: mm_into(prod, out, weight), 100, 600)
        flops = 2 * m * args.vocab * args.hidden
        result["gemm_rows"][m] = {"logits_ms": ms, "products_ms": prod_ms}
        print(
            f"M={m:5d}: logits GEMM {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s, {ms / m * 1e3:.3f} us/row)  "
            f"products GEMM {prod_ms:.3f} ms ({flops / prod_ms / 1e9:.0f} TFLOP/s, {prod_ms / m * 1e3:.3f} us/row)",
            flush=True,
        )
        del out, prod
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
