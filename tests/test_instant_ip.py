"""The instant IP (solvers/ilp/instant.py): a relaxation of the ILP that sees recomputation
cascades; its bound against the proven optimum, its plans in the simulator, and the claim of its
proof that every schedule maps onto a solution."""
from __future__ import annotations

import pytest

from remat import simulate
from remat.budget import parse_budget
from remat.generators import linear_chain, random_layered, unet
from remat.core.errors import SolverError
from remat.core.graph import Graph, Node
from remat.core import analysis
from remat.solvers import get, ilp
from remat.solvers.ilp import bounds, instant, mip, paths, scalable, windows
from remat.solvers.ilp import windows as ilp_windows  # (the name `windows` is a test's local too)


def odd_graph(seed: int) -> Graph:
    """A random DAG with workspace, fixed bytes and forward nodes that cost no time."""
    base = random_layered(10, seed=seed)
    nodes = [Node(v.id, v.name, v.kind, 0.0 if (v.kind == "forward" and v.id % 4 == 1) else v.time, v.bytes,
                  (v.id % 3) if v.kind == "forward" else 0) for v in base.nodes]
    return Graph(nodes, base.edges, 7, base.meta)


@pytest.mark.parametrize("layers,budget,optimum,window", [(10, 5, 42.0, 38.0), (12, 6, 47.0, 45.0)])
def test_chain_optimum_is_proven_where_the_window_ip_stops_short(layers, budget, optimum, window):
    # the window IP pays a dropped value once; rebuilding it needs its predecessor, which the
    # instant IP sees: on unit chains its optimum is revolve's count, the exact ILP's optimum
    g = linear_chain(layers)
    out = instant.solve(g, budget, time_limit=30, threads=1)
    assert out["proven"] and out["bound"] == pytest.approx(optimum)
    assert bounds.window_bound(g, budget) == pytest.approx(window)
    exact = ilp.solve(g, budget, swap=False, time_limit=30, threads=1, mode="exact")
    assert exact.report["status"] == "optimal" and exact.report["objective"] == pytest.approx(optimum)
    res = simulate(g, out["schedule"])  # here its optimal plan also fits inside every stage
    assert res.valid and res.peak_bytes <= budget and res.time == pytest.approx(optimum)


@pytest.mark.parametrize("g,ratio", [(unet(3), "0.6x"), (random_layered(15, seed=0), "0.8x"),
                                     (random_layered(12, seed=3), "0.7x"), (odd_graph(0), "0.9x"),
                                     (odd_graph(1), "0.8x")],
                         ids=["unet3", "random15", "random12", "odd0", "odd1"])
def test_bound_lies_between_the_window_ip_and_the_optimum_and_the_plan_costs_the_objective(g, ratio):
    budget = parse_budget(ratio, g)
    out = instant.solve(g, budget, time_limit=30, threads=1)
    exact = ilp.solve(g, budget, swap=False, time_limit=30, threads=1, mode="exact")
    assert exact.report["status"] == "optimal" and out["proven"]
    opt = exact.report["objective"]
    wb = bounds.window_bound(g, budget)
    assert wb * (1 - 1e-9) <= out["bound"] <= opt * (1 + 1e-9)
    # the plan it reads back runs every computation the model counts, and nothing else; it may
    # peak above the budget inside a stage (random15 at 0.8x does), which the model ignores
    res = simulate(g, out["schedule"])
    assert res.valid and res.time == pytest.approx(out["objective"])


@pytest.mark.parametrize("g,ratio,optimum,plain", [(random_layered(20, seed=2), "0.6x", 159.0, 157.0),
                                                   (random_layered(20, seed=4), "0.65x", 187.0, 180.0),
                                                   (unet(3), "0.6x", 295.0, 295.0)],
                         ids=["random20s2", "random20s4", "unet3"])
def test_rebuild_moments_raise_the_bound_and_stay_below_the_optimum(g, ratio, optimum, plain):
    # the optima were proven by the exact ILP alone (use_instant_ip=False: random20s4 in 16 s;
    # random20s2 is a case where the plain model stops 1.3 % short)
    budget = parse_budget(ratio, g)
    base = instant.solve(g, budget, time_limit=30, threads=1)
    moments = instant.solve(g, budget, time_limit=60, threads=1, in_stage=True)
    assert base["proven"] and moments["proven"]
    assert base["bound"] == pytest.approx(plain)
    assert plain <= moments["bound"] <= optimum * (1 + 1e-9)
    if g.meta["model"] == "random_layered(20, seed=2)":
        assert moments["bound"] == pytest.approx(optimum)  # what the plain model missed


