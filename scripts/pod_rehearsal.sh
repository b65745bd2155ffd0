#!/usr/bin/env bash
# The pod run of docs/tpu.md, rehearsed on this machine: the runbook's own commands (the lines
# marked "runbook" below; tests/scripts/test_pod_rehearsal.py fails when they drift from the
# doc's), run by the same scripts/tpu_pod_run.sh pointed at local workers (TRANSPORT=local: 2
# processes of 4 CPU devices, one jax.distributed job), against a gs:// bucket (an emulator on
# loopback) that holds only what a user puts there: an HF model folder (the tiny policy standing
# in for Qwen3-30B-A3B) and MLE-bench competitions prepared by MLE-bench's own code.
#
#   bash scripts/pod_rehearsal.sh            # the whole sequence (~15-25 min on 2 cores)
#   bash scripts/pod_rehearsal.sh --reduced  # CI: no dry run, no lost host (stop after 2 steps)
#
# Sequence: the bucket's data -> setup every worker -> the sandbox's Kaggle stack on every worker
# -> dry run -> launch and run RL steps -> kill -9 one host mid-step (the other must stop with
# the lost-host message) -> stop, relaunch, resume to the last step -> evaluate one competition
# -> export to an HF folder in the bucket. Its last line is one JSON object (hosts, rl_steps,
# resumed, tasks, mlebench_prepared, engine, tokenizer_bytes_per_host, kaggle_stack, exported,
# the bytes each host downloaded, seconds per phase).
#
# Environment: REHEARSAL_DIR (default: a new folder under /tmp), MLEBENCH_SRC (a copy of
# MLE-bench's repository), VENV_SEED (the venv
# every worker uses; default: the active one), WHEELHOUSE (offline wheels for the sandbox's env).
# MLE-bench is installed with scripts/install_mlebench.sh (from MLEBENCH_SRC, else GitHub) when it
# is not importable; the competitions are MLE-bench Lite's, prepared by MLE-bench's own code.
#
# What differs from a pod, and why: the bucket is an emulator, so Orbax's OCDBT layout is off
# (ace_jax/runtime/checkpoint.py says why: the emulator sends no object generation with a read);
# the weights are 2 layers of width 64; the hosts are CPU processes of one machine.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "${repo}"
reduced=0
[[ "${1:-}" == "--reduced" ]] && reduced=1

root="${REHEARSAL_DIR:-$(mktemp -d /tmp/ace-rehearsal.XXXXXX)}"
mkdir -p "${root}"
phases="${root}/phases.txt"; : > "${phases}"
venv="${VENV_SEED:-${VIRTUAL_ENV:-${repo}/.venv}}"
[[ -x "${venv}/bin/python" ]] || { echo "no venv at ${venv}: make it (README) or set VENV_SEED" >&2; exit 2; }
source "${venv}/bin/activate"
export JAX_PLATFORMS=cpu   # the driver's own helpers (no TPU here; libtpu is installed)
free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
t_start=0
phase() { t_start="$(date +%s.%N)"; echo "=== rehearsal: $1"; }
phase_end() { echo "$1 ${t_start} $(date +%s.%N)" >> "${phases}"; }

# --- the bucket, and the environment every worker and tool gets -----------------------------------
emu_port="$(free_port)"
python scripts/rehearsal.py emulator --port "${emu_port}" --log "${root}/emulator.log" \
  --pidfile "${root}/emulator.pid"
