"""The benchmark and profiling scripts run end to end at toy sizes on CPU (their GPU numbers live in docs/)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_benchmark_kernel_quick(tmp_path):
    load("benchmark_kernel").main(["--quick", "--out", str(tmp_path), "--no-plots"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["accuracy"] and (tmp_path / "results.csv").exists()


@pytest.mark.slow
def test_benchmark_e2e_toy(tmp_path):
    code = load("benchmark_e2e").main(
        ["--model", "toy", "--micro-batches", "2", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)]
    )
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["trainer"] for r in results["runs"]} == {"stock", "fused"}
