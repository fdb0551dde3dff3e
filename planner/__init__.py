"""remat: the optimal memory planner for PyTorch training.

``remat.trace(model, inputs)`` -> a `Graph`; ``remat.plan(graph, "0.5x")`` -> a `Plan` (a
schedule that fits the budget, its predicted peak and time, the solver's bound and gap);
``remat.apply(model, plan)`` -> the model that trains as the plan says; ``remat.measure`` ->
what a step really used; ``remat.capacity(make, "24GiB")`` -> the largest batch that fits.  The layers (docs/design.md): `remat.core` (graph, schedule,
simulator, plan record; no torch), `remat.solvers`, `remat.frontends` (torch), and this
package's top: budgets, planning, pictures, the command line.
"""
from remat.core.compat import register_moved
from remat.core.errors import InfeasibleBudgetError, InvalidInputError, RematError, SolverError
from remat.core.graph import Graph, Node
from remat.core.plan import Plan, load_plan
from remat.core.schedule import Op, Schedule, Stage
from remat.core.simulate import SimResult, simulate
from remat.core.units import format_bytes

from .budget import parse_budget
from .planning import SWEEP_COLUMNS, plan, sweep

__version__ = "0.1.0"
__all__ = ["Graph", "Node", "Schedule", "Stage", "Op", "simulate", "SimResult",
           "plan", "Plan", "load_plan", "sweep", "SWEEP_COLUMNS", "parse_budget", "format_bytes",
           "RematError", "InvalidInputError", "InfeasibleBudgetError", "SolverError", "trace", "apply", "measure",
           "capacity", "compiler", "partition"]

# the module paths of the layout before docs/design.md's, kept importable (with a warning)
MOVED_MODULES = {
    "remat.errors": "remat.core.errors",
    "remat.graph": "remat.core.graph",
    "remat.schedule": "remat.core.schedule",
    "remat.simulate": "remat.core.simulate",
    "remat.plan": ("remat.core.plan", "remat.planning"),
    "remat.frontends.cli": "remat.model_commands",
}
register_moved(MOVED_MODULES)

# `remat.trace`, `remat.apply` and `remat.measure` live in remat.frontends, which imports torch:
# loaded on first use only, so `import remat` stays torch-free
_LAZY = {"trace": ("remat.frontends.tracing", "trace"),
         "measure": ("remat.frontends.measuring", "measure"), "capacity": ("remat.sizing", "capacity"),
         "compiler": ("remat.compiling", "compiler"),
         "partition": ("remat.partitioning", "partition")}


def apply(model, plan, *args, **kwargs):
    """``remat.apply(model, plan, example_inputs, loss_fn, ...)``: a `Plan` (or plan.json) ->
    `remat.frontends.applying.apply` (its docstring: the step as the plan says, on one device);
    a `PartitionPlan` (or partition.json), in each rank of a process group ->
    `remat.distributed.DistributedStep` (``loss = step(*batch)`` runs the partitioned step and
    leaves the full gradients in the model's ``.grad``)."""
    from remat.core.graph import file_format

    from .partitioning import FORMAT as PARTITION_FORMAT, PartitionPlan
    if (isinstance(plan, str) or hasattr(plan, "__fspath__")) and file_format(plan) == PARTITION_FORMAT:
        plan = PartitionPlan.load(plan)
    if not isinstance(plan, PartitionPlan):
        from remat.frontends.applying import apply as apply_plan
        return apply_plan(model, plan, *args, **kwargs)
    if kwargs.pop("executor", None) not in (None, "interpreter"):
        raise InvalidInputError("remat.apply: executor= is for single-device plans; a partition plan runs on "
                                "torch.distributed")
    from .distributed import DistributedStep
    return DistributedStep(model, plan, *args, **kwargs)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    moved = MOVED_MODULES.get(f"remat.{name}")
    if moved is not None:  # `import remat.graph; remat.graph.Graph` (old layout)
        import sys
        return sys.modules[f"remat.{name}"]
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
