"""Solvers: one module per strategy, one interface.

Every strategy is ``solve(graph, budget_bytes, **options) -> Schedule``, registered by name
(`registry`).  ``budget_bytes`` is the peak device memory of the whole step (the graph's fixed
bytes included).  A solver that cannot fit the budget raises `InfeasibleBudgetError`; it never
returns a schedule over budget.  Solvers return schedules; only `remat.core.simulate` computes
their memory and time (the schedule's ``report`` says how the solver got there).

`get`, `names` and `describe` import every solver module first (`load_all`), so each one has
registered; `register` is `registry.register`.
"""
from __future__ import annotations

from typing import Callable

from remat.core.compat import register_moved

from . import registry
from .registry import register

# module paths of the layout before docs/design.md's, kept importable (with a warning)
register_moved({
    "remat.solvers.ilp_scalable": ("remat.solvers.ilp.scalable", "remat.solvers.ilp.worker",
                                   "remat.solvers.ilp.coarsen", "remat.solvers.ilp.bounds", "remat.core.analysis"),
    "remat.solvers.instant_ip": ("remat.solvers.ilp.instant", "remat.solvers.ilp.paths",
                                 "remat.solvers.ilp.windows", "remat.core.analysis"),
})


def load_all() -> None:
    """Import every solver module (importing one registers its strategies)."""
    from . import baselines, chen, dtr, griewank, ilp, lp_round, rotor, tflms  # noqa: F401


def get(name: str) -> Callable:
    load_all()
    return registry.get(name)


def names() -> list[str]:
    load_all()
    return registry.names()


def describe() -> dict[str, str]:
    load_all()
    return registry.describe()


__all__ = ["register", "get", "names", "describe", "load_all", "registry"]
