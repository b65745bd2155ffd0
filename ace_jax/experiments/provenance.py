"""Where a result came from: the commit a run or a benchmark ran on, and whether its tracked
files had uncommitted changes (raw data under ``results/`` left out: writing it is what the runs
do)."""
from __future__ import annotations

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def commit(repo: str = REPO, *, short: bool = False) -> tuple[str, bool]:
    """(HEAD's hash, 7 hex digits with ``short``; whether tracked files outside results/
    differ from it). ("unknown", False) outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", *(["--short=7"] if short else []), "HEAD")
        return head, bool(git("status", "--porcelain", "--untracked-files=no", "--", ".",
                              ":!results"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown", False
