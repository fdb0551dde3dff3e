"""``remat.apply(model, plan, example_inputs)``: the model, made to train as a plan says.

The plan's granularity picks the executor: a joint forward+backward graph's plan runs in
`joint_executor`, every other (module, op-stages) in `executor`; both build on `runtime`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from remat.core.plan import Plan

from .executor import PlannedStep
from .joint_executor import PlannedJointStep, apply_joint
from .runtime import PlannedBase


def apply(model: torch.nn.Module, plan: "Plan | str", example_inputs: Any = None, loss_fn: Callable | None = None, *,
          example_kwargs: dict | None = None) -> PlannedBase:
    """A module whose call runs one training step of `model` as `plan` says: ``loss =
    planned(*inputs); loss.backward()`` gives the loss and parameter gradients of plain autograd
    (``loss_fn(model(*inputs), *inputs)``, default `default_loss`, must be the one the plan was
    traced with).  `plan` is a `Plan` or a path to a plan.json; `example_inputs` have the shapes
    the plan was traced with (without them, the first training call's inputs are the example and
    the checks happen then).  Raises `InvalidInputError` when the model does not cut into the
    plan's forward nodes, NotImplementedError for plans that swap a node other than a forward node."""
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if plan.graph.meta.get("granularity") == "joint":  # one node per op of the joint fwd+bwd graph
        return apply_joint(model, plan, example_inputs, loss_fn, example_kwargs=example_kwargs)
    return PlannedStep(model, plan, example_inputs, loss_fn, example_kwargs)


__all__ = ["apply", "PlannedStep", "PlannedJointStep"]
