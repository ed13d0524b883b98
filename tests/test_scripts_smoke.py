"""The benchmark and profiling scripts run end to end at toy sizes on CPU (their GPU numbers live in docs/)."""

from __future__ import annotations

import json

import pytest
from conftest import load_script


@pytest.mark.slow
def test_benchmark_kernel_quick(tmp_path):
    load_script("benchmark_kernel").main(["--quick", "--out", str(tmp_path), "--no-plots"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["accuracy"] and (tmp_path / "results.csv").exists()
    floors = [r for r in results["results"] if r["impl"] == "floor" and r["ms"]]
    assert floors and all(r["floor_after_ms"] > 0 for r in floors)  # the drift check: the floor again after the impls
    # The docs' tables come from this JSON (on CPU there is no Triton "fused" entry: its cells read "-").
    text = load_script("kernel_tables").main([str(tmp_path / "results.json"), "--long", str(tmp_path / "results.json")])
    torch_row = next(r for r in results["results"] if r["impl"] == "torch" and r["workload"] == "full")
    assert f"| {torch_row['B']} | {torch_row['labelled']} |" in text
    assert f"| {torch_row['ms']:.1f}" in text and "**fused**" in text


@pytest.mark.slow
def test_benchmark_e2e_toy(tmp_path):
    code = load_script("benchmark_e2e").main(
        ["--model", "toy", "--micro-batches", "2", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]
    )
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["trainer"] for r in results["runs"]} == {"stock", "fused"}
