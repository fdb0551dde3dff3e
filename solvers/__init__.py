"""Solvers: one module per strategy, one interface.

Every strategy is ``solve(graph, budget_bytes, **options) -> Schedule``, registered by name.
``budget_bytes`` is the peak device memory of the whole step (the graph's fixed bytes
included).  A solver that cannot fit the budget raises `InfeasibleBudgetError`; it never
returns a schedule over budget.  Solvers return schedules; only `remat.simulate` computes their
memory and time (the schedule's ``report`` says how the solver got there).
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
    _load_all()
    if name not in _REGISTRY:
        raise InvalidInputError(f"--solver: unknown solver {name!r}; available: {', '.join(names())}")
    return _REGISTRY[name]


def names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def describe() -> dict[str, str]:
    _load_all()
    return {k: _DESCRIPTIONS[k] for k in sorted(_REGISTRY)}


def _load_all() -> None:
    # importing the modules registers them
    from . import baselines, chen, dtr, griewank, ilp, ilp_scalable, lp_round, rotor, tflms  # noqa: F401