def test_exact_mode_takes_the_rebuild_moment_bound_when_the_plain_optimum_does_not_fit():
    # the plain optimum (157) overflows at stage 27 in every rebuild order; rows there and at
    # the stages that overflow next prove 159 with a plan that fits (test_stage_order.py)
    g = random_layered(20, seed=2)
    s = ilp.solve(g, 58, swap=False, time_limit=30, threads=1)
    r = s.report
    assert r["lower_bound"] == pytest.approx(159.0) and r["bound_from"] == "instant IP, rebuild moments on demand"
    assert r["objective"] >= 159.0 and r["objective"] == simulate(g, s).time
    if ilp.highs_available():
        assert r["status"] == "optimal" and r["objective"] == pytest.approx(159.0)


def test_cbc_stops_at_an_incumbent_that_meets_a_known_bound():
    # chain32 at 9 units: CBC's bound stays at 122, so it never proves the 126 plan optimal; told
    # that 126 is a bound (revolve's), it is stopped once it holds that incumbent
    g = linear_chain(32)
    best = ilp.solve(g, 9, swap=False, time_limit=30, threads=1)
    assert best.report["status"] == "optimal" and best.report["objective"] == 126.0
    m = ilp.build_model(g, 9, swap=False)
    ilp.set_warm_start(m, best)
    out = mip.run(m, "cbc", 120, 0.0, 1, True, False, stop_at=126.0)
    assert out["result"].startswith("Stopped by remat"), out["result"]
    assert out["objective"] * m.time_unit == pytest.approx(126.0)


@pytest.mark.parametrize("g,budget", [(linear_chain(8, bandwidth=0.25), 4), (linear_chain(10, bandwidth=2), 5),
                                      (unet(3, bandwidth=1), "0.6x"), (odd_graph(1), "0.8x")],
                         ids=["chain-slow-link", "chain-fast-link", "unet3", "odd1"])
def test_swap_bound_stays_below_the_swap_optimum(g, budget):
    budget = parse_budget(str(budget), g)
    out = instant.solve(g, budget, swap=True, time_limit=30, threads=1)
    exact = ilp.solve(g, budget, swap=True, time_limit=60, threads=1, mode="exact")
    assert out["bound"] is not None and exact.report["status"] == "optimal"
    assert g.total_time <= out["bound"] <= exact.report["objective"] * (1 + 1e-9)
    wb = bounds.window_bound(g, budget, swap=True)
    assert wb * (1 - 1e-9) <= out["bound"]


SOLVERS = ("lookahead", "dtr", "chen-sqrtn", "griewank", "checkpoint-all", "tflms")


def fitting_schedules(g, budget):
    """(name, schedule, simulation) of each of SOLVERS' schedules that is valid and fits."""
    for name in SOLVERS:
        try:
            sched = get(name)(g, budget)
        except Exception:  # a baseline that cannot meet this budget
            continue
        res = simulate(g, sched)
        if res.valid and res.peak_bytes <= budget:
            yield name, sched, res


@pytest.mark.parametrize("g,ratio", [(linear_chain(16), "0.5x"), (unet(3), "0.6x"), (odd_graph(1), "0.8x"),
                                     (random_layered(20, seed=2), "0.7x")],
                         ids=["chain16", "unet3", "odd1", "random20"])
def test_every_schedule_maps_onto_a_solution_that_costs_no_more(g, ratio):
    # the proof's first step, checked: read off any schedule (staged or a bare op list, with or
    # without host copies), the model's variables satisfy every row, and the objective is at
    # most the schedule's simulated time
    budget = parse_budget(ratio, g)
    checked = 0
    for name, sched, res in fitting_schedules(g, budget):
        swap = any(op.op == "swap_in" for op in sched.ops)
        for in_stage in (False, True):  # (with the held-through variables and rebuild moments)
            m = instant.build(g, budget, swap=swap, in_stage=in_stage)
            assert instant.set_warm_start(g, m, sched)
            bad = [name for name, c in m.prob.constraints.items() if not c.valid(1e-9)]
            assert not bad, (name, in_stage, bad[:5])
            assert all(x.varValue >= x.lowBound - 1e-9 for x in m.prob.variables() if x.lowBound is not None)
            assert m.prob.objective.value() * m.time_unit <= res.time * (1 + 1e-9), name
        checked += 1
    assert checked >= 3


