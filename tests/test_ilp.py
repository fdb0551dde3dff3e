"""The ILP against exhaustive search, the baselines, the LP bound and the simulator."""
from __future__ import annotations

import math
import time

import pytest

from exhaustive import exhaustive_optimum
from remat import Graph, Node, simulate
from remat.budget import parse_budget
from remat.core.errors import InfeasibleBudgetError
from remat.generators import linear_chain, random_layered, unet
from remat.core import analysis  # noqa: F401
from remat.solvers import get, griewank, ilp, lp_round, names
from remat.solvers.ilp import bounds, exact, instant, mip, warm
from remat.solvers.baselines import checkpoint_all


def with_workspace_and_fixed(g: Graph, workspace: int, fixed: int) -> Graph:
    nodes = [Node(v.id, v.name, v.kind, v.time, v.bytes, workspace if v.id % 3 == 1 else 0) for v in g.nodes]
    return Graph(nodes, g.edges, fixed, g.meta)


def with_persistent(g: Graph, size: int) -> Graph:
    """`g` with `size` persistent bytes (a parameter gradient) on every other backward node."""
    nodes = [Node(v.id, v.name, v.kind, v.time, v.bytes, v.workspace_bytes,
                  persistent_bytes=size if v.kind == "backward" and v.id % 2 == 0 else 0) for v in g.nodes]
    return Graph(nodes, g.edges, g.fixed_bytes, g.meta)


def with_recompute_times(g: Graph, factor: float) -> Graph:
    """`g` whose forward nodes take `factor` times their time when recomputed, every other one
    (a cold cache: `Node.recompute_time`)."""
    nodes = [Node(v.id, v.name, v.kind, v.time, v.bytes, v.workspace_bytes, persistent_bytes=v.persistent_bytes,
                  recompute_time=v.time * factor if v.kind == "forward" and v.id % 2 == 0 else None) for v in g.nodes]
    return Graph(nodes, g.edges, g.fixed_bytes, g.meta)


TINY = {
    "chain3": linear_chain(3, bandwidth=4),
    "random3a": random_layered(3, seed=1, width=2, bandwidth=8),
    "random3b": random_layered(3, seed=4, width=2, bandwidth=2),
    "random3_ws_fixed": with_workspace_and_fixed(random_layered(3, seed=2, width=2, bandwidth=4), 2, 3),
    "random3_persistent": with_persistent(with_workspace_and_fixed(random_layered(3, seed=3, width=2, bandwidth=4),
                                                                   1, 2), 2),
    "random3_recompute_times": with_recompute_times(random_layered(3, seed=1, width=2, bandwidth=8), 3.0),
}


def budgets_around(g: Graph) -> list[int]:
    lo = ilp.min_feasible_budget(g)[0]
    hi = simulate(g, checkpoint_all(g)).peak_bytes
    return list(range(lo - 1, hi + 1))


def ilp_time(g: Graph, budget: int, **options) -> float | None:
    try:
        s = ilp.solve(g, budget, **options)
    except InfeasibleBudgetError:
        return None
    assert s.report["status"] == "optimal"
    res = simulate(g, s)
    assert res.valid and res.peak_bytes <= budget
    assert math.isclose(res.time, s.report["objective"], rel_tol=1e-9)
    return s.report["objective"]


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("swap", [False, True])
def test_ilp_equals_exhaustive_search(name, swap):
    g = TINY[name]
    budgets = budgets_around(g)
    assert len(budgets) >= 2
    for b in budgets:
        assert ilp_time(g, b, swap=swap) == exhaustive_optimum(g, b, swap), (name, b, swap)


@pytest.mark.parametrize("name", ["chain3", "random3a"])
def test_checkmate_model_with_backward_recompute_equals_exhaustive(name):
    # recompute_backward=True is Checkmate's model exactly (any node may be recomputed)
    g = TINY[name]
    for b in budgets_around(g):
        assert ilp_time(g, b, swap=False, recompute_backward=True) == \
            exhaustive_optimum(g, b, False, recompute_backward=True)


