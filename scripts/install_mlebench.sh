#!/usr/bin/env bash
# Installs MLE-bench (its registry, preparers, graders and competition files) into the active
# Python environment, with what its preparers and graders import (requirements-mlebench.txt),
# as MLE-bench's README installs it: from its git repository, or from a copy of it on disk.
#
#   bash scripts/install_mlebench.sh                  # clone github.com/openai/mle-bench (+ git lfs pull)
#   bash scripts/install_mlebench.sh PATH             # a copy of the repository (e.g. a machine
#   MLEBENCH_SRC=PATH bash scripts/install_mlebench.sh   # without access to GitHub); read-only is fine
#   bash scripts/install_mlebench.sh [PATH] --prepare-venv DIR
#       also a venv DIR of its own for MLE-bench's preparers, with tensorflow (siim-isic-melanoma-
#       classification's preparer reads TFRecords with it; the trainer's venv must not hold it:
#       with tensorflow importable, Orbax's epath sends gs:// through tf.io.gfile instead of
#       gcsfs). launch/check_mlebench.py uses .mlebench-prepare-venv when it exists.
#
# MLE-bench goes in with --no-deps: its own list pulls tensorflow, kaggle, docker, openai and more
# for commands a trainer host never runs. The copy is built from a scratch folder, since pip builds
# in the source folder and a shared copy may be read-only. Leaderboards: a copy without
# `git lfs pull` holds Git LFS pointers; the tasks then load without medals (a warning says so).
set -euo pipefail
cd "$(dirname "$0")/.."
src="${MLEBENCH_SRC:-}" prepare_venv=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prepare-venv) prepare_venv="$2"; shift 2 ;;
    *) src="$1"; shift ;;
  esac
done
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
mkdir -p "${build}/src" && cp -r "${src}/." "${build}/src/"
chmod -R u+w "${build}/src"
# one wheel, built once, for this venv and the preparers' venv
pip wheel --quiet --disable-pip-version-check --no-deps -w "${build}/wheel" "${build}/src"
wheel="$(ls "${build}"/wheel/mlebench-*.whl)"
pip_q --no-deps --force-reinstall "${wheel}"
if [[ -n "${prepare_venv}" ]]; then
  # the preparers' own venv: MLE-bench, what they import, tensorflow; numpy / pandas /
  # scikit-learn / scipy at requirements.txt's pins (the preparers' splits depend on them)
  [[ -x "${prepare_venv}/bin/python" ]] || python3 -m venv "${prepare_venv}"
  grep -E '^(numpy|pandas|scikit-learn|scipy|pyyaml|tqdm)[=<>]' requirements.txt > "${build}/pins.txt"
  "${prepare_venv}/bin/pip" install --quiet --disable-pip-version-check -c "${build}/pins.txt" \
    -r requirements-mlebench.txt numpy pandas scikit-learn scipy pyyaml tqdm pillow \
    "tensorflow-cpu>=2.16,<3"
  "${prepare_venv}/bin/pip" install --quiet --disable-pip-version-check --no-deps --force-reinstall "${wheel}"
  "${prepare_venv}/bin/python" -c 'import mlebench.registry, tensorflow' || {
    echo "install_mlebench: the preparers' venv ${prepare_venv} does not import mlebench and tensorflow" >&2
    exit 1; }
  echo "install_mlebench: preparers' venv ${prepare_venv} (with tensorflow)"
fi
python -c 'from mlebench.registry import registry; print("install_mlebench: mlebench", len(registry.list_competition_ids()), "competitions from", "'"${src}"'")'