def test_a_budget_below_what_an_instant_must_hold_is_infeasible():
    g = linear_chain(8)
    assert instant.build(g, 2) is None  # at the first backward node: gradient, two inputs, output
    out = instant.solve(g, 2)
    assert out["infeasible"] and out["bound"] is None and out["schedule"] is None


def test_exact_mode_returns_the_instant_ip_plan_when_it_fits_and_says_it_is_proven():
    g = unet(3)
    budget = parse_budget("0.6x", g)
    s = ilp.solve(g, budget, swap=False, time_limit=30, threads=1)
    r = s.report
    assert r["status"] == "optimal" and r["objective"] == pytest.approx(295.0) and r["gap"] == 0.0
    assert r["bound_from"] == "instant IP" and "instant IP" in r["solver_result"]
    res = simulate(g, s)
    assert res.valid and res.peak_bytes <= budget and res.time == pytest.approx(295.0)
    # without it, the full ILP reaches the same optimum
    plain = ilp.solve(g, budget, swap=False, time_limit=30, threads=1, use_instant_ip=False)
    assert plain.report["status"] == "optimal" and plain.report["objective"] == pytest.approx(295.0)
    assert "instant IP" not in str(plain.report.get("bound_from"))


def test_scalable_mode_proves_a_chain_through_the_instant_ip_where_the_window_ip_cannot(no_chain_bound):
    # chain12 at 6 units: lookahead's plan is optimal (47); the window IP stops at 45
    g = linear_chain(12)
    s = scalable.solve(g, 6, swap=False, time_limit=30, threads=1)
    r = s.report
    assert r["status"] == "optimal" and r["objective"] == pytest.approx(47.0)
    assert r["bound_from"].startswith("instant IP") and r["instant_ip"]["bound"] == pytest.approx(47.0)


def test_exact_mode_proves_unet5_where_the_full_ilp_alone_stops_short():
    # unet(5) at 0.6x (53 nodes): the full ILP alone ends at 1214 with a bound 2 % lower after
    # 150 s (use_instant_ip=False); the instant IP's optimum is that plan, and it fits
    g = unet(5)
    budget = parse_budget("0.6x", g)
    s = ilp.solve(g, budget, swap=False, time_limit=60, threads=1)
    r = s.report
    assert r["status"] == "optimal" and r["objective"] == pytest.approx(1214.0) and r["bound_from"] == "instant IP"
    assert r["wall_time"] < 40
    res = simulate(g, s)
    assert res.valid and res.peak_bytes <= budget and res.time == pytest.approx(1214.0)


@pytest.mark.parametrize("g,budget,optimum", [(linear_chain(12), 6, 47.0), (unet(3), "0.6x", 295.0),
                                              (random_layered(20, seed=2), "0.6x", 157.0)],
                         ids=["chain12", "unet3", "random20s2"])
def test_highs_solves_the_same_model_to_the_same_optimum(g, budget, optimum):
    # the scalable mode's instant-IP run (scalable step 0c) uses HiGHS when installed
    pytest.importorskip("highspy")
    budget = parse_budget(str(budget), g)
    # a HiGHS solve with its default thread count first: HiGHS keeps its first thread pool for
    # the process and failed the next solve that asked for one thread ("Not Set") until mip.run
    # reset it
    assert ilp.solve(linear_chain(6), 5, swap=False, backend="highs", threads=None).report["status"] == "optimal"
    out = instant.solve(g, budget, time_limit=60, threads=1, backend="highs")
    assert out["proven"] and out["bound"] == pytest.approx(optimum) and out["objective"] == pytest.approx(optimum)
    assert simulate(g, out["schedule"]).time == pytest.approx(optimum)


def test_exact_mode_asks_highs_when_cbc_leaves_the_instant_ip_open(monkeypatch):
    # CBC stand-in: stopped with nothing (as on random_layered(49) at 0.8x, where CBC's instant-IP
    # bound is 1.1200 after 30 s and HiGHS proves 1.1272); HiGHS then solves the same model
    pytest.importorskip("highspy")
    real = instant.solve
    calls = []

    def stand_in(*a, backend="cbc", in_stage=False, **k):
        calls.append((backend, in_stage))
        if backend == "cbc" and not in_stage:
            return {"bound": None, "schedule": None, "objective": None, "proven": False, "infeasible": False,
                    "variables": 0}
        return real(*a, backend=backend, in_stage=in_stage, **k)

    monkeypatch.setattr(instant, "solve", stand_in)
    g = unet(3)
    budget = parse_budget("0.6x", g)
    s = ilp.solve(g, budget, swap=False, time_limit=60, threads=1)
    r = s.report
    assert calls[:2] == [("cbc", False), ("highs", False)]
    assert r["status"] == "optimal" and r["objective"] == pytest.approx(295.0) and r["bound_from"] == "instant IP (HiGHS)"
    assert simulate(g, s).peak_bytes <= budget


