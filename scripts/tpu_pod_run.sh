#!/usr/bin/env bash
# Run ace-jax on every worker of a Cloud TPU VM pod slice (see docs/tpu.md).
#
# Usage:
#   scripts/tpu_pod_run.sh setup                 # clone/pull, venv, pip install (+ jax[tpu]) on all workers
#   scripts/tpu_pod_run.sh exec   -- CMD ARGS... # run CMD in the repo on all workers, wait, stream output
#   scripts/tpu_pod_run.sh launch -- CMD ARGS... # start CMD detached (nohup) on all workers, log per worker
#   scripts/tpu_pod_run.sh status                # is the launched run alive on each worker?
#   scripts/tpu_pod_run.sh logs [WORKER] [N]     # last N (default 50) log lines of one worker (default 0)
#   scripts/tpu_pod_run.sh stop                  # SIGTERM the launched run's process group everywhere
#
# Examples:
#   scripts/tpu_pod_run.sh exec -- python launch/tpu_train.py --config=configs/ace30b.py --dry_run
#   scripts/tpu_pod_run.sh launch -- python launch/tpu_train.py --config=configs/ace30b.py \
#       --config.workdir=gs://my-bucket/runs/ace30b --config.model.hf_path=gs://my-bucket/Qwen3-30B-A3B
#
# Environment (required: TPU_NAME, ZONE; REPO_URL for setup):
#   TPU_NAME     the TPU VM name (gcloud compute tpus tpu-vm create NAME ...)
#   ZONE         its zone, e.g. us-east5-a
#   PROJECT      gcloud project (default: gcloud's configured project)
#   REPO_URL     git URL of this repository (setup clones it; pulls when already cloned)
#   BRANCH       branch or tag to check out (default: main)
#   REMOTE_DIR   checkout directory on the workers (default: ~/ace-jax)
#   RUN_NAME     name of a launched run: logs/<RUN_NAME>-worker<i>.log, .pid (default: ace)
#   WORKERS      which workers (default: all; e.g. 0 for the coordinator only)
#   EXTRA_ENV    extra "K=V K2=V2" exported before CMD on every worker
#   DRY=1        print the gcloud commands instead of running them
#
# Every worker runs the SAME command: JAX's multi-host runtime (jax.distributed.initialize, called by
# launch/tpu_train.py on a pod) discovers the other workers from the TPU metadata; process 0 writes
# metrics and commits the buffer, every host executes its share of the sandbox rollouts.
set -euo pipefail

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

