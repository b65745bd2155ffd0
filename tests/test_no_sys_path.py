"""No script edits ``sys.path``: every tracked ``.py`` file outside ``tests/`` imports the
packages as installed (``pip install -e .``, the README's setup) or run from the checkout's root.

The check reads each file's syntax tree (not its text): an assignment to ``sys.path`` or to a
slice or item of it (``=``, ``+=``, ``del``, ``setattr(sys, "path", ...)``), a call of one of its
mutating methods (``insert``, ``append``, ...) and ``site.addsitedir``, with ``sys`` or ``site``
under any alias and ``sys.path`` through ``from sys import path [as p]`` or ``p = sys.path``.
Reading it (``print(sys.path)``, ``list(sys.path)``) is fine. It is tested on made-up sources.
"""
from __future__ import annotations

import ast
import pathlib
import subprocess

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
MUTATORS = frozenset({"insert", "append", "extend", "remove", "pop", "clear", "reverse", "sort",
                      "__setitem__", "__delitem__", "__iadd__"})


def tracked_py_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The ``.py`` files git tracks under ``root``, or would (untracked, not ignored), ``tests/``
    left out; outside a git checkout, every ``.py`` file but those of hidden folders and virtual
    environments."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard", "--", "*.py"],     # new files count too
                             cwd=root, check=True, capture_output=True, text=True).stdout
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if not any(part.startswith(".") or part in ("venv", "site-packages")
                            for part in p.relative_to(root).parts)]
    return [root / n for n in sorted(names)
            if pathlib.PurePosixPath(n).parts[0] != "tests" and (root / n).is_file()]


def sys_path_edits(source: str, filename: str = "<source>") -> list[str]:
    """``filename:line what`` for every place ``source`` assigns to or mutates ``sys.path``."""
    tree = ast.parse(source, filename)
    sys_names, site_names, path_names = set(), set(), set()
    for node in ast.walk(tree):                      # the names sys, site and sys.path go by
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "sys":
                    sys_names.add(a.asname or "sys")
                elif a.name == "site":
                    site_names.add(a.asname or "site")
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and not node.level:
            path_names |= {a.asname or a.name for a in node.names if a.name == "path"}

    def is_sys(node) -> bool:
        return isinstance(node, ast.Name) and node.id in sys_names

    def is_path(node) -> bool:
        return ((isinstance(node, ast.Attribute) and node.attr == "path" and is_sys(node.value))
                or (isinstance(node, ast.Name) and node.id in path_names))

    for node in ast.walk(tree):                      # p = sys.path: p is sys.path too
        if isinstance(node, ast.Assign) and is_path(node.value):
            path_names |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def target_is_path(t) -> bool:
        if isinstance(t, ast.Subscript):
            return is_path(t.value)
        if isinstance(t, ast.Name):                  # rebinding an alias leaves sys.path alone
            return False
        if isinstance(t, (ast.Tuple, ast.List)):
            return any(target_is_path(e) for e in t.elts)
        if isinstance(t, ast.Starred):
            return target_is_path(t.value)
        return is_path(t)

    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Assign) and any(target_is_path(t) for t in node.targets):
            what = "assigns to sys.path"
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and (
                target_is_path(node.target) or is_path(node.target)):
            what = "assigns to sys.path"
        elif isinstance(node, ast.Delete) and any(target_is_path(t) for t in node.targets):
            what = "deletes from sys.path"
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in MUTATORS and is_path(f.value):
                what = f"calls sys.path.{f.attr}"
            elif (isinstance(f, ast.Attribute) and f.attr == "addsitedir"
                  and isinstance(f.value, ast.Name) and f.value.id in site_names):
                what = "calls site.addsitedir"
            elif (isinstance(f, ast.Name) and f.id == "setattr" and len(node.args) >= 2
                  and is_sys(node.args[0]) and isinstance(node.args[1], ast.Constant)
                  and node.args[1].value == "path"):
                what = "sets sys.path"
        if what:
            found.append(f"{filename}:{node.lineno} {what}")
    return sorted(found, key=lambda s: int(s.rsplit(":", 1)[1].split()[0]))


def test_no_tracked_file_outside_tests_edits_sys_path():
    files = tracked_py_files(REPO)
    assert len(files) > 50 and all(f.suffix == ".py" for f in files)
    assert REPO / "results/ideator_room/pilot.py" in files        # scripts under results/ count
    bad = [e for f in files for e in sys_path_edits(f.read_text(), str(f.relative_to(REPO)))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, want", [
    ("import sys\nsys.path.insert(0, 'x')\n", ["s.py:2 calls sys.path.insert"]),
    ("import sys\nif True:\n    sys.path.append('x')\n", ["s.py:3 calls sys.path.append"]),
    ("import sys as _s\n_s.path.extend(['x'])\n", ["s.py:2 calls sys.path.extend"]),
    ("import sys\nsys.path = ['x'] + sys.path\n", ["s.py:2 assigns to sys.path"]),
    ("import sys\nsys.path += ['x']\n", ["s.py:2 assigns to sys.path"]),
    ("import sys\nsys.path[:0] = ['x']\n", ["s.py:2 assigns to sys.path"]),
    ("import sys\ndel sys.path[0]\n", ["s.py:2 deletes from sys.path"]),
    ("import sys\nsetattr(sys, 'path', [])\n", ["s.py:2 sets sys.path"]),
    ("from sys import path as p\np.insert(0, 'x')\n", ["s.py:2 calls sys.path.insert"]),
    ("import sys\np = sys.path\np.append('x')\n", ["s.py:3 calls sys.path.append"]),
    ("import site\nsite.addsitedir('x')\n", ["s.py:2 calls site.addsitedir"]),
    ("def f():\n    import sys\n    sys.path.insert(0, 'x')\n", ["s.py:3 calls sys.path.insert"]),
    # reading it, or a copy of it, or another object's `path`, is not an edit
    ("import sys\nprint(sys.path, list(sys.path), 'x' in sys.path, sys.path.index('x'))\n", []),
    ("import sys\nq = list(sys.path)\nq.insert(0, 'x')\n", []),
    ("import os, sys\nos.path.join('a')\nx = sys.argv\nx.append('y')\n", []),
    ("import sys\np = sys.path\np = []\n", []),
])
def test_the_check_catches_each_way_of_editing_sys_path(source, want):
    assert sys_path_edits(source, "s.py") == want


def test_the_check_finds_the_edit_a_script_used_to_make(tmp_path):
    (tmp_path / "results/x").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "results/x/pilot.py").write_text(
        "import os\nimport sys\n\nREPO = os.path.dirname(__file__)\nsys.path.insert(0, REPO)\n")
    (tmp_path / "tests/test_x.py").write_text("import sys\nsys.path.append('.')\n")   # exempt
    files = tracked_py_files(tmp_path)
    assert files == [tmp_path / "results/x/pilot.py"]
    assert sys_path_edits(files[0].read_text(), "results/x/pilot.py") == [
        "results/x/pilot.py:5 calls sys.path.insert"]