def rebuilds(graph: Graph, schedule) -> set:
    """(instant, value) for every value computed again between two first computes."""
    out, seen, t = set(), set(), 0
    for op in schedule.ops:
        if op.op != "compute":
            continue
        if op.node in seen:
            out.add((t, op.node))
        else:
            seen.add(op.node)
            t += 1
    return out


def test_highs_is_handed_the_warm_start():
    # PuLP passes HiGHS no MIP start; mip.run hands it one through highspy.  Stopped before it
    # solves anything, HiGHS returns the start with it and nothing without it
    pytest.importorskip("highspy")
    g = unet(5)
    budget = parse_budget("0.6x", g)
    start = ilp.best_baseline(g, budget)
    for warm in (False, True):
        m = instant.build(g, budget)
        if warm:
            assert instant.set_warm_start(g, m, start)
        out = mip.run(m, "highs", 1e-6, 0.0, 1, warm, False)
        if warm:
            assert out["objective"] * m.time_unit == pytest.approx(simulate(g, start).time)
        else:
            assert out["objective"] is None


def test_neighbourhoods_partition_the_forward_nodes_into_runs_ending_at_articulation_points():
    for g in (unet(5), random_layered(30, seed=1), linear_chain(20)):
        regions = instant.neighbourhoods(g, 3)
        fwd = [v for v in range(g.n) if g.nodes[v].kind == "forward"]
        assert sorted(v for r in regions for v in r) == fwd and len(regions) == 3
        assert all(max(r) - min(r) + 1 == len(r) for r in regions)
    # blocks of conv -> conv -> add(input, conv): the balanced ends move to the adds, the only
    # articulation points
    times, sizes, edges = [1.0], [4], []
    for _ in range(10):
        a = len(times) - 1
        times += [1.0, 2.0, 0.5]
        sizes += [1, 4, 4]
        edges += [(a, a + 1), (a + 1, a + 2), (a + 2, a + 3), (a, a + 3)]
    from remat.generators import from_forward
    g = from_forward(times, sizes, edges)
    ends = [max(r) for r in instant.neighbourhoods(g, 3)][:-1]
    assert ends and all(e % 3 == 0 for e in ends)  # the adds are 3, 6, 9, ...


@pytest.mark.parametrize("backend", ["cbc", "highs"])
def test_neighbourhood_search_frees_only_its_region_and_keeps_the_start(backend):
    if backend == "highs":
        pytest.importorskip("highspy")
    g = unet(5)
    budget = parse_budget("0.6x", g)
    start = ilp.best_baseline(g, budget)
    region = instant.neighbourhoods(g, 3)[1]
    out = instant.solve(g, budget, start=start, region=region, time_limit=20, threads=1, backend=backend)
    assert out["bound"] is None  # a neighbourhood's bound is not the graph's
    assert out["objective"] <= simulate(g, start).time + 1e-9
    outside = lambda s: {(t, v) for t, v in rebuilds(g, s) if v not in region}  # noqa: E731
    assert outside(out["schedule"]) <= outside(start)
    with pytest.raises(SolverError, match="needs a start"):
        instant.solve(g, budget, region=region)


def test_strict_moments_make_a_plan_that_fits_where_the_plain_model_overflows():
    # random_layered(20, seed 2) at 0.6x: the plain instant IP's optimum (157) rebuilds values
    # that peak 12 % over the budget inside a stage; counting the rebuilds kept to their instant
    # at later rebuilds, the model's optimum is 159, the exact optimum, and its plan fits
    pytest.importorskip("highspy")
    g = random_layered(20, seed=2)
    budget = parse_budget("0.6x", g)
    plain = instant.solve(g, budget, time_limit=30, threads=1, backend="highs")
    assert plain["proven"] and plain["objective"] == pytest.approx(157.0)
    assert simulate(g, plain["schedule"]).peak_bytes > budget
    strict = instant.solve(g, budget, time_limit=30, threads=1, backend="highs", strict=True)
    assert strict["objective"] == pytest.approx(159.0) and strict["bound"] is None  # no relaxation
    res = simulate(g, strict["schedule"])
    assert res.valid and res.peak_bytes <= budget and res.time == pytest.approx(159.0)


