"""``python -m sandbox.prepare``: prepare once, checksums, verification, reference checksums."""
import json
import subprocess
import sys

import pytest

from sandbox import prepare
from sandbox.tasks import registry

SMALL = "iris-species,wine-alcohol"


def test_prepare_then_verify_then_detect_tampering(tmp_path, capsys):
    assert prepare.main([f"--cache_dir={tmp_path}", f"--tasks={SMALL}"]) == 0
    out = capsys.readouterr().out
    assert out.count("prepared") == 2 and "2/2 tasks ok" in out
    d = registry.task_dir(tmp_path, "iris-species", 0)
    sums = json.loads((d / "checksums.json").read_text())
    assert set(sums) == {"task.json", "public/train.csv", "public/test.csv", "public/description.md",
                         "public/sample_submission.csv", "private/answers_dev.csv",
                         "private/answers_test.csv"}

    assert prepare.main([f"--cache_dir={tmp_path}", f"--tasks={SMALL}"]) == 0
    assert capsys.readouterr().out.count("verified") == 2

    with open(d / "public" / "train.csv", "a") as f:
        f.write("deadbeef,1,2,3,4,setosa\n")
    (d / "private" / "answers_dev.csv").unlink()
    assert prepare.main([f"--cache_dir={tmp_path}", "--tasks=iris-species"]) == 1
    err = capsys.readouterr().err
    assert "changed public/train.csv" in err and "missing private/answers_dev.csv" in err
    with pytest.raises(prepare.ChecksumError, match="changed public/train.csv"):
        prepare.verify_checksums(d)

    assert prepare.main([f"--cache_dir={tmp_path}", "--tasks=iris-species", "--force"]) == 0
    prepare.verify_checksums(d)


def test_verify_rebuilds_identically_and_matches_reference(tmp_path, capsys):
    """All tasks: a rebuild is byte-identical, and equals the files the committed leaderboards
    were measured on (results/seed0/checksums.json)."""
    assert prepare.reference_checksums(0) is not None
    offline = registry.list_tasks(family="offline")
    assert prepare.main([f"--cache_dir={tmp_path}", "--verify",
                         "--tasks=" + ",".join(offline)]) == 0
    out = capsys.readouterr().out
    n = len(offline)
    assert out.count("rebuild identical, matches reference") == n and f"{n}/{n} tasks ok" in out


def test_verify_flags_a_different_seed_against_reference(tmp_path, capsys, monkeypatch):
    # seed 1 has no reference; fake one from seed 0 to show the comparison can fail
    ref0 = json.loads((registry.RESULTS_DIR / "seed0" / "checksums.json").read_text())
    monkeypatch.setattr(prepare, "reference_checksums", lambda seed: ref0)
    assert prepare.main([f"--cache_dir={tmp_path}", "--seed=1", "--tasks=iris-species", "--verify"]) == 1
    assert "vs reference: changed public/train.csv" in capsys.readouterr().err


def test_unknown_task_is_refused(tmp_path):
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        prepare.main([f"--cache_dir={tmp_path}", "--tasks=iris-species,nope"])
    assert not (tmp_path / "seed0" / "iris-species").exists()  # failed before any work


def test_cli_entry_point(tmp_path):
    p = subprocess.run([sys.executable, "-m", "sandbox.prepare", f"--cache_dir={tmp_path}",
                        "--tasks=wine-alcohol"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "wine-alcohol" in p.stdout and "1/1 tasks ok" in p.stdout