[[ $# -ge 1 ]] || usage
action="$1"; shift
case "${action}" in -h|--help|help) usage 0 ;; esac

: "${TPU_NAME:?set TPU_NAME to the TPU VM name}"
: "${ZONE:?set ZONE to the TPU zone}"
BRANCH="${BRANCH:-main}"
REMOTE_DIR="${REMOTE_DIR:-~/ace-jax}"
RUN_NAME="${RUN_NAME:-ace}"
WORKERS="${WORKERS:-all}"
EXTRA_ENV="${EXTRA_ENV:-}"
if [[ ! "${RUN_NAME}" =~ ^[A-Za-z0-9._-]+$ ]]; then
  echo "RUN_NAME may only hold letters, digits, '.', '_' and '-': ${RUN_NAME}" >&2; exit 2
fi

# The remote prologue: enter the checkout, activate the venv, set the run environment.
prologue="set -eo pipefail; cd ${REMOTE_DIR}; source .venv/bin/activate; \
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false ${EXTRA_ENV}; mkdir -p logs; \
WORKER_ID=\$(curl -sf -m 2 -H Metadata-Flavor:Google \
http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number \
2>/dev/null || hostname)"

# Run one remote shell script on the selected workers.
on_workers() {
  local script="$1"
  local cmd=(gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --zone "${ZONE}" --worker "${WORKERS}")
  [[ -n "${PROJECT:-}" ]] && cmd+=(--project "${PROJECT}")
  cmd+=(--command "bash -c $(printf '%q' "${script}")")
  if [[ "${DRY:-0}" == 1 ]]; then
    printf '%q ' "${cmd[@]:0:${#cmd[@]}-1}"; echo "<script>"
    printf '%s\n' "--- script run by bash on worker(s) ${WORKERS} ---" "${script}" "---"
  else
    "${cmd[@]}"
  fi
}

# Quote the user's command (everything after --) so it survives ssh + bash -c unchanged.
user_command() {
  [[ "${1:-}" == "--" ]] && shift
  [[ $# -ge 1 ]] || { echo "${action}: give the command after --" >&2; exit 2; }
  printf '%q ' "$@"
}

case "${action}" in
  setup)
    : "${REPO_URL:?set REPO_URL to the git URL of this repository}"
    on_workers "set -eo pipefail
if [ -d ${REMOTE_DIR}/.git ]; then
  git -C ${REMOTE_DIR} fetch --quiet origin && git -C ${REMOTE_DIR} checkout --quiet ${BRANCH} \
    && git -C ${REMOTE_DIR} pull --quiet --ff-only origin ${BRANCH}
else
  git clone --quiet --branch ${BRANCH} $(printf '%q' "${REPO_URL}") ${REMOTE_DIR}
fi
cd ${REMOTE_DIR}
command -v bwrap >/dev/null || (sudo apt-get -qq update && sudo apt-get -qq install -y bubblewrap) || true
python3 -m venv .venv
source .venv/bin/activate
pip install --quiet --upgrade pip
pip install --quiet -r requirements.txt
JAX_VERSION=\$(python -c 'import jax; print(jax.__version__)')
pip install --quiet \"jax[tpu]==\${JAX_VERSION}\"
python -c 'import jax; print(\"worker\", jax.process_index(), \"of\", jax.process_count(), \":\", jax.local_device_count(), \"local /\", jax.device_count(), \"global\", jax.devices()[0].device_kind)'"
    ;;
  exec)
    cmd="$(user_command "$@")"
    on_workers "${prologue}; ${cmd}"
    ;;
  launch)
    cmd="$(user_command "$@")"
    log="logs/${RUN_NAME}-worker\${WORKER_ID}.log"
    pid="logs/${RUN_NAME}-worker\${WORKER_ID}.pid"
    on_workers "${prologue}
if [ -f ${pid} ] && kill -0 \$(cat ${pid}) 2>/dev/null; then
  echo \"worker \${WORKER_ID}: run ${RUN_NAME} is already running (pid \$(cat ${pid}))\" >&2; exit 1
fi
{ echo \"=== \$(date -u +%FT%TZ) commit \$(git rev-parse --short HEAD 2>/dev/null || echo none)\"; echo ${cmd}; } >> ${log}
setsid nohup ${cmd} >> ${log} 2>&1 < /dev/null &
echo \$! > ${pid}
echo \"worker \${WORKER_ID}: started pid \$(cat ${pid}), log ${REMOTE_DIR}/${log}\""
    ;;
  status)
    on_workers "${prologue}
pid=logs/${RUN_NAME}-worker\${WORKER_ID}.pid
if [ -f \${pid} ] && kill -0 \$(cat \${pid}) 2>/dev/null; then
  echo \"worker \${WORKER_ID}: running (pid \$(cat \${pid}))\"
else
  echo \"worker \${WORKER_ID}: not running\"
fi
tail -n 2 logs/${RUN_NAME}-worker\${WORKER_ID}.log 2>/dev/null || true"
    ;;
  logs)
    WORKERS="${1:-0}"
    lines="${2:-50}"
    [[ "${lines}" =~ ^[0-9]+$ ]] || { echo "logs: N must be a number" >&2; exit 2; }
    on_workers "${prologue}; tail -n ${lines} logs/${RUN_NAME}-worker\${WORKER_ID}.log"
    ;;
  stop)
    on_workers "${prologue}
pid=logs/${RUN_NAME}-worker\${WORKER_ID}.pid
if [ -f \${pid} ] && kill -0 \$(cat \${pid}) 2>/dev/null; then
  kill -TERM -- -\$(cat \${pid}) && echo \"worker \${WORKER_ID}: sent SIGTERM to the run\"
else
  echo \"worker \${WORKER_ID}: not running\"
fi"
    ;;
  *)
    echo "unknown action: ${action}" >&2
    usage
    ;;
esac
