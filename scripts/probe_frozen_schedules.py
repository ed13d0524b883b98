"""Where a frozen-head call's time goes beyond the floor, and whether vocabulary slabs would beat token slices.

    python scripts/probe_frozen_schedules.py --json probe_frozen.json

On the benchmark's frozen inputs (``benchmark_kernel.make_batch``/``make_weight``: every position labelled, logits
std ≈ 2), each timed the benchmark's way (``do_bench`` median over seconds of back-to-back calls, so the GPU is as
hot as in the benchmark):
- ``floor``: the two GEMMs over every token at once (the benchmark's floor);
- ``slices``: the same GEMMs slice by slice as the op runs them (1,024 rows of a pair, products into fp32), then
  ``+exp``: with the op's exponentials pass between them, and ``op``: the fused op itself. The steps apart are the
  cost of slicing, of the exp pass, and of everything else;
- ``slabs M``: the alternative for a frozen head, all of ``M`` tokens at once and the vocabulary in slabs whose
  logits fit the same buffer, the products summed over the slabs in fp32 (cuBLAS ``beta = 1``); then ``+exp`` with
  the same pass per slab. A timing model only: a slab's exponentials here use the clamped local target as their
  shift, which costs the same but is not the op's math.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmark_kernel import make_batch, make_weight  # noqa: E402

from trl_fused_cpo import fused_linear_cpo_loss  # noqa: E402
from trl_fused_cpo.ops import rows_triton  # noqa: E402
from trl_fused_cpo.ops.gemm import accumulate_mm, mm_into  # noqa: E402


def bench(fn, args) -> float:
    return float(triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))


def sliced(x, weight, logits, prod, targets, scratch, rows: int, with_exp: bool):
    """The op's frozen GEMMs: slices of ``rows`` tokens, logits into one buffer, products into fp32."""

    def step():
        for s in range(0, x.shape[0], rows):
            e = min(s + rows, x.shape[0])
            buf = logits[: e - s]
            torch.mm(x[s:e], weight.t(), out=buf)
            if with_exp:
                rows_triton.shifted_exp_(buf, targets[s:e], *(t[: e - s] for t in scratch))
            mm_into(prod[s:e], buf, weight)

    return step


def slabbed(x, weight, logits_store, g, targets, scratch, width: int, with_exp: bool):
    """All of ``x`` at once, the vocabulary in slabs of ``width`` columns, ``G = Σ_slab E·W`` in fp32."""
    vocab = weight.shape[0]
    m = x.shape[0]

    def step():
        for j, s in enumerate(range(0, vocab, width)):
            e = min(s + width, vocab)
            buf = logits_store[: m * (e - s)].view(m, e - s)
            torch.mm(x, weight[s:e].t(), out=buf)
            if with_exp:
                local = (targets - s).clamp_(0, e - s - 1)
                rows_triton.shifted_exp_(buf, local, *scratch)
            accumulate_mm(g, buf, weight[s:e], first=j == 0)

    return step


def even_slab_width(vocab: int, rows: int, budget_elems: int, align: int = 32) -> int:
    """The fewest slabs of equal width (a multiple of ``align``) whose ``[rows, width]`` logits fit the budget."""
    count = -(-vocab * rows // budget_elems)
    while True:
        per_slab = -(-vocab // count)
        width = -(-per_slab // align) * align
        if rows * width <= budget_elems:
            return width
        count += 1


def probe(b: int, args, weight: torch.Tensor) -> list[dict]:
    dev = weight.device
    hidden, labels = make_batch(b, args, masked=False, dtype=weight.dtype, device=dev)
    x = hidden.detach().reshape(-1, args.hidden)
    n, vocab = x.shape[0], weight.shape[0]
    targets = labels.reshape(-1)
    slice_rows = args.seq_len  # a pair of 2T tokens in the 384 MiB default: two slices of T
    budget_elems = slice_rows * vocab  # the op's logits buffer
    logits = torch.empty(budget_elems, device=dev, dtype=weight.dtype)
    prod = torch.empty(n, args.hidden, device=dev, dtype=torch.float32)
    scratch_n = [torch.empty(n, device=dev, dtype=torch.float32) for _ in range(4)]
    rows = []

    def add(name, fn, floor_ms=None):
        ms = bench(fn, args)
        row = {"B": b, "variant": name, "ms": ms}
        if floor_ms:
            row["x_floor"] = ms / floor_ms
        rows.append(row)
        print(f"B={b:2d}  {name:22s} {ms:8.3f} ms" + (f"  x{row['x_floor']:.3f}" if floor_ms else ""), flush=True)
        return ms

    all_logits = torch.empty(n, vocab, device=dev, dtype=weight.dtype)
    dx = torch.empty_like(x)

    def floor():
        torch.mm(x, weight.t(), out=all_logits)
        torch.mm(all_logits, weight, out=dx)

    floor_ms = add("floor", floor)

    def op():
        hidden.requires_grad_(True).grad = None
        fused_linear_cpo_loss(hidden, weight, labels, beta=0.1, cpo_alpha=1.0, backend="triton").loss.backward()

    add("op", op, floor_ms)
    buf2d = logits.view(slice_rows, vocab)
    add("slices", sliced(x, weight, buf2d, prod, targets, scratch_n, slice_rows, False), floor_ms)
    add("slices+exp", sliced(x, weight, buf2d, prod, targets, scratch_n, slice_rows, True), floor_ms)
    for m in [int(s) for s in args.slab_rows.split(",") if s]:
        if m > n:
            continue
        width = even_slab_width(vocab, m, budget_elems)
        parts = [(s, min(s + m, n)) for s in range(0, n, m)]  # every token, m at a time

        def run(with_exp, parts=parts, width=width):
            steps = [
                slabbed(x[s:e], weight, logits, prod[s:e], targets[s:e], [t[s:e] for t in scratch_n], width, with_exp)
                for s, e in parts
            ]
            return lambda: [st() for st in steps]

        add(f"slabs M={m} w={width}", run(False), floor_ms)
        add(f"slabs M={m} w={width}+exp", run(True), floor_ms)
    add("floor again", floor)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="4,8")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--slab-rows", default="2048,4096,8192")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--rep", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    weight = make_weight(args.vocab, args.hidden, torch.bfloat16, dev, args.seed)
    rows = []
    for b in [int(s) for s in args.batches.split(",") if s]:
        rows += probe(b, args, weight)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
