"""The package's rooms and the direction of imports between them.

Each room of ``ace_jax/`` states in its ``__init__`` docstring which other rooms it imports
(``Imports: `a`, `b` (and `ace_jax.config_utils`, `models`, ...)``); this test reads that line and
checks that the room's files import exactly those rooms and those extras, lazy imports
inside functions and relative imports included. ``ace_jax/config_utils.py`` and
``ace_jax/registry.py`` import no room; ``models/`` and ``sandbox/`` know nothing of RL (they
import no ``ace_jax``); and no file imports itself back through others (no file-level cycle).
The package's entry point, ``ace_jax/__main__.py`` (``python -m ace_jax``), sits above every room,
like ``launch/``: it may import any room and no module imports it. A room's own ``__main__.py``
(``python -m ace_jax.<room>``) has no such licence: it is a file of its room and imports what the
room declares, no more. The checks are functions of a source root, tested on small made-up trees
too.
"""
from __future__ import annotations

import ast
import pathlib
import re
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("ace_jax", "models", "sandbox")
LOOSE = ("ace_jax.config_utils", "ace_jax.registry")   # shared by every room


def rooms(root: pathlib.Path) -> list[str]:
    return sorted(p.parent.name for p in (root / "ace_jax").glob("*/__init__.py"))


def module_of(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: pathlib.Path, path: pathlib.Path) -> set[str]:
    """Dotted names of every module of ``PACKAGES`` imported anywhere in ``path`` (inside
    functions too), relative imports resolved; ``from a import b`` gives ``a.b``."""
    package = module_of(root, path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {n for n in names if n.split(".")[0] in PACKAGES}
    return out


def declared(root: pathlib.Path, room: str) -> tuple[set[str], set[str]]:
    """(rooms, extras) a room's ``Imports:`` line names; extras are ``LOOSE``, models, sandbox."""
    doc = ast.get_docstring(ast.parse((root / "ace_jax" / room / "__init__.py").read_text()))
    match = re.search(r"Imports: (.*?)\((.*?)\)", doc or "", re.S)
    assert match, f"ace_jax/{room}/__init__.py must state its imports ('Imports: `room`, ...')"
    return set(re.findall(r"`(\w+)`", match.group(1))), set(re.findall(r"`([\w.]+)`",
                                                                        match.group(2)))


def room_violations(root: pathlib.Path, room: str) -> list[str]:
    """What the room's files import against what it declares (both ways)."""
    want_rooms, want_extras = declared(root, room)
    got_rooms, got_extras, bad = set(), set(), []
    for path in sorted((root / "ace_jax" / room).rglob("*.py")):   # its __main__.py too
        for name in sorted(imports(root, path)):
            parts = name.split(".")
            if parts[0] == "ace_jax" and len(parts) > 1 and parts[1] in rooms(root):
                if parts[1] != room:
                    got_rooms.add(parts[1])
                    if parts[1] not in want_rooms:
                        bad.append(f"{path.relative_to(root)} imports {name} (undeclared)")
                continue
            extra = ".".join(parts[:2]) if parts[0] == "ace_jax" else parts[0]
            got_extras.add(extra)
            if extra not in want_extras:
                bad.append(f"{path.relative_to(root)} imports {name} (undeclared)")
    bad += [f"ace_jax/{room} declares `{r}` but imports nothing of it"
            for r in sorted((want_rooms - got_rooms) | (want_extras - got_extras))]
    return bad


def entry_point_violations(root: pathlib.Path) -> list[str]:
    """Modules that import an entry point (a ``__main__`` module)."""
    return [f"{p.relative_to(root)} imports {n}" for pkg in PACKAGES
            for p in sorted((root / pkg).rglob("*.py"))
            for n in sorted(imports(root, p)) if "__main__" in n.split(".")]


def cycle(root: pathlib.Path) -> list[str]:
    """A file-level import cycle among the ``PACKAGES`` files (as module names), or []."""
    files = {module_of(root, p): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    edges = {}
    for mod, path in files.items():
        targets = set()
        for name in imports(root, path):
            while name and name not in files:          # `from a import b`: b may be a name
                name = name.rpartition(".")[0]
            if name and name != mod and not mod.startswith(name + "."):   # not its own package
                targets.add(name)
        edges[mod] = targets
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return []

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return []


# ------------------------------------------------------------------------------ the repo

def test_every_module_lives_in_a_room():
    loose = sorted(p.name for p in (REPO / "ace_jax").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "config_utils.py", "registry.py"]
    assert len(rooms(REPO)) >= 8


@pytest.mark.parametrize("room", rooms(REPO))
def test_room_imports_exactly_what_it_declares(room):
    assert declared(REPO, room)[0] <= set(rooms(REPO))
    bad = room_violations(REPO, room)
    assert not bad, "\n".join(bad)


def test_rooms_form_no_cycle():
    deps = {room: declared(REPO, room)[0] for room in rooms(REPO)}
    done, visiting = set(), []

    def visit(room):
        assert room not in visiting, f"import cycle: {' -> '.join(visiting + [room])}"
        if room in done:
            return
        visiting.append(room)
        for d in deps[room]:
            visit(d)
        visiting.pop()
        done.add(room)

    for room in rooms(REPO):
        visit(room)


def test_the_loose_modules_import_no_room():
    bad = [f"{m} imports {n}" for m in LOOSE
           for n in imports(REPO, REPO / (m.replace(".", "/") + ".py"))
           if n.split(".")[1] in rooms(REPO)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", ["models", "sandbox"])
def test_models_and_sandbox_know_nothing_of_rl(package):
    bad = [f"{p.relative_to(REPO)} imports {n}" for p in sorted((REPO / package).rglob("*.py"))
           for n in sorted(imports(REPO, p)) if n.startswith("ace_jax")]
    assert not bad, "\n".join(bad)


def test_no_file_level_import_cycle():
    assert cycle(REPO) == []


def test_entry_points_are_imported_by_no_module():
    assert (REPO / "ace_jax/__main__.py").exists()      # the package's: `python -m ace_jax`
    assert entry_point_violations(REPO) == []


# ------------------------------------------------------------------------------ the checks

def _tree(tmp_path, files: dict[str, str]) -> pathlib.Path:
    for name in ("models/__init__.py", "sandbox/__init__.py", "ace_jax/__init__.py"):
        files.setdefault(name, "")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    return tmp_path


def _room(imports_line: str) -> str:
    return f'"""A room.\n\nImports: {imports_line}."""\n'


def test_the_checks_catch_an_unused_declaration_and_a_relative_import_against_the_direction(
        tmp_path):
    root = _tree(tmp_path, {
        "ace_jax/low/__init__.py": _room("no other room (and `models`)"),
        "ace_jax/low/a.py": "from ..high import b\nimport models\n",    # relative, upwards
        "ace_jax/high/__init__.py": _room("`low`, `other` (and `models`)"),
        "ace_jax/high/b.py": "from ace_jax.low import a\nimport models\n",
        "ace_jax/other/__init__.py": _room("no other room (and `sandbox`)"),   # unused extra
    })
    assert room_violations(root, "low") == [
        "ace_jax/low/a.py imports ace_jax.high.b (undeclared)"]
    assert room_violations(root, "high") == [
        "ace_jax/high declares `other` but imports nothing of it"]
    assert room_violations(root, "other") == [
        "ace_jax/other declares `sandbox` but imports nothing of it"]


def test_the_checks_catch_a_file_level_cycle(tmp_path):
    root = _tree(tmp_path, {"models/a.py": "from models.b import X\n",
                            "models/b.py": "def f():\n    from models import c\n",
                            "models/c.py": "import models.a\n"})
    assert cycle(root) == ["models.a", "models.b", "models.c", "models.a"]
    (root / "models/c.py").write_text("import models\n")            # its package: no cycle
    assert cycle(root) == []


def test_the_entry_point_may_import_any_room_but_no_module_imports_it(tmp_path):
    root = _tree(tmp_path, {
        "ace_jax/__main__.py": "from ace_jax.high import b\nfrom ace_jax.low import a\n",
        "ace_jax/low/__init__.py": _room("no other room (and `models`)"),
        "ace_jax/low/a.py": "import models\n",
        "ace_jax/high/__init__.py": _room("`low` (and `models`)"),
        "ace_jax/high/b.py": "from ace_jax.low import a\nimport models\n",
    })
    assert room_violations(root, "low") == room_violations(root, "high") == []
    assert entry_point_violations(root) == [] and cycle(root) == []
    (root / "ace_jax/high/b.py").write_text("import models\nfrom ace_jax import low, __main__\n")
    assert entry_point_violations(root) == ["ace_jax/high/b.py imports ace_jax.__main__"]


def test_a_rooms_own_main_imports_only_what_its_room_declares(tmp_path):
    root = _tree(tmp_path, {
        "ace_jax/low/__init__.py": _room("no other room (and `models`)"),
        "ace_jax/low/__main__.py": "import models\nfrom ace_jax.low import a\n",
        "ace_jax/low/a.py": "import models\n",
        "ace_jax/high/__init__.py": _room("`low` (and `models`)"),
        "ace_jax/high/b.py": "from ace_jax.low import a\nimport models\n",
    })
    assert room_violations(root, "low") == []
    (root / "ace_jax/low/__main__.py").write_text(      # upwards, lazily: what train's did
        "import models\n\ndef main():\n    from ace_jax.high import b\n")
    assert room_violations(root, "low") == [
        "ace_jax/low/__main__.py imports ace_jax.high.b (undeclared)"]
    (root / "ace_jax/high/b.py").write_text("from ace_jax.low import a, __main__\n")
    assert entry_point_violations(root) == [
        "ace_jax/high/b.py imports ace_jax.low.__main__"]
