"""Packed attention alone, every route on the benchmark's packed row: forward and forward + backward, TFLOP/s per
visible pair, each route first checked against the dense-mask reference.

The row: ``--pairs`` pairs (16), prompts 100-400 tokens, completions 100-600 (the end-to-end benchmark's lengths),
packed ``prefix_shared`` (and ``padding_free`` with ``--layouts``); heads ``32/8/64`` (Llama-3.2-1B) and
``32/8/128`` (Llama-3-8B). Routes:

- ``flex``: flex_attention compiled once with a static shape over the project's ``packed_block_mask`` (the row
  padded to 128, as the collator pads it); ``flex_tuned``: the same with measured ``kernel_options`` candidates.
- ``varlen``: ``fused_cpo_varlen``, exactly what the trainer calls (transformers' attention-interface function:
  the transposes, the K/V gather, PyTorch's flash varlen); ``varlen[native-gqa]`` / ``varlen[expanded-gqa]``: the
  flash call alone with FA2 given the 8 key/value heads as they are, or expanded to 32 (what ``auto`` picks where
  torch's ``varlen_attn`` has no ``enable_gqa``).
- ``varlen[cudnn]``: the same call on ``varlen_attention.cudnn_varlen_attention``: cuDNN's ragged attention (a
  private aten op) over square segments (the rejected segment's queries re-include the prompt's, outputs dropped:
  top-left causal then equals bottom-right) at the price of the prompt's ``P^2/2`` pairs once more per pair.
- ``sdpa_buckets``: public sdpa (cuDNN forced, then flash) on the square segments padded into length buckets.
- ``sdpa_padded``: TRL's padded layout (``2B`` rows of the longest pair) through sdpa: the scale the issue's
  target comes from (its own FLOPs and, for comparison, per visible pair of the packed row).

FLOPs: ``4 * head_dim * q_heads * visible_pairs`` forward (QK^T and PV over the visible pairs of the packed row,
tail padding excluded), 3.5x that for forward + backward (the issue's convention); ``*_own`` columns count the
route's own pairs (padded rows, re-included prompts). Timing: ``triton.testing.do_bench`` medians (CUDA events).
Writes the JSON record and a markdown table (attention.json, attention.md) under ``--out``; prints the table last.

Usage: ``python scripts/benchmark_attention.py --out results/attn`` (about 2-3 min on an H100; ``--quick`` runs toy
sizes on a CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import error_status, pick_device, run_record, sync, time_ms, write_json  # noqa: E402

from trl_fused_cpo.attention import packed_block_mask  # noqa: E402
from trl_fused_cpo.packing import IGNORE_INDEX, pack_pairs  # noqa: E402
from trl_fused_cpo.varlen_attention import (  # noqa: E402
    TABLES_KWARG,
    VarlenTables,
    _varlen_attn_parameters,
    fused_cpo_varlen_attention,
    varlen_attention,
    varlen_tables,
)

CHECK_TOLERANCE = 2e-2  # rel. error vs fp32 dense in norm; bf16 operands land at 3e-3..1e-2
FLEX_TUNED = (
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
)  # a Hopper candidate; more: --flex-options


def pair_batch(pairs: int, seed: int, prompt=(100, 400), completion=(100, 600)) -> dict[str, torch.Tensor]:
    """A right-padded CPO batch (the collator's format) of random tokens with the benchmark's lengths."""
    rng = random.Random(seed)
    rows = {"chosen": [], "rejected": []}
    for _ in range(pairs):
        p = [rng.randrange(3, 1000) for _ in range(rng.randint(*prompt))]
        for side in rows:
            rows[side].append((p + [rng.randrange(3, 1000) for _ in range(rng.randint(*completion))], len(p)))
    batch = {}
    for side, seqs in rows.items():
        width = max(len(s) for s, _ in seqs)
        ids, mask = torch.zeros(pairs, width, dtype=torch.long), torch.zeros(pairs, width, dtype=torch.long)
        labels = torch.full((pairs, width), IGNORE_INDEX)
        for i, (s, n_prompt) in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
            labels[i, n_prompt : len(s)] = ids[i, n_prompt : len(s)]
        batch.update({f"{side}_input_ids": ids, f"{side}_attention_mask": mask, f"{side}_labels": labels})
    return batch


def visible_pairs(tables: VarlenTables, real_segments: int | None = None) -> int:
    """Visible (query, key) pairs of the segments, bottom-right causal: ``Lq * (Lk - Lq) + Lq * (Lq + 1) / 2``."""
    q = tables.cu_seqlens_q.diff().long()[:real_segments]
    k = tables.cu_seqlens_k.diff().long()[:real_segments]
    return int((q * (k - q) + q * (q + 1) // 2).sum())


# --------------------------------------------------------------------------------------------- the routes
# Each builder takes (packed, tables, device) and returns fn(q, k, v) -> [N, H, D] over the row's [N, heads, D]
# tensors, plus the pairs it computes itself (None: the visible pairs); setup (masks, indexes) stays outside fn.


def route_varlen(packed, tables, device, *, kernel=None, **_):
    """The attention-interface call as the model makes it ([1, heads, N, D] in, the transposes included); with
    ``kernel`` the same call on another of varlen_attention.CUDA_KERNELS than the default."""
    tables = tables.to(device)

    def fn(q, k, v):
        q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, k, v))
        if kernel is None:
            return fused_cpo_varlen_attention(None, q4, k4, v4, None, scaling=q.shape[-1] ** -0.5,
                                              **{TABLES_KWARG: tables})[0][0]  # fmt: skip
        return varlen_attention(*(t[0].transpose(0, 1) for t in (q4, k4, v4)), tables, kernel=kernel)

    own = None
    if kernel == "cudnn":  # square segments: every segment's Lk x Lk causal pairs
        k_lens = tables.cu_seqlens_k.diff().long()
        own = int((k_lens * (k_lens + 1) // 2).sum())
    return fn, own


def route_varlen_gqa(packed, tables, device, *, gqa="native", **_):
    """The flash varlen call alone (no interface transposes) with the K/V heads native or expanded."""
    from trl_fused_cpo.varlen_attention import flash_varlen_attention

    if device.type != "cuda":
        raise RuntimeError("flash varlen needs CUDA")
    tables = tables.to(device)
    return (lambda q, k, v: flash_varlen_attention(q, k, v, tables, gqa=gqa)), None


def route_flex(packed, tables, device, *, flex_row, kernel_options=None, compiled=None, **_):
    """flex_attention over the row padded to 128 (``flex_row``: the same pairs, the collator's flex padding)."""
    from torch.nn.attention.flex_attention import flex_attention

    n, pad = packed.num_tokens, flex_row.num_tokens - packed.num_tokens
    block_mask = packed_block_mask(flex_row.to(device))
    flex = compiled if compiled is not None else flex_attention

    def fn(q, k, v):
        qkv = [F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None] for t in (q, k, v)]
        out = flex(*qkv, block_mask=block_mask, enable_gqa=True, kernel_options=kernel_options)
        return out[0].transpose(0, 1)[:n]

    return fn, None


def square_segments(tables: VarlenTables, n: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Every segment made square: ``(index [N_k] of the row positions read as queries and keys, out_index [N] of
    each row position's own output in that sequence, segment lengths)``."""
    key_index = tables.key_index if tables.key_index is not None else torch.arange(n)
    cu_q, cu_k = tables.cu_seqlens_q.tolist(), tables.cu_seqlens_k.tolist()
    segments = range(len(cu_q) - 1)
    out_index = torch.cat([torch.arange(cu_k[s + 1] - (cu_q[s + 1] - cu_q[s]), cu_k[s + 1]) for s in segments])
    return key_index, out_index, [cu_k[s + 1] - cu_k[s] for s in segments]


def route_sdpa_buckets(packed, tables, device, *, backend="CUDNN_ATTENTION", buckets=4, expand=False, **_):
    """Square segments sorted by length, ``buckets`` padded batches; top-left causal keeps real queries off the
    right padding, whose own outputs are dropped. ``expand``: K/V heads repeated instead of ``enable_gqa``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    index, out_index, lengths = square_segments(tables, packed.num_tokens)
    starts = torch.tensor([0, *lengths]).cumsum(0)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    plans, flat = [], torch.empty(len(index), dtype=torch.long)
    size = -(-len(order) // buckets)
    done = 0
    for b in range(0, len(order), size):
        segs = order[b : b + size]
        width = max(lengths[s] for s in segs)
        gather = torch.zeros(len(segs), width, dtype=torch.long)
        for i, s in enumerate(segs):
            gather[i, : lengths[s]] = index[starts[s] : starts[s] + lengths[s]]
            flat[starts[s] : starts[s] + lengths[s]] = done + i * width + torch.arange(lengths[s])
        plans.append(gather.to(device))
        done += len(segs) * width
    pick = flat[out_index].to(device)  # each row position's output in the concatenated buckets
    own = sum(p.shape[0] * p.shape[1] * (p.shape[1] + 1) // 2 for p in plans)

    def fn(q, k, v):
        outs = []
        with sdpa_kernel(getattr(SDPBackend, backend)):
            for gather in plans:
                qb, kb, vb = (t[gather].transpose(1, 2) for t in (q, k, v))  # [b, heads, T, D]
                if expand:
                    kb, vb = (t.repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (kb, vb))
                out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=not expand)
                outs.append(out.transpose(1, 2))
        return torch.cat([o.reshape(-1, *o.shape[2:]) for o in outs]).index_select(0, pick)

    return fn, own


# --------------------------------------------------------------------------------------------- checking and timing


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def fwd_bwd(fn, q, k, v, grad) -> list[torch.Tensor]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return [out, *torch.autograd.grad(out, (q, k, v), grad)]


def reference(tables: VarlenTables):
    """fp32 per-segment sdpa over the same tables (tests/test_varlen_attention.py proves it equals the dense mask)."""
    from trl_fused_cpo.varlen_attention import varlen_attention_reference

    return lambda q, k, v: varlen_attention_reference(q, k, v, tables)


def measure(name, build, row, tensors, truth, flops, device) -> dict:
    """Check ``build``'s route against ``truth`` (out, dq, dk, dv), then time forward and forward + backward."""
    t0 = time.perf_counter()
    try:
        fn, own_pairs = build(row["packed"], row["tables"], device, **row["extra"])
        got = fwd_bwd(fn, *tensors)
        sync(device)
    except Exception as exc:  # a route this torch cannot run: reported, the others go on
        return {"route": name, "status": error_status(exc), "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    errors = {k: rel(g, t) for k, g, t in zip(("out", "dq", "dk", "dv"), got, truth, strict=True)}
    record = {"route": name, "setup_s": time.perf_counter() - t0, "rel_error": errors}
    if not all(e <= CHECK_TOLERANCE for e in errors.values()):  # NaN fails too
        return {**record, "status": "wrong"}
    q, k, v, grad = tensors
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.no_grad():
        fwd = time_ms(lambda: fn(q, k, v), device)
    both = time_ms(lambda: torch.autograd.grad(fn(*leaves), leaves, grad), device)
    own = flops if own_pairs is None else flops * own_pairs / row["visible_pairs"]
    return {**record, "status": "ok", "fwd_ms": fwd, "fwdbwd_ms": both,
            "fwd_tflops": flops / fwd / 1e9, "fwdbwd_tflops": 3.5 * flops / both / 1e9,
            "fwd_tflops_own": own / fwd / 1e9, "fwdbwd_tflops_own": 3.5 * own / both / 1e9}  # fmt: skip


def padded_layout(batch, heads: tuple[int, int, int], visible: int, device) -> list[dict]:
    """TRL's padded layout through sdpa (its default pick; cuDNN forced, with GQA or the K/V heads expanded; flash
    forced): the scale of the target."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hq, hkv, d = heads
    rows = torch.cat([batch["chosen_attention_mask"].sum(1), batch["rejected_attention_mask"].sum(1)])
    t = int(rows.max())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(len(rows), h, t, d, device=device, dtype=dtype) for h in (hq, hkv, hkv))
    grad = torch.randn_like(q)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    expanded = [leaves[0], *(x.detach().repeat_interleave(hq // hkv, 1).requires_grad_() for x in leaves[1:])]
    own, flops = 4 * d * hq * len(rows) * t * (t + 1) / 2, 4 * d * hq * visible
    out = []
    for backend in ("default", "CUDNN_ATTENTION", "CUDNN_ATTENTION,expanded", "FLASH_ATTENTION"):
        if backend != "default" and device.type != "cuda":
            continue
        name = backend.split(",")[0]
        ctx = sdpa_kernel(getattr(SDPBackend, name)) if backend != "default" else contextlib.nullcontext()
        inputs, gqa = (expanded, False) if "expanded" in backend else (leaves, True)
        fn = lambda i=inputs, g=gqa: F.scaled_dot_product_attention(*i, is_causal=True, enable_gqa=g)  # noqa: E731
        record = {"layout": "padded", "route": f"sdpa_padded[{backend}]", "T": t}
        try:
            with ctx:
                with torch.no_grad():
                    fwd = time_ms(fn, device)
                both = time_ms(lambda fn=fn, i=inputs: torch.autograd.grad(fn(), i, grad), device)
        except Exception as exc:
            out.append({**record, "status": error_status(exc)})
            continue
        out.append({**record, "status": "ok", "fwd_ms": fwd, "fwdbwd_ms": both,
                    "fwd_tflops": flops / fwd / 1e9, "fwdbwd_tflops": 3.5 * flops / both / 1e9,
                    "fwd_tflops_own": own / fwd / 1e9, "fwdbwd_tflops_own": 3.5 * own / both / 1e9})  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------- the run


def routes(device, heads, args) -> list[tuple[str, object, dict]]:
    """``(name, builder, extra kwargs)`` of every route to run at ``heads``."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else None
    out = [
        ("varlen", route_varlen, {}),
        ("varlen[native-gqa]", route_varlen_gqa, {"gqa": "native"}),
        ("varlen[expanded-gqa]", route_varlen_gqa, {"gqa": "expand"}),
        ("flex", route_flex, {"compiled": compiled}),
    ]
    for i, options in enumerate(args.flex_options if device.type == "cuda" else ()):
        out.append((f"flex_tuned[{i}]", route_flex, {"compiled": compiled, "kernel_options": options}))
    out += [
        ("varlen[cudnn]", route_varlen, {"kernel": "cudnn"}),
        ("sdpa_buckets[cudnn]", route_sdpa_buckets, {"backend": "CUDNN_ATTENTION"}),
        ("sdpa_buckets[cudnn,expanded]", route_sdpa_buckets, {"backend": "CUDNN_ATTENTION", "expand": True}),
        ("sdpa_buckets[flash]", route_sdpa_buckets, {"backend": "FLASH_ATTENTION"}),
    ]
    return [r for r in out if args.routes is None or r[0].split("[")[0] in args.routes]


def run_heads(batch, layout, heads, device, args) -> list[dict]:
    """Every route at one head configuration on one layout's row."""
    packed = pack_pairs(batch, layout, pad_token_id=0)
    tables = varlen_tables(packed)
    real_segments = 2 * packed.num_pairs
    visible = visible_pairs(tables, real_segments)
    hq, hkv, d = heads
    flops = 4 * d * hq * visible
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(hq * d)
    n = packed.num_tokens
    tensors = [torch.randn(n, h, d, device=device, dtype=dtype, generator=gen) for h in (hq, hkv, hkv, hq)]
    truth = fwd_bwd(reference(tables.to(device)), *(t.float() for t in tensors))  # fp32
    row = {"packed": packed, "tables": tables, "visible_pairs": visible,
           "extra": {"flex_row": pack_pairs(batch, layout, pad_token_id=0, pad_to_multiple_of=128)}}  # fmt: skip
    results = []
    for name, build, extra in routes(device, heads, args):
        row["extra"] = {**row["extra"], **extra}
        record = measure(name, build, row, tensors, truth, flops, device)
        results.append({"layout": layout, "heads": f"{hq}/{hkv}/{d}", "n": n, "visible_pairs": visible, **record})
        print(json.dumps(results[-1]), flush=True)
        row["extra"] = {"flex_row": row["extra"]["flex_row"]}
    if args.routes is None or "sdpa_padded" in args.routes:
        for record in padded_layout(batch, heads, visible, device):
            results.append({"heads": f"{hq}/{hkv}/{d}", "visible_pairs": visible, **record})
            print(json.dumps(results[-1]), flush=True)
    return results


def markdown(results: list[dict], header: dict) -> str:
    lines = [
        f"Packed attention, {header['device']}, torch {header['versions'].get('torch')}, {header['date']}; "
        f"{header['pairs']} pairs. TFLOP/s per visible pair of the packed row (4·d·heads·pairs forward, ×3.5 "
        "forward + backward); own: the route's own pairs.",
        "",
        "| layout | heads | route | rel err (out/dq/dk/dv) | fwd ms | fwd+bwd ms | TFLOP/s fwd / fwd+bwd | own | status |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        err = "/".join(f"{e:.1e}" for e in r["rel_error"].values()) if "rel_error" in r else ""
        if r.get("status") == "ok":
            ms = f"{r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f}"
            rate = f"{r['fwd_tflops']:.3g} / {r['fwdbwd_tflops']:.3g}"
            own = f"{r['fwd_tflops_own']:.3g} / {r['fwdbwd_tflops_own']:.3g}"
        else:
            ms, rate, own = " | ", "", ""
        status = r.get("status", "")[:100]
        lines.append(f"| {r['layout']} | {r['heads']} | {r['route']} | {err} | {ms} | {rate} | {own} | {status} |")
    return "\n".join(lines) + "\n"


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for attention.json and attention.md")
    p.add_argument("--pairs", type=int, default=16)
    p.add_argument("--heads", nargs="+", default=["32,8,64", "32,8,128"], help="q_heads,kv_heads,head_dim ...")
    p.add_argument("--layouts", nargs="+", default=["prefix_shared"], choices=["prefix_shared", "padding_free"])
    p.add_argument(
        "--routes",
        nargs="+",
        default=None,
        help="subset by name before [: varlen flex flex_tuned sdpa_buckets sdpa_padded",
    )
    p.add_argument("--flex-options", type=json.loads, default=list(FLEX_TUNED), help="JSON list of kernel_options")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--quick", action="store_true", help="toy sizes (2 pairs of 8-40 tokens, 4/2/16 heads): CPU")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    device = pick_device(args.device)
    lengths = ((8, 24), (8, 40)) if args.quick else ((100, 400), (100, 600))
    pairs = 2 if args.quick else args.pairs
    heads_list = [(4, 2, 16)] if args.quick else [tuple(int(x) for x in h.split(",")) for h in args.heads]
    batch = pair_batch(pairs, args.seed, *lengths)
    header = {**run_record(device), "pairs": pairs, "varlen_attn_parameters": sorted(_varlen_attn_parameters() or [])}
    results = []
    for layout in args.layouts:
        for heads in heads_list:
            results += run_heads(batch, layout, heads, device, args)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "attention.json", {**header, "results": results})
    table = markdown(results, header)
    (out / "attention.md").write_text(table)
    print(table)
    return 0 if any(r.get("status") == "ok" and r["route"] == "varlen" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
