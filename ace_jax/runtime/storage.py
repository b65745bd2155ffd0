"""Where a run's artefacts are read and written: a local path or an fsspec URL (``gs://...``).

Every read and write of a run artefact that is not an Orbax checkpoint, the metrics stream or the
buffer store (each of which has its own remote path) goes through here, so a ``gs://bucket/run``
workdir never becomes a local folder named ``gs:``:

  join(root, *parts)        a child path ("/"-joined for a URL, os.path.join for a local path)
  exists / listdir / read_text / write_text / makedirs
  local_copy(path, files=)  a directory as a local path (a URL's files, or only those that
                            match the glob patterns ``files``, are downloaded into a cache
                            folder keyed by the URL and the selected files' versions), for the
                            libraries that read only local files (tokenizers, task data);
                            ``downloaded_bytes()`` counts what this process downloaded
  upload_dir(local, path)   a local directory's files to ``path``

Local writes are atomic (a temporary file renamed into place); an object store's single-object
writes are atomic by themselves. A `local_copy` is atomic too (downloaded into a temporary folder
beside the cache folder, then renamed into place), and processes that share a cache folder (two
hosts rehearsed on one machine) take turns on it (an exclusive ``flock`` of the cache folder while
one downloads): the second finds the first's copy complete and downloads nothing.
"""
from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import uuid
from typing import Any, Iterator, Optional, Sequence

log = logging.getLogger(__name__)

# `local_copy`'s default cache folder: $ACE_JAX_STORAGE_CACHE when set (read at each call), else
# ~/.cache/ace_jax/storage.
CACHE_ENV_VAR = "ACE_JAX_STORAGE_CACHE"
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "ace_jax", "storage")


def is_url(path: str) -> bool:
    """True for an fsspec URL (``scheme://...``), False for a local path."""
    return "://" in os.fspath(path)


def join(root: str, *parts: str) -> str:
    root = os.fspath(root)
    if is_url(root):
        return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(root, *parts)


def _fs(path: str) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(path)


def exists(path: str) -> bool:
    path = os.fspath(path)
    if not is_url(path):
        return os.path.exists(path)
    fs, p = _fs(path)
    return fs.exists(p)


def listdir(path: str) -> list[str]:
    """The names of the entries of a folder (a local path or a URL), sorted."""
    path = os.fspath(path)
    if not is_url(path):
        return sorted(os.listdir(path))
    fs, p = _fs(path)
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False))


