#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU-capable tests, then the stage profile.
#   (on the GPU machine) bash scripts/gpu_run.sh [what...]   what: tests profile kernel e2e (default: tests profile)
set -uo pipefail
bash .whl/gpu-wheels install .whl >/dev/null && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TRL_EXPERIMENTAL_SILENCE=1
OUT=${OUT:-outputs/gpu}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
  python3 -c "import torch, triton, transformers, trl; print(torch.__version__, triton.__version__, transformers.__version__, trl.__version__)"; } | tee "$OUT/env.txt"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests profile)
for what in "${steps[@]}"; do
  case $what in
    tests) python3 -m pytest -q -x tests/gpu tests/ops tests/test_loss.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.txt" ;;
    profile) python3 scripts/profile_fused_op.py --json "$OUT/profile.json" | tail -60 ;;
    kernel) python3 scripts/benchmark_kernel.py --out "$OUT" 2>&1 | tail -80 ;;
    e2e) python3 scripts/benchmark_e2e.py --out "$OUT" 2>&1 | tail -60 ;;
    *) echo "unknown step $what" ;;
  esac
done