def test_swap_beats_recomputation_and_matches_exhaustive():
    # the smallest graph found where swapping strictly helps (stage t+2 prefetch needs room)
    g = linear_chain(4, bandwidth=4)
    assert exhaustive_optimum(g, 5, False) == 14.0
    assert exhaustive_optimum(g, 5, True) == 13.0
    assert ilp_time(g, 5, swap=False) == 14.0
    s = ilp.solve(g, 5, swap=True)
    assert s.report["objective"] == 13.0
    ops = {o.op for o in s.ops}
    assert {"swap_out", "swap_in", "wait"} <= ops
    res = simulate(g, s)
    assert res.host_peak_bytes > 0 and res.transfer_time > 0


GRAPHS = {
    "chain8": linear_chain(8),
    "random10": random_layered(10, seed=3),
    "unet2": unet(2),
    "random10_cold": with_recompute_times(random_layered(10, seed=3), 2.5),
}


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("ratio", [1.0, 0.7, 0.5])
def test_ilp_beats_every_baseline_and_lp_bound_holds(name, ratio):
    g = GRAPHS[name]
    full = simulate(g, checkpoint_all(g)).peak_bytes
    budget = max(int(full * ratio), ilp.min_feasible_budget(g, swap=False)[0])
    s = ilp.solve(g, budget, swap=False, time_limit=60)
    assert s.report["status"] == "optimal"
    res = simulate(g, s)
    assert res.valid and res.peak_bytes <= budget
    assert math.isclose(res.time, s.report["objective"], rel_tol=1e-9)
    bound = lp_round.lower_bound(g, budget, swap=False)
    assert bound <= s.report["objective"] + 1e-6
    for other in names():
        if other in ("ilp",):
            continue
        try:
            b = get(other)(g, budget)
        except InfeasibleBudgetError:
            continue
        except Exception as e:  # griewank on non-chains says so clearly
            assert "chain" in str(e)
            continue
        rb = simulate(g, b)
        assert rb.valid and rb.peak_bytes <= budget, other
        if rb.transfer_time == 0:  # recompute-only schedules: the ILP here has swap off
            assert s.report["objective"] <= rb.time + 1e-9, other
        assert_executable(g, rb, other)
    assert_executable(g, res, "ilp")


@pytest.mark.parametrize("ratio", [0.7, 0.5])
def test_bounds_price_recomputations_at_their_recompute_time(ratio):
    g = GRAPHS["random10_cold"]
    plain = Graph([Node(v.id, v.name, v.kind, v.time, v.bytes, v.workspace_bytes) for v in g.nodes], g.edges)
    full = simulate(g, checkpoint_all(g)).peak_bytes
    budget = max(int(full * ratio), ilp.min_feasible_budget(g, swap=False)[0])
    s = ilp.solve(g, budget, swap=False, time_limit=60)
    assert s.report["status"] == "optimal"
    # dearer recomputations: a slower optimum than the same graph priced at the first computes'
    assert s.report["objective"] > ilp.solve(plain, budget, swap=False, time_limit=60).report["objective"]
    for bound in (bounds.knapsack_bound(g, budget), bounds.window_bound(g, budget),
                  instant.solve(g, budget, time_limit=30)["bound"]):
        assert bound <= s.report["objective"] + 1e-9


def assert_executable(g, res, who):
    # autograd runs every backward node and the loss exactly once: only forward values recompute
    for v in g.nodes:
        if v.kind != "forward":
            assert res.compute_counts[v.id] == 1, (who, v.name, res.compute_counts[v.id])


def test_swap_never_slower_than_recompute_only():
    g = linear_chain(12, bandwidth=2)
    for budget in (6, 8):
        a = ilp.solve(g, budget, swap=False, time_limit=60)
        b = ilp.solve(g, budget, swap=True, time_limit=60)
        assert b.report["objective"] <= a.report["objective"] + 1e-9


def test_time_limited_run_reports_incumbent_bound_and_gap():
    # random_layered(20, seed 2) at 0.6x: its optimum (163) is above the instant IP's bound
    # (156.2) and CBC cannot close that in 2 s; the report must say so.  (Chain32 at 9 units,
    # once this case, is proven at once through revolve's bound: test_chain_bound.py.)
    g = random_layered(20, seed=2)
    s = ilp.solve(g, 58, swap=False, time_limit=2)
    r = s.report
    assert r["status"] == "feasible", r
    assert r["lower_bound"] is not None and r["lower_bound"] < r["objective"], r
    assert 0 < r["gap"] < 1
    assert math.isclose(r["gap"], (r["objective"] - r["lower_bound"]) / r["objective"])
    assert simulate(g, s).time == r["objective"]


