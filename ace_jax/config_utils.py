"""Config helpers shared by every entry point: loading ``configs/*.py`` (``path[:arg]``), the
config's leaf keys, and refusing unknown keys the same way everywhere (`check_overrides` for
``--config.a.b=v`` flags, `merge_section` for a section given as a dict).

A top-level leaf: every room may import it (tests/test_layout.py)."""
from __future__ import annotations

import difflib
import importlib.util
import inspect
import pathlib
from typing import Any, Iterable, Mapping, Optional, Sequence

import ml_collections


class ConfigKeyError(KeyError):
    """An override names a key the config does not have; the message lists the valid keys."""

    def __str__(self) -> str:
        return str(self.args[0])


class ConfigError(ValueError):
    """A config value (or a combination of values) that cannot work; the message names the
    keys. Raised by ``ace_jax.train.config.validate``."""


def split_config_arg(spec: str) -> tuple[str, Optional[str]]:
    """``"configs/local.py:smoke"`` -> ``("configs/local.py", "smoke")``; no ``:arg`` -> None
    (the ``--config=path[:arg]`` syntax of ``ml_collections.config_flags``)."""
    path, sep, arg = spec.partition(":")
    if sep and path.endswith(".py"):
        return path, arg
    return spec, None


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """Imports a ``configs/*.py`` file and returns its ``get_config()``; ``path:arg`` returns
    ``get_config(arg)`` (as ``--config=path:arg`` does)."""
    path, arg = split_config_arg(path)
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_ace_config_{p.stem}", p)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise AttributeError(f"{path} has no get_config()")
    if arg is None:
        return module.get_config()
    if not inspect.signature(module.get_config).parameters:
        raise ValueError(f"{path}'s get_config() takes no argument, got {arg!r}")
    return module.get_config(arg)


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


def flat_dict(cfg: ml_collections.ConfigDict) -> dict[str, Any]:
    """``{dotted key: value}`` for every leaf of ``cfg`` (`flat_keys` order)."""
    out = {}
    for key in flat_keys(cfg):
        v = cfg
        for part in key.split("."):
            v = v[part]
        out[key] = v
    return out


def _unknown_key_error(key: str, keys: Sequence[str], what: str) -> ConfigKeyError:
    """The one refusal message: the bad key, close matches, and the valid keys beside it."""
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    siblings = [k for k in keys if parent and k.startswith(parent + ".")] or list(keys)
    close = difflib.get_close_matches(key, keys, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ConfigKeyError(
        f"{what}: no such config key.{hint}\nValid keys"
        f"{' under ' + parent if parent and siblings != list(keys) else ''}:\n  "
        + "\n  ".join(siblings))


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
        raise _unknown_key_error(key, keys, f"--{flag}.{key}")


def merge_section(defaults: ml_collections.ConfigDict, values: Optional[Mapping[str, Any]],
                  name: str, *, ignore: Iterable[str] = ()) -> ml_collections.ConfigDict:
    """A copy of ``defaults`` (a section's ``default_config()``) with ``values`` set on it.

    ``values`` is a (possibly nested) dict, e.g. the ``agent`` section of a saved run config;
    nested dicts merge into nested sections. A key that ``defaults`` does not have raises
    ConfigKeyError naming ``<name>.<key>`` and listing the section's valid keys (as
    `check_overrides` does for ``--config.*`` flags), unless it is listed in ``ignore``
    (dotted keys relative to the section: keys older configs had and that are gone).
    Values are type-checked by ``ml_collections`` (an int may fill a float field, a list a
    tuple field); a value of the wrong type raises ConfigError."""
    out = ml_collections.ConfigDict(defaults.to_dict())
    skip = set(ignore)
    keys = [f"{name}.{k}" for k in flat_keys(out)]
    sections = {k.rsplit(".", 1)[0] for k in keys}

    def merge(dst: ml_collections.ConfigDict, src: Mapping[str, Any], prefix: str):
        for k, v in src.items():
            rel = f"{prefix}{k}"
            if rel in skip:
                continue
            full = f"{name}.{rel}"
            if k not in dst:
                raise _unknown_key_error(full, keys, full)
            if isinstance(dst[k], ml_collections.ConfigDict) and isinstance(v, Mapping):
                merge(dst[k], v, rel + ".")
            elif isinstance(dst[k], ml_collections.ConfigDict) or full in sections:
                raise ConfigError(f"{full} is a section; got {v!r}")
            else:
                try:
                    dst[k] = v
                except TypeError as e:
                    raise ConfigError(f"{full}: {e}") from None

    merge(out, values or {}, "")
    return out


RUN_SEED = -1   # a section's seed with this value follows the run's ``seed`` (train.config)


def section_seed(value: int, key: str) -> int:
    """The seed a section's ``key`` holds, as a non-negative int. ``RUN_SEED`` (-1, what a
    run config's ``lp.seed`` and ``sft.seed`` default to) stands for the run's ``seed`` and is
    resolved by ``ace_jax.train.config.resolve_seeds``; met here, the section was taken from a
    run config that was never resolved: ConfigError says so."""
    if int(value) < 0:
        raise ConfigError(f"{key}={value}: {RUN_SEED} stands for the run's seed, which only a "
                          f"run config resolves (train.config.resolve_seeds); set {key} to a "
                          "seed >= 0 to use this section on its own")
    return int(value)
