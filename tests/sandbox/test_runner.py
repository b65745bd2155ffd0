"""``sandbox/runner.py``, run directly as the process backend runs it: seeds, tracebacks, exits,
and the zygote's refusal to run outside its own PID namespace."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from sandbox.backends import base


def run(tmp_path, code: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "solution.py").write_text(code)
    return subprocess.run([sys.executable, *base.PYTHON_FLAGS, base.RUNNER,
                           *(args or ("run", "solution.py"))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "PYTHONHASHSEED": "0"})


def test_numpy_is_seeded_when_the_script_imports_it_and_not_imported_otherwise(tmp_path):
    rng = np.random.RandomState(0)
    r = run(tmp_path, "import numpy as np\nprint(repr(np.random.random()))\n")
    assert r.returncode == 0, r.stderr
    assert float(r.stdout) == rng.random()
    r = run(tmp_path, "import sys\nprint('numpy' in sys.modules, __name__, sys.argv)\n")
    assert r.stdout.strip() == "False __main__ ['solution.py']", (r.stdout, r.stderr)


def test_an_error_prints_python_s_own_traceback_and_exits_1(tmp_path):
    r = run(tmp_path, "x = 1\nraise KeyError('k')\n")
    assert r.returncode == 1
    assert r.stderr == ("Traceback (most recent call last):\n"
                        f'  File "{tmp_path / "solution.py"}", line 2, in <module>\n'
                        "    raise KeyError('k')\nKeyError: 'k'\n"), r.stderr


def test_system_exit_behaves_as_usual(tmp_path):
    assert run(tmp_path, "import sys\nsys.exit(4)\n").returncode == 4
    r = run(tmp_path, "raise SystemExit('bye')\n")
    assert (r.returncode, r.stderr) == (1, "bye\n")
    assert run(tmp_path, "import atexit\natexit.register(print, 'atexit ran')\n").stdout == "atexit ran\n"


def test_the_zygote_refuses_to_run_outside_its_own_pid_namespace(tmp_path):
    r = run(tmp_path, "", "zygote", "0", "")
    assert r.returncode == 1 and "must be PID 1" in r.stderr, r.stderr


def test_shutdown_flushes_what_python_s_would(tmp_path):
    """The runner ends with os._exit (no module teardown), after what a script can observe."""
    code = ("import threading, time\n"
            "f = open('unclosed.txt', 'w')\nf.write('kept')\n"  # flushed when released
            "class Noisy:\n    def __del__(self):\n        print('del ran')\n"
            "n = Noisy()\n"
            "def late():\n    time.sleep(0.3)\n    open('thread.txt', 'w').write('joined')\n"
            "threading.Thread(target=late).start()\n"
            "print('buffered', end='')\n")
    r = run(tmp_path, code)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "unclosed.txt").read_text() == "kept"
    assert (tmp_path / "thread.txt").read_text() == "joined"
    assert r.stdout == "buffereddel ran\n"
    statuses = [run(tmp_path, f"import sys\nsys.exit({c})\n").returncode for c in (256, -1, None)]
    assert statuses == [0, 255, 0]
