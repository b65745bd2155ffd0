"""MLE-bench competitions as its users have them: MLE-bench's own prepare code, then a bucket.

Three steps, each usable alone (``launch/stage_mlebench.py`` runs them from the command line):

  write_synthetic_raw(id, raw_dir)          small raw files in the layout Kaggle ships for one of
                                            ``SYNTHETIC_COMPETITIONS`` (rehearsals and tests; a
                                            real run puts Kaggle's download there instead)
  prepare_from_raw(ids, raw_root, data_dir) MLE-bench's own preparer of each competition on
                                            ``raw_root/<id>/``, into
                                            ``data_dir/<id>/prepared/{public,private}``: the steps
                                            of ``mlebench prepare`` after its Kaggle download
  stage(data_dir, ids, dest)                per competition, ``dest/<id>/``: ``prepared/public``,
                                            ``prepared/private``, ``config.yaml``,
                                            ``description.md``, ``leaderboard.csv``, the grader's
                                            ``.py`` files and a ``STAGED.json`` manifest

The hosts of a run then fetch only the competitions their config names, public and private
folders apart (``ace_jax.env.tasks.stage_competitions``), and load them with or without the
``mlebench`` package (``sandbox.tasks.mlebench``: with it the score comes from MLE-bench's
``grade_fn``, without it from our metric of the same name).

Why this is not a hand-made ``config.yaml``: everything a host reads about a competition except
its rows -- ``config.yaml`` (the grader's name and ``grade_fn``), ``description.md``,
``leaderboard.csv``, the grader (``grade.py`` and its sibling modules) and the code that splits
Kaggle's training file into public train/test and private answers (``prepare.py``) -- is
MLE-bench's own, read from the installed ``mlebench`` package. Only the raw rows of
``write_synthetic_raw`` are made up, written in the exact files and columns MLE-bench's
``prepare.py`` reads from Kaggle's download, so MLE-bench's code runs on them unchanged.

``prepare_from_raw`` and ``stage`` need ``mlebench`` importable (``MLEBenchNotInstalledError``
says how to install it: ``MLEBENCH_INSTALL``); loading the staged files does not.
"""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
from typing import Any, Optional, Sequence

import yaml

from ace_jax.runtime import storage
from sandbox.tasks import mlebench as mlebench_task
from sandbox.tasks import mlebench_raw

log = logging.getLogger("ace_jax.env.mlebench_data")

#: How to make ``mlebench`` importable: its repository, installed without its heavy dependencies
#: (tensorflow, kaggle, docker, ... are needed by other MLE-bench commands, not by the
#: registry, the preparers or the graders used here), plus the two small ones they import.
MLEBENCH_INSTALL = ("git clone https://github.com/openai/mle-bench && (cd mle-bench && "
                    "git lfs fetch --all && git lfs pull) && pip install --no-deps -e mle-bench "
                    "&& pip install 'py7zr>=0.21' 'appdirs>=1.4.4'")

#: The manifest ``stage`` writes last into ``<dest>/<id>/``.
STAGED_MANIFEST = "STAGED.json"

#: What ``prepare_from_raw`` writes into ``<data_dir>/<id>/`` (not staged; ``stage`` copies it
#: into the manifest): who prepared the competition, from which raw files.
PREPARE_RECORD = "mlebench_prepare.json"

#: The files of a competition folder staged beside ``prepared/`` (besides the grader's ``*.py``).
COMPETITION_FILES = ("config.yaml", "description.md", "leaderboard.csv")

_CHECKSUMS_SKIPPED = (
    "skipped: MLE-bench's checksums.yaml holds the md5 of Kaggle's own files, which these raw "
    "files are not (as `mlebench prepare --skip-verification`)")


class MLEBenchNotInstalledError(ImportError):
    """``mlebench`` is not importable; the message says how to install it."""


class PrepareError(RuntimeError):
    """A competition cannot be prepared (unknown id, no raw files, MLE-bench's checks failed)."""


class StageError(RuntimeError):
    """A competition cannot be staged (not prepared, no config.yaml, a failed upload)."""


