"""Markdown tables for docs/benchmarks.md from benchmark_kernel.py's JSON: a side-by-side run plus long runs.

    python scripts/kernel_tables.py docs/results/kernel_long_peers_3de2689/results.json \
        --long docs/results/trainable_budgets/1536.json docs/results/kernel_long_peers/results.json

One table per workload: the side-by-side cells are ``ms (× floor) / peak GiB``; the long-run column lists each
long run's ``× floor`` for the fused op (its own floor, same run), so that run-to-run spread is visible.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TITLES = {
    "full": "All positions labelled, trainable head (fwd + bwd)",
    "masked": "40% of positions unlabelled, trainable head",
    "frozen": "Frozen head (LoRA), all labelled",
    "frozen-masked": "Frozen head, 40% unlabelled",
    "forward": "Forward only (`torch.no_grad()`, eval), all labelled",
}
PEERS = ("fused-lean", "torch", "liger", "trl-chunked", "cce")


def index(path: Path) -> dict[tuple[str, int, str], dict]:
    return {(r["workload"], r["B"], r["impl"]): r for r in json.loads(path.read_text())["results"]}


def cell(row: dict | None, bold: bool = False) -> str:
    if row is None or row.get("ms") is None:
        return "-" if row is None else row.get("status", "-")
    peak = "" if row.get("peak_gib") is None else f" / {row['peak_gib']:.2f}"
    ratio = "" if row.get("x_floor") is None else f" ({row['x_floor']:.2f}×)"
    text = f"{row['ms']:.1f}{ratio}{peak}"
    return f"**{text}**" if bold else text


def long_ratio(runs: list[dict], workload: str, b: int) -> str:
    ratios = [run.get((workload, b, "fused"), {}).get("x_floor") for run in runs]
    return " / ".join("-" if r is None else f"{r:.2f}" for r in ratios)


def tables(side: dict, runs: list[dict]) -> str:
    out = []
    for workload, title in TITLES.items():
        sizes = sorted({b for (w, b, _) in side if w == workload})
        if not sizes:
            continue
        peers = [p for p in PEERS if any((workload, b, p) in side for b in sizes)]
        head = ["B", "labelled tokens", "floor ms", "**fused**"] + (["fused, long runs (× floor)"] if runs else [])
        out += [f"### {title}", "", "| " + " | ".join(head + peers) + " |", "|" + "---|" * (len(head) + len(peers))]
        for b in sizes:
            floor = side.get((workload, b, "floor"), {})
            cells = [str(b), str(floor.get("labelled", "-")), f"{floor['ms']:.2f}" if floor.get("ms") else "-"]
            cells.append(cell(side.get((workload, b, "fused")), bold=True))
            if runs:
                cells.append(long_ratio(runs, workload, b))
            cells += [cell(side.get((workload, b, p))) for p in peers]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("side_by_side", type=Path, help="results.json of the run with every peer")
    p.add_argument("--long", type=Path, nargs="*", default=[], help="results.json of long runs (fused + floor)")
    args = p.parse_args(argv)
    text = tables(index(args.side_by_side), [index(path) for path in args.long])
    print(text)
    return text


if __name__ == "__main__":
    main()
