#!/usr/bin/env bash
# Write the source tree of COMMIT into .ab/COMMIT (git-ignored), for a same-run A/B on the device machine:
#   tools/ab_tree.sh 13da7d5   then   GPU_CHECK_GATE=.ab/13da7d5 tools/gpu_check.sh   (carry: .ab)
# Patches after the commit (docs/wip, stacked in order) are applied to the tree, which is then .ab/COMMIT+A+B...
# (A, B: the patches' names without .patch); their hunks outside the tree's folders (tests) are left out:
#   tools/ab_tree.sh HEAD docs/wip/a.patch docs/wip/b.patch   ->   .ab/HEAD+a+b
# AB_DIR writes under another folder than .ab.
set -euo pipefail
cd "$(dirname "$0")/.."
commit=${1:?usage: tools/ab_tree.sh COMMIT [PATCH...]}
shift
parts=(pyproject.toml nanoqwen templates config tune)
dest=${AB_DIR:-.ab}/$commit
for p in "$@"; do dest+="+$(basename "$p" .patch)"; done
rm -rf "$dest" && mkdir -p "$dest"
git archive "$commit" "${parts[@]}" | tar -x -C "$dest"
keep=()   # the patches' hunks inside the tree's parts (git apply matches them after --directory)
for part in "${parts[@]}"; do keep+=(--include="$dest/$part" --include="$dest/$part/*"); done
for p in "$@"; do git apply --unsafe-paths --directory="$dest" "${keep[@]}" "$p"; done
echo "$dest"
