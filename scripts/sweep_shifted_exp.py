"""Experiment: why a frozen head's exponentials pass runs at ~2.4 TB/s, and a variant that is faster.

    python scripts/sweep_shifted_exp.py --rows 1024 --json shifted_exp.json

``probe_frozen_schedules.py`` put the pass at 0.18-0.24 ms per 1,024-row slice inside the op (7% of a frozen call
at B = 4) where one read and one write of the logits take ~0.13 ms at copy speed. Each variant here is the shipped
kernel's loop (``frozen_grad_kernels._shifted_exp_kernel``) with pieces switched on or off:
- ``EXP``: the exponential (off: an in-place copy over the same grid, the ceiling of this structure);
- ``GUARD``: the block max checked against the shift before the store (the overflow guard, with its rescale);
- ``SUMS``: 0 none, 1 the shipped three scalar sums per block, 2 the sums kept as vectors until the segment ends;
- ``PREFETCH``: the next block's load issued before this block's reductions, so that one load is always in flight.
Diagnostic variants (no guard or no sums) compute the wrong thing; only ``GUARD`` with ``SUMS`` are candidates,
checked against the shipped kernel (E and the partials), also on rows that take the rescale.

Each kernel is timed alone by CUDA events around it, after an untimed copy restores the logits (the pass is in
place), so no copy time is subtracted.

``--lse-tiles``: the read-only log-sum-exp pass (``logsumexp_kernel._segment_stats_kernel``, eval and trainable
heads) at the same kind of tiles, shipped and with the same hand-issued prefetch, and the trainable head's
``softmax_grad_`` pass, for the record.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import torch
import triton
import triton.language as tl

from trl_fused_cpo.ops import frozen_grad_kernels, logsumexp_kernel, softmax_grad_kernel


@triton.jit
def _variant_kernel(
    logits_ptr,
    targets_ptr,
    part_ptr,
    rows,
    V,
    stride_row,
    LIMIT: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
    EXP: tl.constexpr,
    GUARD: tl.constexpr,
    SUMS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    start = seg * SEGMENT
    offsets = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row)
    c = tl.load(row_ptr + target).to(tl.float32)
    if SUMS == 2:
        s = tl.zeros([BLOCK], dtype=tl.float32)
        s_other = tl.zeros([BLOCK], dtype=tl.float32)
        total = tl.zeros([BLOCK], dtype=tl.float32)
    else:
        s = 0.0
        s_other = 0.0
        total = 0.0
    if PREFETCH:
        x_next = tl.load(row_ptr + start + offsets, mask=start + offsets < V, other=float("-inf"))
    for off in tl.range(0, SEGMENT, BLOCK):
        cols = start + off + offsets
        if PREFETCH:
            x = x_next.to(tl.float32)
            ncols = cols + BLOCK
            x_next = tl.load(row_ptr + ncols, mask=(ncols < V) & (off + BLOCK < SEGMENT), other=float("-inf"))
        else:
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        if GUARD:
            block_max = tl.max(x, axis=0)
            if block_max > c + LIMIT:  # rare: rescale this segment's earlier blocks to the new shift
                factor = tl.exp(c - block_max)
                _rescale_blocks(row_ptr, start, start + off, target, factor, V, BLOCK)
                s *= factor
                s_other *= factor
                c = block_max
        is_target = cols == target
        if EXP:
            e = tl.exp(x - c)
            out = tl.where(is_target, x, e)
        else:
            e = x
            out = x
        if SUMS == 1:
            s += tl.sum(e, axis=0)
            s_other += tl.sum(tl.where(is_target, 0.0, e), axis=0)
            total += tl.sum(tl.where(cols < V, x, 0.0), axis=0)
        elif SUMS == 2:
            s += e
            s_other += tl.where(is_target, 0.0, e)
            total += tl.where(cols < V, x, 0.0)
        tl.store(row_ptr + cols, out.to(logits_ptr.dtype.element_ty), mask=cols < V)
    if SUMS == 2:
        s_out = tl.sum(s, axis=0)
        s_other_out = tl.sum(s_other, axis=0)
        total_out = tl.sum(total, axis=0)
    else:
        s_out = s
        s_other_out = s_other
        total_out = total
    part = seg.to(tl.int64) * rows + row
    plane = tl.num_programs(1) * rows
    tl.store(part_ptr + part, c)
    tl.store(part_ptr + plane + part, s_out)
    tl.store(part_ptr + 2 * plane + part, s_other_out)
    tl.store(part_ptr + 3 * plane + part, total_out)


@triton.jit
def _max_and_sums(m1, s1, o1, t1, m2, s2, o2, t2):
    return tl.maximum(m1, m2), s1 + s2, o1 + o2, t1 + t2


@triton.jit
def _rescale_blocks(row_ptr, start, end, target, factor, V, BLOCK: tl.constexpr):
    """``E *= factor`` over columns ``[start, end)``, the target column (its raw logit) left as it is."""
    offsets = tl.arange(0, BLOCK)
    for prev in tl.range(start, end, BLOCK):
        pcols = prev + offsets
        e = tl.load(row_ptr + pcols, mask=pcols < V, other=0.0).to(tl.float32)
        e = tl.where(pcols == target, e, e * factor)
        tl.store(row_ptr + pcols, e.to(row_ptr.dtype.element_ty), mask=pcols < V)


@triton.jit
def _one_reduce_kernel(
    logits_ptr,
    targets_ptr,
    part_ptr,
    rows,
    V,
    stride_row,
    LIMIT: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The guard's max and the three sums in one reduction per block (one barrier phase, not four); a block that
    trips the guard recomputes its exponentials on the new shift (rare)."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    start = seg * SEGMENT
    offsets = tl.arange(0, BLOCK)
    target = tl.load(targets_ptr + row)
    c = tl.load(row_ptr + target).to(tl.float32)
    s = 0.0
    s_other = 0.0
    total = 0.0
    if PREFETCH:
        x_next = tl.load(row_ptr + start + offsets, mask=start + offsets < V, other=float("-inf"))
    for off in tl.range(0, SEGMENT, BLOCK):
        cols = start + off + offsets
        if PREFETCH:
            x = x_next.to(tl.float32)
            ncols = cols + BLOCK
            x_next = tl.load(row_ptr + ncols, mask=(ncols < V) & (off + BLOCK < SEGMENT), other=float("-inf"))
        else:
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        is_target = cols == target
        e = tl.exp(x - c)
        block_max, bs, bo, bt = tl.reduce(
            (x, e, tl.where(is_target, 0.0, e), tl.where(cols < V, x, 0.0)), 0, _max_and_sums
        )
        if block_max > c + LIMIT:  # rare: rescale this segment's earlier blocks, redo this one on the new shift
            factor = tl.exp(c - block_max)
            _rescale_blocks(row_ptr, start, start + off, target, factor, V, BLOCK)
            s *= factor
            s_other *= factor
            c = block_max
            e = tl.exp(x - c)
            bs = tl.sum(e, axis=0)
            bo = tl.sum(tl.where(is_target, 0.0, e), axis=0)
        s += bs
        s_other += bo
        total += bt
        tl.store(row_ptr + cols, tl.where(is_target, x, e).to(logits_ptr.dtype.element_ty), mask=cols < V)
    part = seg.to(tl.int64) * rows + row
    plane = tl.num_programs(1) * rows
    tl.store(part_ptr + part, c)
    tl.store(part_ptr + plane + part, s)
    tl.store(part_ptr + 2 * plane + part, s_other)
    tl.store(part_ptr + 3 * plane + part, total)


@triton.jit
def _select_guard_kernel(
    logits_ptr,
    targets_ptr,
    part_ptr,
    rows,
    V,
    stride_row,
    LIMIT: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """No branch in the loop: the sums are vectors, and from the first block that trips the guard on, blocks are
    left raw; after the loop (rare) the shipped loop with its rescale takes the segment from that block."""
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
    raw_from = SEGMENT  # the first block left raw
    if PREFETCH:
        x_next = tl.load(row_ptr + start + offsets, mask=start + offsets < V, other=float("-inf"))
    for off in tl.range(0, SEGMENT, BLOCK):
        cols = start + off + offsets
        if PREFETCH:
            x = x_next.to(tl.float32)
            ncols = cols + BLOCK
            x_next = tl.load(row_ptr + ncols, mask=(ncols < V) & (off + BLOCK < SEGMENT), other=float("-inf"))
        else:
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        raw_from = tl.where((tl.max(x, axis=0) > c + LIMIT) & (raw_from == SEGMENT), off, raw_from)
        done = off < raw_from
        is_target = cols == target
        e = tl.exp(x - c)
        s += tl.where(done, e, 0.0)
        s_other += tl.where(done & ~is_target, e, 0.0)
        total += tl.where(cols < V, x, 0.0)
        tl.store(row_ptr + cols, tl.where(done & ~is_target, e, x).to(logits_ptr.dtype.element_ty), mask=cols < V)
    s_out = tl.sum(s, axis=0)
    s_other_out = tl.sum(s_other, axis=0)
    if raw_from < SEGMENT:  # rare: the shipped loop over the raw blocks, earlier ones rescaled with the shift
        for off in tl.range(raw_from, SEGMENT, BLOCK):
            cols = start + off + offsets
            x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            block_max = tl.max(x, axis=0)
            if block_max > c + LIMIT:
                factor = tl.exp(c - block_max)
                _rescale_blocks(row_ptr, start, start + off, target, factor, V, BLOCK)
                s_out *= factor
                s_other_out *= factor
                c = block_max
            e = tl.exp(x - c)
            is_target = cols == target
            s_out += tl.sum(e, axis=0)
            s_other_out += tl.sum(tl.where(is_target, 0.0, e), axis=0)
            tl.store(row_ptr + cols, tl.where(is_target, x, e).to(logits_ptr.dtype.element_ty), mask=cols < V)
    part = seg.to(tl.int64) * rows + row
    plane = tl.num_programs(1) * rows
    tl.store(part_ptr + part, c)
    tl.store(part_ptr + plane + part, s_out)
    tl.store(part_ptr + 2 * plane + part, s_other_out)
    tl.store(part_ptr + 3 * plane + part, tl.sum(total, axis=0))


@triton.jit
def _lse_prefetch_kernel(
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
    """``logsumexp_kernel._segment_stats_kernel`` with the next block's load issued before this block's math."""
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    start = seg * SEGMENT
    offsets = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0
    total = 0.0
    x_next = tl.load(row_ptr + start + offsets, mask=start + offsets < V, other=float("-inf"))
    for off in tl.range(0, SEGMENT, BLOCK):
        cols = start + off + offsets
        x = x_next.to(tl.float32)
        ncols = cols + BLOCK
        x_next = tl.load(row_ptr + ncols, mask=(ncols < V) & (off + BLOCK < SEGMENT), other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        total += tl.sum(tl.where(cols < V, x, 0.0), axis=0)
        m = m_new
    part = seg.to(tl.int64) * rows + row
    segments = tl.num_programs(1)
    tl.store(part_ptr + part, m)
    tl.store(part_ptr + segments * rows + part, s)
    tl.store(part_ptr + 2 * segments * rows + part, total)
    target = tl.load(targets_ptr + row)
    if (target >= start) & (target < start + SEGMENT):
        tl.store(target_logit_ptr + row, tl.load(row_ptr + target).to(tl.float32))


def sweep_lse(pristine, targets, tiles: str, reps: int) -> list[dict]:
    """The read-only passes: log-sum-exp (shipped, prefetch) per tile, and softmax_grad_ as shipped."""
    rows, vocab = pristine.shape
    nbytes = pristine.numel() * pristine.element_size()
    target_logit = torch.empty(rows, device=pristine.device)
    results = []
    for tile in tiles.split(","):
        segment, block, warps = (int(v) for v in tile.split("x"))
        part = torch.empty(3, triton.cdiv(vocab, segment), rows, device=pristine.device)
        grid = (rows, triton.cdiv(vocab, segment))
        for name, kernel in (("lse", logsumexp_kernel._segment_stats_kernel), ("lse+prefetch", _lse_prefetch_kernel)):
            launch_pass = functools.partial(
                kernel[grid], pristine, targets, part, target_logit, rows, vocab, vocab, SEGMENT=segment, BLOCK=block,
                num_warps=warps,
            )  # fmt: skip
            ms = event_ms(lambda: None, launch_pass, reps)
            results.append(dict(name=name, segment=segment, block=block, warps=warps, ms=ms, tbs=nbytes / ms / 1e9))
            print(f"seg {segment:5d} block {block:4d} w{warps:<2d} {name:20s} {ms:.4f} ms {nbytes / ms / 1e9:.2f} TB/s")
    logits = torch.empty_like(pristine)
    lse, coef = torch.zeros(rows, device=pristine.device), torch.ones(rows, device=pristine.device)
    ms = event_ms(
        lambda: logits.copy_(pristine), lambda: softmax_grad_kernel.softmax_grad_(logits, lse, targets, coef), reps
    )
    results.append(dict(name="softmax_grad", ms=ms, tbs=2 * nbytes / ms / 1e9))
    print(f"softmax_grad_ (shipped) {ms:.4f} ms {2 * nbytes / ms / 1e9:.2f} TB/s", flush=True)
    return results


def launch(logits, targets, part, cfg: dict) -> None:
    rows, vocab = logits.shape
    grid = (rows, triton.cdiv(vocab, cfg["segment"]))
    common = dict(LIMIT=frozen_grad_kernels.SHIFT_LIMIT, SEGMENT=cfg["segment"], BLOCK=cfg["block"])
    if cfg["kind"] == "shipped":
        frozen_grad_kernels._shifted_exp_kernel[grid](
            logits, targets, logits, part, rows, vocab, logits.stride(0), **common, SHIFT_IS_TARGET=True,
            num_warps=cfg["warps"],
        )  # fmt: skip
    elif cfg["kind"] in ("one-reduce", "select-guard"):
        kernel = _one_reduce_kernel if cfg["kind"] == "one-reduce" else _select_guard_kernel
        kernel[grid](
            logits, targets, part, rows, vocab, logits.stride(0), **common, PREFETCH=cfg["prefetch"],
            num_warps=cfg["warps"],
        )  # fmt: skip
    else:
        _variant_kernel[grid](
            logits, targets, part, rows, vocab, logits.stride(0), **common, EXP=cfg["exp"], GUARD=cfg["guard"],
            SUMS=cfg["sums"], PREFETCH=cfg["prefetch"], num_warps=cfg["warps"],
        )  # fmt: skip


def event_ms(reset, fn, reps: int) -> float:
    """Median of ``fn`` alone, each run after an untimed ``reset``; the events are read once at the end."""
    for _ in range(5):
        reset()
        fn()
    pairs = []
    for _ in range(reps):
        reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


TILES = "8192x2048x4,8192x1024x2,8192x4096x8,16384x2048x4,4096x2048x4"  # segment x block x warps


def configs(tiles: str = TILES, names: str | None = None) -> list[dict]:
    out = []
    for tile in tiles.split(","):
        segment, block, warps = (int(v) for v in tile.split("x"))
        base = dict(segment=segment, block=block, warps=warps)
        out.append(dict(base, kind="shipped", name="shipped"))
        for name, exp, guard, sums, prefetch in (
            ("copy", False, False, 0, False),
            ("copy+prefetch", False, False, 0, True),
            ("exp", True, False, 0, False),
            ("exp+guard", True, True, 0, False),
            ("exp+sums", True, False, 1, False),
            ("shipped-as-variant", True, True, 1, False),
            ("prefetch", True, True, 1, True),
            ("vec", True, True, 2, False),
            ("vec+prefetch", True, True, 2, True),
        ):
            out.append(dict(base, kind="variant", name=name, exp=exp, guard=guard, sums=sums, prefetch=prefetch))
        for kind in ("one-reduce", "select-guard"):
            for prefetch in (False, True):
                name = kind + ("+prefetch" if prefetch else "")
                out.append(dict(base, kind=kind, name=name, prefetch=prefetch))
    return [c for c in out if names is None or c["name"] in names.split(",")]


def compare(cfg, pristine, targets, rows) -> dict:
    """Largest differences of E and of the partials against the shipped kernel at the same tiles."""
    segments = triton.cdiv(pristine.shape[1], cfg["segment"])
    outs = []
    for c in (dict(cfg, kind="shipped"), cfg):
        e = pristine.clone()
        part = torch.empty(4, segments, rows, device=e.device)
        launch(e, targets, part, c)
        outs.append((e.float(), part))
    (e0, p0), (e1, p1) = outs
    return {
        "E": float((e0 - e1).abs().max()),
        "partials_rel": float(((p0 - p1).abs() / p0.abs().clamp(min=1)).max()),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--tiles", default=TILES, help="segment x block x warps, comma-separated")
    p.add_argument("--names", default=None, help="only these variants (comma-separated); default: all")
    p.add_argument("--lse-tiles", default=None, help="also the log-sum-exp pass at these tiles")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows, vocab = args.rows, args.vocab
    pristine = (torch.randn(rows, vocab, device="cuda") * 2).to(torch.bfloat16)  # the benchmark's logit std
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    rescaled = pristine.clone()  # rows whose target logit is 100 below a logit: the guard's rescale path
    rescaled[::7, vocab // 3] = 100.0
    rescaled[::7, vocab - 5] = 130.0
    logits = torch.empty_like(pristine)
    copy_ms = event_ms(lambda: None, lambda: logits.copy_(pristine), args.reps)
    nbytes = 2 * logits.numel() * logits.element_size()
    print(f"copy (out of place): {copy_ms:.3f} ms, {nbytes / copy_ms / 1e9:.2f} TB/s", flush=True)
    results = [{"name": "torch copy", "ms": copy_ms, "tbs": nbytes / copy_ms / 1e9}]
    for cfg in configs(args.tiles, args.names):
        segments = triton.cdiv(vocab, cfg["segment"])
        part = torch.empty(4, segments, rows, device="cuda")
        ms = event_ms(
            lambda: logits.copy_(pristine), lambda cfg=cfg, part=part: launch(logits, targets, part, cfg), args.reps
        )
        row = dict(cfg, ms=ms, tbs=nbytes / ms / 1e9)
        if cfg["kind"] != "shipped" and cfg.get("guard", True) and cfg.get("sums", 1):
            row["diff"] = compare(cfg, pristine, targets, rows)
            row["diff_rescaled"] = compare(cfg, rescaled, targets, rows)
        results.append(row)
        diff = f"  diff {row['diff']} rescaled {row['diff_rescaled']}" if "diff" in row else ""
        print(
            f"seg {cfg['segment']:5d} block {cfg['block']:4d} w{cfg['warps']:<2d} {cfg['name']:20s} {ms:.4f} ms "
            f"{row['tbs']:.2f} TB/s{diff}",
            flush=True,
        )
    if args.lse_tiles:
        results += sweep_lse(pristine, targets, args.lse_tiles, args.reps)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return results


if __name__ == "__main__":
    main()
