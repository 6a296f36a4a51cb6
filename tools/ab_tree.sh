#!/usr/bin/env bash
# Write the source tree of COMMIT into .ab/COMMIT (git-ignored), for a same-run A/B on the device machine:
#   tools/ab_tree.sh 13da7d5   then   GPU_CHECK_GATE=.ab/13da7d5 tools/gpu_check.sh   (carry: .ab)
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${1:?usage: tools/ab_tree.sh COMMIT}
dest=.ab/$commit
rm -rf "$dest" && mkdir -p "$dest"
git archive "$commit" pyproject.toml nanoqwen templates config tune | tar -x -C "$dest"
echo "$dest"
