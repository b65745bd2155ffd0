"""The pod rehearsal's helpers (``scripts/pod_rehearsal.sh`` runs them; nothing here trains).

  python scripts/rehearsal.py emulator --port P --log F --pidfile F   # a gs:// emulator, detached
  python scripts/rehearsal.py hf-folder --out gs://B/Qwen3-30B-A3B     # the user's HF model folder
  python scripts/rehearsal.py competitions --raw DIR --data DIR --ids a,b  # MLE-bench's prepare
  python scripts/rehearsal.py wait --workdir gs://B/runs/x --step N   # until step N is logged
  python scripts/rehearsal.py summary --root DIR --workdir ... --export ...  # the last JSON line

What stands in for what a user has: the bucket is ``gcp-storage-emulator`` on loopback, served by
``scripts/gcs_emulator.py`` (the variables ``emulator_env`` prints point gcsfs and tensorstore at
it); the HF folder is the rehearsal's tiny Qwen3-MoE (``configs/ace30b.py:REHEARSAL_MODEL``,
seeded init) exported by the project's HF exporter, with the real Qwen3 tokenizer files beside
it; the competitions are made by MLE-bench's own prepare code on small synthetic raw files
(``ace_jax.env.mlebench_data``).
"""
from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
BUCKET = "ace-rehearsal"


def emulator_env(port: int) -> dict[str, str]:
    """What a process needs to reach the emulator by gs:// URLs alone: gcsfs (fsspec) and
    tensorstore (Orbax), anonymous, no GCE metadata probe, no gRPC bucket-type probe."""
    url = f"http://127.0.0.1:{port}"
    return dict(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
                GOOGLE_AUTH_TOKEN_FOR_TESTING="fake", FSSPEC_GS_TOKEN="anon",
                GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", NO_GCE_CHECK="true")


def start_emulator(port: int, log: str, pidfile: str, bucket: str = BUCKET) -> None:
    """Starts ``scripts/gcs_emulator.py`` (gcp-storage-emulator, in memory, one bucket, an upload
    cut short stores nothing) detached; returns when it answers."""
    if importlib.util.find_spec("gcp_storage_emulator") is None:
        sys.exit("gcp-storage-emulator is not installed (pip install -r requirements-test.txt)")
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "gcs_emulator.py"),
                             "--port", str(port), "--bucket", bucket],
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                            start_new_session=True)
    pathlib.Path(pidfile).write_text(str(proc.pid))
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", f"/storage/v1/b/{bucket}")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    sys.exit(f"the GCS emulator did not start on port {port}: "
             f"{pathlib.Path(log).read_text(errors='replace')[-1000:]}")


def _rehearsal_config():
    spec = importlib.util.spec_from_file_location("ace30b", REPO / "configs" / "ace30b.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_hf_folder(out: str, tokenizer_dir: str, seed: int = 0) -> dict:
    """The rehearsal's stand-in for Qwen3-30B-A3B's HF folder: config.json + safetensors of the
    tiny model (seeded init, exported by ``models.hf_mapping.export_hf``) and the real Qwen3
    tokenizer's files, uploaded to ``out``. Returns the files' sizes."""
    from flax import nnx

    from ace_jax.runtime import storage
    from models import configs, hf_mapping, qwen3

    model_cfg = configs.get_model_config("tiny_moe", **_rehearsal_config().REHEARSAL_MODEL)
    model = qwen3.Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(seed))
    with tempfile.TemporaryDirectory() as tmp:
        hf_mapping.export_hf(model, model.config, tmp)
        for name in sorted(os.listdir(tokenizer_dir)):
            if os.path.isfile(os.path.join(tokenizer_dir, name)):
                shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(tmp, name))
        sizes = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
        storage.upload_dir(tmp, out)
    return sizes


def make_competitions(raw: str, data: str, ids: list[str]) -> dict:
    """Synthetic raw files in Kaggle's format for ``ids``, prepared into ``data`` by MLE-bench's
    own prepare code (``ace_jax.env.mlebench_data``)."""
    from ace_jax.env import mlebench_data

    for cid in ids:
        mlebench_data.write_synthetic_raw(cid, os.path.join(raw, cid), n_rows=200)
    mlebench_data.prepare_from_raw(ids, raw, data)
    return {"prepared": ids, "data_dir": data}


def _metrics(workdir: str) -> list[dict]:
    from ace_jax.runtime import storage

    path = storage.join(workdir, "metrics.jsonl")
    if not storage.exists(path):
        return []
    return [json.loads(x) for x in storage.read_text(path).splitlines() if x.strip()]


def rl_steps(workdir: str) -> int:
    """How many RL steps the run has logged (its steps count from 0)."""
    return 1 + max((int(m["step"]) for m in _metrics(workdir) if "reward/mean" in m), default=-1)


