#!/usr/bin/env bash
# Stage earlier versions of the package for `gpu_run.sh kernel-ab` (an A/B/A long run against the working tree).
#   bash scripts/stage_ab.sh REV [REV...]   (on this machine) writes ab/<short rev>/trl_fused_cpo from git;
#   then carry "ab" with the device call. ab/ is ignored by git.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || { echo "usage: bash scripts/stage_ab.sh REV [REV...]" >&2; exit 2; }
for rev in "$@"; do
  short=$(git rev-parse --short "$rev")
  rm -rf "ab/$short" && mkdir -p "ab/$short"
  git archive "$short" trl_fused_cpo | tar -x -C "ab/$short"
  echo "staged ab/$short"
done