cleanup() {
  TRANSPORT=local LOCAL_ROOT="${root}" RUN_NAME=ace30b scripts/tpu_pod_run.sh stop >/dev/null 2>&1 || true
  [[ -f "${root}/emulator.pid" ]] && kill "$(cat "${root}/emulator.pid")" 2>/dev/null || true
}
trap cleanup EXIT
emu="STORAGE_EMULATOR_HOST=http://127.0.0.1:${emu_port} TENSORSTORE_GCS_HTTP_URL=http://127.0.0.1:${emu_port} GOOGLE_AUTH_TOKEN_FOR_TESTING=fake FSSPEC_GS_TOKEN=anon GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false NO_GCE_CHECK=true"
export ${emu}
export EXTRA_ENV="${emu}"
export TRANSPORT=local LOCAL_ROOT="${root}" LOCAL_WORKERS=2 LOCAL_DEVICES=4
export LOCAL_COORDINATOR="127.0.0.1:$(free_port)"
export VENV_SEED="${venv}"
export SANDBOX_VENV="${SANDBOX_VENV:-${repo}/.sandbox-venv}"
# The repository as it is now (uncommitted files included), as a commit the workers clone.
snapshot="$(cd "${repo}" && tmp_index="$(mktemp)" && cp .git/index "${tmp_index}" \
  && GIT_INDEX_FILE="${tmp_index}" git add -A && tree="$(GIT_INDEX_FILE="${tmp_index}" git write-tree)" \
  && rm -f "${tmp_index}" && git -c user.name=pod-rehearsal -c user.email=pod-rehearsal@localhost \
     commit-tree "${tree}" -p HEAD -m "pod rehearsal snapshot")"
git init -q --bare "${root}/origin.git"
git -C "${repo}" push -q "${root}/origin.git" "${snapshot}:refs/heads/rehearsal"
export REPO_URL="${root}/origin.git" BRANCH=rehearsal
export BUCKET=ace-rehearsal CONFIG=configs/ace30b.py:rehearsal
# MLE-bench Lite: the runbook's example (text, json), an image competition and a tabular one
COMPETITIONS="random-acts-of-pizza,aerial-cactus-identification,tabular-playground-series-dec-2021"
TASK_IDS="('${COMPETITIONS//,/\',\'}')"
MLEBENCH_DATA="${root}/mlebench-data"
EVAL_TASK=random-acts-of-pizza

# --- what the user puts in the bucket (docs/tpu.md section 3) --------------------------------------
phase data
python scripts/rehearsal.py hf-folder --out "gs://${BUCKET}/Qwen3-30B-A3B"
if [[ -n "${MLEBENCH_SRC:-}" ]] || ! python -c 'import mlebench.registry' 2>/dev/null; then
  bash scripts/install_mlebench.sh ${MLEBENCH_SRC:+"${MLEBENCH_SRC}"}
fi
python scripts/rehearsal.py competitions --raw "${root}/raw" --data "${MLEBENCH_DATA}" --ids "${COMPETITIONS}"
python launch/stage_mlebench.py --data_dir=$MLEBENCH_DATA --competitions=$COMPETITIONS --dest=gs://$BUCKET/mlebench  # runbook
python launch/check_mlebench.py --competitions=$COMPETITIONS  # runbook
phase_end data

phase setup
scripts/tpu_pod_run.sh setup  # runbook
scripts/tpu_pod_run.sh exec -- python -m sandbox.backends.stack_check --backend=bwrap --python=.sandbox-venv/bin/python 2>&1 | tee "${root}/kaggle_stack.log"  # runbook
phase_end setup

if [[ "${reduced}" == 0 ]]; then
  phase dry_run
  WORKERS=0 scripts/tpu_pod_run.sh exec -- python launch/tpu_train.py --config=$CONFIG --dry_run  # runbook
  phase_end dry_run
fi

RUN="python launch/tpu_train.py --config=$CONFIG --no_progress --config.workdir=gs://$BUCKET/runs/ace30b --config.model.hf_path=gs://$BUCKET/Qwen3-30B-A3B --config.model.tokenizer_path=gs://$BUCKET/Qwen3-30B-A3B --config.buffer.store.url=gs://$BUCKET/runs/ace30b/buffer --config.checkpoint.directory=gs://$BUCKET/runs/ace30b/checkpoints --config.tasks.data_dir=gs://$BUCKET/mlebench --config.tasks.ids=$TASK_IDS --config.compile_cache_dir=gs://$BUCKET/xla_cache"  # runbook
workdir="gs://${BUCKET}/runs/ace30b"
pidfile() { echo "${root}/worker$1/ace-jax/logs/ace30b-worker$1.pid"; }
wait_exit() {  # until worker $1's run has ended (at most $2 s)
  local pid; pid="$(cat "$(pidfile "$1")")"
  for _ in $(seq "$2"); do kill -0 "${pid}" 2>/dev/null || return 0; sleep 1; done
  echo "worker $1's run (pid ${pid}) still runs after $2 s" >&2; return 1
}