def wait_for_step(workdir: str, step: int, timeout_s: float, alive: str = "") -> None:
    """Returns once the run in ``workdir`` has logged ``step`` RL steps; exits non-zero after
    ``timeout_s`` or when the pid file ``alive`` names a process that has ended."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if rl_steps(workdir) >= step:
            return
        if alive and os.path.exists(alive):
            try:
                os.kill(int(pathlib.Path(alive).read_text()), 0)
            except (OSError, ValueError):
                sys.exit(f"the run ended before step {step} (pid file {alive})")
        time.sleep(2)
    sys.exit(f"no step {step} in {workdir} after {timeout_s:.0f} s")


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def _fetched(home: str) -> dict:
    """What one host fetched into its caches: ``storage.local_copy``'s folders (the tokenizer,
    evaluation's run files) and the staged competitions."""
    storage_cache = os.path.join(home, ".cache", "ace_jax", "storage")
    copies = [os.path.join(storage_cache, d) for d in
              (os.listdir(storage_cache) if os.path.isdir(storage_cache) else ())]
    tasks_cache = os.path.join(home, "ace-jax", "cache", "tasks", "mlebench")
    return dict(
        tokenizer_bytes=max((_tree_bytes(d) for d in copies
                             if os.path.exists(os.path.join(d, "tokenizer.json"))), default=0),
        bytes=sum(_tree_bytes(d) for d in copies) + _tree_bytes(tasks_cache),
        task_ids=sorted(os.listdir(tasks_cache)) if os.path.isdir(tasks_cache) else [])


def summary(root: str, workdir: str, export: str, hosts: int, phases: str,
            tasks_url: str, ids: list[str], kaggle_log: str, lost_host: str,
            retries: str = "") -> dict:
    """The rehearsal's outcome, read from what it left: the bucket, each worker's home and logs."""
    from ace_jax.runtime import storage

    run_cfg = json.loads(storage.read_text(storage.join(workdir, "config.json")))
    manifests = []
    for cid in ids:
        path = storage.join(tasks_url, cid, "STAGED.json")
        manifests.append(json.loads(storage.read_text(path)) if storage.exists(path) else {})
    fetched = [_fetched(os.path.join(root, f"worker{i}")) for i in range(hosts)]
    log0 = pathlib.Path(root, "worker0", "ace-jax", "logs", "ace30b-worker0.log")
    coordinator = log0.read_text(errors="replace") if log0.exists() else ""
    kaggle = pathlib.Path(kaggle_log).read_text(errors="replace") if os.path.exists(kaggle_log) else ""
    lost = pathlib.Path(lost_host).read_text().strip() if os.path.exists(lost_host) else ""
    logged = [m for m in _metrics(workdir) if "reward/mean" in m]
    steps = [int(m["step"]) for m in logged]
    exported = storage.exists(storage.join(export, "config.json")) and any(
        n.endswith(".safetensors") for n in storage.listdir(export))
    seconds = {}
    for line in pathlib.Path(phases).read_text().splitlines():
        name, t0, t1 = line.split()
        seconds[name] = round(float(t1) - float(t0), 1)
    return dict(
        hosts=hosts, rl_steps=rl_steps(workdir),
        steps_logged_once=steps == list(range(len(steps))),
        resumed="resumed at iteration" in coordinator,
        lost_host_message=lost[:300] or None,
        tasks=len([m for m in manifests if m]),
        mlebench_prepared=bool(manifests) and all(m.get("mlebench_prepared") for m in manifests),
        engine=run_cfg.get("engine", {}).get("kind"),
        # the paged engine's host round trip per decode call, gathered across the processes
        engine_host_gather_ms=next((m["engine/host_gather_ms"] for m in reversed(logged)
                                    if "engine/host_gather_ms" in m), None),
        tokenizer_bytes_per_host=max(f["tokenizer_bytes"] for f in fetched),
        fetched_bytes_per_host=[f["bytes"] for f in fetched],
        tasks_fetched_per_host=[f["task_ids"] for f in fetched],
        kaggle_stack=kaggle.count("KAGGLE_STACK ") >= hosts and "Traceback" not in kaggle,
        exported=exported, seconds=seconds,
        launch_retries=(len(pathlib.Path(retries).read_text().split())
                        if retries and os.path.exists(retries) else 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("emulator")
    e.add_argument("--port", type=int, required=True)
    e.add_argument("--log", required=True)
    e.add_argument("--pidfile", required=True)
    h = sub.add_parser("hf-folder")
    h.add_argument("--out", required=True)
    h.add_argument("--tokenizer", default=str(REPO / "cache" / "qwen3-tokenizer"))
    c = sub.add_parser("competitions")
    c.add_argument("--raw", required=True)
    c.add_argument("--data", required=True)
    c.add_argument("--ids", required=True)
    w = sub.add_parser("wait")
    w.add_argument("--workdir", required=True)
    w.add_argument("--step", type=int, required=True)
    w.add_argument("--timeout", type=float, default=1800)
    w.add_argument("--alive", default="")
    s = sub.add_parser("summary")
    for k in ("root", "workdir", "export", "phases", "tasks_url", "ids", "kaggle_log"):
        s.add_argument("--" + k, required=True)
    s.add_argument("--lost_host", default="")
    s.add_argument("--retries", default="")
    s.add_argument("--hosts", type=int, required=True)
    a = ap.parse_args(argv)
    if a.cmd == "emulator":
        start_emulator(a.port, a.log, a.pidfile)
    elif a.cmd == "hf-folder":
        print(json.dumps(make_hf_folder(a.out, a.tokenizer)))
    elif a.cmd == "competitions":
        print(json.dumps(make_competitions(a.raw, a.data, a.ids.split(","))))
    elif a.cmd == "wait":
        wait_for_step(a.workdir, a.step, a.timeout, a.alive)
    elif a.cmd == "summary":
        print(json.dumps(summary(a.root, a.workdir, a.export, a.hosts, a.phases, a.tasks_url,
                                 a.ids.split(","), a.kaggle_log, a.lost_host, a.retries)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
