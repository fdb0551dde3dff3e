"""Persistent bytes (parameter gradients allocated at their first accumulation): the simulator's
rule, the graph format, the static analysis, and every solver keeping to its budget with them."""
from __future__ import annotations

import dataclasses
import json

import pytest

from remat import Graph, InfeasibleBudgetError, InvalidInputError, simulate
from remat.core import analysis
from remat.core.schedule import Op
from remat.core.simulate import SimState
from remat.generators import linear_chain, random_layered, unet
from remat.solvers import get, names
from remat.solvers.baselines import checkpoint_all


def with_persistent(g: Graph, size: int, every: int = 2) -> Graph:
    """`g` with `size` persistent bytes on every `every`-th backward node."""
    nodes = [dataclasses.replace(v, persistent_bytes=size if v.kind == "backward" and v.id % every == 0 else 0)
             for v in g.nodes]
    return Graph(nodes, g.edges, g.fixed_bytes, g.meta)


def test_persistent_bytes_count_from_the_next_allocation_after_the_first_compute():
    # chain3: f0 f1 f2 loss g2 g1 g0; 5 persistent bytes on g1 (node 5), 1 fixed
    g = linear_chain(3, fixed_bytes=1)
    g = Graph([dataclasses.replace(v, persistent_bytes=5 if v.id == 5 else 0) for v in g.nodes], g.edges, 1, g.meta)
    assert g.persistent_before == [0, 0, 0, 0, 0, 0, 5] and g.persistent_total == 5
    plain_graph = linear_chain(3, fixed_bytes=1)
    sched = checkpoint_all(g)
    r, plain = simulate(g, sched, timeline=True), simulate(plain_graph, sched, timeline=True)
    assert r.valid
    ops = [(t["op"], t["node"]) for t in r.timeline]
    k = ops.index(("compute", 5))
    nxt = next(j for j in range(k + 1, len(ops)) if ops[j][0] in ("compute", "swap_in"))
    extra = [t["after_bytes"] - u["after_bytes"] for t, u in zip(r.timeline, plain.timeline)]
    # g1's own compute and the frees right after it: as without; from g0 on, 5 more
    assert extra[:nxt] == [0] * nxt and extra[nxt:] == [5] * (len(ops) - nxt)
    during = [t["device_bytes"] - u["device_bytes"] for t, u in zip(r.timeline, plain.timeline)]
    assert during[:nxt] == [0] * nxt and during[nxt] == 5
    assert r.peak_bytes == max(plain.peak_bytes, max(t["device_bytes"] for t in r.timeline))


def test_the_steps_end_holds_every_persistent_byte():
    # a node whose persistent bytes exceed everything else: the peak is the step's end
    g = linear_chain(2)
    g = Graph([dataclasses.replace(v, persistent_bytes=100 if v.id == 4 else 0) for v in g.nodes], g.edges, 2, g.meta)
    r = simulate(g, checkpoint_all(g))
    assert r.valid and r.peak_bytes == 2 + 100
    assert analysis.node_need(g) == 102 and analysis.forced_need(g) == 102


def test_a_recomputation_allocates_no_persistent_bytes_again():
    # persistent bytes on a forward node (the format allows it): only its first compute adds them
    g = linear_chain(2)  # f0 f1 loss g1 g0
    g = Graph([dataclasses.replace(v, persistent_bytes=7 if v.id == 0 else 0) for v in g.nodes], g.edges, 0, g.meta)
    ops = [Op("compute", 0), Op("compute", 1), Op("free", 0), Op("compute", 2), Op("compute", 0),
           Op("compute", 3), Op("compute", 4)]  # (f0 rebuilt for g1)
    state = SimState(g)
    seen = []
    for op in ops:
        assert state.apply(op) is None
        seen.append(state.bytes_by_origin["persistent"])
    assert seen == [0] + [7] * (len(ops) - 1)  # (counted from the next compute on, once)
    assert state.counts[0] == 2
    res = simulate(g, ops)
    assert res.valid and res.peak_bytes == state.peak


def test_format_version_2_round_trips_and_version_1_stays_as_it_was(tmp_path):
    g = with_persistent(unet(2), 3)
    d = g.to_dict()
    assert d["version"] == 2 and any("persistent_bytes" in v for v in d["nodes"])
    again = Graph.from_dict(json.loads(json.dumps(d)))
    assert again.content_hash() == g.content_hash() and again.persistent_total == g.persistent_total
    plain = unet(2).to_dict()
    assert plain["version"] == 1 and not any("persistent_bytes" in v for v in plain["nodes"])
    bad = json.loads(json.dumps(d))
    bad["version"] = 1
    with pytest.raises(InvalidInputError, match="persistent_bytes: not in version 1"):
        Graph.from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["nodes"][-1]["persistent_bytes"] = -1
    with pytest.raises(InvalidInputError, match="persistent_bytes: must be an integer >= 0"):
        Graph.from_dict(bad)


def test_static_needs_count_the_persistent_bytes_already_there():
    g = with_persistent(linear_chain(4), 10)
    before = g.persistent_before
    loads = analysis.instant_loads(g)
    plain = analysis.instant_loads(linear_chain(4))
    assert [a - b for a, b in zip(loads, plain)] == before  # (a node's own count after it)
    assert analysis.node_need(g) >= analysis.node_need(linear_chain(4))
    # no schedule fits below the forced need, and checkpoint-all's peak is at least it
    assert simulate(g, checkpoint_all(g)).peak_bytes >= analysis.forced_need(g)


GRAPHS = {
    "chain8": with_persistent(linear_chain(8), 4),
    "unet2": with_persistent(unet(2), 3),
    "random10": with_persistent(random_layered(10, seed=2), 5, every=3),
}
QUICK = {"ilp": {"time_limit": 20}, "ilp-scalable": {"time_limit": 20}, "lp-round": {"time_limit": 20}}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_every_solver_keeps_to_its_budget_with_persistent_bytes(name):
    g = GRAPHS[name]
    top = simulate(g, checkpoint_all(g)).peak_bytes
    low = analysis.forced_need(g)
    budgets = sorted({low, (low + top) // 2, top})
    ilp_times = {}
    for solver in ["ilp"] + [s for s in names() if s != "ilp"]:
        if solver == "griewank" and name != "chain8":
            continue  # chains only
        for b in budgets:
            try:
                sched = get(solver)(g, b, **QUICK.get(solver, {}))
            except InfeasibleBudgetError:
                continue
            res = simulate(g, sched)
            assert res.valid, (solver, b, res.violation)
            assert res.peak_bytes <= b, (solver, b, res.peak_bytes)
            if solver == "ilp":
                assert sched.report["status"] == "optimal"
                ilp_times[b] = res.time
            elif solver not in ("tflms", "checkpoint-last-node") and b in ilp_times:
                # nothing in the ILP's class of schedules (backward nodes run once; TFLMS's op
                # lists can overlap transfers across stages) is faster than its proven optimum
                assert res.time >= ilp_times[b] - 1e-9, (solver, b, res.time, ilp_times[b])
    assert ilp_times, "the ILP fits at least the checkpoint-all budget"
