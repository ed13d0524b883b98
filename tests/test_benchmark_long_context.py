"""scripts/benchmark_long_context.py at toy sizes on CPU: the search, the records, the tables (GPU numbers: lead)."""

from __future__ import annotations

import json

import pytest
from conftest import load_script

bench = load_script("benchmark_long_context")


def test_search_doubles_then_bisects_to_the_tolerance():
    limit = 45_000
    tried = []

    def fits(n):
        tried.append(n)
        return n <= limit

    found = bench.search_longest(
        fits, start=8192, cap=131_072, tolerance=1024, granularity=256, out_of_time=lambda: False
    )
    assert tried[:4] == [8192, 16384, 32768, 65536]
    assert found["resolved"] and found["max_tokens_per_pair"] <= limit < found["first_failure"]
    assert found["first_failure"] - found["max_tokens_per_pair"] <= 1024
    assert all(n % 256 == 0 for n in tried)
    capped = bench.search_longest(
        lambda n: True, start=64, cap=100, tolerance=8, granularity=4, out_of_time=lambda: False
    )
    assert capped["max_tokens_per_pair"] == 100 and capped["first_failure"] is None and capped["note"] == "cap reached"
    failed = bench.search_longest(
        lambda n: None, start=64, cap=100, tolerance=8, granularity=4, out_of_time=lambda: False
    )
    assert failed["max_tokens_per_pair"] == 0 and not failed["resolved"] and "failed" in failed["note"]
    spent = bench.search_longest(
        fits, start=8192, cap=131_072, tolerance=1024, granularity=256, out_of_time=lambda: True
    )
    assert spent["max_tokens_per_pair"] == 0 and "budget" in spent["note"]


def test_split_and_unique_token_flops():
    assert bench.split_tokens(65_536, (2, 1, 1)) == (32_768, 16_384, 16_384)
    config = bench.build_config("llama3.2-1b")
    assert bench.nonembedding_params(config) == pytest.approx(0.97e9, rel=0.01)  # the published non-embedding count
    assert bench.nonembedding_params(bench.build_config("llama3.1-8b")) == pytest.approx(6.98e9, rel=0.01)
    p, c, r = 4, 2, 2
    flops = bench.pair_flops(config, p, c, r, labelled=4, full=True)
    want = 6 * bench.nonembedding_params(config) * 8 + 6 * 16 * 2048 * (36 + 36 - 16) + 6 * 128_256 * 2048 * 4
    assert flops == want
    assert bench.context_of("llama3.1-8b") == 131_072


def test_search_on_the_toy_model_in_process(tmp_path):
    argv = ["--models", "toy", "--trainers", "stock,prefix_shared", "--start", "32", "--cap", "64", "--tolerance",
            "8", "--steps", "1", "--in-process", "--no-plots", "--out", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["device"].startswith("cpu") and results["versions"]["trl_fused_cpo"]
    searches = {s["trainer"]: s for s in results["searches"]}
    assert set(searches) == {"stock", "prefix_shared"}
    for s in searches.values():
        assert s["max_tokens_per_pair"] == 64 and s["note"] == "cap reached" and s["model"] == "toy"
        assert [t["tokens"] for t in s["tries"]] == [32, 64] and all(t["ok"] for t in s["tries"])
        last = s["tries"][-1]
        assert last["split"] == [32, 16, 16] and last["sequence_lengths"] == [48, 48]  # 2 : 1 : 1, untruncated
        assert last["labelled"] == 32 and last["step_s"] > 0 and last["mfu"] > 0 and len(last["losses"]) == 1
    assert searches["prefix_shared"]["layout"] == "prefix_shared" and searches["stock"]["layout"] == "padded"
    assert "| toy | prefix_shared | prefix_shared | sdpa |" in (tmp_path / "results.md").read_text()


def test_fixed_lengths_and_options(tmp_path):
    argv = ["--models", "toy", "--trainers", "stock,padded", "--mode", "fixed", "--lengths", "40,8192", "--steps", "1",
            "--option", "tiled_mlp_tokens=16", "--in-process", "--no-plots", "--out", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    fixed = json.loads((tmp_path / "results.json").read_text())["fixed"]
    assert [r["status"] for r in fixed] == ["fits", "beyond context"] * 2  # the toy's context is 4,096
    assert fixed[0]["applied_options"] == {} and fixed[2]["applied_options"] == {"tiled_mlp_tokens": 16}  # stock: none
    assert "| toy | padded | tiled_mlp_tokens=16 | 40 | fits |" in (tmp_path / "results.md").read_text()
    with pytest.raises(SystemExit, match="FusedCPOConfig has no such field"):
        bench.main(["--models", "toy", "--option", "no_such_knob=1", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown model or trainer"):
        bench.main(["--models", "toy", "--trainers", "fast", "--out", str(tmp_path)])


@pytest.mark.slow
def test_a_try_in_a_subprocess(tmp_path):
    """The OOM-safe path: the try runs in a fresh interpreter and its record comes back through a file."""
    argv = ["--models", "toy", "--trainers", "prefix_shared", "--mode", "fixed", "--lengths", "32", "--steps", "1",
            "--no-plots", "--out", str(tmp_path), "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    assert bench.main(argv) == 0
    fixed = json.loads((tmp_path / "results.json").read_text())["fixed"]
    assert fixed[0]["status"] == "fits" and (tmp_path / "logs" / "toy_prefix_shared_32.log").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "results.json", "results.md"]
