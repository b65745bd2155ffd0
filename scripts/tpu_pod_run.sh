#!/usr/bin/env bash
# Run ace-jax on every worker of a Cloud TPU VM pod slice (see docs/tpu.md).
#
# Usage:
#   scripts/tpu_pod_run.sh setup                 # clone/pull, then scripts/worker_setup.sh on all workers
#   scripts/tpu_pod_run.sh exec   -- CMD ARGS... # run CMD in the repo on all workers, wait, stream output
#   scripts/tpu_pod_run.sh launch -- CMD ARGS... # start CMD detached (nohup) on all workers, log per worker
#   scripts/tpu_pod_run.sh status                # is the launched run alive on each worker?
#   scripts/tpu_pod_run.sh logs [WORKER] [N]     # last N (default 50) log lines of one worker (default 0)
#   scripts/tpu_pod_run.sh stop                  # SIGTERM the launched run's process group everywhere,
#                                                # wait for it to end (SIGKILL after STOP_TIMEOUT s, 120)
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
#   PYTHON       the interpreter setup makes the venv with (default: the newest python3.1x >= 3.11
#                on the worker; else uv installs 3.11; else setup stops and says what to do)
#   SANDBOX_VENV where setup builds the sandbox's Kaggle stack (default: REMOTE_DIR/.sandbox-venv;
#                requirements-sandbox.txt; pass --config.sandbox.python=<it>/bin/python)
#   MLEBENCH_SRC a copy of MLE-bench's repository on every worker (setup installs MLE-bench from it;
#                unset: from its git repository, scripts/install_mlebench.sh)
#   WHEELHOUSE   a folder of wheels (pip download -r requirements-sandbox.txt -d DIR): the sandbox
#                env is then installed offline from it
#
# Local workers (TRANSPORT=local; scripts/pod_rehearsal.sh): the same actions on N processes of
# this machine instead of gcloud ssh. Worker i runs with HOME=LOCAL_ROOT/worker<i> (so ~/ace-jax,
# ~/.cache and the logs are its own), WORKER_ID=i, LOCAL_DEVICES CPU devices and the JAX
# coordinator variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID) that a TPU
# VM gets from its metadata. TPU_NAME and ZONE are not needed.
#   LOCAL_ROOT     folder holding the workers' homes (required)
#   LOCAL_WORKERS  how many workers (default 2)
#   LOCAL_DEVICES  CPU devices per worker (default 4)
#   LOCAL_COORDINATOR  host:port of process 0's coordinator (default 127.0.0.1:8476)
#   VENV_SEED      an existing venv with requirements.txt installed: setup links ~/ace-jax/.venv
#                  to it instead of installing a copy per worker (they share one disk here)
#
# Every worker runs the SAME command: JAX's multi-host runtime (jax.distributed.initialize, called by
# launch/tpu_train.py on a pod) discovers the other workers from the TPU metadata; process 0 writes
# metrics and commits the buffer, every host executes its share of the sandbox rollouts.
set -euo pipefail

usage() { sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

[[ $# -ge 1 ]] || usage
action="$1"; shift
case "${action}" in -h|--help|help) usage 0 ;; esac

TRANSPORT="${TRANSPORT:-gcloud}"
case "${TRANSPORT}" in
  gcloud)
    : "${TPU_NAME:?set TPU_NAME to the TPU VM name}"
    : "${ZONE:?set ZONE to the TPU zone}" ;;
  local)
    : "${LOCAL_ROOT:?set LOCAL_ROOT to the folder holding the local workers}"
    LOCAL_WORKERS="${LOCAL_WORKERS:-2}"
    LOCAL_DEVICES="${LOCAL_DEVICES:-4}"
    LOCAL_COORDINATOR="${LOCAL_COORDINATOR:-127.0.0.1:8476}" ;;
  *) echo "TRANSPORT must be gcloud or local, got ${TRANSPORT}" >&2; exit 2 ;;
