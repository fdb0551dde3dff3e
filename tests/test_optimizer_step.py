"""The optimizer's step at the step's end: what it allocates while it runs (its transient) is
measured at trace when an optimizer is named, counted after the last op by the simulator and by
every static need, refused by the planner below it with a message that names it, and the
measured step (forward, backward and ``optimizer.step()``) matches the prediction."""
from __future__ import annotations

import copy

import pytest

import remat
from remat.core.analysis import forced_need, node_need
from remat.core.errors import InfeasibleBudgetError
from remat.core.graph import Graph, Node
from remat.core.schedule import Schedule
from remat.core.simulate import simulate


def _chain(step_bytes: int) -> Graph:
    """f0 -> f1 -> loss -> b1 -> b0, each backward node allocating a 10-byte gradient."""
    nodes = [Node(0, "f0", "forward", 1.0, 4), Node(1, "f1", "forward", 1.0, 4), Node(2, "loss", "loss", 1.0, 1),
             Node(3, "b1", "backward", 1.0, 4, persistent_bytes=10, extra={"forward": 1}),
             Node(4, "b0", "backward", 1.0, 4, persistent_bytes=10, extra={"forward": 0})]
    edges = [(0, 1), (1, 2), (2, 3), (1, 3), (3, 4), (0, 4)]
    meta = {"optimizer_step_bytes": step_bytes} if step_bytes else {}
    return Graph(nodes, edges, fixed_bytes=100, meta=meta)


def test_the_transient_comes_after_the_last_op_on_what_is_still_live():
    plain, with_step = _chain(0), _chain(30)
    sched = Schedule.keep_all(plain)
    assert with_step.step_end_bytes == 20 + 30
    base = simulate(plain, sched).peak_bytes
    peak = simulate(with_step, sched).peak_bytes
    assert peak == max(base, 100 + 20 + 30)     # fixed + every gradient + the step's transient
    assert peak > base
    assert forced_need(with_step) >= 150 and node_need(with_step) >= 150
    assert simulate(_chain(1), sched).peak_bytes == base   # a transient below the backward's peak changes nothing


def test_a_budget_below_the_optimizer_step_is_refused_naming_it():
    g = _chain(300)
    with pytest.raises(InfeasibleBudgetError, match="optimizer's step needs"):
        remat.plan(g, 100 + 20 + 299, time_limit=5)
    plan = remat.plan(g, 100 + 20 + 300, time_limit=5)
    assert plan.predicted["peak_bytes"] == 420


def test_a_named_optimizer_is_measured_and_its_step_runs_as_predicted():
    torch = pytest.importorskip("torch")
    from remat.frontends.run import run_plan
    torch.manual_seed(0)
    # parameter-heavy: the step's end (parameters, gradients, Adam's two moments, the step's
    # transient) is its peak
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    x = torch.randn(8, 256)
    graph = remat.trace(model, (x,), optimizer="adam", profile="flops", granularity="module")
    step = graph.optimizer_step_bytes
    assert step >= 256 * 256 * 4          # at least one weight's worth (the per-tensor loop's sqrt)
    plan = remat.plan(graph, "1.0x", solver="checkpoint-all")
    assert plan.predicted["peak_bytes"] == graph.fixed_bytes + graph.step_end_bytes
    rep = run_plan(copy.deepcopy(model), (x,), plan, steps=2, plain=True)
    measured, predicted = rep.peak_bytes, plan.predicted["peak_bytes"]
    assert abs(measured - predicted) <= 0.02 * predicted, (measured, predicted)
    assert measured > graph.fixed_bytes + graph.persistent_total    # the transient is real
    # plain's step has the same end (the planned step keeps its loss value: 4 bytes)
    assert abs(rep.plain.peak_bytes - measured) <= 8
