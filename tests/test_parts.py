"""Ops with several output tensors as parts (`remat.core.graph`): each tensor freed at its own last
use, an op's parts computed together.  The format, the simulator's rule, the exact ILP against an
exhaustive search, every registered solver, and the joint frontend's parts."""
from __future__ import annotations

import json
import random

import pytest

from exhaustive import exhaustive_optimum
from remat import generators as G
from remat.core.errors import InfeasibleBudgetError, InvalidInputError
from remat.core.graph import Graph
from remat.core.schedule import Op, Schedule, early_frees
from remat.core.simulate import keep_all_peak, simulate
from remat.solvers import get, ilp, names
from remat.solvers.parts import merge


def _bn_chain(layers: int = 4, size: int = 10, stats: int = 2) -> Graph:
    """A chain whose odd layers are batch-norm-like: a large output the next layer reads and small
    statistics only their backward reads."""
    g0 = G.linear_chain(layers, size=size)
    return G.split_outputs(g0, {v: [(stats, [g0.n - 1 - v])] for v in range(1, layers, 2)})


def test_parts_round_trip_and_old_versions_refuse_them():
    g = _bn_chain()
    d = g.to_dict()
    assert d["version"] == 3 and sum("part_of" in nd for nd in d["nodes"]) == 2
    h = Graph.from_dict(json.loads(json.dumps(d)))
    assert h.op_members == g.op_members == {1: [1, 2], 4: [4, 5]}
    assert h.content_hash() == g.content_hash()
    d["version"] = 2
    with pytest.raises(InvalidInputError, match="part_of: not in version 2"):
        Graph.from_dict(d)
    assert G.linear_chain(3).to_dict()["version"] == 1  # graphs without parts read and write as before


@pytest.mark.parametrize("change, message", [
    (lambda d: d["nodes"][2].update(time=1.0), "time 0"),
    (lambda d: d["nodes"][2].update(part_of=0), "right after it"),
    (lambda d: d["edges"].append([0, 2]), "reads its leader only"),
])
def test_malformed_parts_are_refused_in_one_line(change, message):
    d = _bn_chain().to_dict()
    change(d)
    with pytest.raises(InvalidInputError, match=message):
        Graph.from_dict(d)


def test_each_tensor_is_freed_at_its_own_last_use():
    merged, parts = G.linear_chain(4, size=10), _bn_chain()
    # plain autograd: the large outputs die after their forward readers' backward use, the
    # statistics live on; merged, each op holds both until the later of the two
    assert keep_all_peak(parts) < keep_all_peak(merged)
    assert keep_all_peak(merge(parts).graph) == keep_all_peak(merged)
    res = simulate(parts, Schedule.keep_all(parts))
    assert res.valid and res.compute_counts == [1] * parts.n
    assert res.time == pytest.approx(merged.total_time)


def test_the_simulator_holds_an_ops_parts_together():
    g = _bn_chain()
    ops = Schedule.keep_all(g).ops
    i = next(k for k, o in enumerate(ops) if o.op == "compute" and o.node == 1)
    # another compute between the leader and its part
    bad = ops[:i + 1] + [Op("compute", 3)] + ops[i + 1:]
    assert "between the parts of op 1" in str(simulate(g, bad).violation)
    # a part on its own (its leader kept, the op not run)
    j = next(k for k, o in enumerate(ops) if o.op == "compute" and o.node == 2)
    lone = ops[:j + 1] + [Op("free", 2), Op("compute", 2)]
    assert "computed without the op" in str(simulate(g, lone).violation)


def test_keeps_of_any_shape_make_valid_schedules():
    # `Schedule.from_sets` turns any keep sets into a schedule that follows the parts rule:
    # recomputing an op recomputes all its parts, and its parts' stages compute only them
    g = _bn_chain(6)
    rng = random.Random(0)
    for _ in range(200):
        keep = [{i for i in range(t) if g.succs[i] and rng.random() < 0.4} for t in range(g.n)]
        res = simulate(g, Schedule.from_sets(g, keep))
        assert res.valid, res.violation


@pytest.mark.parametrize("swap", [False, True])
def test_exact_ilp_is_the_exhaustive_optimum_with_parts(swap):
    g0 = G.linear_chain(3 if swap else 4, size=10, bandwidth=2.0)
    g = G.split_outputs(g0, {1: [(3, [g0.n - 2])]} if swap else {1: [(2, [g0.n - 2])], 2: [(3, [g0.n - 4, g0.n - 3])]})
    for budget in range(keep_all_peak(g) - 22, keep_all_peak(g) + 1, 4):
        best = exhaustive_optimum(g, budget, swap)
        try:
            sched = ilp.solve(g, budget, swap=swap, mode="exact", time_limit=30)
        except InfeasibleBudgetError:
            assert best is None, budget
            continue
        res = simulate(g, sched)
        assert res.valid and res.peak_bytes <= budget
        assert sched.report["status"] == "optimal"
        assert res.time == pytest.approx(best), budget