esac
BRANCH="${BRANCH:-main}"
REMOTE_DIR="${REMOTE_DIR:-~/ace-jax}"
RUN_NAME="${RUN_NAME:-ace}"
WORKERS="${WORKERS:-all}"
EXTRA_ENV="${EXTRA_ENV:-}"
if [[ ! "${RUN_NAME}" =~ ^[A-Za-z0-9._-]+$ ]]; then
  echo "RUN_NAME may only hold letters, digits, '.', '_' and '-': ${RUN_NAME}" >&2; exit 2
fi

# The remote prologue: enter the checkout, activate the venv, set the run environment.
# The checkout is put first on PYTHONPATH: the run imports this commit's ace_jax, whatever else the
# venv holds.
prologue="set -eo pipefail; cd ${REMOTE_DIR}; source .venv/bin/activate; \
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=\$PWD ${EXTRA_ENV}; \
mkdir -p logs; WORKER_ID=\${WORKER_ID:-\$(curl -sf -m 2 -H Metadata-Flavor:Google \
http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number \
2>/dev/null || hostname)}"

# The selected worker numbers of a local run ("all", or a comma-separated list).
local_workers() {
  if [[ "${WORKERS}" == all ]]; then seq 0 $((LOCAL_WORKERS - 1)); else tr ',' '\n' <<< "${WORKERS}"; fi
}

# Run one shell script on worker i of this machine, as a TPU VM worker would run it: its own HOME,
# its CPU devices, and the JAX coordinator variables the TPU metadata gives a pod's hosts.
run_local_worker() {
  local i="$1" script="$2" home="${LOCAL_ROOT}/worker$1"
  mkdir -p "${home}"
  env HOME="${home}" WORKER_ID="${i}" JAX_PLATFORMS=cpu \
    XLA_FLAGS="--xla_force_host_platform_device_count=${LOCAL_DEVICES}" \
    JAX_COORDINATOR_ADDRESS="${LOCAL_COORDINATOR}" JAX_NUM_PROCESSES="${LOCAL_WORKERS}" \
    JAX_PROCESS_ID="${i}" bash -c "${script}" 2>&1 | sed -u "s/^/[worker ${i}] /"
  return "${PIPESTATUS[0]}"
}

# Run one remote shell script on the selected workers (all at once; fails if any worker failed).
on_workers() {
  local script="$1"
  if [[ "${TRANSPORT}" == local ]]; then
    if [[ "${DRY:-0}" == 1 ]]; then
      printf '%s\n' "--- script run by bash on local worker(s) ${WORKERS} ---" "${script}" "---"
      return 0
    fi
    local pids=() i rc=0
    for i in $(local_workers); do
      run_local_worker "${i}" "${script}" & pids+=($!)
    done
    for i in "${pids[@]}"; do wait "${i}" || rc=1; done
    return "${rc}"
  fi
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
$(printf '%q ' env PYTHON="${PYTHON:-}" VENV_SEED="${VENV_SEED:-}" SANDBOX_VENV="${SANDBOX_VENV:-}" \
    WHEELHOUSE="${WHEELHOUSE:-}" MLEBENCH_SRC="${MLEBENCH_SRC:-}" TRANSPORT="${TRANSPORT}") bash scripts/worker_setup.sh"
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
  for _ in \$(seq ${STOP_TIMEOUT:-120}); do kill -0 \$(cat \${pid}) 2>/dev/null || break; sleep 1; done
  if kill -0 \$(cat \${pid}) 2>/dev/null; then
    kill -KILL -- -\$(cat \${pid}); echo \"worker \${WORKER_ID}: still running after ${STOP_TIMEOUT:-120} s: killed\"
  else
    echo \"worker \${WORKER_ID}: stopped\"
  fi
else
  echo \"worker \${WORKER_ID}: not running\"
fi"
    ;;
  *)
    echo "unknown action: ${action}" >&2
    usage
    ;;
esac
