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

import importlib
import threading
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
    """Import every solver module (importing one registers its strategies), in a thread of its
    own the first time: PuLP, imported with them, keeps the exception of each solver library it
    does not find, traceback and all, and a traceback holds every frame of the stack that
    imported it, with their locals.  Imported from inside a step -- ``remat.compiler`` plans
    during the first call of the compiled model -- that kept the caller's first outputs (a
    model's logits) alive for good; a thread's stack holds no caller's frames."""
    if _LOADED:
        return
    failed: list = []

    def load() -> None:
        try:
            for name in ("baselines", "chen", "dtr", "griewank", "ilp", "lp_round", "rotor", "tflms"):
                importlib.import_module(f"{__name__}.{name}")
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            failed.append(e)
    t = threading.Thread(target=load, name="remat-solvers-import")
    t.start()
    t.join()
    if failed:
        raise failed[0]
    _LOADED.append(True)


_LOADED: list = []


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
