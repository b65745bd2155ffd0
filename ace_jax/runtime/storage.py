"""Where a run's artefacts are read and written: a local path or an fsspec URL (``gs://...``).

Every read and write of a run artefact that is not an Orbax checkpoint, the metrics stream or the
buffer store (each of which has its own remote path) goes through here, so a ``gs://bucket/run``
workdir never becomes a local folder named ``gs:``:

  join(root, *parts)        a child path ("/"-joined for a URL, os.path.join for a local path)
  exists / listdir / read_text / write_text / makedirs
  local_copy(path)          a directory as a local path (a URL's files are downloaded into a
                            cache folder keyed by the URL and the files' versions), for the
                            libraries that read only local files (tokenizers, task data)
  upload_dir(local, path)   a local directory's files to ``path``

Local writes are atomic (a temporary file renamed into place); an object store's single-object
writes are atomic by themselves.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from typing import Any

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


def local_copy(path: str, cache_dir: str = CACHE_DIR, *, name: str = "") -> str:
    """``path`` itself when local; for a URL, a local folder holding its files, downloaded
    once: a later call reuses it until the remote files change (their names, sizes and
    versions: etag / md5 / mtime). The folder is ``cache_dir/<name>`` (replaced when the
    remote files changed), or without ``name`` a folder named by a hash of the URL and its
    files' versions. FileNotFoundError when the URL holds no file."""
    path = os.fspath(path)
    if not is_url(path):
        return path
    fs, p = _fs(path)
    root = p.rstrip("/") + "/"
    found = {f: info for f, info in fs.find(root.rstrip("/"), detail=True).items()
             if info.get("type", "file") == "file" and f.startswith(root)}
    if not found:
        raise FileNotFoundError(f"{path} holds no file")
    version = lambda i: str(i.get("etag") or i.get("md5Hash") or i.get("mtime")  # noqa: E731
                            or i.get("updated") or "")
    key = path.rstrip("/") + repr(sorted((f[len(root):], int(i.get("size") or 0), version(i))
                                         for f, i in found.items()))
    local = os.path.join(cache_dir, name or hashlib.sha256(key.encode()).hexdigest()[:20])
    done = os.path.join(local, ".complete")
    if os.path.exists(done) and open(done).read() == key:
        return local
    if os.path.exists(local):       # another version of the files, or an interrupted copy
        shutil.rmtree(local)
    os.makedirs(local)
    for f in found:
        dst = os.path.join(local, *f[len(root):].split("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        fs.get_file(f, dst)
    with open(done, "w") as f:
        f.write(key)
    return local
