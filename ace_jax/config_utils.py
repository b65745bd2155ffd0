"""Config helpers: checking ``--config.a.b=v`` overrides against the config's real keys."""
from __future__ import annotations

import difflib
import importlib.util
import pathlib
from typing import Sequence

import ml_collections


class ConfigKeyError(KeyError):
    """An override names a key the config does not have; the message lists the valid keys."""

    def __str__(self) -> str:
        return str(self.args[0])


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """Imports a ``configs/*.py`` file and returns its ``get_config()``."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_ace_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"{path} has no get_config()")
    return module.get_config()


def flat_keys(cfg: ml_collections.ConfigDict, prefix: str = "") -> list[str]:
    """Every leaf key of ``cfg`` as a dotted path (``rl.group_size``), sorted."""
    out = []
    for k, v in cfg.items():
        name = f"{prefix}{k}"
        if isinstance(v, ml_collections.ConfigDict):
            out += flat_keys(v, name + ".")
        else:
            out.append(name)
    return sorted(out)


def check_overrides(cfg: ml_collections.ConfigDict, argv: Sequence[str], flag: str = "config"):
    """Raises ConfigKeyError for the first ``--config.<key>`` in argv that ``cfg`` lacks."""
    keys = flat_keys(cfg)
    sections = {k.rsplit(".", 1)[0] for k in keys if "." in k}
    for arg in argv:
        if not arg.startswith(f"--{flag}."):
            continue
        key = arg[len(flag) + 3:].split("=", 1)[0]
        if key in keys or key in sections:
            continue
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        siblings = [k for k in keys if parent and k.startswith(parent + ".")] or keys
        close = difflib.get_close_matches(key, keys, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigKeyError(
            f"--{flag}.{key}: no such config key.{hint}\nValid keys"
            f"{' under ' + parent if parent and siblings is not keys else ''}:\n  "
            + "\n  ".join(siblings))
