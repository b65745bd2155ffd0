"""sandbox.execution: classifying a finished execution, reading its exception line."""
from __future__ import annotations

import pathlib

from sandbox.backends import RawExecution
from sandbox.execution import classify, last_exception_line
from sandbox.result import Status


def test_classify_units():
    def raw(**kw):
        return RawExecution(**{"exit_code": 1, **kw})

    assert classify(raw(timed_out=True, exit_code=-15))[0] is Status.TIMEOUT
    assert classify(raw(cpu_limit_hit=True, exit_code=-24))[0] is Status.TIMEOUT
    assert classify(raw(oom_killed=True, exit_code=-9))[0] is Status.OOM
    assert classify(raw(stderr="Traceback...\nnumpy._core._exceptions._ArrayMemoryError: "
                               "Unable to allocate 8.0 GiB"))[0] is Status.OOM
    assert classify(raw(stderr="terminate called after throwing an instance of 'std::bad_alloc'",
                        exit_code=-6))[0] is Status.OOM
    assert classify(raw(exit_code=-9))[0] is Status.RUNTIME_ERROR  # no evidence of memory
    assert classify(raw(error="bwrap: Can't mount proc"))[0] is Status.SANDBOX_ERROR
    assert classify(raw(exit_code=-11)) == (Status.RUNTIME_ERROR, "killed by signal 11")
    assert classify(raw(disk_limit_hit=True))[0] is Status.RUNTIME_ERROR
    assert classify(raw(cancelled=True))[0] is Status.SANDBOX_ERROR
    assert classify(raw(exit_code=0))[0] is Status.NO_SUBMISSION
    assert classify(raw(exit_code=0, submission_error="submission.csv is a symlink"))[0] \
        is Status.INVALID_SUBMISSION
    assert classify(raw(exit_code=0, submission=pathlib.Path("/x.csv"))) == (Status.OK, "")


def test_last_exception_line():
    tb = ("Traceback (most recent call last):\n  File \"solution.py\", line 3\n"
          "ValueError: Input contains NaN\n\nsome trailing noise\n")
    assert last_exception_line(tb) == "ValueError: Input contains NaN"
    assert last_exception_line("nothing here") == ""