def test_infeasible_budget_is_an_error_and_min_feasible_budget_is_tight():
    g = random_layered(5, seed=0)
    found, lb = ilp.min_feasible_budget(g, swap=False)
    assert lb <= found
    assert ilp.solve(g, found, swap=False).report["status"] == "optimal"
    if lb == found:  # proven: one byte less cannot work
        with pytest.raises(InfeasibleBudgetError):
            ilp.solve(g, found - 1, swap=False)


def test_min_feasible_budget_is_never_above_its_heuristic_start():
    # the answer cannot be worse than checkpoint-all or Chen's greedy segments, however little
    # time CBC gets (a loaded machine's short limit once returned the keep-all peak)
    from remat.solvers import chen
    g = random_layered(12, seed=3)
    starts = [simulate(g, ilp.prune_waste(g, f(g))).peak_bytes
              for f in (checkpoint_all, chen.chen_greedy, chen.chen_greedy_ap)]
    assert simulate(g, exact.smallest_peak_start(g)).peak_bytes == min(starts)
    found, lb = ilp.min_feasible_budget(g, swap=False, time_limit=1)
    assert lb <= found <= min(starts)


def test_min_feasible_budget_keeps_its_start_when_cbc_stops_at_a_worse_incumbent(monkeypatch):
    # CBC may reject the start and return an incumbent of its own, keep-all at worst
    g = random_layered(12, seed=3)
    monkeypatch.setattr(exact.mip, "run", lambda *a, **k: {"sol_status": 2, "bound": 0.0})
    monkeypatch.setattr(exact, "schedule_from_model", lambda graph, m: checkpoint_all(graph))
    found, _ = ilp.min_feasible_budget(g, swap=False, time_limit=1)
    keep_all = simulate(g, checkpoint_all(g)).peak_bytes
    assert found == simulate(g, exact.smallest_peak_start(g)).peak_bytes < keep_all


def test_budget_below_fixed_bytes_names_them():
    g = linear_chain(4, fixed_bytes=100)
    with pytest.raises(InfeasibleBudgetError) as e:
        ilp.solve(g, 50)
    assert e.value.fixed_bytes == 100
    assert "100 fixed bytes" in str(e.value)


def test_memory_quantisation_keeps_exact_bytes_feasible():
    base = random_layered(8, seed=5)
    nodes = [Node(v.id, v.name, v.kind, v.time, v.bytes * 1_000_003 + 17 * v.id) for v in base.nodes]
    g = Graph(nodes, base.edges, 0, base.meta)
    full = simulate(g, checkpoint_all(g)).peak_bytes
    found, lb = ilp.min_feasible_budget(g, swap=False)
    assert lb <= found
    budget = (found + full) // 2
    # (without the instant IP, which works in exact bytes and proves this one before the ILP runs)
    s = ilp.solve(g, budget, swap=False, max_memory_units=2000, use_instant_ip=False)
    assert s.report["memory_quantum"] > 1
    res = simulate(g, s)
    assert res.valid and res.peak_bytes <= budget
    # the bound must hold for the exact problem: the unquantised optimum is not below it
    exact = ilp.solve(g, budget, swap=False, max_memory_units=10**9)
    assert "quantised_status" not in exact.report and exact.report["status"] == "optimal"
    assert s.report["lower_bound"] <= exact.report["objective"] + 1e-9
    assert exact.report["objective"] <= s.report["objective"] + 1e-9
    assert s.report["status"] in ("optimal", "feasible")
    if s.report["status"] == "optimal":
        assert s.report["objective"] == exact.report["objective"]


def test_highs_backend_agrees_with_cbc():
    pytest.importorskip("highspy")
    g = linear_chain(6)
    for budget in (5, 6):
        a = ilp.solve(g, budget, swap=False)
        b = ilp.solve(g, budget, swap=False, backend="highs")
        assert b.report["status"] == "optimal"
        assert math.isclose(a.report["objective"], b.report["objective"], rel_tol=1e-6)


