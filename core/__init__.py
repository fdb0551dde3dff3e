"""remat.core: the torch-free bottom layer every other part builds on.

* `graph`: the training graph (`Graph`, `Node`, graph.json);
* `schedule`: stage matrices and the op list they imply (`Schedule`, `Stage`, `Op`);
* `simulate`: the one model of a schedule's memory and time (`simulate`, `SimState`);
* `plan`: a schedule for a graph at a budget with its prediction (`Plan`, plan.json);
* `analysis`: graph analyses several solvers share (instants' loads, horizons, cut points);
* `errors`: the errors that reach a user; `units`: byte counts for people.

Nothing here imports torch, pulp or matplotlib.
"""
from .errors import InfeasibleBudgetError, InvalidInputError, RematError, SolverError
from .graph import Graph, Node
from .plan import Plan, load_plan
from .schedule import Op, Schedule, Stage
from .simulate import SimResult, SimState, simulate
from .units import format_bytes

__all__ = ["Graph", "Node", "Schedule", "Stage", "Op", "simulate", "SimResult", "SimState", "Plan", "load_plan",
           "format_bytes", "RematError", "InvalidInputError", "InfeasibleBudgetError", "SolverError"]
