"""Plans: a schedule for one graph at one budget, with what the simulator predicts for it.

A plan embeds its graph, so a saved plan is self-contained (``remat simulate plan.json`` needs
nothing else).  Making one is `remat.planning.plan`'s job (budget parsing, a solver, the
simulator); this module is the record and its file format.

JSON format (``remat.plan``, version 1)::

    {"format": "remat.plan", "version": 1,
     "graph_hash": "9caa313e87cc6bf5",        # Graph.content_hash() of the embedded graph
     "budget_bytes": 5,
     "solver": {"name": "ilp", "status": "optimal", "objective": 27.0, "lower_bound": 27.0,
                "gap": 0.0, "wall_time": 0.4, ...},   # whatever else the solver reports
     "predicted": {"peak_bytes": 5, "time": 27.0, "overhead": 1.08, "host_peak_bytes": 0,
                   "fixed_bytes": 0, "activation_peak_bytes": 5, "compute_time": 27.0,
                   "transfer_time": 0.0},
     "schedule": {"ops": [{"op": "compute", "node": 0, "stage": 0}, ...], "stages": [...]},
     "graph": {"format": "remat.graph", ...}}

Loading checks, in order, and names the field that fails: ``format``, ``version``, ``graph``
(as `Graph.from_dict` does), ``graph_hash`` (must equal the embedded graph's content hash),
``budget_bytes``, ``solver``, ``schedule`` (as `Schedule.from_dict` does, node ids against the
graph; stages, when present, must imply the op list), ``predicted``, and finally that the
schedule replays without a violation in the simulator.  Nothing here imports torch.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InvalidInputError
from .graph import Graph, read_json
from .schedule import Schedule, ops_from_stages
from .simulate import SimResult, simulate, storage_view
from .units import format_bytes

log = logging.getLogger(__name__)

FORMAT = "remat.plan"
VERSION = 1
SOLVER_KEYS = ("name", "status", "objective", "lower_bound", "gap", "wall_time")
PREDICTED_KEYS = ("peak_bytes", "time", "overhead", "host_peak_bytes", "fixed_bytes",
                  "activation_peak_bytes", "compute_time", "transfer_time")


@dataclass
class Plan:
    graph: Graph
    schedule: Schedule
    budget_bytes: int
    solver: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)

    @property
    def graph_hash(self) -> str:
        return self.graph.content_hash()

    @property
    def fits(self) -> bool:
        """Whether the predicted peak is within the budget."""
        return self.predicted.get("peak_bytes", math.inf) <= self.budget_bytes

    def simulate(self, bandwidth: float | None = None) -> SimResult:
        return simulate(self.graph, self.schedule, bandwidth)

    @property
    def storage_peak_bytes(self) -> int:
        """The predicted peak as the exact accounting of tensor storages sees it (the CPU's
        `remat.measure`): without what kernels allocate inside themselves and the executor's saved
        generator states (`storage_view`); the predicted peak when the graph records neither."""
        view = storage_view(self.graph)
        if view is self.graph:
            return int(self.predicted.get("peak_bytes", simulate(self.graph, self.schedule).peak_bytes))
        return simulate(view, self.schedule).peak_bytes

    # ---- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "graph_hash": self.graph_hash,
                "budget_bytes": int(self.budget_bytes), "solver": jsonable(self.solver),
                "predicted": jsonable(self.predicted), "schedule": self.schedule.to_dict(),
                "graph": self.graph.to_dict()}

    @classmethod
    def from_dict(cls, d: Any) -> "Plan":
        if not isinstance(d, dict):
            raise InvalidInputError("plan: expected a JSON object")
        if d.get("format") != FORMAT:
            raise InvalidInputError(f"plan.format: expected {FORMAT!r}, got {d.get('format')!r}"
                                    + (" (this is a graph; make a plan with `remat plan`)"
                                       if d.get("format") == "remat.graph" else ""))
        if d.get("version") != VERSION:
            raise InvalidInputError(f"plan.version: this remat reads version {VERSION}, got {d.get('version')!r}")
        if "graph" not in d:
            raise InvalidInputError("plan.graph: missing (a plan embeds the graph it was made for)")
        graph = _prefixed(Graph.from_dict, d["graph"])
        stored = d.get("graph_hash")
        if not isinstance(stored, str):
            raise InvalidInputError(f"plan.graph_hash: missing or not a string: {stored!r}")
        actual = graph.content_hash()
        if stored != actual:
            raise InvalidInputError(
                f"plan.graph_hash: {stored!r} does not match the embedded graph's content hash {actual!r}: "
                "the plan was edited or belongs to another graph; re-plan with `remat plan`")
        budget = d.get("budget_bytes")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise InvalidInputError(f"plan.budget_bytes: expected a positive integer, got {budget!r}")
        solver = d.get("solver")
        if not isinstance(solver, dict):
            raise InvalidInputError("plan.solver: missing or not an object")
        if not isinstance(solver.get("name"), str):
            raise InvalidInputError(f"plan.solver.name: missing or not a string: {solver.get('name')!r}")
        if "status" in solver and not isinstance(solver["status"], str):
            raise InvalidInputError(f"plan.solver.status: expected a string, got {solver['status']!r}")
        if "schedule" not in d:
            raise InvalidInputError("plan.schedule: missing")
        schedule = _prefixed(Schedule.from_dict, d["schedule"], graph)
        schedule.report = dict(solver)
        if schedule.stages is not None and ops_from_stages(graph, schedule.stages) != schedule.ops:
            raise InvalidInputError("plan.schedule.stages: do not imply plan.schedule.ops (one of them "
                                    "was edited); re-plan with `remat plan`")
        predicted = d.get("predicted")
        if not isinstance(predicted, dict):
            raise InvalidInputError("plan.predicted: missing or not an object")
        for key in ("peak_bytes", "time"):
            val = predicted.get(key)
            if not isinstance(val, (int, float)) or isinstance(val, bool):
                raise InvalidInputError(f"plan.predicted.{key}: missing or not a number: {val!r}")
        res = simulate(graph, schedule)
        if not res.valid:
            raise InvalidInputError(f"plan.schedule: the schedule is invalid for the embedded graph: "
                                    f"{res.violation}; re-plan with `remat plan`")
        if res.peak_bytes != predicted["peak_bytes"] or not math.isclose(res.time, predicted["time"],
                                                                          rel_tol=1e-9, abs_tol=1e-12):
            log.warning("plan.predicted says peak %s, time %s; the simulator now says peak %s, time %s "
                        "(graph meta such as the bandwidth changed?)", predicted["peak_bytes"],
                        predicted["time"], res.peak_bytes, res.time)
        return cls(graph, schedule, budget, dict(solver), dict(predicted))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(read_json(path, "plan"))

    def __repr__(self) -> str:
        return (f"Plan(graph={self.graph_hash}, n={self.graph.n}, budget={format_bytes(self.budget_bytes)}, "
                f"solver={self.solver.get('name')!r}, status={self.solver.get('status')!r}, "
                f"peak={format_bytes(self.predicted.get('peak_bytes'))}, time={self.predicted.get('time')})")


def load_plan(path: str | Path) -> Plan:
    """Read and validate a ``remat.plan`` file (see the module docstring)."""
    return Plan.load(path)


def predicted_from(graph: Graph, res: SimResult) -> dict:
    """The ``predicted`` block of a plan: peak, time, overhead and their breakdown."""
    return {"peak_bytes": res.peak_bytes, "time": res.time, "overhead": res.overhead(graph),
            "host_peak_bytes": res.host_peak_bytes, "fixed_bytes": graph.fixed_bytes,
            "activation_peak_bytes": res.activation_peak_bytes, "compute_time": res.compute_time,
            "transfer_time": res.transfer_time}


def _prefixed(fn, *args):
    """Call a from_dict, prefixing its error's field path with ``plan.``."""
    try:
        return fn(*args)
    except InvalidInputError as e:
        raise InvalidInputError(f"plan.{e}") from None


def is_plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def jsonable(x: Any) -> Any:
    """JSON-safe copy: numpy scalars to Python, non-finite floats to None, unknown objects to str."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "item") and callable(x.item):  # numpy scalar
        try:
            return jsonable(x.item())
        except (TypeError, ValueError):
            pass
    if isinstance(x, Schedule):
        return None
    return str(x)


__all__ = ["Plan", "load_plan", "predicted_from", "jsonable", "FORMAT", "VERSION", "SOLVER_KEYS", "PREDICTED_KEYS"]
