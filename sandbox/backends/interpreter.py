"""The sandbox's interpreter (``sandbox.python``): which Python runs the agent's code, checked once.

The trainer and the sandbox need different packages: the trainer JAX and its own pins, the sandbox
the Kaggle stack (``requirements-sandbox.txt``: lightgbm, xgboost, catboost, torch, ...). So the
executions (and the warm interpreters) can run with another interpreter than the trainer's, for
example ``DEST/bin/python`` of a venv made by ``scripts/build_sandbox_env.sh DEST``. What runs in
the sandbox, ``sandbox/runner.py``, uses only the standard library, so the trainer's packages are
never needed there.

``probe(python)`` asks the interpreter itself where it lives (``sys.prefix``, the base
installation, its site-packages): the bwrap backend binds exactly those directories, and nothing
of the trainer's venv unless the sandbox runs the trainer's interpreter.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from typing import Optional

from sandbox.backends import base

MIN_VERSION = (3, 11)  # the runner is started with ``python -P`` (3.11+)
PROBE_TIMEOUT_S = 60.0  # an interpreter answers in ~20 ms; a cold disk or NFS may take seconds
BUILD_HINT = ("build the sandbox's environment with `bash scripts/build_sandbox_env.sh DEST` and "
              "set sandbox.python=DEST/bin/python, or leave sandbox.python empty to run the "
              "trainer's own interpreter")

_PROBE = """\
import json, sys, sysconfig
paths = sysconfig.get_paths()
print(json.dumps({"version": list(sys.version_info[:3]), "prefix": sys.prefix,
                  "base_prefix": sys.base_prefix, "exec_prefix": sys.exec_prefix,
                  "base_exec_prefix": sys.base_exec_prefix,
                  "site_dirs": sorted({paths["purelib"], paths["platlib"]})}))
"""


@dataclasses.dataclass(frozen=True)
class InterpreterInfo:
    """What one interpreter says about itself.

    Attributes:
      executable: the path it was asked by (absolute, symlinks kept: a venv's bin/python).
      version: (major, minor, micro).
      prefixes: its ``sys.prefix``, ``sys.base_prefix``, ``sys.exec_prefix`` and
        ``sys.base_exec_prefix`` (a venv and the installation it is made from).
      site_dirs: its site-packages directories (purelib, platlib).
    """

    executable: str
    version: tuple[int, int, int]
    prefixes: tuple[str, ...]
    site_dirs: tuple[str, ...]


def resolve(python: Optional[str]) -> str:
    """The absolute path of ``python`` ("" or None: the trainer's ``sys.executable``; a relative
    path is taken from the current directory)."""
    return sys.executable if not python else os.path.abspath(os.path.expanduser(python))


def probe(python: Optional[str]) -> InterpreterInfo:
    """Checks ``python`` (see ``resolve``) and returns what it says about itself.

    Raises:
      SandboxConfigError: the path does not exist, is not executable, does not run as Python, or
        is older than Python 3.11; the message says how to build a sandbox environment.
    """
    path = resolve(python)
    if not os.path.exists(path):
        raise base.SandboxConfigError(f"sandbox.python {python!r} ({path}) does not exist: "
                                      f"{BUILD_HINT}")
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise base.SandboxConfigError(f"sandbox.python {path} is not an executable file: "
                                      f"{BUILD_HINT}")
    st = os.stat(path)
    return _probe_cached(path, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=16)
def _probe_cached(path: str, mtime_ns: int, inode: int) -> InterpreterInfo:
    """``probe`` of one file version (a rebuilt venv is probed again)."""
    try:
        r = subprocess.run([path, "-I", "-c", _PROBE], capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=PROBE_TIMEOUT_S,
                           env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
        facts = json.loads(r.stdout) if r.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        raise base.SandboxConfigError(
            f"sandbox.python {path} did not run as a Python interpreter ({e}): {BUILD_HINT}") from e
    if facts is None:
        raise base.SandboxConfigError(
            f"sandbox.python {path} did not run as a Python interpreter (exit {r.returncode}: "
            f"{r.stderr.strip()[-300:]}): {BUILD_HINT}")
    version = tuple(int(v) for v in facts["version"])
    if version[:2] < MIN_VERSION:
        raise base.SandboxConfigError(
            f"sandbox.python {path} is Python {'.'.join(map(str, version))}; the sandbox needs "
            f">= {'.'.join(map(str, MIN_VERSION))} (its runner uses `python -P`): {BUILD_HINT}")
    prefixes = tuple(dict.fromkeys(facts[k] for k in ("prefix", "base_prefix", "exec_prefix",
                                                      "base_exec_prefix")))
    return InterpreterInfo(path, version, prefixes, tuple(facts["site_dirs"]))