# ------------------------------------------------------------------------------------ mlebench

def _registry(data_dir: "os.PathLike | str"):
    """MLE-bench's competition registry with its data folder set to ``data_dir``."""
    try:
        from mlebench.registry import registry
    except ImportError as e:
        raise MLEBenchNotInstalledError(
            f"preparing MLE-bench competitions needs the mlebench package ({e}); install it from "
            f"its repository: {MLEBENCH_INSTALL}") from e
    return registry.set_data_dir(pathlib.Path(data_dir))


def _git_head(root: pathlib.Path) -> Optional[str]:
    """The commit checked out in ``root`` (None when it is no git checkout or git is absent)."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def mlebench_info() -> dict[str, Any]:
    """Which ``mlebench`` is importable: ``installed``, ``version``, ``commit`` (from pip's
    ``direct_url.json`` or the checkout's git HEAD; None when unknown) and ``path`` (its package
    folder)."""
    spec = importlib.util.find_spec("mlebench")
    if spec is None or not spec.submodule_search_locations:
        return {"installed": False, "version": None, "commit": None, "path": None}
    pkg = pathlib.Path(list(spec.submodule_search_locations)[0])
    version, commit = None, None
    try:
        dist = importlib.metadata.distribution("mlebench")
        version = dist.version
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        commit = (direct.get("vcs_info") or {}).get("commit_id")
    except (importlib.metadata.PackageNotFoundError, json.JSONDecodeError):
        pass
    return {"installed": True, "version": version, "commit": commit or _git_head(pkg.parent),
            "path": str(pkg)}


def _callable_name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


# ------------------------------------------------------------------------------------ prepare

def _is_prepared(competition) -> bool:
    """MLE-bench's ``is_dataset_prepared``: non-empty public and private folders, the answers
    and the sample submission in place."""
    pub, priv = competition.public_dir, competition.private_dir
    return (pub.is_dir() and any(pub.iterdir()) and priv.is_dir() and any(priv.iterdir())
            and competition.answers.is_file() and competition.sample_submission.is_file())


#: Runs one competition's preparer in another interpreter (``prepare_from_raw(python=...)``):
#: argv = competition id, MLE-bench data dir, raw dir.
_PREPARE_IN_SUBPROCESS = """
import pathlib, sys
from mlebench.registry import registry
cid, data, raw = sys.argv[1], pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
c = registry.set_data_dir(data).get_competition(cid)
c.prepare_fn(raw=raw, public=c.public_dir, private=c.private_dir)
"""


def _run_preparer(competition, raw: pathlib.Path, python: Optional[str]) -> None:
    """MLE-bench's preparer of ``competition`` on ``raw``: here, or in the interpreter ``python``
    (one with MLE-bench and what the preparer imports, e.g. tensorflow for siim's TFRecords; see
    ``scripts/install_mlebench.sh --prepare-venv``)."""
    if not python:
        competition.prepare_fn(raw=raw, public=competition.public_dir,
                               private=competition.private_dir)
        return
    data_dir = competition.public_dir.parent.parent.parent
    proc = subprocess.run([python, "-c", _PREPARE_IN_SUBPROCESS, competition.id, str(data_dir),
                           str(raw)], capture_output=True, text=True)
    if proc.returncode:
        raise PrepareError(f"{competition.id}: MLE-bench's preparer failed in {python} (exit "
                           f"{proc.returncode}): {proc.stderr.strip()[-1500:]}")


def _prepare_one(competition, raw: pathlib.Path, overwrite: bool,
                 python: Optional[str] = None) -> dict[str, Any]:
    """``mlebench prepare``'s steps after its Kaggle download for one competition, on ``raw``.

    Returns the record written to ``<data_dir>/<id>/mlebench_prepare.json``.
    """
    from mlebench.utils import extract

    cid = competition.id
    if not raw.is_dir() or not any(raw.iterdir()):
        raise PrepareError(
            f"no raw files for {cid!r} in {raw}: put Kaggle's download there (`kaggle "
            f"competitions download -c {cid} -p {raw}`) or write synthetic ones "
            "(write_synthetic_raw / --synthetic_rows)")
    params = list(inspect.signature(competition.prepare_fn).parameters)
    if params != ["raw", "public", "private"]:       # mlebench's is_valid_prepare_fn
        raise PrepareError(f"{cid}: MLE-bench's preparer {_callable_name(competition.prepare_fn)} "
                           f"takes {params}, not (raw, public, private)")
    if not competition.leaderboard.exists():         # mlebench's ensure_leaderboard_exists
        raise PrepareError(f"{cid}: MLE-bench has no leaderboard at {competition.leaderboard}; "
                           "`mlebench prepare` refuses such a competition")
    kaggle_zip = raw / f"{cid}.zip"
    if [p.name for p in raw.iterdir()] == [kaggle_zip.name]:   # Kaggle's download, unextracted
        log.info("%s: extracting %s into %s", cid, kaggle_zip, raw)
        extract(kaggle_zip, raw, recursive=False)
    if overwrite and competition.public_dir.parent.exists():
        shutil.rmtree(competition.public_dir.parent)
    competition.public_dir.mkdir(parents=True, exist_ok=True)
    competition.private_dir.mkdir(parents=True, exist_ok=True)
    already = _is_prepared(competition)
    if already:
        log.info("%s: already prepared in %s (overwrite=True prepares it again)", cid,
                 competition.public_dir.parent)
    else:
        log.info("%s: preparing with MLE-bench's %s on %s", cid,
                 _callable_name(competition.prepare_fn), raw)
        _run_preparer(competition, raw, python)
    (competition.public_dir / "description.md").write_text(competition.description)
    log.info("%s: checksums %s", cid, _CHECKSUMS_SKIPPED)
    for d in (competition.public_dir, competition.private_dir):
        if not d.is_dir() or not any(d.iterdir()):
            raise PrepareError(f"{cid}: MLE-bench's preparer left {d} empty")
    record = {
        "competition_id": cid, "mlebench_prepared": True,
        "preparer": _callable_name(competition.prepare_fn), "mlebench": mlebench_info(),
        "raw_dir": str(raw.resolve()),
        "raw_files": sorted(str(p.relative_to(raw)) for p in raw.rglob("*") if p.is_file()),
        "checksums": _CHECKSUMS_SKIPPED, "already_prepared": already,
        "prepared_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    (competition.public_dir.parent.parent / PREPARE_RECORD).write_text(
        json.dumps(record, indent=1) + "\n")
    return record


def prepare_from_raw(competition_ids: Sequence[str], raw_root: "os.PathLike | str",
                     data_dir: "os.PathLike | str", *, overwrite: bool = False,
                     python: Optional[str] = None) -> dict[str, Any]:
    """Runs MLE-bench's own preparer of each competition on raw files already on disk.

    The steps of ``mlebench prepare`` (``mlebench.data.download_and_prepare_dataset``) after its
    Kaggle download: the registry's competition (its ``preparer`` from ``config.yaml``); the
    preparer's signature check; the leaderboard must exist; Kaggle's zip ``<id>.zip`` is extracted
    when it is all ``raw_root/<id>/`` holds; ``prepared/public`` and ``prepared/private`` are
    created and filled by ``prepare(raw=raw_root/<id>, public=..., private=...)`` unless already
    prepared (as MLE-bench skips it; ``overwrite`` prepares again); the competition's
    ``description.md`` is written into ``prepared/public``. MLE-bench's checksums are skipped (they
    are of Kaggle's files; logged, and recorded). The raw files are used in place (MLE-bench's
    preparers may extract into the raw folder, as they do in MLE-bench's own ``raw/``).

    Args:
      competition_ids: MLE-bench competition ids.
      raw_root: holds ``<id>/`` with Kaggle's files of each competition (extracted, or the zip).
      data_dir: MLE-bench's data folder: ``<id>/prepared/{public,private}`` are written there,
        and ``<id>/mlebench_prepare.json`` (who prepared it, from which raw files).
      python: run each preparer in this interpreter instead of here (it needs MLE-bench and what
        the preparer imports: ``scripts/install_mlebench.sh --prepare-venv DIR`` builds one with
        tensorflow, which siim-isic-melanoma-classification's preparer needs and the trainer's
        venv leaves out); None: in this process.

    Returns:
      ``{"data_dir", "mlebench": mlebench_info(), "competitions": {id: record}}``.

    Raises:
      MLEBenchNotInstalledError: ``mlebench`` is not importable (the message says how to install).
      PrepareError: an unknown competition id, no raw files, or a check of MLE-bench's failed.
    """
    registry = _registry(data_dir)
    known = set(registry.list_competition_ids())
    unknown = [c for c in competition_ids if c not in known]
    if unknown:
        raise PrepareError(f"MLE-bench has no competitions {unknown} (its registry lists "
                           f"{len(known)}, e.g. {sorted(known)[:5]})")
    out = {}
    for cid in competition_ids:
        out[cid] = _prepare_one(registry.get_competition(cid), pathlib.Path(raw_root) / cid,
                                overwrite, python)
    return {"data_dir": str(pathlib.Path(data_dir).resolve()), "mlebench": mlebench_info(),
            "competitions": out}


# ------------------------------------------------------------------------------ synthetic raw

#: The competitions ``write_synthetic_raw`` can write raw files for: MLE-bench Lite's 22.
SYNTHETIC_COMPETITIONS = mlebench_raw.LITE


def write_synthetic_raw(competition_id: str, raw_dir: "os.PathLike | str", *, n_rows: int = 60,
                        seed: int = 0) -> list[pathlib.Path]:
    """Small made-up raw files in the layout Kaggle ships for ``competition_id`` (one of MLE-bench
    Lite's, ``SYNTHETIC_COMPETITIONS``): ``sandbox.tasks.mlebench_raw.write_synthetic_raw``."""
    return mlebench_raw.write_synthetic_raw(competition_id, raw_dir, n_rows=n_rows, seed=seed)


# ------------------------------------------------------------------------------------ stage

def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _remote_files(url: str) -> dict[str, int]:
    """Relative path -> size (bytes) of every file under ``url`` (a local path or a URL)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    if not fs.exists(root):
        return {}
    fs.invalidate_cache(root)
    return {f[len(root) + 1:]: int(i.get("size") or 0)
            for f, i in fs.find(root, detail=True).items()
            if i.get("type", "file") == "file" and f.startswith(root + "/")}


def _remove(url: str, names: Sequence[str]) -> None:
    """Deletes the files ``url/<name>`` (a local path or a URL)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    for name in names:
        fs.rm_file(root.rstrip("/") + "/" + name)


def _owned(rel: str) -> bool:
    """True for a path under ``<dest>/<id>/`` that ``stage`` writes (and so may replace):
    ``prepared/public/**``, ``prepared/private/**``, the competition files, ``*.py`` at the top,
    the manifest. Anything else there (e.g. ``raw/``, Kaggle's zip) is left alone."""
    if rel.startswith(("prepared/public/", "prepared/private/")):
        return True
    return "/" not in rel and (rel in COMPETITION_FILES or rel == STAGED_MANIFEST
                               or rel.endswith(".py"))


def _prepared_by(local: pathlib.Path) -> dict[str, Any]:
    """Who prepared ``<data_dir>/<id>``: ``prepare_from_raw``'s record when there, else what
    MLE-bench's own data layout shows (``raw/`` beside ``prepared/``: ``mlebench prepare``), else
    unknown (``mlebench_prepared`` False)."""
    record = local / PREPARE_RECORD
    if record.exists():
        return json.loads(record.read_text())
    if (local / "raw").is_dir() or (local / f"{local.name}.zip").is_file():
        return {"mlebench_prepared": True,
                "preparer": "mlebench prepare (inferred from its data layout: raw/ beside "
                            "prepared/)"}
    return {"mlebench_prepared": False,
            "preparer": f"unknown (no {PREPARE_RECORD} and no raw/ in {local})"}


def _competition_files(cid: str, comp: pathlib.Path, public: pathlib.Path,
                       ) -> tuple[dict[str, pathlib.Path], str]:
    """(name -> source file) of the competition folder's files to stage, and the leaderboard's
    state: "staged", "missing" or "git-lfs-pointer" (not staged; logged with what to run)."""
    files = {"config.yaml": comp / "config.yaml"}
    desc = comp / "description.md"
    files["description.md"] = desc if desc.is_file() else public / "description.md"
    lb, state = comp / "leaderboard.csv", "staged"
    if not lb.is_file():
        state = "missing"
        log.warning("%s: %s has no leaderboard.csv; the staged task has no reference leaderboard "
                    "(medals and HumanRank n/a)", cid, comp)
    elif mlebench_task.is_git_lfs_pointer(lb):
        state = "git-lfs-pointer"
        root = comp.parent.parent.parent
        checkout = (f"the mle-bench checkout ({root})" if (root / "pyproject.toml").is_file()
                    else "the mle-bench checkout mlebench was installed from (then reinstall it)")
        log.warning("%s: %s is a Git LFS pointer, not the leaderboard: not staged, so medals and "
                    "HumanRank are unavailable for this competition; run `git lfs fetch --all && "
                    "git lfs pull` in %s and stage again", cid, lb, checkout)
    else:
        files["leaderboard.csv"] = lb
    for py in sorted(comp.glob("*.py")):      # grade.py and its siblings (classes.py, ...)
        files[py.name] = py
    return files, state


def _stage_one(cid: str, data_dir: pathlib.Path, dest: str) -> dict[str, Any]:
    """Uploads one prepared competition to ``dest/<cid>/`` and writes its manifest."""
    local = data_dir / cid
    public, private = local / "prepared" / "public", local / "prepared" / "private"
    for d in (public, private):
        if not d.is_dir() or not any(d.iterdir()):
            raise StageError(f"{cid}: {d} is missing or empty; prepare the competition first "
                             f"(prepare_from_raw, or `mlebench prepare -c {cid}`)")
    comp = mlebench_task.find_competition_dir(cid, data_dir)
    if not (comp / "config.yaml").is_file():
        raise StageError(f"{cid}: no config.yaml in {comp}: MLE-bench's competition files come "
                         f"from the installed mlebench package; install it: {MLEBENCH_INSTALL}")
    cfg = yaml.safe_load((comp / "config.yaml").read_text()) or {}
    for key in ("answers", "sample_submission"):
        declared = (cfg.get("dataset") or {}).get(key)
        if declared and not (data_dir / declared).is_file():
            raise StageError(f"{cid}: MLE-bench's config.yaml names {key} {declared!r}, missing "
                             f"under {data_dir}")
    comp_files, leaderboard = _competition_files(cid, comp, public)
    sources = {f"prepared/public/{p.relative_to(public).as_posix()}": p
               for p in sorted(public.rglob("*")) if p.is_file()}
    sources.update({f"prepared/private/{p.relative_to(private).as_posix()}": p
                    for p in sorted(private.rglob("*")) if p.is_file()})
    sources.update(comp_files)

    target = storage.join(dest, cid)
    storage.upload_dir(str(public), storage.join(target, "prepared", "public"))
    storage.upload_dir(str(private), storage.join(target, "prepared", "private"))
    with tempfile.TemporaryDirectory(prefix="stage-mlebench-") as tmp:
        for name, src in comp_files.items():
            shutil.copyfile(src, os.path.join(tmp, name))
        storage.upload_dir(tmp, target)
    remote = _remote_files(target)
    stale = sorted(r for r in remote if _owned(r) and r not in sources and r != STAGED_MANIFEST)
    _remove(target, stale)
    wrong = [r for r, p in sources.items() if remote.get(r) != p.stat().st_size]
    if wrong:
        raise StageError(f"{cid}: upload to {target} incomplete: {wrong[:5]} missing or of "
                         "another size")
    prepared_by = _prepared_by(local)
    manifest = {
        "competition_id": cid,
        "mlebench_prepared": bool(prepared_by.get("mlebench_prepared")),
        "prepared_by": prepared_by, "mlebench": mlebench_info(),
        "competition_dir": str(comp),
        "grader": {"name": (cfg.get("grader") or {}).get("name"),
                   "grade_fn": (cfg.get("grader") or {}).get("grade_fn"),
                   "files": sorted(n for n in comp_files if n.endswith(".py"))},
        "leaderboard": leaderboard,
        "files": [{"path": r, "size": p.stat().st_size, "sha256": _sha256(p)}
                  for r, p in sorted(sources.items())],
        "staged_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "staged_by": "ace_jax.env.mlebench_data.stage",
    }
    storage.write_text(storage.join(target, STAGED_MANIFEST), json.dumps(manifest, indent=1) + "\n")
    log.info("%s: staged %d files (%d bytes) to %s", cid, len(sources),
             sum(p.stat().st_size for p in sources.values()), target)
    return {"url": target, "files": len(sources),
            "bytes": sum(p.stat().st_size for p in sources.values()),
            "public_bytes": sum(p.stat().st_size for r, p in sources.items()
                                if r.startswith("prepared/public/")),
            "private_bytes": sum(p.stat().st_size for r, p in sources.items()
                                 if r.startswith("prepared/private/")),
            "mlebench_prepared": manifest["mlebench_prepared"], "leaderboard": leaderboard,
            "grader": manifest["grader"]["name"], "removed_stale": len(stale)}


def stage(data_dir: "os.PathLike | str", competition_ids: Sequence[str],
          dest_url: str) -> dict[str, Any]:
    """Uploads prepared competitions with everything a host needs to load them.

    Per competition, to ``<dest_url>/<id>/``: ``prepared/public/**`` and ``prepared/private/**``
    from ``<data_dir>/<id>/``; from the competition folder (``sandbox.tasks.mlebench.
    find_competition_dir``: the installed mlebench package's, or files already beside the data)
    ``config.yaml``, ``description.md``, ``leaderboard.csv`` (not a Git LFS pointer: that is
    logged as a warning saying medals/HumanRank are unavailable and what to run) and the
    grader's ``*.py`` (``grade.py`` and its siblings); then ``STAGED.json`` (every file's path,
    size in bytes and sha256, the mlebench version/commit, ``mlebench_prepared``, who prepared
    it). Files a previous stage left there that are no longer staged are removed (only in the
    paths ``stage`` writes; e.g. a ``raw/`` folder is left alone).

    Args:
      data_dir: MLE-bench's data folder holding ``<id>/prepared/{public,private}``.
      competition_ids: the competitions to stage (at least one).
      dest_url: a ``gs://`` URL or a local path (``ace_jax.runtime.storage``).

    Returns:
      ``{"dest", "mlebench", "competitions": {id: {"url", "files", "bytes", "public_bytes",
      "private_bytes", "mlebench_prepared", "leaderboard", "grader", "removed_stale"}},
      "files", "bytes", "mlebench_prepared"}`` (sizes in bytes; ``mlebench_prepared`` True when
      every competition was prepared by MLE-bench's code).

    Raises:
      StageError: no competition named, a competition not prepared, no config.yaml (mlebench not
        installed and none beside the data), dest is the data folder itself, or an upload that
        did not arrive whole.
    """
    ids = list(competition_ids)
    if not ids:
        raise StageError("name the competitions to stage (a bucket gets only what a run names)")
    data = pathlib.Path(data_dir).resolve()
    if not storage.is_url(dest_url) and pathlib.Path(dest_url).resolve() == data:
        raise StageError(f"dest {dest_url!r} is the data folder itself; stage to another place")
    per = {cid: _stage_one(cid, data, dest_url) for cid in ids}
    return {"dest": dest_url, "mlebench": mlebench_info(), "competitions": per,
            "files": sum(c["files"] for c in per.values()),
            "bytes": sum(c["bytes"] for c in per.values()),
            "mlebench_prepared": all(c["mlebench_prepared"] for c in per.values())}
