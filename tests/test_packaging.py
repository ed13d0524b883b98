"""pyproject.toml's metadata: the bounds admit the versions the package runs on, and the runtime needs no plotting.

Installing into an environment that already holds the newest torch/triton/transformers is checked for real by
`make test-latest` (.ci/run's second lane, .ci/check_no_downgrade.py); these are the cheap static checks.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# The GPU machine (the design notes, §5; trl and datasets carried there as wheels) and the CPU lanes (Makefile).
GPU_MACHINE = {
    "torch": "2.11.0",
    "triton": "3.6.0",
    "transformers": "5.17.0",
    "accelerate": "1.15.0",
    "peft": "0.21.0",
    "trl": "1.16.0",
    "datasets": "5.2.0",
}
CPU_MAIN_LANE = {"torch": "2.13.0", "triton": "3.7.1"}


def requirements() -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    return {r.name.lower(): r for r in reqs}


@pytest.mark.parametrize("pinned", [GPU_MACHINE, CPU_MAIN_LANE], ids=["gpu-machine", "cpu-main-lane"])
def test_bounds_admit_the_versions_we_run_on(pinned):
    reqs = requirements()
    for name, version in pinned.items():
        assert reqs[name].specifier.contains(version, prereleases=True), (
            f"{name} {reqs[name].specifier} excludes {version}"
        )


def test_triton_bound_admits_what_cuda_torch_pins():
    # torch 2.13.0's Linux wheel requires triton==3.7.1, torch 2.15.0's triton~=3.9.0: a bound below either makes pip
    # downgrade torch (issue 29).
    spec = requirements()["triton"].specifier
    assert spec.contains("3.7.1") and spec.contains("3.9.0")


def test_plotting_is_an_extra_not_a_runtime_dependency():
    assert "matplotlib" not in requirements()
    extras = PROJECT["optional-dependencies"]
    assert any(Requirement(r).name == "matplotlib" for r in extras["bench"])
    # the CPU suite runs the benchmark scripts, which plot when they can
    assert any(Requirement(r).name == "trl_fused_cpo" and "bench" in Requirement(r).extras for r in extras["test"])


def test_the_package_never_imports_matplotlib():
    for path in (ROOT / "trl_fused_cpo").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            assert not any(n.split(".")[0] == "matplotlib" for n in names), f"{path} imports matplotlib"


def test_license_is_an_spdx_expression():
    # `license = {text = ...}` makes setuptools >= 77 print a deprecation warning on every install.
    assert PROJECT["license"] == "Apache-2.0"
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    setuptools = next(Requirement(r) for r in build if Requirement(r).name == "setuptools")
    assert not setuptools.specifier.contains("76.1.0") and setuptools.specifier.contains("77.0.0")
