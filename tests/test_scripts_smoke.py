"""Every script in scripts/ runs end to end at toy sizes on CPU (their GPU numbers live in docs/results/).

train_cpo.py has its own tests (tests/test_train_script.py); gpu_run.sh is checked for syntax and for steps that
run scripts which no longer exist.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import load_script

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.slow
def test_benchmark_kernel_quick(tmp_path):
    load_script("benchmark_kernel").main(["--quick", "--out", str(tmp_path), "--no-plots"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["accuracy"] and (tmp_path / "results.csv").exists()
    assert results["versions"]["trl_fused_cpo"] and results["device"].startswith("cpu")  # bench_common's record
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
        ["--model", "toy", "--micro-batches", "2", "--steps", "1", "--warmup", "1", "--profile", "--out", str(tmp_path)]
    )
    assert code == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert {r["trainer"] for r in results["runs"]} == {"stock", "fused"}
    for run in results["runs"]:  # --profile: one more step, profiled, not timed
        assert len(run["step_times_s"]) == 2 and run["timed_steps"] == 1 and run["profiled_step_s"] > 0
        assert any(e["name"] == "aten::mm" for e in run["profile_top"])
        # the distance to the limit: MFU over the unique tokens, the run's context, the profiled step by class
        assert 0 < run["unique_token_mfu"] < 1 and run["model"] == "toy" and run["micro_batch"] == 2
        assert run["gpu"] == "cpu" and run["lengths"] == "synthetic" and "cublas_bf16_tflops" in run
        assert set(run["step_breakdown_ms"]) >= {"gemm", "attention", "elementwise", "head", "optimizer", "idle"}
        batch = run["batches"][0]
        assert batch["unique"] + batch["pairs"] == batch["prefix_shared"]  # the packed row repeats one prompt token
    assert results["comparisons"] and results["comparisons"][0]["same_batches"]


@pytest.mark.slow
def test_benchmark_e2e_variants_toy(tmp_path):
    """Liger and compile variants (gpu_run.sh e2e-kernels): compiled runs compile and train like stock; a variant that
    fails (Liger's kernels need CUDA) is recorded and the others still run; --no-plots writes results.json alone."""
    import torch

    variants = "stock,fused+liger,fused+compile,fused"
    argv = ["--model", "toy", "--micro-batches", "2", "--steps", "1", "--warmup", "2", "--variants", variants]
    code = load_script("benchmark_e2e").main([*argv, "--no-process-warmup", "--no-plots", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    runs = {r["trainer"]: r for r in results["runs"]}
    assert list(runs) == variants.split(",") and [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert runs["fused+compile"]["ok"] and runs["fused+compile"]["compiled"] == "OptimizedModule"
    assert runs["fused+compile"]["options"] == ["compile"] and runs["fused+compile"]["warmup_s"] > 0
    rows = {c["trainer"]: c for c in results["comparisons"]}
    assert rows["fused+compile"]["same_batches"] and rows["fused+compile"]["max_rel_loss_diff"] < 1e-3
    assert "speedup_vs_fused" in rows["fused+compile"] and results["comparisons"][0]["trainer"] == "fused"
    if not torch.cuda.is_available():
        assert code == 1 and not runs["fused+liger"]["ok"] and runs["fused+liger"]["error"]


@pytest.mark.slow
def test_benchmark_e2e_activation_and_attention_variants_toy(tmp_path):
    """+act= reaches FusedCPOConfig's activation_policy (a layout variant without it keeps TRL's blanket
    checkpointing), +attn= names the attention implementation; each trains to stock's loss."""
    variants = "stock,fused+prefix,fused+prefix+act=none,fused+act=1,fused+padfree+attn=eager"
    argv = ["--model", "toy", "--micro-batches", "2", "--steps", "1", "--warmup", "1", "--variants", variants]
    code = load_script("benchmark_e2e").main([*argv, "--no-process-warmup", "--no-plots", "--out", str(tmp_path)])
    assert code == 0
    runs = {r["trainer"]: r for r in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert runs["fused+prefix"]["activation_plan"]["delegate"]
    assert runs["fused+prefix+act=none"]["activation_plan"] == {
        "checkpointed": 0, "offload": False, "delegate": False, "reason": "activation_policy=none"
    }  # fmt: skip
    assert runs["fused+act=1"]["activation_plan"]["checkpointed"] == 1
    assert runs["fused+act=1"]["options"] == ["act=1"] and runs["fused+padfree+attn=eager"]["ok"]
    losses = {kind: run["losses"][0] for kind, run in runs.items()}
    assert all(loss == pytest.approx(losses["stock"], rel=1e-4) for loss in losses.values()), losses


def test_benchmark_e2e_refuses_unknown_variants():
    main = load_script("benchmark_e2e").main
    bad_variants = ("fused+turbo", "liger", "fused+compile+compile-regional", "fused+liger+liger", "fused+sdpa")
    bad_variants += ("fused+act=some", "stock+act=none", "fused+act=", "fused+act=1+act=2", "fused+speed=2")
    for bad in bad_variants:
        with pytest.raises(SystemExit):
            main(["--model", "toy", "--variants", bad])


@pytest.mark.slow
def test_profile_fused_op_quick(tmp_path):
    """Stage timings and the whole op at toy shapes; on CPU the Triton kernels run through the interpreter."""
    out = tmp_path / "profile.json"
    result = load_script("profile_fused_op").main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text())["labelled_tokens"] == result["labelled_tokens"] == 2 * 16
    assert all(ms > 0 for key, ms in result["stage_ms_one_chunk"].items() if not key.endswith("_tflops"))
    assert {"trainable", "frozen", "forward"} <= set(result["fused"])
    assert all(result["fused"][k]["x_floor"] > 0 for k in ("trainable", "frozen", "forward"))


def test_make_tiny_data_reproduces_the_shipped_file(tmp_path):
    written = load_script("make_tiny_data").main(["--out", str(tmp_path / "tiny.jsonl")])
    shipped = SCRIPTS.parent / "trl_fused_cpo" / "data" / "tiny_preferences.jsonl"
    assert written.read_bytes() == shipped.read_bytes()


@pytest.mark.slow
def test_make_random_checkpoint_toy(tmp_path):
    out = load_script("make_random_checkpoint").main(["--model", "toy", "--out", str(tmp_path), "--rows", "4"])
    assert (out / "config.json").exists() and (out / "tokenizer_config.json").exists()
    rows = [json.loads(line) for line in (out / "preferences.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and set(rows[0]) >= {"prompt", "chosen", "rejected"}


@pytest.mark.slow
@pytest.mark.parametrize("check", [["--check", "parity", "--tie"], ["--check", "lora"]])
def test_check_wrappers_without_a_wrapper(check, tmp_path):
    """The checks gpu_run.sh runs under FSDP2 / ZeRO-3, here in one plain CPU process on the torch backend."""
    out = tmp_path / "check.json"
    assert load_script("check_wrappers").main([*check, "--backend", "torch", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["ok"]


def test_gpu_run_steps_run_only_scripts_that_exist():
    script = (SCRIPTS / "gpu_run.sh").read_text()
    subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_run.sh")], check=True)
    for name in set(re.findall(r"scripts/([\w.]+\.(?:py|sh))", script)):
        assert (SCRIPTS / name).exists(), f"gpu_run.sh names scripts/{name}, which is not in the tree"
    handled = set(re.findall(r"^    ([\w-]+(?: \| [\w-]+)*)\)", script, flags=re.MULTILINE))
    handled = {step for group in handled for step in group.split(" | ")}
    header = script.split("set -uo pipefail")[0]
    listed = {"tests", "tests-cuda", "profile", "wrappers", "kernel", "kernel-long", "kernel-long-peers"}
    listed |= {"frozen-budgets", "trainable-budgets", "kernel-b2", "kernel-ab", "e2e", "recipe", "maxbatch"}
    listed |= {"maxbatch-8b", "e2e-kernels", "e2e-kernels-regional"}
    listed |= {"attention", "probe", "backbone", "long-context", "long-fixed"}  # the backbone / long-pair steps
    assert listed <= handled, listed - handled
    assert all(step in header for step in handled), handled - {s for s in handled if s in header}
