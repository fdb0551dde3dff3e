"""remat: the optimal memory planner for PyTorch training."""
from .errors import InfeasibleBudgetError, InvalidInputError, RematError, SolverError
from .graph import Graph, Node
from .schedule import Op, Schedule, Stage
from .simulate import SimResult, simulate
from .budget import format_bytes, parse_budget
from .plan import Plan, load_plan, plan  # the function `remat.plan`; the module is sys.modules["remat.plan"]

__version__ = "0.1.0"
__all__ = ["Graph", "Node", "Schedule", "Stage", "Op", "simulate", "SimResult",
           "plan", "Plan", "load_plan", "parse_budget", "format_bytes",
           "RematError", "InvalidInputError", "InfeasibleBudgetError", "SolverError", "trace", "apply", "measure"]


def __getattr__(name: str):
    # `remat.trace` lives in remat.frontends, which imports torch: load it on first use only,
    # so `import remat` stays torch-free.
    if name == "trace":
        from remat.frontends.trace import trace
        return trace
    if name == "apply":
        from remat.frontends.executor import apply
        return apply
    if name == "measure":
        from remat.frontends.measure import measure
        return measure
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
