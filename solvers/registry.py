"""The solver registry: name -> ``solve(graph, budget_bytes, **options) -> Schedule``.

A solver module registers its strategies with ``@register("name", "one-line description")`` when
it is imported; `remat.solvers` imports every solver module before it answers `get`, `names`
or `describe`.  Here the lookups answer for what is registered so far (a solver module that
needs a baseline imports that baseline's module first).
"""
from __future__ import annotations

from typing import Callable

from remat.core.errors import InvalidInputError

_REGISTRY: dict[str, Callable] = {}
_DESCRIPTIONS: dict[str, str] = {}


def register(name: str, description: str = "") -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        _REGISTRY[name] = fn
        _DESCRIPTIONS[name] = description or (fn.__doc__ or "").strip().splitlines()[0]
        return fn
    return deco


def get(name: str) -> Callable:
    if name not in _REGISTRY:
        raise InvalidInputError(f"--solver: unknown solver {name!r}; available: {', '.join(names())}")
    return _REGISTRY[name]


def names() -> list[str]:
    return sorted(_REGISTRY)


def describe() -> dict[str, str]:
    return {k: _DESCRIPTIONS[k] for k in sorted(_REGISTRY)}


__all__ = ["register", "get", "names", "describe"]