def test_highs_banner_stays_out_of_stdout():
    # HiGHS prints its banner to the C stdout at the first Highs() of a process, before any
    # option can stop it; `remat plan` writes its summary there (a fresh process: once per process)
    pytest.importorskip("highspy")
    import subprocess
    import sys
    code = ("from remat.generators import linear_chain; from remat.solvers import ilp; "
            "s = ilp.solve(linear_chain(6), 5, swap=False, backend='highs'); print(s.report['status'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "optimal" and "HiGHS" not in out.stdout + out.stderr


def test_parse_cbc_log():
    text = ("Result - Stopped on time limit\n\nObjective value:                37.00000000\n"
            "Lower bound:                    25.000\nGap:                            0.48\n")
    assert ilp.parse_cbc_log(text) == {"result": "Stopped on time limit", "objective": 37.0, "lower_bound": 25.0}


def test_lp_round_is_valid_and_bounded():
    g = linear_chain(10)
    s = lp_round.solve(g, 7, swap=False)
    res = simulate(g, s)
    assert res.valid and res.peak_bytes <= 7
    assert s.report["lower_bound"] <= res.time
    opt = ilp.solve(g, 7, swap=False).report["objective"]
    assert s.report["lower_bound"] <= opt <= res.time


def assign(m, g, sched):
    """Set every model variable from a schedule (FREE as the release indicator, U by its
    recurrence, tau as the stage time) and return the rows and bounds it violates."""
    import pulp
    n, st, M = g.n, sched.stages, m.meta["M"]
    for d in (m.R, m.S, m.SO, m.SI, m.SF):
        for v in d.values():
            v.varValue = 0
    missing = []
    for t, s in enumerate(st):
        for d, ids in ((m.R, [i for i in s.compute if i != t]), (m.S, s.keep), (m.SO, s.swap_out),
                       (m.SI, s.swap_in), (m.SF, s.fetch)):
            for i in ids:
                if (t, i) in d:
                    d[t, i].varValue = 1
                else:
                    missing.append((t, i))
    for (t, i, k), f in m.FREE.items():
        comp, nxt = set(st[t].compute), set(st[t + 1].keep) if t + 1 < n else set()
        later = [j for j in g.succs[i] if k < j <= t and j in comp]
        f.varValue = int(k in comp and i not in nxt and not later and i not in st[t].swap_out)
    for t in range(n):
        comp = set(st[t].compute)
        u = sum(M[i] for i in st[t].keep + st[t].swap_in + st[t].fetch) + M[0] * (0 in comp)
        for k in range(t + 1):
            if k:
                u += M[k] * (k in comp) - sum(M[i] * m.FREE[t, i, k - 1].varValue
                                              for i in set(g.preds[k - 1]) if (t, i, k - 1) in m.FREE)
            m.U[t, k].varValue = u
        if t in m.tau:
            comp_t = sum(g.nodes[i].time for i in comp) / m.time_unit
            xfer = sum(g.nodes[i].bytes / g.bandwidth for i in st[t].swap_out + st[t].swap_in) / m.time_unit
            fetch = sum(g.nodes[i].bytes / g.bandwidth for i in st[t].fetch) / m.time_unit
            m.tau[t].varValue = fetch + max(comp_t, xfer)
    bad = list(missing)
    for name, c in m.prob.constraints.items():
        val = c.value()
        if (c.sense == pulp.LpConstraintLE and val > 1e-6) or (c.sense == pulp.LpConstraintGE and val < -1e-6) \
                or (c.sense == pulp.LpConstraintEQ and abs(val) > 1e-6):
            bad.append((name, val))
    for v in m.prob.variables():
        if v.varValue is not None and v.upBound is not None and v.varValue > v.upBound + 1e-6:
            bad.append((v.name, v.varValue))
    return bad


@pytest.mark.parametrize("g", [linear_chain(10), random_layered(8, seed=2), unet(2)], ids=str)
def test_every_baseline_schedule_satisfies_every_ilp_row(g):
    # the ILP and the simulator describe the same schedules: a pruned baseline that fits the
    # budget in the simulator is a feasible point of the model, with objective = simulated time
    full = simulate(g, checkpoint_all(g)).peak_bytes
    checked = 0
    for ratio in (1.0, 0.8, 0.6):
        budget = int(full * ratio)
        m = ilp.build_model(g, budget, swap=True)
        for nm in ("checkpoint-all", "chen-sqrtn", "chen-greedy", "checkpoint-last-node", "lp-round"):
            try:
                sch = ilp.prune_waste(g, get(nm)(g, budget))
            except InfeasibleBudgetError:
                continue
            res = simulate(g, sch)
            if res.peak_bytes > budget:
                continue
            assert assign(m, g, sch) == [], nm
            import pulp
            assert math.isclose(pulp.value(m.prob.objective) * m.time_unit, res.time, rel_tol=1e-9)
            checked += 1
    assert checked >= 5


def test_ilp_swap_schedule_satisfies_its_own_rows():
    g = linear_chain(6, bandwidth=4)
    s = ilp.solve(g, 5, swap=True)
    assert any(st.swap_out for st in s.stages)
    m = ilp.build_model(g, 5, swap=True)
    assert assign(m, g, s) == []


def test_fetch_lets_a_swap_in_serve_its_own_stage():
    # before fetches, TFLMS (a swap-in its consumer waits for) reached 31 here while the ILP's
    # "optimal" swap schedule was 46, the recompute-only optimum
    g = linear_chain(8)
    s = ilp.solve(g, 4, swap=True, time_limit=60)
    assert s.report["status"] == "optimal"
    assert s.report["objective"] == 31.0
    assert ilp.solve(g, 4, swap=False).report["objective"] == 46.0
    assert any(st.fetch for st in s.stages)
    assert simulate(g, get("tflms")(g, 4)).time >= s.report["objective"]


def test_garbage_solver_bound_is_replaced_by_the_lp_bound(monkeypatch, no_chain_bound):
    # CBC interrupted in its root cut loop printed "Lower bound: 2.08e13" against an incumbent of
    # 154; such a bound must never reach the report (it would read as a proof)
    g = linear_chain(12)
    monkeypatch.setattr(mip, "run", lambda *a, **k: {
        "sol_status": 0, "objective": None, "bound": 2.0e13, "proven": False,
        "result": "Stopped on time limit", "infeasible": False})
    s = ilp.solve(g, 6, swap=False, time_limit=30)
    r = s.report
    assert r["status"] == "feasible"
    assert r["bound_from"] == "lp_relaxation"
    lp = lp_round.lower_bound(g, 6, swap=False)
    assert r["lower_bound"] == pytest.approx(lp) and r["lower_bound"] < r["objective"]
    assert r["objective"] == simulate(g, s).time


def test_dtr_seeds_the_ilp_so_it_is_never_worse_than_dtr():
    # chain32 at 10 units: time-limited CBC alone stopped at 125; DTR finds 122
    g = linear_chain(32)
    s = ilp.solve(g, 10, swap=False, time_limit=5)
    d = simulate(g, get("dtr-eq")(g, 10)).time
    assert s.report["objective"] <= d
    assert s.report["objective"] <= 122.0


def test_swap_ilp_starts_from_the_recompute_only_optimum():
    # the swap model is never worse than recompute-only, even time-limited, and stops early once
    # the recompute-only optimum already costs nothing extra
    g = linear_chain(12, bandwidth=0.25)
    plain = ilp.solve(g, 8, swap=False, time_limit=30)
    with_swap = ilp.solve(g, 8, swap=True, time_limit=6)
    assert with_swap.report["objective"] <= plain.report["objective"] + 1e-9
    free = ilp.solve(g, simulate(g, checkpoint_all(g)).peak_bytes, swap=True, time_limit=30)
    assert free.report["status"] == "optimal" and free.report["objective"] == g.total_time
    assert "recompute-only optimum" in free.report["solver_result"]


def test_shift_search_fits_revolve_with_one_more_snapshot():
    # revolve with 6 snapshots peaks at 10 units on chain32; with each recomputation allowed one
    # stage later (into the stage that consumes it) the same work fits in 9 units
    g = linear_chain(32)
    seed = griewank.griewank_schedule(g, 6)
    assert simulate(g, seed).peak_bytes == 10 and simulate(g, seed).time == 126.0
    s = ilp.shift_search(g, 9, seed, time_limit=30)
    r = simulate(g, s)
    assert r.valid and r.peak_bytes <= 9 and r.time == 126.0
    allowed = {(t + d, i) for t, st in enumerate(seed.stages) for i in st.compute for d in warm.SHIFTS}
    assert all((t, i) in allowed for t, st in enumerate(s.stages) for i in st.compute)
    # the whole revolve sweep fits only 5 snapshots at 9 units: 8 units of time more
    assert simulate(g, get("griewank")(g, 9)).time == 134.0


def test_restricted_support_recomputes_nothing_else():
    g = linear_chain(6)
    m = ilp.build_model(g, 5, swap=False, r_support=set())
    assert not m.R
    m = ilp.build_model(g, 5, swap=False, r_support={(9, 2)})
    assert set(m.R) == {(9, 2)}


@pytest.mark.parametrize("n", [8, 10])
def test_chain_optimum_is_revolve_with_budget_minus_three_snapshots(n):
    # exact optima of the chain with unit costs match revolve's count with s = B - 3 snapshots
    # (the gradients in and out and the layer's input and output take the other three units);
    # the warm-start search already reaches them
    g = linear_chain(n)
    for b in range(5, 9):
        expect = 3 * n + 1 + griewank.binomial_cost(n, b - 3) - (n - 1)
        s = ilp.solve(g, b, swap=False, time_limit=60)
        assert s.report["status"] == "optimal" and s.report["objective"] == expect
        w = ilp.searched_warm_start(g, b, time_limit=10)
        assert simulate(g, w).time == expect


def test_chain32_at_9_units_reaches_revolve_count_quickly():
    # was 133-134 from CBC in 40 s; the warm start gives 126 = 97 + t(32, 6) - 31: the lookahead
    # replay reaches it alone, the shift search around revolve did before
    # (test_shift_search_fits_revolve_with_one_more_snapshot)
    g = linear_chain(32)
    s = ilp.solve(g, 9, swap=False, time_limit=8)
    assert s.report["objective"] == 126.0 and s.report["lower_bound"] <= 126.0
    assert s.report["warm_start"] == "lookahead" or s.report["warm_start"].startswith("shift search")


def test_time_limited_exact_solve_reports_at_least_the_window_bound():
    # CBC stopped early (or misled by its preprocessing) leaves a weak bound; the window IP's is
    # integral and costs a tenth of a second, and the report takes the larger
    g = random_layered(40, seed=4)
    budget = parse_budget("0.8x", g)
    s = ilp.solve(g, budget, swap=False, time_limit=3, threads=1, mode="exact")
    wb = bounds.window_bound(g, budget)
    rep = s.report
    assert g.total_time < wb <= rep["lower_bound"] * (1 + 1e-9) <= rep["objective"] * (1 + 1e-9)
    assert rep["status"] == ("optimal" if rep["lower_bound"] >= rep["objective"] * (1 - 1e-9) else "feasible")


@pytest.mark.parametrize("ignores_sigint", [False, True])
def test_watchdog_stops_a_cbc_that_overruns_its_time_limit(tmp_path, monkeypatch, ignores_sigint, no_chain_bound):
    # CBC ignores its own limit in preprocessing and infeasibility proofs (seen: 215 s against
    # 30); a stand-in that never ends is interrupted, or killed, and the warm start comes back
    # (Python, not sh: CBC sets its own SIGINT handler, and a shell started from a background job
    # inherits SIGINT ignored and may not reset it)
    import sys
    fake = tmp_path / "cbc"
    how = "SIG_IGN" if ignores_sigint else "SIG_DFL"
    fake.write_text(f"#!{sys.executable}\nimport signal, time\nsignal.signal(signal.SIGINT, signal.{how})\n"
                    "time.sleep(600)\n")
    fake.chmod(0o755)
    monkeypatch.setattr(mip, "cbc_binary", lambda: str(fake))
    monkeypatch.setattr(mip, "WATCHDOG_GRACE", (1.0, 0.5))
    monkeypatch.setattr(mip, "WATCHDOG_KILL_S", 1.0)
    g = linear_chain(8)
    import time as _t
    t0 = _t.perf_counter()
    s = ilp.solve(g, 6, swap=False, time_limit=1.0)
    assert _t.perf_counter() - t0 < 30
    r = s.report
    assert "Stopped by remat" in r["solver_result"] and "returned the warm start" in r["solver_result"]
    assert ("killed" if ignores_sigint else "interrupted") in r["solver_result"]
    assert r["status"] == "feasible" and simulate(g, s).peak_bytes <= 6


@pytest.mark.parametrize("printed,kept", [(29.0, None), (25.0, 25.0)])
def test_a_stopped_cbc_whose_bound_meets_its_incumbent_gives_no_bound(monkeypatch, printed, kept):
    # CBC stopped inside its root cut loop prints "best possible 4.8e12" and then its incumbent as
    # the lower bound (seen on the instant IP of chain32 at 9 units after 0.7-0.9 s): taken as a
    # bound it "proved" 126 optimal; a bound below the incumbent stays
    from types import SimpleNamespace
    import pulp
    prob = pulp.LpProblem("p", pulp.LpMinimize)
    x = pulp.LpVariable("x", 0, 1, pulp.LpBinary)
    prob += 29 * x
    x.varValue = 1
    prob.sol_status = 2
    monkeypatch.setattr(mip, "run_cbc", lambda *a, **k: {"result": "Stopped on time limit",
                                                          "objective": 29.0, "lower_bound": printed})
    out = mip.run(SimpleNamespace(prob=prob, time_unit=1.0), "cbc", 1.0, 0.0, 1, True, False)
    assert out["objective"] == 29.0 and not out["proven"] and out["bound"] == kept


def test_exact_mode_says_at_once_when_what_must_be_resident_does_not_fit():
    # random_layered(49) at 0.5x: the gradients still to be read plus a node and its inputs need
    # 163 bytes at some first compute; CBC once took 238 s to prove the model infeasible
    g = random_layered(49, seed=0)
    budget = parse_budget("0.5x", g)
    t0 = time.perf_counter()
    with pytest.raises(InfeasibleBudgetError) as e:
        ilp.solve(g, budget, swap=False, time_limit=30, mode="exact")
    assert time.perf_counter() - t0 < 5
    assert e.value.min_feasible_lower_bound == 163 > budget
    assert "163 bytes" in str(e.value)


@pytest.mark.parametrize("proven", [False, True])
def test_values_that_do_not_fit_are_an_error_only_when_proven_optimal(monkeypatch, caplog, proven):
    # a solver stopped at its limit may write values that are no schedule (ResNet-50's coarse graph
    # at 0.3x: peak 3.28 GB against 0.96): dropped with an info line, the warm start returned; a
    # proven optimum that does not fit is a modelling bug and says so
    import logging
    g = unet(4)  # at 0.7x the ILP runs (no bound proves the warm start first)
    budget = parse_budget("0.7x", g)
    too_big = checkpoint_all(g, 10**15)
    assert simulate(g, too_big).peak_bytes > budget
    monkeypatch.setattr(mip, "run", lambda *a, **k: {
        "sol_status": 1 if proven else 2, "objective": 1.0, "bound": None, "proven": proven,
        "result": "Optimal solution found" if proven else "Stopped on time", "infeasible": False,
        "watchdog": None})
    monkeypatch.setattr(exact, "integral", lambda m: True)
    monkeypatch.setattr(exact, "schedule_from_model", lambda graph, m: too_big)
    with caplog.at_level(logging.INFO, logger="remat"):
        s = ilp.solve(g, budget, mode="exact", swap=False, time_limit=5, use_instant_ip=False)
    assert simulate(g, s).peak_bytes <= budget and "returned the warm start" in s.report["solver_result"]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert bool(errors) == proven and ("please report" in errors[0].getMessage() if proven else True)
    assert any("does not fit in the simulator" in r.getMessage() for r in caplog.records)
