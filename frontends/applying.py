"""``remat.apply(model, plan, example_inputs)``: the model, made to train as a plan says.

``executor="interpreter"`` (the default): the plan's granularity picks the interpreter, which
replays the captured ATen ops of each node inside one autograd function (``loss =
planned(*inputs)``): a joint forward+backward graph's plan runs in `joint_executor`, every other
(module, op-stages) in `executor`; both build on `runtime`.  ``executor="native"``: the model
itself follows a module-level plan in the user's own loop (`native`); ``"auto"``: the model as
plain autograd where the plan asks nothing of the step and plain autograd's measured peak fits
its budget (`PlainExecution`, `remat.core.plain`), else native where the plan can run so within
its budget, else the interpreter, with a line saying why.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from remat.core.plan import Plan

import logging

from remat.core import native
from remat.core.errors import InvalidInputError
from remat.core.plain import plain_obstacle, plain_prediction

from .executor import PlannedStep
from .base import default_loss, step_loss
from .joint_executor import PlannedJointStep, apply_joint
from .native import NativeExecution
from .runtime import PlannedBase

log = logging.getLogger(__name__)

EXECUTORS = ("interpreter", "native", "auto")


def apply(model: torch.nn.Module, plan: "Plan | str", example_inputs: Any = None, loss_fn: Callable | None = None, *,
          example_kwargs: dict | None = None, executor: str = "interpreter") -> "PlannedBase | NativeExecution":
    """A module whose call runs one training step of `model` as `plan` says: ``loss =
    planned(*inputs); loss.backward()`` gives the loss and parameter gradients of plain autograd
    (``loss_fn(model(*inputs), *inputs)``, default `default_loss`, must be the one the plan was
    traced with).  `plan` is a `Plan` or a path to a plan.json; `example_inputs` have the shapes
    the plan was traced with (without them, the first training call's inputs are the example and
    the checks happen then).  Raises `InvalidInputError` when the model does not cut into the
    plan's forward nodes, NotImplementedError for plans that swap a node other than a forward node.

    ``executor="native"``: hooks on `model` itself make its own training step follow the plan
    (``out = model(*inputs); loss = loss_fn(out, ...); loss.backward()`` unchanged); returns the
    `NativeExecution` (``remove()`` takes the hooks off; calling it runs ``loss_fn(model(*inputs),
    *inputs)``, like the interpreter's module).  Raises `InvalidInputError` for a plan outside the
    native class (`remat.core.native`).  ``"auto"``: `PlainExecution` (the model unchanged) when the
    plan computes every node once, swaps nothing and plain autograd's traced peak fits its budget;
    else native when the plan, kept to the native class, fits its budget; else the interpreter."""
    if executor not in EXECUTORS:
        raise InvalidInputError(f"executor: expected one of {EXECUTORS}, got {executor!r}")
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if executor == "auto":
        why = plain_obstacle(plan.graph, plan.schedule, plan.budget_bytes)
        if why is None:
            log.info("remat.apply: the plan asks nothing of the step and plain autograd's measured peak fits its "
                     "budget: the model runs as it is")
            return PlainExecution(model, plan, loss_fn)
    if executor != "interpreter":
        why = native_refusal(plan)
        if why is None or executor == "native":
            return NativeExecution(model, plan, loss_fn)
        log.info("remat.apply: running the plan with the interpreter: %s", why)
    if plan.graph.meta.get("granularity") == "joint":  # one node per op of the joint fwd+bwd graph
        return apply_joint(model, plan, example_inputs, loss_fn, example_kwargs=example_kwargs)
    return PlannedStep(model, plan, example_inputs, loss_fn, example_kwargs)


class PlainExecution:
    """A plan in the plain class (`remat.core.plain`) run as the model's own plain autograd:
    nothing is installed on `model`, the user's loop is unchanged, and calling it runs
    ``loss_fn(model(*inputs), *inputs)`` (like the interpreter's module).  `predicted`:
    `plain_prediction` (the plain step the trace measured)."""
    host_peak_bytes = 0

    def __init__(self, model: torch.nn.Module, plan: Plan, loss_fn: Callable | None = None):
        self.model, self.plan = model, plan
        self.loss_fn = loss_fn or default_loss
        self.predicted = plain_prediction(plan.graph, plan.schedule)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return step_loss(self.model, self.loss_fn, args, kwargs, self.plan.graph.meta.get("model_inputs"))

    def remove(self) -> None:
        """Nothing to take off (the same call as `NativeExecution.remove`)."""


def native_refusal(plan: Plan) -> str | None:
    """Why ``executor="auto"`` runs `plan` with the interpreter (None: natively)."""
    graph = plan.graph
    sched, kept = native.nativize(graph, plan.schedule) if graph.meta.get("granularity", "module") == "module" \
        else (plan.schedule, [])
    why = native.obstacle(graph, sched)
    if why is not None:
        return f"it cannot run natively: {why}"
    peak = native.native_peak(graph, sched)
    if peak > plan.budget_bytes:
        return (f"natively it would peak at {peak:,} bytes, over its budget of {plan.budget_bytes:,}"
                + (f" ({', '.join(kept)} kept resident)" if kept else "")
                + "; plan with executor='native' to run it in the model's own code")
    return None


__all__ = ["apply", "native_refusal", "PlannedStep", "PlannedJointStep", "NativeExecution", "PlainExecution", "EXECUTORS"]
