"""Docker backend: one throw-away container per execution (hosts that run a Docker engine).

The container gets: the run's working dir bind-mounted at ``/workspace`` (rw) and
``task.public_dir`` at ``/workspace/input`` (ro); no network (``network_disabled``); a memory
limit with no extra swap (``mem_limit`` = ``memswap_limit``); ``nano_cpus``; ``pids_limit``; a
read-only root filesystem with a size-capped ``/tmp`` tmpfs; RLIMIT_FSIZE/CORE/NOFILE ulimits;
all capabilities dropped, ``no-new-privileges``; a non-root user (65534 by default); a
size-capped json log. The wall-clock deadline is enforced from the host: ``stop`` (SIGTERM, the
grace period, SIGKILL) and the container is always removed (``force=True``), which kills every
process inside it, daemons included. ``State.OOMKilled`` gives a real OOM status.

The image must hold a Python with the packages the tasks need (numpy, pandas, scikit-learn) and
no copy of the source datasets; it is configured with ``image=``. Peak memory is not measured
(``peak_memory_mb`` is None): the engine reports it only while the container runs.
"""
from __future__ import annotations

import os
import pathlib
import threading
import time
import uuid
from typing import Any, Mapping, Optional

from sandbox.backends import base
from sandbox.backends.owner import sweep_dead_owners
from sandbox.backends.process import THREAD_VARS, default_root_dir, owner_lock

WORKSPACE = "/workspace"
RUNNER_IN_CONTAINER = "/opt/ace_sandbox/runner.py"  # sandbox/runner.py, bound read-only


