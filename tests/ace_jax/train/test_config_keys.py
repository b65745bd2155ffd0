"""Every leaf key of the run config's schema is read by some code, and no ``.get`` fallback on a
config section disagrees with the schema's default (one owner, one default, no dead keys).

The schema is ``ace_jax.train.config.default_config()`` plus its optional sections (``dry_run``,
``ideator``). A key counts as read where a file of ``ace_jax/``, ``models/`` or ``sandbox/``
reads it by name (``.key`` not assigned, ``["key"]``, ``get("key"``) and that file owns the
section (defines its ``default_config``) or names the section; the keys read otherwise (a section
read whole, a section handed to another room's function) are listed in ``READ_ELSEWHERE`` (each
entry must still be needed).
"""
from __future__ import annotations

import ast
import pathlib
import re

import ml_collections

from ace_jax.ideator import ideator_trainer
from ace_jax.train import config as run_config, dry_run

REPO = pathlib.Path(__file__).resolve().parents[3]
SOURCES = sorted(p for pkg in ("ace_jax", "models", "sandbox") for p in (REPO / pkg).rglob("*.py"))

# key (or key prefix) -> the code that reads it without naming it
READ_ELSEWHERE = {
    "mesh.rules.": "runtime/sharding.py: the rules table is read as a dict",
    "sampler_mesh.rules.": "runtime/sampler_layout.py -> sharding: the same rules table",
    "sandbox.backend_options.": "sandbox/pool.py: **backend_options to the backend",
    **{f"{m}.{axis}": "runtime/sharding.py: cfg[axis] for axis in MESH_AXES"
       for m in ("mesh", "sampler_mesh") for axis in ("data", "fsdp", "tensor", "expert")},
    **{f"ideator.{k}": "ideator/prompts.py: env/agent.describe_task(task, the ideator section)"
       for k in ("description", "max_columns_chars")},
}


def schema() -> ml_collections.ConfigDict:
    c = run_config.default_config()
    c.dry_run = dry_run.default_config()
    c.ideator = ideator_trainer.default_config()
    return c


def leaves(c, prefix="") -> dict:
    out = {}
    for k, v in c.items():
        if isinstance(v, ml_collections.ConfigDict) and k != "overrides":
            out.update(leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _reads(name: str) -> re.Pattern:
    return re.compile(rf"\.{name}\b(?!\s*=[^=])|\[[\"']{name}[\"']\]|get\([\"']{name}[\"']")


def readers(key: str, texts: dict) -> list[str]:
    """Files that read ``key`` (see the module docstring)."""
    section, _, name = key.rpartition(".")
    top = section.split(".")[0] if section else ""
    pat = _reads(name)
    return [p for p, t in texts.items() if pat.search(t) and (
        not top or re.search(rf"\b{top}\b", t))]


def test_every_leaf_key_has_a_reader():
    texts = {str(p.relative_to(REPO)): p.read_text() for p in SOURCES}
    table = {k: readers(k, texts) for k in leaves(schema())}
    elsewhere = {k for k, r in table.items() if not r and any(k.startswith(p)
                                                               for p in READ_ELSEWHERE)}
    unread = sorted(k for k, r in table.items() if not r and k not in elsewhere)
    assert len(table) > 200
    assert not unread, f"config keys nothing reads: {unread}"
    # each exception still names a key of the schema (a key it covers may also match the name
    # pattern somewhere by chance, e.g. mesh.data and a dict's "data" entry in a file about meshes)
    for prefix in READ_ELSEWHERE:
        assert any(k.startswith(prefix) for k in table), f"READ_ELSEWHERE[{prefix!r}]: stale"


def _defaults_by_section(c) -> dict:
    """section name ('' for the top level) -> {key: default}, for every section and subsection."""
    out = {"": {k: v for k, v in c.items() if not isinstance(v, ml_collections.ConfigDict)}}
    for k, v in c.items():
        if isinstance(v, ml_collections.ConfigDict) and k != "overrides":
            out[k] = {kk: vv for kk, vv in v.items()}
    return out


def fallbacks(texts: dict, sections: dict) -> list[str]:
    """``<section>.get("key", literal)`` calls whose literal is not the section's default.
    The section is the receiver's last name (``cfg.model.get`` -> model, ``optim.get`` -> optim,
    ``optim_cfg.get`` -> optim); ``cfg`` / ``config`` alone is the top level."""
    bad = []
    for path, text in texts.items():
        for node in ast.walk(ast.parse(text)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get" and len(node.args) == 2
                    and isinstance(node.args[0], ast.Constant)):
                continue
            recv = ast.unparse(node.func.value).split(".")[-1]
            section = "" if recv in ("cfg", "config") else recv.removesuffix("_cfg")
            key = node.args[0].value
            if section not in sections or key not in sections[section]:
                continue
            try:
                fallback = ast.literal_eval(node.args[1])
            except ValueError:
                continue   # a name: not a literal we can compare
            want = sections[section][key]
            if isinstance(want, ml_collections.ConfigDict) or fallback != want:
                bad.append(f"{path}:{node.lineno}: {ast.unparse(node)} (schema: {want!r})")
    return bad


def test_no_get_fallback_disagrees_with_the_schema():
    texts = {str(p.relative_to(REPO)): p.read_text() for p in SOURCES}
    assert fallbacks(texts, _defaults_by_section(schema())) == []


def test_the_fallback_check_catches_a_disagreeing_default():
    sections = _defaults_by_section(schema())
    texts = {"a.py": 'x = cfg.optim.get("share_prompts", True)\n'
                     'y = optim_cfg.get("microbatches", 1)\n'
                     'z = cfg.get("compile_cache_dir", "")\n'
                     'w = other.get("share_prompts", True)\n'}
    assert [b.split(": ")[0] for b in fallbacks(texts, sections)] == ["a.py:1", "a.py:3"]
    assert sections["optim"]["microbatches"] == 1


def test_the_reader_check_needs_the_section():
    texts = {"a.py": "n = cfg.rl.group_size\n", "b.py": "n = x.group_size\n",
             "c.py": "cfg.rl.group_size = 3\n"}
    assert readers("rl.group_size", texts) == ["a.py"]
