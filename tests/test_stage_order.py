"""Rebuild order inside a stage (solvers/stage_order.py): same computes, same time, lower peak."""
from __future__ import annotations

import pytest

from remat import simulate
from remat.budget import parse_budget
from remat.generators import linear_chain, random_layered, unet
from remat.core.graph import Graph, Node
from remat.core.schedule import Schedule, Stage, stages_from_ops
from remat.core.errors import InfeasibleBudgetError
from remat.solvers import get, ilp, stage_order
from remat.solvers.ilp import instant


def two_chains() -> tuple[Graph, Schedule]:
    """x -> a1 (100 bytes) -> a2, x -> b1 (30 bytes), c = (a2, b1); the last stage rebuilds
    a1, b1, a2.  In id order a1 is still resident while b1 is rebuilt (peak 140 bytes);
    rebuilding a2 right after a1 frees a1 first (peak 120, as in the stage before)."""
    sizes = [10, 100, 30, 10, 10]
    nodes = [Node(i, f"n{i}", "forward", 1.0, b) for i, b in enumerate(sizes)]
    g = Graph(nodes, [(0, 1), (0, 2), (1, 3), (3, 4), (2, 4)])
    stages = [Stage([0]), Stage([1], [0]), Stage([2], [0]), Stage([1, 3], [0]), Stage([1, 2, 3, 4], [0])]
    return g, Schedule.from_stages(g, stages)


def test_a_stage_that_overflows_in_id_order_fits_in_another_order():
    g, staged = two_chains()
    plain = simulate(g, staged)
    assert plain.valid and plain.peak_bytes == 140
    ordered = stage_order.lower_peak(g, staged, 125)
    res = simulate(g, ordered)
    assert ordered.stages is None and res.valid and res.peak_bytes == 120
    assert res.time == plain.time and res.compute_counts == plain.compute_counts
    assert [o.node for o in ordered.ops if o.op == "compute" and o.stage == 4] == [1, 3, 2, 4]
    # first computes stay in id order, so the plan still maps onto stages (and the instant IP)
    assert stages_from_ops(g, ordered.ops) is not None
    # no order fits 119 bytes: lower_peak says so, reorder names the stages
    assert stage_order.lower_peak(g, staged, 119) is None
    best, over = stage_order.reorder(g, staged, 119)
    assert over == [3, 4] and simulate(g, best).peak_bytes == 120


def test_stage_peak_is_the_simulators_peak_in_id_order():
    g = unet(4)
    checked = 0
    for ratio in ("0.5x", "0.8x", "1.0x"):
        budget = parse_budget(ratio, g)
        for name in ("checkpoint-all", "chen-sqrtn", "chen-greedy"):
            try:
                sched = get(name)(g, budget)
            except InfeasibleBudgetError:
                continue
            checked += 1
            st = sched.stages
            peaks = [stage_order.stage_peak(g, sorted(s.compute), set(s.keep),
                                            set(st[t + 1].keep) if t + 1 < len(st) else set())
                     for t, s in enumerate(st)]
            assert max(peaks) + g.fixed_bytes == simulate(g, sched).peak_bytes
    assert checked >= 3


@pytest.mark.parametrize("g,ratio", [(random_layered(20, seed=2), "0.6x"), (random_layered(30, seed=5), "0.7x"),
                                     (unet(4), "0.6x"), (linear_chain(16), "0.4x")],
                         ids=["random20", "random30", "unet4", "chain16"])
def test_reordering_keeps_time_and_counts_and_never_raises_a_peak(g, ratio):
    # the plain instant IP's plans ignore memory inside a stage; whatever reorder returns runs
    # the same computes as often, and its peak is at most the id order's
    budget = parse_budget(ratio, g)
    out = instant.solve(g, budget, time_limit=20, threads=1)
    staged = out["schedule"]
    plain = simulate(g, staged)
    ordered, over = stage_order.reorder(g, staged, budget)
    res = simulate(g, ordered)
    assert res.valid and res.time == pytest.approx(plain.time) and res.compute_counts == plain.compute_counts
    assert res.peak_bytes <= plain.peak_bytes
    assert (res.peak_bytes <= budget) == (not over)
    assert stages_from_ops(g, ordered.ops) is not None
    if plain.peak_bytes <= budget:  # nothing to reorder: the id order's op list itself
        assert ordered.ops == staged.ops


