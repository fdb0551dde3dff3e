"""remat: the optimal memory planner for PyTorch training."""
from .errors import InfeasibleBudgetError, InvalidInputError, RematError, SolverError
from .graph import Graph, Node
from .schedule import Op, Schedule, Stage
from .simulate import SimResult, simulate

__version__ = "0.1.0"
__all__ = ["Graph", "Node", "Schedule", "Stage", "Op", "simulate", "SimResult",
           "RematError", "InvalidInputError", "InfeasibleBudgetError", "SolverError"]
