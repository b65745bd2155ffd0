"""The pod rehearsal (scripts/pod_rehearsal.sh) and the runbook (docs/tpu.md) run the same commands,
and scripts/tpu_pod_run.sh's local workers are what the rehearsal says they are.

The drift test reads both files: every command of the runbook that acts on the pod or the bucket
(``scripts/tpu_pod_run.sh ...``, ``python launch/...``, ``RUN=...``) is run by the rehearsal
verbatim (a line marked ``# runbook``), unless the doc's line says ``# not rehearsed: <why>``;
and every line the rehearsal marks ``# runbook`` is in the doc. The rehearsal itself runs in CI
(``.ci/run``: ``bash scripts/pod_rehearsal.sh --reduced``), not here.
"""
import os
import pathlib
import re
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "tpu.md"
REHEARSAL = REPO / "scripts" / "pod_rehearsal.sh"
# A command that acts on the pod or the bucket: an optional VAR=value prefix, then one of these.
ACTION = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:scripts/tpu_pod_run\.sh |python launch/)|^RUN=")
TEE = re.compile(r' 2>&1 \| tee "[^"]*"$')


def _norm(line: str) -> str:
    return " ".join(line.split())


def doc_commands(text: str) -> list[tuple[str, str]]:
    """(command, note) of every line in the doc's ```bash blocks, continuations joined; note is
    the text after ``# not rehearsed:`` (empty when the line has none)."""
    out, block, pending = [], False, ""
    for raw in text.splitlines():
        if raw.startswith("```"):
            block, pending = raw.strip() == "```bash", ""
            continue
        if not block:
            continue
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        cmd, _, comment = line.partition(" #")
        note = comment.split("not rehearsed:", 1)[1].strip() if "not rehearsed:" in comment else ""
        if cmd.strip():
            out.append((_norm(cmd), note))
    return out


def rehearsal_commands(text: str) -> list[str]:
    """The commands of the rehearsal's lines marked ``# runbook`` (their output capture cut)."""
    out = []
    for line in text.splitlines():
        if line.rstrip().endswith("# runbook"):
            cmd = line.rstrip()[:-len("# runbook")].rstrip()
            out.append(_norm(TEE.sub("", cmd)))
    return out


def test_the_runbook_and_the_rehearsal_run_the_same_commands():
    doc = doc_commands(DOC.read_text())
    rehearsed = rehearsal_commands(REHEARSAL.read_text())
    assert len(rehearsed) >= 8, rehearsed
    doc_cmds = {c for c, _ in doc}
    assert [c for c in rehearsed if c not in doc_cmds] == [], \
        "the rehearsal runs these as runbook steps, but docs/tpu.md does not have them"
    missing = [c for c, note in doc if ACTION.search(c) and not note and c not in rehearsed]
    assert missing == [], ("docs/tpu.md tells the user to run these, but the rehearsal does not: "
                           "rehearse them or mark them '# not rehearsed: <why>'")


def test_the_drift_check_fails_when_a_command_changes():
    doc = DOC.read_text()
    rehearsal = REHEARSAL.read_text()
    line = next(x for x in rehearsal.splitlines() if "launch -- $RUN" in x and "# runbook" in x)
    changed = rehearsal.replace(line, line.replace("launch -- $RUN", "launch -- $RUN --dry_run"))
    rehearsed = rehearsal_commands(changed)
    assert [c for c in rehearsed if c not in {c for c, _ in doc_commands(doc)}]
    # a doc step that the rehearsal does not run is found too
    extra = doc.replace("```bash\n", "```bash\nscripts/tpu_pod_run.sh exec -- python -c 1\n", 1)
    doc2 = doc_commands(extra)
    assert any(c == "scripts/tpu_pod_run.sh exec -- python -c 1" for c, n in doc2 if not n)


def _dry(action, *args, **env):
    e = dict(os.environ, TRANSPORT="local", LOCAL_ROOT="/tmp/nowhere", DRY="1", **env)
    return subprocess.run(["bash", str(REPO / "scripts" / "tpu_pod_run.sh"), action, *args],
                          env=e, capture_output=True, text=True, timeout=30)


def test_local_workers_need_no_gcloud_and_get_their_own_home():
    out = _dry("exec", "--", "python", "-c", "print(1)")
    assert out.returncode == 0, out.stderr
    assert "gcloud" not in out.stdout and "PYTHONPATH=$PWD" in out.stdout
    assert "print\\(1\\)" in out.stdout or "print(1)" in out.stdout


def test_a_real_local_exec_runs_on_every_worker_with_its_coordinator_variables(tmp_path):
    home = tmp_path / "w"
    for i in range(2):   # what `setup` leaves: a checkout with a venv
        d = home / f"worker{i}" / "ace-jax"
        (d / ".venv" / "bin").mkdir(parents=True)
        (d / ".venv" / "bin" / "activate").write_text("")
    env = dict(os.environ, TRANSPORT="local", LOCAL_ROOT=str(home), LOCAL_WORKERS="2",
               LOCAL_DEVICES="3", LOCAL_COORDINATOR="127.0.0.1:1234")
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "tpu_pod_run.sh"), "exec", "--", "bash", "-c",
         'echo "$WORKER_ID $JAX_PROCESS_ID/$JAX_NUM_PROCESSES $JAX_COORDINATOR_ADDRESS $XLA_FLAGS $HOME"'],
        env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    for i in range(2):
        assert (f"[worker {i}] {i} {i}/2 127.0.0.1:1234 "
                f"--xla_force_host_platform_device_count=3 {home}/worker{i}") in out.stdout, out.stdout


@pytest.mark.parametrize("missing", ["TPU_NAME", "ZONE"])
def test_gcloud_transport_still_requires_the_pod(missing):
    env = dict(os.environ, TPU_NAME="x", ZONE="y", DRY="1")
    env.pop(missing)
    env.pop("TRANSPORT", None)
    out = subprocess.run(["bash", str(REPO / "scripts" / "tpu_pod_run.sh"), "status"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and missing in out.stderr
