#!/usr/bin/env bash
# Installs MLE-bench (its registry, preparers, graders and competition files) into the active
# Python environment, with what its preparers and graders import (requirements-mlebench.txt),
# as MLE-bench's README installs it: from its git repository, or from a copy of it on disk.
#
#   bash scripts/install_mlebench.sh                  # clone github.com/openai/mle-bench (+ git lfs pull)
#   bash scripts/install_mlebench.sh PATH             # a copy of the repository (e.g. a machine
#   MLEBENCH_SRC=PATH bash scripts/install_mlebench.sh   # without access to GitHub); read-only is fine
#
# MLE-bench goes in with --no-deps: its own list pulls tensorflow, kaggle, docker, openai and more
# for commands a trainer host never runs. The copy is built from a scratch folder, since pip builds
# in the source folder and a shared copy may be read-only. Leaderboards: a copy without
# `git lfs pull` holds Git LFS pointers; the tasks then load without medals (a warning says so).
set -euo pipefail
cd "$(dirname "$0")/.."
src="${1:-${MLEBENCH_SRC:-}}"
pip_q() { pip install --quiet --disable-pip-version-check "$@"; }

pip_q -r requirements-mlebench.txt
if [[ -z "${src}" ]]; then
  src="${XDG_CACHE_HOME:-${HOME}/.cache}/ace-jax/mle-bench"
  if [[ ! -d "${src}/.git" ]]; then
    git clone --quiet https://github.com/openai/mle-bench "${src}"
  fi
  if git -C "${src}" lfs version >/dev/null 2>&1; then
    git -C "${src}" lfs fetch --all && git -C "${src}" lfs pull
  else
    echo "install_mlebench: git-lfs is not installed; leaderboards stay Git LFS pointers (no medals)" >&2
  fi
fi
[[ -f "${src}/pyproject.toml" && -d "${src}/mlebench/competitions" ]] || {
  echo "install_mlebench: ${src} is no MLE-bench repository (no pyproject.toml / mlebench/competitions)" >&2
  exit 2; }
build="$(mktemp -d)"
trap 'rm -rf "${build}"' EXIT
cp -r "${src}/." "${build}/"
chmod -R u+w "${build}"
pip_q --no-deps --force-reinstall "${build}"   # a few seconds
python -c 'from mlebench.registry import registry; print("install_mlebench: mlebench", len(registry.list_competition_ids()), "competitions from", "'"${src}"'")'
