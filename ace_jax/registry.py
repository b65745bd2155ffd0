"""Named tables of interchangeable functions, picked by name in a config.

One `Registry` per kind of thing: GRPO's advantage estimators, loss aggregations, KL estimators
and behaviour weights (`ace_jax.rl.advantage_estimators`, `.loss_aggregation`, `.kl_estimators`,
`.behaviour_weights`), the LP samplers (`ace_jax.curriculum.learnability.SAMPLERS`) and the
rewards (`ace_jax.env.rewards.REWARDS`). A variant is one decorated function:

    THINGS: Registry = Registry("thing")

    @THINGS.register("mine", aliases=("my",))
    def mine(...): ...

    THINGS.get("mine")      # the function; an unknown name raises UnknownNameError, whose
                            # message lists the valid names
    THINGS.names()          # sorted names (aliases included)
    "mine" in THINGS        # membership; iterating yields the sorted names

A name is registered once: registering a different function under a taken name (or alias) is a
`ValueError`; registering the very same function again under the same name is a no-op (a module
body run twice). A top-level leaf module: it imports nothing of `ace_jax`, so every room may use it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

__all__ = ["UnknownNameError", "Registry"]


class UnknownNameError(KeyError):
    """A registry lookup with a name that is not registered; the message lists the valid names."""

    def __str__(self) -> str:  # KeyError would otherwise print the repr of the message.
        return str(self.args[0]) if self.args else ""


class Registry(Generic[F]):
    """A named table of functions of one kind ("advantage estimator", "sampler", "reward", ...).

    Args:
      kind: what the entries are, singular; it names them in error messages.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[F], F]:
        """Decorator registering `fn` under `name` (and `aliases`) and returning it unchanged.

        Raises ValueError for a name that is not a non-empty str (at once) and, when decorating,
        for a name or alias already taken by another function (nothing is registered then).
        """
        keys = (name, *aliases)
        for key in keys:
            if not isinstance(key, str) or not key:
                raise ValueError(f"{self.kind} name must be a non-empty str, got {key!r}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"{self.kind} {name!r}: repeated name in {keys}")

        def decorator(fn: F) -> F:
            taken = [k for k in keys if k in self._table and self._table[k] is not fn]
            if taken:
                raise ValueError(f"{self.kind} {taken[0]!r} is already registered")
            for key in keys:
                self._table[key] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as `name`; `UnknownNameError` listing the valid names otherwise."""
        try:
            return self._table[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}") from None

    __getitem__ = get  # dict-style lookup, same error

    def names(self) -> list[str]:
        """The registered names (aliases included), sorted."""
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._table
        except TypeError:
            return False

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._table)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