def test_time_windows_cover_the_instants_and_a_window_search_frees_only_its_instants():
    g = unet(5)
    windows = instant.time_windows(g, 3)
    parts = windows[:3]
    assert parts[0][0] == -1 and parts[-1][1] == g.n - 1
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # the three runs partition the instants
    assert len(windows) == 5 and all(parts[i][0] < windows[3 + i][0] < parts[i][1] < windows[3 + i][1]
                                     for i in range(2))  # each straddles one cut
    budget = parse_budget("0.6x", g)
    start = ilp.best_baseline(g, budget)
    a, b = windows[1]
    out = instant.solve(g, budget, start=start, instants=(a, b), time_limit=20, threads=1)
    assert out["bound"] is None and out["objective"] <= simulate(g, start).time + 1e-9

    def outside(s):
        seen, t, got = set(), 0, set()
        for op in s.ops:
            if op.op == "compute":
                if op.node in seen and not a < t <= b:
                    got.add((t, op.node))
                elif op.node not in seen:
                    seen.add(op.node)
                    t += 1
        return got
    assert outside(out["schedule"]) == outside(start)


def test_rebuild_moments_on_demand_reach_the_exact_optimum_with_a_proof():
    # random_layered(20, seed 2) at 0.6x: the plain instant IP's optimum (157) overflows at stage
    # 27 in every rebuild order; rows there give 158 (overflows at 32), then 159 with a plan
    # that fits: the exact optimum, proven by a relaxation (the rows are not strict)
    pytest.importorskip("highspy")
    g = random_layered(20, seed=2)
    budget = parse_budget("0.6x", g)
    moments: dict[int, bool] = {}
    seen = []
    for _ in range(6):
        out = instant.solve(g, budget, time_limit=30, threads=1, backend="highs", moments=dict(moments) or None)
        ordered, over = stage_order.reorder(g, out["schedule"], budget)
        seen.append(round(out["bound"]))
        if not over:
            break
        moments.update({t: t in moments for t in over})
    assert seen == [157, 158, 159, 159] and not any(moments.values())
    res = simulate(g, ordered)
    assert out["proven"] and res.valid and res.peak_bytes <= budget and res.time == pytest.approx(159.0)
    # a start that fits only in another order violates the rows where it rebuilds: they are
    # raised to its level, so that it stays a solution
    m = instant.build(g, budget, moments={27: True})
    instant.set_warm_start(g, m, instant.solve(g, budget, time_limit=30, threads=1, backend="highs")["schedule"])
    assert m.prob.constraints["interval_27"].value() > 0
    assert instant.loosen_unmet_moments(m) == [27] and m.prob.constraints["interval_27"].value() <= 0


def test_recompute_time_by_window_adds_up_to_the_schedules_recomputation():
    from remat.core.analysis import recompute_in as _recompute_in
    g = unet(5)
    budget = parse_budget("0.6x", g)
    sched = ilp.best_baseline(g, budget)
    extra = simulate(g, sched).compute_time - g.total_time
    assert extra > 0
    parts = instant.time_windows(g, 3)[:3]
    assert sum(_recompute_in(g, sched, w) for w in parts) == pytest.approx(extra)
    # the rebuilds before a node's first compute belong to the interval that ends at it
    first = next(t for t in range(g.n) if _recompute_in(g, sched, (t - 1, t)) > 0)
    assert _recompute_in(g, sched, (-1, first - 1)) == 0


def test_evictions_make_a_plan_fit_where_no_rebuild_order_does():
    g, staged = two_chains()
    ordered, over = stage_order.reorder(g, staged, 119)
    assert over == [3, 4]
    fitted = stage_order.evict_to_fit(g, ordered, 119)
    res = simulate(g, fitted)
    assert fitted.stages is None and res.valid and res.peak_bytes == 110
    # stage 3 frees x (10 bytes, one unit to rebuild) to compute a2 beside a1, and rebuilds it in
    # stage 4 for a1; stage 4 frees it again at a2 and rebuilds it for b1: two units more
    assert res.time == simulate(g, ordered).time + 2
    assert res.compute_counts == [3, 3, 2, 2, 1]
    # a plan that fits is replayed as it is
    assert stage_order.evict_to_fit(g, ordered, 120).ops == ordered.ops
    # nothing to free: x is the only forward value besides what the compute reads
    assert stage_order.evict_to_fit(g, ordered, 109) is None


@pytest.mark.parametrize("seed", [0, 3, 5])
def test_evict_to_fit_gives_valid_schedules_under_the_budget(seed):
    g = random_layered(30, seed=seed)
    plan = get("checkpoint-all")(g, 10 ** 15)
    plain = simulate(g, plan)
    fitted_any = 0
    for ratio in (0.9, 0.7, 0.5):
        budget = int(g.fixed_bytes + ratio * (plain.peak_bytes - g.fixed_bytes))
        fitted = stage_order.evict_to_fit(g, plan, budget)
        if fitted is None:
            continue
        fitted_any += 1
        res = simulate(g, fitted)
        assert res.valid and res.peak_bytes <= budget
        assert res.time >= plain.time and all(c >= 1 for c in res.compute_counts)
        # first computes keep the plan's order, so the result still maps onto stages
        assert stages_from_ops(g, fitted.ops) is not None
    assert fitted_any >= 1
