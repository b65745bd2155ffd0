"""Where execution cgroups can be made: the mounted hierarchy that carries a controller (cgroup v1
or v2), the cgroup of this process or of the calling thread in it, and the hierarchy of the
executions' memory cgroups (``detect_memory``). ``sandbox.backends.cgroup`` makes and drives the
cgroups themselves; its module docstring has the design (pids and memory, v1 and v2).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import uuid
from typing import Optional

_DEFAULT_PARENT = "ace_sandbox"

# Per version: (limit file, swap file and its value, events file with the "oom_kill" counter).
_MEMORY_FILES = {
    "v1": ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.oom_control"),
    "v2": ("memory.max", "memory.swap.max", "memory.events"),
}


def _pids_mount() -> tuple[Optional[pathlib.Path], str, str]:
    """(mount point, version 'v1'|'v2', reason) of the hierarchy that carries ``pids``."""
    return _controller_mount("pids")


def _controller_mount(controller: str) -> tuple[Optional[pathlib.Path], str, str]:
    """(mount point, version 'v1'|'v2', reason) of the hierarchy that carries ``controller``:
    a v1 hierarchy of that controller, else the v2 one (whether v2 offers the controller is
    checked by the caller, in its cgroup's ``cgroup.controllers``)."""
    try:
        mountinfo = pathlib.Path("/proc/self/mountinfo").read_text()
    except OSError as e:
        return None, "", f"cannot read /proc/self/mountinfo: {e}"
    v2 = None
    for line in mountinfo.splitlines():
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(fields) < 5 or len(post_fields) < 3:
            continue
        fstype, options = post_fields[0], post_fields[2].split(",")
        mount_root, mount_point = fields[3], fields[4]
        if fstype == "cgroup" and controller in options and mount_root == "/":
            return pathlib.Path(mount_point), "v1", ""
        if fstype == "cgroup2" and mount_root == "/":
            v2 = pathlib.Path(mount_point)
    if v2 is not None:
        return v2, "v2", ""
    return None, "", f"no cgroup '{controller}' hierarchy is mounted"


def _cgroup_of(proc_file: str, version: str, controller: str = "pids") -> Optional[str]:
    """The cgroup path, in the hierarchy that carries ``controller``, listed in ``proc_file``
    (``/proc/self/cgroup``: the process; ``/proc/thread-self/cgroup``: the calling thread)."""
    try:
        lines = pathlib.Path(proc_file).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if version == "v1" and controller in controllers.split(","):
            return path
        if version == "v2" and hier == "0" and controllers == "":
            return path
    return None


def _own_cgroup(version: str, controller: str = "pids") -> Optional[str]:
    return _cgroup_of("/proc/self/cgroup", version, controller)


def _thread_cgroup(version: str, controller: str = "pids") -> Optional[str]:
    """The calling thread's cgroup path in the hierarchy that carries ``controller``."""
    return _cgroup_of("/proc/thread-self/cgroup", version, controller)


@dataclasses.dataclass(frozen=True)
class MemoryHierarchy:
    """Where the memory cgroups of executions are made (see the module docstring).

    Attributes:
      parent: the directory they are made in: v1 ``<memory mount>/<own memory cgroup>/ace_sandbox``
        (an execution's is ``parent / <its pids cgroup's name>``); v2 the pids parent itself (one
        hierarchy: an execution's memory cgroup is its pids cgroup).
      version: "v1" or "v2".
      mount: root of the v1 memory hierarchy (a host thread steps back there if its own memory
        cgroup is gone); None on v2.
    """

    parent: pathlib.Path
    version: str
    mount: Optional[pathlib.Path] = None

    def dir_of(self, pids_path: pathlib.Path) -> pathlib.Path:
        """The memory cgroup of the execution whose pids cgroup is ``pids_path``."""
        return self.parent / pids_path.name if self.version == "v1" else pids_path


def detect_memory(pids_parent: pathlib.Path, pids_version: str,
                  parent_name: str = _DEFAULT_PARENT) -> tuple[Optional[MemoryHierarchy], str]:
    """(hierarchy, "") if per-execution memory cgroups can be made beside the pids cgroups under
    ``pids_parent``, else (None, the reason). Makes (v1) or enables (v2) the parent and makes and
    removes one probe cgroup with a limit written."""
    mount, version, reason = _controller_mount("memory")
    if mount is None:
        return None, reason
    if version == "v2":
        if pids_version != "v2":
            return None, "the memory controller is on cgroup v2 but pids on v1 (mixed hierarchies)"
        return _detect_memory_v2(pids_parent)
    own = _own_cgroup("v1", "memory")
    if own is None:
        return None, "cannot find this process's v1 memory cgroup in /proc/self/cgroup"
    hierarchy = MemoryHierarchy(mount / own.lstrip("/") / parent_name, "v1", mount)
    try:
        hierarchy.parent.mkdir(exist_ok=True)
    except OSError as e:
        return None, f"cannot create a memory cgroup under {hierarchy.parent}: {e.strerror or e}"
    return hierarchy, _probe_memory(hierarchy)


def _detect_memory_v2(parent: pathlib.Path) -> tuple[Optional[MemoryHierarchy], str]:
    """v2: enables ``+memory`` for the children of ``parent`` (and of its parent, our cgroup)."""
    base = parent.parent
    try:
        if "memory" not in (base / "cgroup.controllers").read_text().split():
            return None, f"the memory controller is not available in {base} (cgroup v2)"
        for d in (base, parent):
            if "memory" not in (d / "cgroup.subtree_control").read_text().split():
                (d / "cgroup.subtree_control").write_text("+memory")
    except OSError as e:
        return None, (f"cannot enable the memory controller below {base} (cgroup v2): "
                      f"{e.strerror or e}; a cgroup that holds processes (this one) cannot give "
                      "its children the memory controller unless it is the root cgroup: run the "
                      "trainer as root in the root cgroup, or in a cgroup of its own whose parent "
                      "delegates memory")
    hierarchy = MemoryHierarchy(parent, "v2")
    return hierarchy, _probe_memory(hierarchy)


def _probe_memory(hierarchy: MemoryHierarchy) -> str:
    """"" if a memory cgroup with a limit can be made under ``hierarchy.parent``, else why not."""
    probe = hierarchy.parent / f"probe-{uuid.uuid4().hex[:8]}"
    try:
        probe.mkdir()
        try:
            (probe / _MEMORY_FILES[hierarchy.version][0]).write_text(str(1 << 30))
        finally:
            os.rmdir(probe)
    except OSError as e:
        return f"cannot limit a memory cgroup under {hierarchy.parent}: {e.strerror or e}"
    return ""
