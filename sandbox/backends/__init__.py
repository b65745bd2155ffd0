"""Isolation backends, by name: ``process``, ``bwrap`` (default isolation), ``docker``.

A new backend is a ``Backend`` subclass in its own file plus one ``register_backend`` call; the
pool builds backends through ``make_backend(name, **options)``. Modules are imported lazily, so
``docker`` is only imported when the docker backend is asked for.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Union

from sandbox.backends.base import (Backend, IsolationRequiredError, Limits, RawExecution,
                                   SandboxConfigError, SandboxSetupError,
                                   SandboxUnavailableError)

_Factory = Union[str, Callable[..., Backend]]
_REGISTRY: dict[str, _Factory] = {
    "process": "sandbox.backends.process:ProcessBackend",
    "bwrap": "sandbox.backends.bwrap:BwrapBackend",
    "docker": "sandbox.backends.docker:DockerBackend",
}
_LIMIT_FIELDS = {f.name for f in dataclasses.fields(Limits)} - {"time_s", "memory_mb"}


def register_backend(name: str, factory: _Factory) -> None:
    """Registers ``factory`` (a callable or a ``"module:attr"`` string) under ``name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"backend name must be a non-empty string, got {name!r}")
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    """Registered backend names (registered, not necessarily usable on this host)."""
    return sorted(_REGISTRY)


def make_backend(name: str, **options: Any) -> Backend:
    """Builds backend ``name``. Options that name a ``Limits`` field (pids_max, disk_mb,
    max_time_s, ...) are gathered into ``limits``; time and memory come from each task.

    Raises:
      KeyError: unknown backend name (the message lists the known ones).
      SandboxUnavailableError: the backend cannot run on this host (the message says why).
    """
    if name not in _REGISTRY:
        raise KeyError(f"unknown sandbox backend {name!r}; known: {available_backends()}")
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    limit_kwargs = {k: options.pop(k) for k in list(options) if k in _LIMIT_FIELDS}
    if limit_kwargs:
        if "limits" in options:
            raise ValueError(f"pass either limits= or the fields {sorted(limit_kwargs)}, not both")
        options["limits"] = Limits(**limit_kwargs)
    return factory(**options)


__all__ = ["Backend", "IsolationRequiredError", "Limits", "RawExecution", "SandboxConfigError",
           "SandboxSetupError", "SandboxUnavailableError", "available_backends", "make_backend",
           "register_backend"]
