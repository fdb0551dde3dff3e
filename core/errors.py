"""Errors that reach a user. Each says what is wrong and what to do; the CLI maps them to exit codes."""
from __future__ import annotations


class RematError(Exception):
    """Base class. `exit_code` is what the CLI returns: 1 runtime failure, 2 bad input.
    `cli_hint`, when set, is what the command line adds to the message (the flag to change): the
    message itself speaks to every caller, the Python API's too."""
    exit_code = 1
    cli_hint: str | None = None


class InvalidInputError(RematError, ValueError):
    """Malformed graph/plan/budget/option: the message names the field."""
    exit_code = 2


class InfeasibleBudgetError(RematError):
    """No schedule fits the budget. Carries the smallest feasible budget that was found."""
    exit_code = 1

    def __init__(self, message: str, budget_bytes: int, min_feasible_bytes: int | None = None,
                 min_feasible_lower_bound: int | None = None, fixed_bytes: int = 0):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.min_feasible_lower_bound = min_feasible_lower_bound
        self.fixed_bytes = fixed_bytes


class SolverError(RematError):
    """A solver failed for a reason other than infeasibility (time limit with no incumbent, ...)."""
    exit_code = 1