def test_every_solver_plans_graphs_with_parts():
    g = _bn_chain(8)
    budget = int(keep_all_peak(g) * 0.8)
    planned = 0
    for name in names():
        try:
            sched = get(name)(g, budget)
        except InfeasibleBudgetError:
            continue
        res = simulate(g, sched)
        assert res.valid, (name, res.violation)
        assert res.peak_bytes <= budget, name
        planned += 1
        if name not in ("ilp", "checkpoint-all"):  # (planned on the merged graph: no bound of it holds here)
            assert sched.report.get("status") != "optimal", name
    assert planned >= 10


def test_the_joint_frontend_splits_multi_output_ops():
    torch = pytest.importorskip("torch")
    import remat
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 16), nn.BatchNorm1d(16),
                          nn.ReLU(), nn.Linear(16, 4))
    g = remat.trace(model, (torch.randn(8, 16),), granularity="joint", profile="flops")
    ops = {g.nodes[lead].extra["op"]: members for lead, members in g.op_members.items()}
    assert any("dropout" in op for op in ops) and any("batch_norm" in op for op in ops)
    for lead, members in g.op_members.items():
        assert g.nodes[lead].workspace_bytes >= sum(g.nodes[p].bytes for p in members[1:])
    # the dropout's mask (a part) is what its backward reads; the output goes on to the ReLU
    drop = next(m for op, m in ops.items() if "dropout" in op)
    assert all(g.nodes[k].kind == "backward" for k in g.succs[drop[1]])


def test_the_instant_ip_stays_a_relaxation_with_parts():
    from remat.solvers.ilp import instant
    g0 = G.linear_chain(4, size=10)
    g = G.split_outputs(g0, {1: [(2, [g0.n - 2])], 2: [(3, [g0.n - 4, g0.n - 3])]})
    for budget in range(keep_all_peak(g) - 20, keep_all_peak(g) + 1, 4):
        best = exhaustive_optimum(g, budget, False)
        out = instant.solve(g, budget, time_limit=20)
        if best is None or out["bound"] is None:
            continue
        assert out["bound"] <= best + 1e-9, budget
        if out["schedule"] is not None:  # its plans follow the parts rule (they may peak over inside a stage)
            assert "part" not in str(simulate(g, out["schedule"]).violation or "")


def test_the_scalable_mode_plans_the_parts():
    g = _bn_chain(50)   # 126 nodes: above the exact mode's threshold
    assert g.n > 100
    budget = int(g.fixed_bytes + (keep_all_peak(g) - g.fixed_bytes) * 0.6)
    sched = ilp.solve(g, budget, swap=False, time_limit=10, threads=1)
    res = simulate(g, sched)
    assert res.valid and res.peak_bytes <= budget
    assert sched.report["mode"] == "scalable" and sched.report["lower_bound"] <= res.time + 1e-9
    # the coarsening never cuts between an op's parts
    from remat.solvers.ilp.coarsen import choose_groups, fit_groups
    for groups in (choose_groups(g, 30), fit_groups(g, choose_groups(g, 30), budget)):
        assert all(g.nodes[run[0]].part_of is None for run in groups)


def test_a_family_of_graphs_with_parts_scales_them_as_parts():
    from remat.sizes import GraphFamily
    fam = GraphFamily({2: _bn_chain(size=20, stats=4), 4: _bn_chain(size=40, stats=8)}, dim="batch")
    g = fam.at(6)
    assert g.op_members == _bn_chain().op_members
    assert [v.bytes for v in g.nodes] == [v.bytes for v in _bn_chain(size=60, stats=12).nodes]
    assert simulate(g, Schedule.keep_all(g)).valid


def test_a_coarse_schedules_expansion_fits_once_runs_parts_no_one_reads_are_freed_when_made():
    # the coarse model frees a recomputed run after its last reader; expanded, the run's batch-norm
    # statistics (parts only their backward reads) were held to the stage's end: 54 bytes over a
    # budget of 52, where freeing each as soon as it is made gives 50 at the same time
    from remat.budget import parse_budget
    from remat.solvers.ilp import coarsen
    g = _bn_chain(12)
    budget = parse_budget("0.4x", g)
    co = coarsen.coarsen(g, coarsen.fit_groups(g, coarsen.choose_groups(g, 7), budget))
    cs = ilp.solve(co.graph, budget, swap=False, time_limit=10, threads=1, mode="exact")
    fine = coarsen.expand(co, cs)
    staged = simulate(g, fine)
    assert staged.valid and staged.peak_bytes == 54 > budget == 52
    early = simulate(g, Schedule(early_frees(g, fine.ops)))
    assert early.valid and early.peak_bytes == 50 <= budget
    assert early.time == staged.time and early.compute_counts == staged.compute_counts


@pytest.mark.parametrize("name", ["griewank", "dtr", "lookahead"])
def test_early_frees_keep_every_op_and_never_raise_the_peak(name):
    from remat.budget import parse_budget
    for layers, ratio in ((8, "0.6x"), (12, "0.4x"), (16, "0.4x")):
        g = _bn_chain(layers)
        s = get(name)(g, parse_budget(ratio, g))
        before, after = simulate(g, s), simulate(g, Schedule(early_frees(g, s.ops)))
        assert after.valid and after.time == before.time and after.compute_counts == before.compute_counts
        assert after.peak_bytes <= before.peak_bytes
        assert sorted((o.op, o.node) for o in early_frees(g, s.ops)) == sorted((o.op, o.node) for o in s.ops)
