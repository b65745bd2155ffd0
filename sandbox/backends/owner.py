"""Who owns a working dir or a pids cgroup: a random token, and a lock file its process holds.

A host that dies mid-execution (SIGKILL, the OOM killer, a lost VM) leaves its working dirs (RAM,
on /dev/shm) and its pids cgroups behind; the next backend made on the same root dir sweeps them.
Naming them by the owner's pid could not tell a dead owner from a live one once the pool runs in
a PID namespace (in a container the pool is pid 1 or 7, and that number is alive in every
namespace that looks) or once the kernel hands the pid to another process.

Here an owner is a random 64-bit token, never reused, and the lock file
``<root_dir>/owner-<token>.lock``, on which the owner holds an exclusive ``flock`` for as long as
it lives. The kernel drops a flock when the last descriptor of it closes, so when its process
dies, however it dies; and a flock is seen by every process that opens the file, in any PID
namespace. An owner is alive exactly while its lock is held: a sweeper that gets the lock knows
the owner is dead and removes what it left (``sweep_dead_owners``), then the lock file.

The descriptor is close-on-exec: sandboxed scripts never inherit it. A child that the host forks
without exec (multiprocessing's "fork") shares it, and the owner then counts as alive while that
child lives; its leftovers wait for a later sweep. A clean owner deletes its lock file before it
lets go of the lock (``OwnerLock.release``); what it kept on purpose (``keep=True`` working dirs)
then has no owner file and is never swept.
"""
from __future__ import annotations

import fcntl
import os
import pathlib
import string
import uuid
import weakref
from typing import Callable

LOCK_PREFIX, LOCK_SUFFIX = "owner-", ".lock"
TOKEN_CHARS = 16  # hex digits: 64 random bits


def is_token(text: str) -> bool:
    """Whether ``text`` has the shape of an owner token (16 lowercase hex digits)."""
    return len(text) == TOKEN_CHARS and all(c in string.hexdigits[:16] for c in text)


def lock_path(directory: os.PathLike, token: str) -> pathlib.Path:
    """The lock file of owner ``token`` under ``directory``."""
    return pathlib.Path(directory) / f"{LOCK_PREFIX}{token}{LOCK_SUFFIX}"


def _release(fd: int, path: str) -> None:
    try:
        os.unlink(path)  # first: a sweeper must never find a clean owner's file unlocked
    except OSError:
        pass
    os.close(fd)


class OwnerLock:
    """This process's claim on what it makes under ``directory``, held until ``release()``.

    Args:
      directory: where the lock file goes (made if missing): the root of the working dirs.

    Raises:
      OSError: the directory or the lock file cannot be made, or locking is not supported there.
    """

    def __init__(self, directory: os.PathLike):
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.token = uuid.uuid4().hex[:TOKEN_CHARS]
        self.path = lock_path(directory, self.token)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            _release(fd, os.fspath(self.path))
            raise
        # An owner dropped without release() (a backend never closed) lets go when collected.
        self._finalizer = weakref.finalize(self, _release, fd, os.fspath(self.path))

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        """Deletes the lock file and lets go of the lock. Idempotent."""
        self._finalizer()


def sweep_dead_owners(directory: os.PathLike, remove_leftovers: Callable[[str], bool]) -> int:
    """Removes what dead owners left: for every lock file under ``directory`` that nobody holds.

    Holding the dead owner's lock, calls ``remove_leftovers(token)``, which removes that owner's
    working dirs and cgroups and returns True once none is left; then deletes the lock file (if
    something could not be removed yet, the file stays and a later sweep tries again). A lock
    that is held (a live owner), a file that cannot be opened or locked (another user's, a file
    system without locks) and any other entry are left alone.

    Returns:
      how many dead owners were swept completely.
    """
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    swept = 0
    for entry in entries:
        name = entry.name
        if not (name.startswith(LOCK_PREFIX) and name.endswith(LOCK_SUFFIX)):
            continue
        token = name[len(LOCK_PREFIX):-len(LOCK_SUFFIX)]
        if not is_token(token):
            continue
        try:
            fd = os.open(entry.path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: the owner lives (or locks do not work here: do not guess)
                continue
            if remove_leftovers(token):
                try:
                    os.unlink(entry.path)
                except OSError:
                    pass
                swept += 1
        finally:
            os.close(fd)
    return swept
