#!/usr/bin/env bash
# The package installed as a user installs it: a non-editable `pip install .` into a fresh venv,
# then `python -m ace_jax --help` from outside the checkout (no path into the checkout is
# set). Run by .ci/run after the tests; about as long as the tests' own install.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "$repo"
cd "$tmp"
set +e
"$tmp/venv/bin/python" -m ace_jax --help > help.txt 2> err.txt
rc=$?
set -e
# absl's --help prints the usage and exits with 1; anything else (a traceback) is a failure
if [ "$rc" != 1 ] || [ -s err.txt ] || ! grep -q -- "--config:" help.txt; then
  echo "check_install: 'python -m ace_jax --help' failed (rc $rc):" >&2
  cat help.txt err.txt >&2
  exit 1
fi
where="$("$tmp/venv/bin/python" -c 'import ace_jax, os; print(os.path.dirname(ace_jax.__file__))')"
case "$where" in "$tmp"/venv/*) ;; *) echo "check_install: ace_jax came from $where" >&2; exit 1;; esac
echo "check_install: ok (ace_jax installed at $where)"