# ---- split at tight instants ----------------------------------------------------------------------
SPLIT_CASES = [(linear_chain(12), "0.4x", 54.0, True), (unet(3), "0.6x", 295.0, True), (unet(4), "0.6x", 595.0, True),
               (random_layered(20, seed=2), "0.6x", 159.0, False), (random_layered(15, seed=0), "0.8x", 129.0, False),
               (random_layered(20, seed=4), "0.65x", 187.0, False)]


@pytest.mark.parametrize("g,ratio,optimum,meets", SPLIT_CASES,
                         ids=["chain12", "unet3", "unet4", "random20s2", "random15", "random20s4"])
def test_split_bound_stays_below_the_optimum_and_adds_up_its_windows(g, ratio, optimum, meets):
    # optima: the exact ILP's (tests above and test_scalable's table); on the chain and the
    # U-Nets the windows' sum is the optimum itself
    budget = parse_budget(ratio, g)
    backend = "highs" if ilp.highs_available() else "cbc"
    out = windows.split_bound(g, budget, time_limit=30, threads=1, backend=backend)
    candidates = windows.split_candidates(g, budget)
    assert candidates and set(out["cuts"]) <= set(candidates) and out["cuts"][0] == candidates[0]
    wins = out["windows"]
    assert [a for a, *_ in wins] == [0] + out["cuts"] and [b for _, b, *_ in wins] == out["cuts"] + [g.n - 1]
    assert out["bound"] == pytest.approx(g.total_time + sum(lb for _, _, lb, _ in wins))
    assert out["proven"]
    assert out["bound"] <= optimum * (1 + 1e-9)
    assert (out["bound"] == pytest.approx(optimum)) == meets


def _split_with_one_hard_window(monkeypatch, g, budget, hard):
    """`split_bound` over 1000 s where every window but `hard` is proven at once and `hard` runs
    to every limit it gets (a fake clock); returns window -> the limits it was solved with."""
    clock = [0.0]
    solves: dict = {}
    windows: dict = {}
    build = instant.build

    def build_and_note(graph, b, **k):
        m = windows[k["window"]] = build(graph, b, **k)
        return m

    def run(m, backend, limit, gap, threads, warm, msg, **k):
        w = next(w for w, mm in windows.items() if mm is m)
        solves.setdefault(w, []).append(limit)
        if w == hard:
            clock[0] += limit
            return {"bound": 1000.0, "proven": False, "infeasible": False, "objective": 2000.0}
        return {"bound": 0.0, "proven": True, "infeasible": False, "objective": 0.0}

    monkeypatch.setattr(instant, "build", build_and_note)
    monkeypatch.setattr(mip, "run", run)
    monkeypatch.setattr(ilp_windows._time, "perf_counter", lambda: clock[0])
    out = ilp_windows.split_bound(g, budget, time_limit=1000.0, threads=1, backend="highs")
    assert (hard[0], hard[1], pytest.approx(1000.0 * windows[hard].time_unit), False) in out["windows"]
    return solves


def test_split_bound_gives_its_hard_window_what_is_left_in_one_solve(monkeypatch):
    # a window on the best cuts that runs to every limit it gets (as U-Net d3's (70, 120] at 0.3x,
    # which HiGHS proves in 1525 s): after the first pass over the windows between candidates
    # (half of 1 - SPLIT_FIRST of the time) and the first window (proven at once here), it is
    # solved again once, with everything left, not in two solves that each start from scratch
    g = unet(4)
    budget = parse_budget("0.6x", g)
    hard = (windows.split_candidates(g, budget)[0], g.n - 1)
    solves = _split_with_one_hard_window(monkeypatch, g, budget, hard)
    first, again = solves[hard]  # two solves, no more
    assert first == pytest.approx((1 - windows.SPLIT_FIRST) * 1000.0 / 2)  # (the others proven at once)
    assert again == pytest.approx(1000.0 - first)