wait_steps() {  # until the run has logged $1 RL steps
  python scripts/rehearsal.py wait --workdir "${workdir}" --step "$1" --timeout 1500 \
    --alive "$(pidfile 0)" && return 0
  # CPU hosts only: a gloo collective between the two processes times out when one reaches a
  # program's first collective much later than the other (2 loaded cores). Relaunched once, as a
  # user would relaunch, and counted in the JSON (launch_retries). A TPU pod has no gloo.
  local w
  for w in 0 1; do   # this launch's part of the log (launch appends a "=== date commit" line)
    awk '/^=== /{n=NR} {l[NR]=$0} END{for(i=n;i<=NR;i++) print l[i]}' \
      "${root}/worker${w}/ace-jax/logs/ace30b-worker${w}.log"
  done | grep -q "Gloo context initialization failed" || return 1
  echo "launch_retry" >> "${root}/retries.txt"
  wait_exit 0 180; wait_exit 1 180
  RUN_NAME=ace30b scripts/tpu_pod_run.sh launch -- $RUN
  python scripts/rehearsal.py wait --workdir "${workdir}" --step "$1" --timeout 1500 \
    --alive "$(pidfile 0)"
}

phase launch
first_steps=$(( reduced ? 2 : 1 ))
RUN_NAME=ace30b scripts/tpu_pod_run.sh launch -- $RUN  # runbook
RUN_NAME=ace30b scripts/tpu_pod_run.sh status  # runbook
wait_steps "${first_steps}"
phase_end launch

if [[ "${reduced}" == 0 ]]; then
  phase lost_host
  sleep 5   # into the next step
  kill -9 -- "-$(cat "$(pidfile 1)")"
  wait_exit 0 180   # the survivor must stop by itself (mesh.heartbeat_timeout_s is 20 s here)
  # our PeerLostError when Python notices first, else JAX's own fatal error (docs/tpu.md, section 8)
  grep -m1 -E "Another process of this run died|another task died" \
    "${root}/worker0/ace-jax/logs/ace30b-worker0.log" > "${root}/lost_host.txt"
  phase_end lost_host
else
  RUN_NAME=ace30b scripts/tpu_pod_run.sh stop  # runbook
  wait_exit 0 120; wait_exit 1 120
fi

phase resume
RUN_NAME=ace30b scripts/tpu_pod_run.sh stop  # runbook
RUN_NAME=ace30b scripts/tpu_pod_run.sh launch -- $RUN  # runbook
last=4
wait_steps "${last}"
wait_exit 0 300; wait_exit 1 300
phase_end resume

phase evaluate
scripts/tpu_pod_run.sh exec -- python launch/evaluate.py --policy=run:gs://$BUCKET/runs/ace30b --tasks=$EVAL_TASK --seeds=0 --max_steps=1 --no_progress --out=gs://$BUCKET/evals/ace30b  # runbook
phase_end evaluate

phase export
WORKERS=0 scripts/tpu_pod_run.sh exec -- python launch/export_hf.py --run=gs://$BUCKET/runs/ace30b --out=gs://$BUCKET/exports/ace30b --dtype=bfloat16  # runbook
phase_end export

python scripts/rehearsal.py summary --root "${root}" --workdir "${workdir}" \
  --export "gs://${BUCKET}/exports/ace30b" --hosts 2 --phases "${phases}" \
  --tasks_url "gs://${BUCKET}/mlebench" --ids "${COMPETITIONS}" \
  --kaggle_log "${root}/kaggle_stack.log" --lost_host "${root}/lost_host.txt" \
  --retries "${root}/retries.txt"