def makedirs(path: str) -> None:
    """Creates a local directory (and its parents); nothing for a URL (object stores have no
    directories)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


def read_text(path: str) -> str:
    """The file's text; FileNotFoundError when it is missing."""
    path = os.fspath(path)
    if not is_url(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    fs, p = _fs(path)
    return fs.cat_file(p).decode("utf-8")


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` whole (never a half-written file), creating local parents."""
    path = os.fspath(path)
    if is_url(path):
        fs, p = _fs(path)
        fs.pipe_file(p, text.encode("utf-8"))
        return
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def upload_dir(local: str, path: str) -> None:
    """Copies the files of the local directory ``local``, sub-folders included, to ``path``
    (a URL or a local path)."""
    for name in sorted(os.listdir(local)):
        src = os.path.join(local, name)
        if os.path.isdir(src):
            upload_dir(src, join(path, name))
        elif is_url(path):
            fs, p = _fs(join(path, name))
            fs.put_file(src, p)
        else:
            os.makedirs(path, exist_ok=True)
            shutil.copyfile(src, os.path.join(path, name))


_downloaded = 0
_downloaded_lock = threading.Lock()


def downloaded_bytes() -> int:
    """The bytes this process's `local_copy` calls have downloaded so far (a copy found complete
    in the cache counts nothing)."""
    return _downloaded


def _selected(rel: str, files: Optional[tuple[str, ...]]) -> bool:
    """Whether the file ``rel`` (its path under the copied folder, "/"-separated) matches one of
    the glob patterns ``files`` (None: every file)."""
    return files is None or any(fnmatch.fnmatchcase(rel, pat) for pat in files)


def _complete(local: str, key: str) -> bool:
    try:
        with open(os.path.join(local, ".complete")) as f:
            return f.read() == key
    except OSError:
        return False


@contextlib.contextmanager
def _exclusive(folder: str) -> Iterator[None]:
    """An exclusive lock of ``folder`` among the processes of this machine (``flock`` of the
    folder itself: no lock file appears in it); nothing where flock is unavailable."""
    try:
        import fcntl
    except ImportError:   # not POSIX: one process per cache folder
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # releases the lock


def local_copy(path: str, cache_dir: Optional[str] = None, *, name: str = "",
               files: Optional[Sequence[str]] = None) -> str:
    """``path`` itself when local; for a URL, a local folder holding its files, downloaded
    once: a later call reuses it until the remote files change (their names, sizes and
    versions: etag / md5 / mtime). ``files``: glob patterns of the files to copy, matched
    against each file's path under ``path`` (e.g. `models.tokenizer.TOKENIZER_FILES`: the
    tokenizer of an HF model folder without its weights); None copies every file. The folder
    is ``cache_dir/<name>`` (replaced when the remote files changed), or without ``name`` a
    folder named by a hash of the URL, ``files`` and the selected files' versions; the default
    ``cache_dir`` is ``$ACE_JAX_STORAGE_CACHE``, else `CACHE_DIR`. FileNotFoundError when the
    URL holds no (selected) file.

    Safe for several processes sharing ``cache_dir``: the copy is written into a temporary
    folder and renamed into place, under an exclusive lock of ``cache_dir``, so a reader sees
    a complete copy or none, and a second process waits for the first's copy instead of
    downloading again."""
    global _downloaded
    path = os.fspath(path)
    if not is_url(path):
        return path
    files = None if files is None else tuple(files)
    cache_dir = cache_dir or os.environ.get(CACHE_ENV_VAR) or CACHE_DIR
    fs, p = _fs(path)
    root = p.rstrip("/") + "/"
    found = {f: info for f, info in fs.find(root.rstrip("/"), detail=True).items()
             if info.get("type", "file") == "file" and f.startswith(root)
             and _selected(f[len(root):], files)}
    if not found:
        raise FileNotFoundError(f"{path} holds no file" if files is None else
                                f"{path} holds no file matching {list(files)}")
    version = lambda i: str(i.get("etag") or i.get("md5Hash") or i.get("mtime")  # noqa: E731
                            or i.get("updated") or "")
    key = path.rstrip("/") + ("" if files is None else repr(files)) + repr(sorted(
        (f[len(root):], int(i.get("size") or 0), version(i)) for f, i in found.items()))
    local = os.path.join(cache_dir, name or hashlib.sha256(key.encode()).hexdigest()[:20])
    if _complete(local, key):
        return local
    os.makedirs(cache_dir, exist_ok=True)
    parent, base = os.path.split(local)   # parent: cache_dir, or below it for a name "a/b"
    os.makedirs(parent, exist_ok=True)
    with _exclusive(cache_dir):
        if _complete(local, key):          # another process copied it while this one waited
            return local
        for leftover in os.listdir(parent):   # a copy whose process died (we hold the lock)
            if leftover.startswith((f".tmp-{base}-", f".old-{base}-")):
                shutil.rmtree(os.path.join(parent, leftover), ignore_errors=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=f".tmp-{base}-")
        try:
            got = 0
            for f in found:
                dst = os.path.join(tmp, *f[len(root):].split("/"))
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                fs.get_file(f, dst)
                got += os.path.getsize(dst)
            with open(os.path.join(tmp, ".complete"), "w") as f:
                f.write(key)
            if os.path.exists(local):   # another version of the files (or an older copy)
                old = os.path.join(parent, f".old-{base}-{uuid.uuid4().hex[:8]}")
                os.rename(local, old)
                os.rename(tmp, local)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, local)
        finally:
            if os.path.exists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
    with _downloaded_lock:
        _downloaded += got
    log.info("downloaded %d files (%d bytes) of %s into %s", len(found), got, path, local)
    return local
