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


def _folder_bytes(folder) -> dict:
    """{relative path: size} of the files under ``folder`` (the cache's marker excluded)."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), folder)
            if rel != ".complete":
                out[rel] = os.path.getsize(os.path.join(dirpath, n))
    return out


def test_the_tokenizer_of_an_hf_folder_is_copied_without_its_weights(gs, tmp_path, monkeypatch):
    """``model.tokenizer_path`` = an HF model folder in a bucket (tokenizer files beside the
    safetensors, as Qwen3-30B-A3B's): ``setup.load_tokenizer`` downloads the tokenizer's files
    and not one byte of the weights."""
    import json

    import ml_collections

    from ace_jax.train import setup
    from models import tokenizer as tok_lib

    folder = tmp_path / "Qwen3-tiny"
    tok_lib.train_bpe_tokenizer(["def f(x):\n    return x + 1\n"] * 20, 300, folder)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    for i in (1, 2):   # 6 MB of "weights"
        (folder / f"model-0000{i}-of-00002.safetensors").write_bytes(os.urandom(3 << 20))
    tokenizer_files = {n: os.path.getsize(folder / n) for n in os.listdir(folder)
                       if "safetensors" not in n}
    assert set(tokenizer_files) == {"tokenizer.json", "tokenizer_config.json",
                                    "chat_template.jinja", "config.json",
                                    "generation_config.json"}
    url = storage.join(gs, "Qwen3-tiny")
    storage.upload_dir(str(folder), url)

    cache = tmp_path / "cache"
    monkeypatch.setenv(storage.CACHE_ENV_VAR, str(cache))
    cfg = ml_collections.ConfigDict({"model": {"tokenizer_path": url, "init_from_run": ""}})
    before = storage.downloaded_bytes()
    tok = setup.load_tokenizer(cfg, str(tmp_path / "run"), tasks=[])
    downloaded = storage.downloaded_bytes() - before
    assert downloaded == sum(tokenizer_files.values())            # the tokenizer's bytes only
    (copy,) = [cache / n for n in os.listdir(cache)]
    assert _folder_bytes(copy) == tokenizer_files                  # no weights in the cache
    assert tok("return x")["input_ids"] == \
        tok_lib.load_tokenizer(folder)("return x")["input_ids"]
    # the same tokenizer again: the cached copy, nothing downloaded
    setup.load_tokenizer(cfg, str(tmp_path / "run"), tasks=[])
    assert storage.downloaded_bytes() - before == downloaded
    assert os.listdir(cache) == [copy.name]
    # a selection that matches nothing says what it looked for
    with pytest.raises(FileNotFoundError, match="no file matching"):
        storage.local_copy(url, str(cache), files=("*.bin",))


def test_local_copy_is_atomic_and_shared_by_processes_of_one_machine(gs, tmp_path,
                                                                     monkeypatch):
    """A copy that fails half-way leaves nothing behind (the next call starts afresh); two
    callers racing on one cache folder (two hosts rehearsed on one machine) get the same
    complete copy, downloaded once."""
    import threading

    src = tmp_path / "data"
    (src / "sub").mkdir(parents=True)
    for i in range(4):
        (src / f"f{i}.bin").write_bytes(os.urandom(64 << 10))
    (src / "sub" / "g.txt").write_text("g")
    url = storage.join(gs, "data")
    storage.upload_dir(str(src), url)
    cache = str(tmp_path / "cache")
    size = sum(os.path.getsize(p) for p in src.rglob("*") if p.is_file())

    real_fs = storage._fs

    class Broken:
        def __init__(self, fs):
            self.fs, self.calls = fs, 0

        def __getattr__(self, name):
            return getattr(self.fs, name)

        def get_file(self, rpath, lpath):
            self.calls += 1
            if self.calls == 3:
                raise ConnectionResetError("the download broke off")
            return self.fs.get_file(rpath, lpath)

    monkeypatch.setattr(storage, "_fs", lambda p: (Broken(real_fs(p)[0]), real_fs(p)[1]))
    with pytest.raises(ConnectionResetError):
        storage.local_copy(url, cache, name="data")
    assert os.listdir(cache) == []                   # no half copy, no temporary folder
    monkeypatch.setattr(storage, "_fs", real_fs)

    # a temporary folder of a process killed mid-copy is cleared by the next copy
    os.makedirs(os.path.join(cache, ".tmp-data-killed"))
    before = storage.downloaded_bytes()
    results, errors = [], []

    def copy():
        try:
            results.append(storage.local_copy(url, cache, name="data"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=copy) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert storage.downloaded_bytes() - before == size           # once, not three times
    assert os.listdir(cache) == ["data"]
    assert sorted(_folder_bytes(results[0])) == sorted(
        os.path.relpath(p, src) for p in src.rglob("*") if p.is_file())
    # changed remote files replace the named copy in place
    storage.write_text(storage.join(url, "sub", "g.txt"), "g2")
    assert storage.local_copy(url, cache, name="data") == results[0]
    assert open(os.path.join(results[0], "sub", "g.txt")).read() == "g2"
    assert os.listdir(cache) == ["data"]
