#!/usr/bin/env bash
# Builds the sandbox's Python environment (the Kaggle stack of requirements-sandbox.txt) as a venv
# at DEST, for `--config.sandbox.python=DEST/bin/python`.
#
#   bash scripts/build_sandbox_env.sh DEST [--wheelhouse DIR] [--python PY] [--torch-index URL|none]
#
#   DEST          where the venv goes (made, or rebuilt when its stamp is stale). A non-empty DEST
#                 that is not a venv is refused.
#   --wheelhouse  install offline from DIR only (`--no-index --find-links DIR`); fill DIR once, on
#                 a host with the same Python and platform, with `pip download -r
#                 requirements-sandbox.txt -d DIR --extra-index-url https://download.pytorch.org/whl/cpu`
#                 (~470 MB). Without it: the configured indexes (PyPI).
#   --python      the interpreter to base the venv on (default: $PYTHON, else `python3` on PATH:
#                 run it with the trainer's venv active to get the trainer's Python). >= 3.11:
#                 the sandbox runs scripts with `python -P`.
#   --torch-index PyTorch's CPU wheel index (https://download.pytorch.org/whl/cpu), added when
#                 reachable (default `none`: only the configured indexes; scripts/worker_setup.sh
#                 passes it on a pod). PyPI has only the CUDA build of torch for Linux x86_64;
#                 see requirements-sandbox.txt.
#
# Idempotent: DEST/.ace-sandbox-stamp holds the sha256 of requirements-sandbox.txt and the Python
# version; when they match, the script says so and returns at once. Concurrent calls wait for each
# other (flock on DEST's parent folder). It ends by running sandbox/backends/stack_check.py
# with the new interpreter (imports lightgbm, xgboost, catboost, torch, sklearn; fits a tiny model
# with each; prints the versions), and writes the stamp only when that passed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQUIREMENTS="$REPO/requirements-sandbox.txt"
CHECK="$REPO/sandbox/backends/stack_check.py"
STAMP_NAME=".ace-sandbox-stamp"

die() { echo "build_sandbox_env: $*" >&2; exit 1; }
log() { echo "build_sandbox_env: $*" >&2; }

usage() { sed -n '2,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

parse_args() {
  DEST="" WHEELHOUSE="" PY="${PYTHON:-}" TORCH_INDEX="none"
  while [ $# -gt 0 ]; do
    case "$1" in
      --wheelhouse) WHEELHOUSE="${2:?--wheelhouse needs a folder}"; shift 2 ;;
      --python) PY="${2:?--python needs an interpreter}"; shift 2 ;;
      --torch-index) TORCH_INDEX="${2:?--torch-index needs a URL or none}"; shift 2 ;;
      -h|--help) usage; exit 0 ;;
      -*) die "unknown option $1 (see --help)" ;;
      *) [ -z "$DEST" ] || die "one DEST only (got $DEST and $1)"; DEST="$1"; shift ;;
    esac
  done
  [ -n "$DEST" ] || { usage >&2; die "DEST is required"; }
  PY="${PY:-python3}"
}

# The base interpreter: exists, runs, and is Python >= 3.11. Prints its version.
check_python() {
  command -v "$PY" >/dev/null 2>&1 || die "no interpreter '$PY' (pass --python or set PYTHON)"
  "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null || die \
    "'$PY' is Python $("$PY" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null || echo '?'); the sandbox needs >= 3.11 (it runs scripts with -P)"
  "$PY" -c 'import sys; print(sys.version.split()[0])'
}

# What the stamp records: the requirements' hash and the base Python's version.
stamp_text() {
  local sha
  sha="$(sha256sum "$REQUIREMENTS" | cut -d' ' -f1)"
  printf 'requirements-sha256=%s\npython=%s\n' "$sha" "$1"
}

# Echoes the pip options that pick where wheels come from.
source_options() {
  if [ -n "$WHEELHOUSE" ]; then
    [ -d "$WHEELHOUSE" ] || die "wheelhouse $WHEELHOUSE is not a folder (fill it with: pip download -r requirements-sandbox.txt -d $WHEELHOUSE)"
    echo "--no-index --find-links $WHEELHOUSE"
    return
  fi
  if [ "$TORCH_INDEX" != "none" ] && "$PY" - "$TORCH_INDEX" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
EOF
  then
    echo "--extra-index-url $TORCH_INDEX"
  else
    log "PyTorch's CPU index ($TORCH_INDEX) is not used (unreachable or 'none'): torch==...+cpu must come from the configured indexes or find-links"
  fi
}

# A fresh venv at DEST; refuses to clear a non-empty folder that is not a venv.
make_venv() {
  if [ -e "$DEST" ] && [ -n "$(ls -A "$DEST" 2>/dev/null)" ] && [ ! -f "$DEST/pyvenv.cfg" ]; then
    die "$DEST exists and is not a venv; refusing to clear it (pick another DEST)"
  fi
  "$PY" -m venv --clear "$DEST" || die "'$PY -m venv' failed (Debian/Ubuntu: apt-get install python3-venv)"
}

main() {
  parse_args "$@"
  local version want start opts
  version="$(check_python)"
  want="$(stamp_text "$version")"
  mkdir -p "$(dirname "$DEST")"
  if command -v flock >/dev/null 2>&1; then  # no lock file to clean up: the parent folder
    exec 9<"$(dirname "$DEST")"
    flock 9
  fi
  if [ -f "$DEST/$STAMP_NAME" ] && [ "$(cat "$DEST/$STAMP_NAME")" = "$want" ] && [ -x "$DEST/bin/python" ]; then
    log "$DEST is up to date (python $version, $(head -1 "$DEST/$STAMP_NAME"))"
    return 0
  fi
  start=$SECONDS
  log "building $DEST with python $version from ${WHEELHOUSE:-the configured indexes}"
  opts="$(source_options)"
  make_venv
  # shellcheck disable=SC2086  # opts is a list of words
  "$DEST/bin/python" -m pip install --no-input --disable-pip-version-check -q \
    $opts -r "$REQUIREMENTS" || die "pip install -r requirements-sandbox.txt failed"
  "$DEST/bin/python" -m pip check || die "the installed packages conflict (pip check)"
  "$DEST/bin/python" -I "$CHECK" || die "the Kaggle-stack check failed with $DEST/bin/python"
  echo "$want" > "$DEST/$STAMP_NAME"
  log "built $DEST in $((SECONDS - start)) s, $(du -sh "$DEST" | cut -f1)"
}

main "$@"