def test_split_bound_gives_a_hard_first_window_all_the_time_the_others_leave(monkeypatch):
    # ResNet-50 d2 at 0.3x: the first window is the open one; it stopped at SPLIT_FIRST of the
    # time (1088 of 1800 s) with the rest unused
    g = unet(4)
    budget = parse_budget("0.6x", g)
    hard = (0, windows.split_candidates(g, budget)[0])
    solves = _split_with_one_hard_window(monkeypatch, g, budget, hard)
    assert solves[hard] == [pytest.approx(1000.0)]  # (the others took no time)


def test_split_candidates_are_tight_backward_instants():
    g = unet(4)
    budget = parse_budget("0.6x", g)
    cap = budget - g.fixed_bytes
    forced = analysis.forced_loads(g)
    cands = windows.split_candidates(g, budget)
    assert cands and cands == sorted(cands) and len(cands) <= windows.SPLIT_MOST
    assert all(g.nodes[t].kind == "backward" and cap - forced[t] <= windows.SPLIT_ROOM * cap for t in cands)
    others = [cap - forced[t] for t, v in enumerate(g.nodes) if v.kind == "backward" and t not in cands
              and 0 < t < g.n - 1]
    assert all(cap - forced[t] <= r for t in cands for r in others)  # the tightest ones
    assert len(cands) == windows.SPLIT_MOST or all(r > windows.SPLIT_ROOM * cap for r in others)
    assert windows.split_candidates(g, parse_budget("1x", g)) == []  # nothing is tight without a squeeze
    assert windows.split_bound(g, parse_budget("1x", g)) is None


@pytest.mark.parametrize("g,ratio", [(unet(3), "0.6x"), (random_layered(20, seed=2), "0.7x"), (linear_chain(16), "0.3x")],
                         ids=["unet3", "random20", "chain16"])
def test_every_schedule_maps_onto_every_window_at_no_more_than_its_recomputation(g, ratio):
    # the split bound's proof, checked: read off a schedule, each window's variables satisfy every
    # row the window keeps, and the windows of any cuts cost at most what the schedule recomputes
    budget = parse_budget(ratio, g)
    points = windows.split_candidates(g, budget)
    assert points
    checked = 0
    for name, sched, res in fitting_schedules(g, budget):
        if any(op.op == "swap_in" for op in sched.ops):
            continue
        ends = [0] + points + [g.n - 1]
        total = 0.0
        for a, b in zip(ends, ends[1:]):
            m = instant.build(g, budget, window=(a, b))
            assert all(t >= a for t, _ in m.P) and all(t > a for t, _ in m.N) and all(t <= b for t, _ in m.P)
            assert instant.set_warm_start(g, m, sched)
            bad = [k for k, c in m.prob.constraints.items() if not c.valid(1e-9)]
            assert not bad, (name, a, b, bad[:5])
            total += (m.prob.objective.value() or 0.0) * m.time_unit
        assert total <= (res.time - g.total_time) * (1 + 1e-9) + 1e-9, name
        checked += 1
    assert checked >= 2


needs_highs = pytest.mark.skipif(not ilp.highs_available(), reason="HiGHS solves these models (the rows work with CBC too)")


def _violated_path_rows(g, m):
    """The path rows the model's current point violates (`path_rows` at its variables' values)."""
    return paths.path_rows(g, m, {x: x.varValue or 0.0 for x in [*m.P.values(), *m.N.values()]}, eps=1e-9)


@needs_highs
@pytest.mark.parametrize("g,ratio", [(unet(3), "0.6x"), (random_layered(12, seed=3), "0.7x"), (linear_chain(16), "0.5x"),
                                     (odd_graph(1), "0.8x")], ids=["unet3", "random12", "chain16", "odd1"])
