#!/usr/bin/env bash
# Runs seeds of plan.md's command, then adds them to this folder's raw data (issue 51).
#
#   bash results/procedural_heldout/run.sh run 4,6      # ~1 h a seed alone on 2 cores
#   bash results/procedural_heldout/run.sh export 4,5   # runs.json / metrics.csv.gz, then tables
#   bash results/procedural_heldout/run.sh command 4,5  # prints the compare arguments it runs
#
# `run` makes a worktree at the plan's commit (97d309c) with commit 89b6e6d's grading applied
# (deviations.md says why), and runs plan.md's own command there (read from plan.md, with
# --seeds replaced) at low priority; its log goes to $WORKTREE.log. Running it again resumes:
# finished runs are reused, an interrupted one resumes from its checkpoint. A seed alone keeps
# about 1.25 of 2 cores busy: a second `run` of other seeds (e.g. `run 5,7` beside `run 4,6`)
# shares the worktree (each seed's runs are folders of their own) and takes the rest, ~80 min a
# seed each.
# `export` writes, with this checkout's code, every finished run the worktree holds of the plan's
# seeds (SEEDS, and any other seed's finished arms; an export keeps the runs an earlier export
# wrote), regenerates docs/results.md and its figure and checks them against the raw data.
#
# Environment: WORKTREE (default: ../procedural_heldout at the repository's side), PYTHON
# (default: this checkout's .venv). Stop a run with: pkill -f ace_jax.experiments.compare
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "${here}/../.." && pwd)"
what="${1:?usage: run.sh run|export|command SEEDS}"
seeds="${2:?usage: run.sh run|export|command SEEDS (e.g. 4,5)}"
worktree="${WORKTREE:-$(dirname "${repo}")/procedural_heldout}"
python="${PYTHON:-${repo}/.venv/bin/python}"
plan_commit=97d309c
grading_commit=89b6e6d

# plan.md's command as its words: the indented block from "python -m ace_jax.experiments.compare"
# to the first blank line, continuation backslashes dropped, --seeds replaced.
mapfile -t cmd < <(awk '/^ *python -m ace_jax.experiments.compare/ {on=1} on && /^ *$/ {exit}
                        on {gsub(/\\$/, ""); print}' "${here}/plan.md" | xargs -n1)
[[ "${cmd[0]:-}" == python && "${cmd[2]:-}" == ace_jax.experiments.compare ]] || {
  echo "run.sh: no compare command in ${here}/plan.md" >&2; exit 2; }
args=()
for ((i = 3; i < ${#cmd[@]}; i++)); do
  if [[ "${cmd[i]}" == --seeds ]]; then args+=(--seeds "${seeds}"); i=$((i + 1))
  else args+=("${cmd[i]}"); fi
done

case "${what}" in
  command) printf '%s\n' "${args[@]}" ;;
  run)
    if [[ ! -d "${worktree}" ]]; then
      git -C "${repo}" worktree prune
      git -C "${repo}" worktree add --detach "${worktree}" "${plan_commit}"
      git -C "${repo}" show "${grading_commit}" -- sandbox/grading.py | git -C "${worktree}" apply
    fi
    [[ "$(git -C "${worktree}" rev-parse --short=7 HEAD)" == "${plan_commit}" ]] || {
      echo "run.sh: ${worktree} is not at ${plan_commit}" >&2; exit 2; }
    echo "=== $(date -u) seeds ${seeds}" >> "${worktree}.log"
    cd "${worktree}"
    nohup nice -n 5 "${python}" -m ace_jax.experiments.compare "${args[@]}" \
      >> "${worktree}.log" 2>&1 &
    echo "running seeds ${seeds} in ${worktree} (pid $!); log: ${worktree}.log"
    ;;
  export)
    cd "${repo}"
    "${python}" -m ace_jax.experiments.compare "${args[@]}" --export_only \
      --root "${worktree}/runs/procedural_heldout"
    "${python}" -m ace_jax.experiments.tables --figures
    "${python}" -m ace_jax.experiments.tables --check
    ;;
  *) echo "run.sh: run, export or command, not ${what}" >&2; exit 2 ;;
esac
