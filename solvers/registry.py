"""The solver registry: name -> ``solve(graph, budget_bytes, **options) -> Schedule``.

A solver module registers its strategies with ``@register("name", "one-line description")`` when
it is imported; ``parts=True`` says the strategy plans graphs whose ops have several parts
(`remat.core.graph`) itself; every other one is looked up wrapped in `remat.solvers.parts.on_merged`
(it plans the merged graph, and its schedule is expanded to the parts); `remat.solvers` imports
every solver module before it answers `get`, `names`
or `describe`.  Here the lookups answer for what is registered so far (a solver module that
needs a baseline imports that baseline's module first).
"""
from __future__ import annotations

from typing import Callable

from remat.core.errors import InvalidInputError

_REGISTRY: dict[str, Callable] = {}
_DESCRIPTIONS: dict[str, str] = {}


def register(name: str, description: str = "", parts: bool = False) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        _REGISTRY[name] = fn if parts else _merged(fn)
        _DESCRIPTIONS[name] = description or (fn.__doc__ or "").strip().splitlines()[0]
        return fn
    return deco


def _merged(fn: Callable) -> Callable:
    """`remat.solvers.parts.on_merged`, imported at the first graph with parts (that module imports
    the ILP package, which imports this one)."""
    def solve(graph, *args, **options):
        if not graph.has_parts:
            return fn(graph, *args, **options)
        from .parts import solve_merged
        return solve_merged(fn, graph, *args, **options)
    solve.__doc__, solve.__name__, solve.__wrapped__ = fn.__doc__, getattr(fn, "__name__", "solve"), fn
    return solve


def get(name: str) -> Callable:
    if name not in _REGISTRY:
        raise InvalidInputError(f"--solver: unknown solver {name!r}; available: {', '.join(names())}")
    return _REGISTRY[name]


def names() -> list[str]:
    return sorted(_REGISTRY)


def describe() -> dict[str, str]:
    return {k: _DESCRIPTIONS[k] for k in sorted(_REGISTRY)}


__all__ = ["register", "get", "names", "describe"]
