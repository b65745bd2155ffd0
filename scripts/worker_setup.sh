#!/usr/bin/env bash
# Set up one worker of a pod (run in its checkout by `scripts/tpu_pod_run.sh setup`): a Python >=
# 3.11 venv with the trainer's requirements (+ jax[tpu] on a TPU VM), and the sandbox's Kaggle
# stack in a venv of its own. Idempotent: a second run installs nothing new.
#
# Environment (all optional):
#   PYTHON        interpreter to make the venv with (default: the newest python3.1x >= 3.11 on
#                 PATH; else uv, installed from PyPI into ~/.local, installs CPython 3.11)
#   VENV_SEED     an existing venv with requirements.txt installed: .venv becomes a link to it
#                 (local rehearsal workers share one disk; a pod's hosts never set this)
#   SANDBOX_VENV  where the sandbox's venv goes (default: .sandbox-venv in the checkout; elsewhere,
#                 .sandbox-venv becomes a link to it)
#   MLEBENCH_SRC  a copy of MLE-bench's repository (a host without GitHub access); unset: cloned
#                 from GitHub. MLE-bench's graders score every execution on this host.
#   WHEELHOUSE    wheels for the sandbox's venv (installed offline from them when given)
#   TRANSPORT     "local": CPU workers of this machine, so no jax[tpu]
set -euo pipefail
cd "$(dirname "$0")/.."

# The interpreter: every pin needs Python >= 3.11 (TPU VM images ship 3.10 on Ubuntu 22.04).
is_311() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
pick_python() {
  local p
  for p in ${PYTHON:-} python3.13 python3.12 python3.11 python3; do
    if command -v "${p}" >/dev/null && is_311 "${p}"; then command -v "${p}"; return 0; fi
  done
  return 1
}

if [[ -n "${VENV_SEED:-}" ]]; then
  [[ -x "${VENV_SEED}/bin/python" ]] || { echo "VENV_SEED=${VENV_SEED} holds no bin/python" >&2; exit 2; }
  [[ -e .venv && ! -L .venv ]] && rm -rf .venv
  ln -sfn "${VENV_SEED}" .venv
elif [[ ! -x .venv/bin/python ]] || ! is_311 .venv/bin/python; then
  rm -rf .venv
  if python_bin="$(pick_python)"; then
    "${python_bin}" -m venv .venv
  else
    echo "no Python >= 3.11 on this worker ($(python3 --version 2>&1)); installing one with uv" >&2
    python3 -m pip install --quiet --user uv || {
      echo "setup: cannot install uv (pip install --user uv failed). Install Python >= 3.11" \
           "(e.g. sudo apt-get install python3.11 python3.11-venv) and rerun with PYTHON=python3.11" >&2
      exit 1; }
    uv="${HOME}/.local/bin/uv"
    "${uv}" python install 3.11
    "${uv}" venv --seed --python 3.11 .venv
  fi
fi
source .venv/bin/activate
is_311 python || { echo "setup: .venv has $(python --version); needs >= 3.11" >&2; exit 1; }

if [[ -z "${VENV_SEED:-}" ]]; then
  pip install --quiet --upgrade pip
  pip install --quiet -r requirements.txt
  if [[ "${TRANSPORT:-gcloud}" != local ]]; then
    JAX_VERSION="$(python -c 'import jax; print(jax.__version__)')"
    pip install --quiet "jax[tpu]==${JAX_VERSION}"
  fi
fi
# MLE-bench (its preparers, graders and competition files) in the trainer's venv: every host
# grades its own executions with MLE-bench's grade_fn (without it, a loud fallback to our metrics).
if [[ -z "${VENV_SEED:-}" ]] || ! python -c 'import mlebench.registry' 2>/dev/null; then
  bash scripts/install_mlebench.sh ${MLEBENCH_SRC:+"${MLEBENCH_SRC}"}
fi

# The sandbox's interpreter and the Kaggle stack (requirements-sandbox.txt).
# configs/ace30b.py runs executions with .sandbox-venv/bin/python (sandbox.python): a SANDBOX_VENV
# elsewhere is linked there.
sandbox_venv="${SANDBOX_VENV:-${PWD}/.sandbox-venv}"
torch_index=none   # local workers: this machine's torch==2.13.0+cpu; a pod: PyTorch's CPU index
[[ "${TRANSPORT:-gcloud}" != local ]] && torch_index=https://download.pytorch.org/whl/cpu
bash scripts/build_sandbox_env.sh "${sandbox_venv}" --torch-index "${torch_index}" \
  ${WHEELHOUSE:+--wheelhouse "${WHEELHOUSE}"}
if [[ "$(realpath -m "${sandbox_venv}")" != "$(realpath -m .sandbox-venv)" ]]; then
  [[ -e .sandbox-venv && ! -L .sandbox-venv ]] && rm -rf .sandbox-venv
  ln -sfn "${sandbox_venv}" .sandbox-venv
fi

python -c 'import mlebench.registry' || { echo "setup: MLE-bench does not import" >&2; exit 1; }
python -c 'import sys, jax; print("worker setup:", sys.version.split()[0], "jax", jax.__version__, jax.local_device_count(), "local", jax.devices()[0].device_kind, "devices")'
echo "worker setup: sandbox python ${sandbox_venv}/bin/python"