def test_path_rows_hold_at_every_integral_solution_the_model_has(g, ratio):
    # the path rows' proof: every integral solution satisfies them, so no path row is violated at
    # (a) every baseline's schedule read onto the model, (b) optimal solutions of the model under
    # random objectives (vertices of its integer hull, far from the schedules), whole and windowed
    import random
    import pulp
    budget = parse_budget(ratio, g)
    points = windows.split_candidates(g, budget) or [g.n // 2]
    for window in (None, (points[0], g.n - 1)):
        m = instant.build(g, budget, window=window)
        for name, sched, _ in fitting_schedules(g, budget):
            if not any(op.op == "swap_in" for op in sched.ops):
                assert instant.set_warm_start(g, m, sched)
                assert not _violated_path_rows(g, m), (name, window)
        rng = random.Random(7)
        cols = list(m.P.values()) + list(m.N.values())
        for _ in range(4):
            m.prob.setObjective(pulp.lpSum(rng.uniform(-1, 1) * x for x in cols))
            m.prob.solve(pulp.PULP_CBC_CMD(msg=False, threads=1))
            assert m.prob.sol_status == 1
            assert not _violated_path_rows(g, m), window


@needs_highs
@pytest.mark.parametrize("g,budget", [(linear_chain(10), 5), (random_layered(20, seed=2), "0.6x"),
                                      (random_layered(12, seed=3), "0.7x")], ids=["chain10", "random20s2", "random12"])
def test_path_rows_raise_the_lp_and_keep_the_optimum(g, budget):
    # the rows cut off LP points (the LP rises; chain10: 38 -> 40.9 of 42) but no integral
    # solution: the model proves the same optimum with them as without
    budget = parse_budget(budget, g) if isinstance(budget, str) else budget
    plain = instant.solve(g, budget, time_limit=60, threads=1, backend="highs", path=False)
    assert plain["proven"]
    optimum = plain["objective"]
    m = instant.build(g, budget)
    lp = paths.Relaxation(m)
    assert lp.solve() is not None
    before = lp.objective * m.time_unit
    out = paths.add_path_rows(g, m)
    assert out["rows"] > 0 and before + 1e-6 * optimum < out["lp"] <= optimum * (1 + 1e-9)
    assert len([k for k in m.prob.constraints if k.startswith("path_")]) == out["rows"] <= out["separated"]
    solved = instant.solve(g, budget, time_limit=60, threads=1, backend="highs")
    assert solved["proven"] and solved["objective"] == pytest.approx(optimum)


def test_path_rows_without_highs_come_from_cbcs_lp_alike(monkeypatch):
    # without highspy the LP rounds run in CBC: the LP rises above the plain one (150.24) and stays
    # below the optimum (157), tight rows are kept, and the model is left with no LP values on its
    # variables (a warm start sets its own)
    g = random_layered(20, seed=2)
    budget = parse_budget("0.6x", g)
    monkeypatch.setattr(mip, "highs_available", lambda: False)
    m = instant.build(g, budget)
    out = paths.add_path_rows(g, m)
    assert out["rows"] > 0 and 150.24 < out["lp"] <= 157.0 + 1e-9
    assert len([k for k in m.prob.constraints if k.startswith("path_")]) == out["rows"] <= out["separated"]
    assert all(x.varValue is None for x in m.prob.variables())
    solved = instant.solve(g, budget, time_limit=60, threads=1)  # (CBC)
    assert solved["proven"] and solved["objective"] == pytest.approx(157.0)


# ---- coupled windows -----------------------------------------------------------------------------
@needs_highs
@pytest.mark.parametrize("g,ratio,cut,free,optimum", [
    (linear_chain(12), "0.5x", 16, 4.0, 7.0),          # coupled: the optimum itself
    (random_layered(12, seed=0), "0.7x", 16, 8.0, 11.0),
    (random_layered(20, seed=2), "0.6x", 24, 29.0, 30.0)], ids=["chain12", "random12", "random20s2"])
def test_coupled_bound_lifts_the_free_split_and_stays_below_every_schedule(g, ratio, cut, free, optimum):
    # windows (0, cut] and (cut, end] joined through the residents at `cut`: one round is the split
    # with a free start (W1's LP plus W2's optimum); the rounds after it rise, never above the
    # instant IP's proven optimum (its recomputation) nor what any recompute-only schedule recomputes
    budget = parse_budget(ratio, g)
    end = g.n - 1
    first = windows.coupled_bound(g, budget, cut, end, rounds=1, time_limit=30)
    out = windows.coupled_bound(g, budget, cut, end, time_limit=60)
    assert first["bound"] == pytest.approx(free) and not first["converged"]
    assert out["converged"] and out["bound"] == pytest.approx(out["master"], rel=1e-5)
    assert free + 0.1 < out["bound"] <= optimum + 1e-6
    solved = instant.solve(g, budget, time_limit=60, threads=1, backend="highs", path=False)
    assert solved["proven"] and solved["objective"] - g.total_time == pytest.approx(optimum)
    checked = 0
    for name, sched, res in fitting_schedules(g, budget):
        if any(op.op == "swap_in" for op in sched.ops):  # (a recompute-only bound)
            continue
        assert out["bound"] <= (res.time - g.total_time) * (1 + 1e-9) + 1e-9, name
        checked += 1
    assert checked >= 2


def test_coupled_bound_needs_highs_and_a_cut_inside(monkeypatch):
    g = linear_chain(12)
    budget = parse_budget("0.5x", g)
    assert windows.coupled_bound(g, budget, 0, g.n - 1) is None
    assert windows.coupled_bound(g, budget, 16, 16) is None
    monkeypatch.setattr(mip, "highs_available", lambda: False)
    assert windows.coupled_bound(g, budget, 16, g.n - 1) is None


def test_window_size_counts_the_window_models_variables_and_places_the_coupling_cut():
    g = random_layered(20, seed=4)
    budget = parse_budget("0.65x", g)
    for a, b in [(0, g.n - 1), (0, 31), (29, 31), (12, 35), (30, 31)]:
        m = instant.build(g, budget, window=(a, b))
        assert windows.window_size(g, a, b) == len(m.P) + len(m.N), (a, b)
    for least in (20, 40, 80):
        cut = windows.couple_cut(g, 31, least)
        assert windows.window_size(g, cut, 31) >= least > windows.window_size(g, cut + 1, 31)
    assert windows.couple_cut(g, 31, windows.window_size(g, 0, 31) + 1) is None


@needs_highs
def test_couple_split_couples_the_splits_start_at_its_tightest_point_and_stays_below_the_optimum(monkeypatch):
    # random_layered(20, seed 4) at 0.65x: optimum 187 (the exact ILP), split 179; the coupling
    # ends at the split's tightest point, keeps the split's windows after it, and is a bound
    g = random_layered(20, seed=4)
    budget = parse_budget("0.65x", g)
    split = windows.split_bound(g, budget, time_limit=30, threads=1, backend="highs")
    monkeypatch.setattr(windows, "COUPLE_W2_VARS", 40)
    out = windows.couple_split(g, budget, split, time_limit=30, threads=1)
    cap = budget - g.fixed_bytes
    forced = analysis.forced_loads(g)
    points = [t for t in split["tails"] if 0 < t < g.n - 1]
    assert out["end"] == min(points, key=lambda t: (cap - forced[t], t))
    assert out["cut"] == windows.couple_cut(g, out["end"], 40)
    co = windows.coupled_bound(g, budget, out["cut"], out["end"], time_limit=30, threads=1,
                                  price_limit=windows.COUPLE_PRICE_S,
                                  path_rounds=windows.COUPLE_SPLIT_PATH_ROUNDS)
    assert out["bound"] == pytest.approx(g.total_time + co["bound"] + split["tails"][out["end"]])
    assert g.total_time + split["tails"][out["end"]] < out["bound"] <= 187.0 + 1e-9
    for name, sched, res in fitting_schedules(g, budget):
        if not any(op.op == "swap_in" for op in sched.ops):
            assert out["bound"] <= res.time * (1 + 1e-9), name
    assert windows.couple_split(g, budget, dict(split, tails={g.n - 1: 0.0}), time_limit=30) is None
    monkeypatch.setattr(windows, "COUPLE_W2_VARS", 10 ** 6)  # (no window that large: no cut)
    assert windows.couple_split(g, budget, split, time_limit=30) is None


@needs_highs
def test_highs_gives_up_when_asked_with_its_bound_in_seconds_of_the_schedule():
    # random_layered(20, seed 2) at 0.6x: the instant IP's optimum is 157 (proven below); a
    # `give_up` that says yes at once stops HiGHS unproven with a bound still below it, and the
    # bounds it is shown are seconds of the schedule (at most the optimum), not model units
    g = random_layered(20, seed=2)
    budget = parse_budget("0.6x", g)
    seen: list = []
    out = instant.solve(g, budget, time_limit=60, threads=1, backend="highs", path=False,
                           give_up=lambda elapsed, bound: seen.append((elapsed, bound)) or True)
    assert len(seen) >= 1 and not out["proven"]
    assert out["bound"] is None or out["bound"] <= 157.0 + 1e-6
    full = instant.solve(g, budget, time_limit=60, threads=1, backend="highs", path=False,
                            give_up=lambda elapsed, bound: seen.append((elapsed, bound)) and False)
    assert full["proven"] and full["objective"] == pytest.approx(157.0)
    bounds = [b for _, b in seen if b is not None]
    assert bounds and all(g.total_time * 0.5 < b <= 157.0 + 1e-6 for b in bounds)
