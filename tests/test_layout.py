"""The package's rooms and the direction of imports between them.

Each room of ``ace_jax/`` states in its ``__init__`` docstring which other rooms it may import
(``Imports: `a`, `b` ...``); this test reads that line and checks every import in the room's
files against it, lazy imports inside functions included. ``models/`` and ``sandbox/`` know
nothing of RL: they import no ``ace_jax``.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOMS = sorted(p.parent.name for p in (REPO / "ace_jax").glob("*/__init__.py"))


def _imports(path: pathlib.Path) -> set[str]:
    """Dotted names of every ``ace_jax`` module (or package) imported anywhere in ``path``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "ace_jax"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "ace_jax":
                out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _declared(room: str) -> set[str]:
    doc = ast.get_docstring(ast.parse((REPO / "ace_jax" / room / "__init__.py").read_text()))
    match = re.search(r"Imports: (.*?)\(", doc or "", re.S)
    assert match, f"ace_jax/{room}/__init__.py must state its imports ('Imports: `room`, ...')"
    return set(re.findall(r"`(\w+)`", match.group(1)))


def test_every_module_lives_in_a_room():
    loose = sorted(p.name for p in (REPO / "ace_jax").glob("*.py"))
    assert loose == ["__init__.py", "config_utils.py", "registry.py"]
    assert len(ROOMS) >= 8


@pytest.mark.parametrize("room", ROOMS)
def test_room_imports_only_what_it_declares(room):
    allowed = _declared(room) | {room}
    assert allowed <= set(ROOMS), f"{room} declares unknown rooms {allowed - set(ROOMS)}"
    bad = []
    for path in sorted((REPO / "ace_jax" / room).glob("*.py")):
        for name in sorted(_imports(path)):
            parts = name.split(".")
            if parts[1] in ROOMS and parts[1] not in allowed:
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, f"ace_jax/{room} may import {sorted(allowed)}:\n" + "\n".join(bad)


def test_rooms_form_no_cycle():
    deps = {room: _declared(room) for room in ROOMS}
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

    for room in ROOMS:
        visit(room)


@pytest.mark.parametrize("package", ["models", "sandbox"])
def test_models_and_sandbox_know_nothing_of_rl(package):
    bad = [f"{p.relative_to(REPO)} imports {n}" for p in sorted((REPO / package).rglob("*.py"))
           for n in sorted(_imports(p))]
    assert not bad, "\n".join(bad)
