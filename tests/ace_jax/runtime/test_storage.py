"""Run artefacts on a local path or a gs:// URL: the same calls, against a real GCS emulator."""
import os

import fsspec
import pytest

from ace_jax.runtime import storage


@pytest.fixture
def gs(gcs_emulator, monkeypatch):
    """A fresh gs:// prefix on the emulator, reached as a user reaches GCS: by URL alone."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon", "skip_instance_cache": True})
    return "gs://" + gcs_emulator.prefix()


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path):
    return str(tmp_path / "run") if request.param == "local" else request.getfixturevalue("gs")


def test_write_read_exists(root):
    path = storage.join(root, "rollouts", "000001.jsonl")
    assert not storage.exists(path)
    with pytest.raises(FileNotFoundError):
        storage.read_text(path)
    storage.write_text(path, "a\nb\n")
    assert storage.exists(path) and storage.read_text(path) == "a\nb\n"
    storage.write_text(path, "c\n")                        # overwritten whole
    assert storage.read_text(path) == "c\n"


def test_join_keeps_urls_urls():
    assert storage.join("gs://b/run/", "x", "/y") == "gs://b/run/x/y"
    assert storage.join("runs/a", "x") == os.path.join("runs/a", "x")
    assert storage.is_url("gs://b") and not storage.is_url("gs:/b") and not storage.is_url("/x")


def test_a_local_write_is_never_half_done(tmp_path, monkeypatch):
    path = str(tmp_path / "f.txt")
    storage.write_text(path, "old")

    class Boom(Exception):
        pass

    def fail(*a, **k):
        raise Boom

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(Boom):
        storage.write_text(path, "new")
    assert open(path).read() == "old" and os.listdir(tmp_path) == ["f.txt"]


def test_upload_and_local_copy_follow_the_remote_files(root, tmp_path):
    src = tmp_path / "tok"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "extra.txt").write_text("x")
    storage.upload_dir(str(src), storage.join(root, "tokenizer"))
    cache = str(tmp_path / "cache")
    local = storage.local_copy(storage.join(root, "tokenizer"), cache)
    assert sorted(os.listdir(local)) == sorted(
        (["extra.txt", "tokenizer.json"]) + ([".complete"] if storage.is_url(root) else []))
    assert open(os.path.join(local, "tokenizer.json")).read() == "{}"
    if storage.is_url(root):
        again = storage.local_copy(storage.join(root, "tokenizer"), cache)
        assert again == local                                      # reused, not downloaded
        storage.write_text(storage.join(root, "tokenizer", "tokenizer.json"), '{"v": 2}')
        changed = storage.local_copy(storage.join(root, "tokenizer"), cache)
        assert changed != local and open(os.path.join(changed, "tokenizer.json")).read() == \
            '{"v": 2}'
        with pytest.raises(FileNotFoundError, match="holds no file"):
            storage.local_copy(storage.join(root, "nothing"), cache)


def test_listdir_names_the_entries(root):
    for name in ("b.txt", "a/x.txt"):
        storage.write_text(storage.join(root, name), "x")
    assert storage.listdir(root) == ["a", "b.txt"]