class DockerBackend(base.Backend):
    """Runs each execution in a fresh container. See the module docstring.

    Args:
      image: the image to run (must contain ``python``).
      client: a ``docker.DockerClient`` (default: ``docker.from_env()``).
      root_dir, keep, limits, threads, output_head_bytes, output_tail_bytes, submission_max_mb,
        extra_env: as for ``ProcessBackend``.
      cpus: CPU quota of the container (``nano_cpus = cpus * 1e9``).
      user: "uid:gid" the script runs as inside the container.
      python: the interpreter inside the image.
      runtime: an OCI runtime name (e.g. "runsc" for gVisor, "sysbox-runc"); None = engine default.
      poll_s: how often the container state is checked.

    Raises:
      SandboxUnavailableError: the docker SDK is missing, no engine answers, or ``root_dir``
        cannot hold the working dirs.
    """

    name = "docker"

    def __init__(self, *, image: str = "python:3.11-slim", client: Any = None,
                 root_dir: Optional[os.PathLike] = None, keep: bool = False,
                 limits: Optional[base.Limits] = None, threads: int = 1, cpus: float = 1.0,
                 output_head_bytes: int = 4096, output_tail_bytes: int = 4096,
                 submission_max_mb: int = 256, extra_env: Optional[Mapping[str, str]] = None,
                 user: str = "65534:65534", python: str = "python", runtime: Optional[str] = None,
                 poll_s: float = 0.05):
        if cpus <= 0:
            raise ValueError(f"cpus must be positive, got {cpus}")
        if client is None:
            client = docker_client()
        self.client = client
        self.image = image
        self.limits = limits or base.Limits()
        self.root_dir = (pathlib.Path(root_dir) if root_dir is not None
                         else default_root_dir(self.limits.disk_mb))
        self.keep = keep
        self.threads = threads
        self.cpus = cpus
        self.output_head_bytes, self.output_tail_bytes = output_head_bytes, output_tail_bytes
        self.submission_max_bytes = int(submission_max_mb) << 20
        self.extra_env = dict(extra_env or {})
        self.user = user
        self.python = python
        self.runtime = runtime
        self.poll_s = poll_s
        self.owner = owner_lock(self.root_dir)
        sweep_dead_owners(self.root_dir, self._remove_dead_owner)  # hosts killed mid-execution

    def container_kwargs(self, task: Any, workdir: pathlib.Path, limits: base.Limits,
                         marker: str) -> dict[str, Any]:
        """Keyword arguments of ``client.containers.run`` for one execution."""
        from docker.types import LogConfig, Ulimit  # local import: optional dependency

        env = {"HOME": WORKSPACE, "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONHASHSEED": "0"}
        env.update({var: str(self.threads) for var in THREAD_VARS})
        env.update(self.extra_env)
        fsize = int(limits.file_size_mb) << 20
        kwargs = dict(
            image=self.image,
            # sandbox/runner.py seeds the RNGs (see it); no -P: the image's Python may be older
            command=[self.python, "-s", "-u", RUNNER_IN_CONTAINER, "run", base.SCRIPT_NAME],
            detach=True,
            working_dir=WORKSPACE,
            volumes={
                os.fspath(workdir): {"bind": WORKSPACE, "mode": "rw"},
                os.path.realpath(task.public_dir): {"bind": f"{WORKSPACE}/input", "mode": "ro"},
                base.RUNNER: {"bind": RUNNER_IN_CONTAINER, "mode": "ro"},
            },
            environment=env,
            user=self.user,
            network_disabled=True,
            mem_limit=f"{int(limits.memory_mb)}m",
            memswap_limit=f"{int(limits.memory_mb)}m",
            nano_cpus=int(self.cpus * 1e9),
            pids_limit=int(limits.pids_max),
            read_only=True,
            tmpfs={"/tmp": f"size={int(limits.disk_mb)}m,mode=1777"},
            ulimits=[Ulimit(name="fsize", soft=fsize, hard=fsize),
                     Ulimit(name="core", soft=0, hard=0),
                     Ulimit(name="nofile", soft=int(limits.open_files), hard=int(limits.open_files))],
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            stdin_open=False,
            log_config=LogConfig(type="json-file", config={"max-size": "8m", "max-file": "1"}),
            labels={"ace_sandbox_run": marker, "ace_sandbox_task": str(task.task_id)},
        )
        if self.runtime:
            kwargs["runtime"] = self.runtime
        return kwargs

    def execute(self, task: Any, code: str, *, cancel: Optional[threading.Event] = None) -> base.RawExecution:
        limits = base.task_limits(task, self.limits)
        workdir = base.prepare_workdir(self.root_dir, code, self.owner.token)
        # The container user is not the host user: let it write its outputs.
        for sub in ("working", "submission", "tmp"):
            os.chmod(workdir / sub, 0o777)
        marker = uuid.uuid4().hex
        raw = base.RawExecution(workdir=workdir if self.keep else None)
        container = None
        try:
            if not pathlib.Path(task.public_dir).is_dir():
                raise base.SandboxSetupError(f"task public_dir {task.public_dir} is not a directory")
            start = time.monotonic()
            try:
                container = self.client.containers.run(
                    **self.container_kwargs(task, workdir, limits, marker))
            except Exception as e:
                raise base.SandboxSetupError(f"docker could not start the container: {e}") from e
            deadline = start + limits.time_s
            disk_bytes = int(limits.disk_mb) << 20
            kill_reason = None
            while True:
                container.reload()
                if container.status in ("exited", "dead"):
                    break
                now = time.monotonic()
                if cancel is not None and cancel.is_set():
                    kill_reason = "cancelled"
                elif now >= deadline:
                    kill_reason = "timeout"
                elif base.dir_usage_bytes(workdir, disk_bytes) > disk_bytes:
                    kill_reason = "disk"
                if kill_reason:
                    container.stop(timeout=max(1, int(round(limits.grace_s))))
                    break
                time.sleep(self.poll_s)
            raw.wall_s = time.monotonic() - start
            container.reload()
            state = container.attrs.get("State", {})
            code_ = state.get("ExitCode")
            raw.exit_code = -(code_ - 128) if isinstance(code_, int) and 128 < code_ < 128 + 65 else code_
            raw.oom_killed = bool(state.get("OOMKilled"))
            raw.timed_out = kill_reason == "timeout"
            raw.cancelled = kill_reason == "cancelled"
            raw.disk_limit_hit = kill_reason == "disk"
            raw.stdout = self._logs(container, stdout=True)
            raw.stderr = self._logs(container, stdout=False)
            if kill_reason is None:
                raw.submission, raw.submission_error = base.collect_submission(
                    workdir, self.submission_max_bytes)
            return raw
        finally:
            if container is not None:
                try:
                    container.remove(force=True)
                except Exception:
                    pass
            if not self.keep:
                base.remove_workdir(workdir)

    def _remove_dead_owner(self, token: str) -> bool:
        """Removes the working dirs of a dead owner (not its containers, if any still run)."""
        return base.remove_owner_workdirs(self.root_dir, token)

    def close(self) -> None:
        """Gives up the owner lock of the working dirs."""
        self.owner.release()

    def _logs(self, container: Any, stdout: bool) -> str:
        capture = base.BoundedCapture(self.output_head_bytes, self.output_tail_bytes)
        for chunk in container.logs(stdout=stdout, stderr=not stdout, stream=True):
            capture.feed(chunk)
        return capture.text()


def docker_client() -> Any:
    """``docker.from_env()`` after a ping; SandboxUnavailableError (with the cause) otherwise."""
    try:
        import docker  # local import: optional dependency
    except ImportError as e:
        raise base.SandboxUnavailableError(
            f"the docker SDK is not installed ({e}); `pip install docker`") from e
    try:
        client = docker.from_env()
        client.ping()
    except Exception as e:
        raise base.SandboxUnavailableError(
            f"no Docker engine answers ({type(e).__name__}: {e}); start dockerd or use the "
            "'bwrap' backend") from e
    return client
