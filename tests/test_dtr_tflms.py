"""DTR (Kirisame et al.) and TFLMS (Le et al.) planners: validity and fit in the simulator, DTR's
own memory accounting equal to the simulator's, the linear-chain O(N) bound, failures as DTR
reports them, TFLMS's swaps and tuning, and comparisons with the ILP's proven optimum."""
from __future__ import annotations

import math

import pytest

from remat import InfeasibleBudgetError, InvalidInputError, simulate
from remat.generators import linear_chain, random_layered, unet
from remat.core.graph import Graph, Node
from remat.core import analysis
from remat.solvers import dtr, get, ilp, names, tflms
from remat.solvers.registry import _REGISTRY
from remat.solvers.baselines import checkpoint_all

DTR_NAMES = ["dtr", "dtr-eq", "dtr-local", "dtr-lru", "dtr-size", "dtr-msps", "lookahead"]
ALL_NAMES = DTR_NAMES + ["tflms"]

GRAPHS = {
    "chain16": linear_chain(16),
    "chain12+fixed": linear_chain(12, size=3, fixed_bytes=100),
    "random20": random_layered(20, seed=1),
    "random30": random_layered(30, seed=0),
    "unet3": unet(3),
    "unet2x2": unet(2, convs_per_level=2),
}
RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)


def full_peak(g: Graph) -> int:
    return simulate(g, checkpoint_all(g)).peak_bytes


def budgets(g: Graph) -> list[int]:
    full = full_peak(g)
    return [g.fixed_bytes + int((full - g.fixed_bytes) * r) for r in RATIOS]


def assert_executable(g: Graph, res, who: str) -> None:
    # autograd evaluates every backward node and the loss exactly once
    for v in g.nodes:
        if v.kind != "forward":
            assert res.compute_counts[v.id] == 1, (who, v.id, v.kind, res.compute_counts[v.id])


def with_forward_workspace(g: Graph, ws: int) -> Graph:
    nodes = [Node(v.id, v.name, v.kind, v.time, v.bytes, ws if v.kind == "forward" else 0) for v in g.nodes]
    return Graph(nodes, g.edges, g.fixed_bytes, {**g.meta, "model": f"{g.meta['model']}+ws{ws}"})


def test_registered_and_listed():
    for name in ALL_NAMES:
        assert name in names()
        assert get(name) is _REGISTRY[name]
    assert _REGISTRY["tflms"].__wrapped__ is tflms.solve  # (wrapped for graphs with parts: remat.solvers.parts)


# ---- every heuristic: valid, fits, executable; DTR's peak is the simulator's ----------------
@pytest.mark.parametrize("gname", sorted(GRAPHS))
def test_every_schedule_is_valid_fits_and_is_executable(gname):
    g = GRAPHS[gname]
    solved = {name: 0 for name in ALL_NAMES}
    for budget in budgets(g):
        for name in ALL_NAMES:
            try:
                sched = get(name)(g, budget)
            except InfeasibleBudgetError as e:
                assert any(w in str(e) for w in ("out of memory: nothing evictable", "thrashing: compute > 2x",
                                                  "no setting fits")), str(e)
                continue
            res = simulate(g, sched)
            assert res.valid, (name, budget, res.violation)
            assert res.peak_bytes <= budget, (name, budget, res.peak_bytes)
            assert sched.stages is None and sched.report["status"] == "heuristic"
            assert_executable(g, res, name)
            assert res.time >= g.total_time - 1e-9
            if name in DTR_NAMES:
                assert sched.report["peak_bytes"] == res.peak_bytes, (name, budget)
                assert sched.report["compute_time"] == pytest.approx(res.compute_time)
                assert res.time == pytest.approx(res.compute_time)  # no transfers
                assert {o.op for o in sched.ops} <= {"compute", "free"}
                assert res.time <= 2.0 * g.total_time + 1e-9  # the thrash guard held
            else:
                assert all(c == 1 for c in res.compute_counts)  # TFLMS never recomputes
            solved[name] += 1
    # the unconstrained budget and at least one tighter one are solved by every strategy
    for name, count in solved.items():
        assert count >= 2, (gname, name, solved)


@pytest.mark.parametrize("gname", ["chain16", "random20", "unet3"])
def test_dtr_at_full_budget_recomputes_nothing_and_tight_budgets_recompute(gname):
    g = GRAPHS[gname]
    full = full_peak(g)
    for name in DTR_NAMES:
        s = get(name)(g, full)
        assert s.report["rematerializations"] == 0 and s.report["evictions"] == 0
        assert simulate(g, s).time == pytest.approx(g.total_time)
    s = dtr.dtr(g, int(full * 0.8))
    assert s.report["rematerializations"] > 0 and s.report["evictions"] > 0
    assert simulate(g, s).time > g.total_time


def _belady_graph() -> Graph:
    # a -> b -> c -> d -> e(d, a) -> f(e, b) -> loss; unit times and bytes.  At d, with a, b and c
    # resident, 3 bytes force one eviction: a is the staler (DTR's choice) but e reads it next;
    # b is read later, by f
    nodes = [Node(i, "abcdef"[i], "forward", 1.0, 1) for i in range(6)] + [Node(6, "loss", "loss", 1.0, 1)]
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 4), (4, 5), (1, 5), (5, 6)]
    return Graph(nodes, edges, 0, {"model": "belady"})


def test_lookahead_evicts_what_is_needed_last_and_beats_staleness():
    g = _belady_graph()
    first_eviction = {}
    times = {}
    for h in ("dtr", "dtr-local", "dtr-msps", "lookahead"):
        s = dtr.solve(g, 3, h, numerator="local")
        frees = [o.node for o in s.ops if o.op == "free"]
        first_eviction[h] = frees[0]
        times[h] = simulate(g, s).time
    assert first_eviction == {"dtr": 0, "dtr-local": 0, "dtr-msps": 0, "lookahead": 1}
    assert times["lookahead"] == 9.0 and times["dtr"] == times["dtr-local"] == 10.0
    # the search is deterministic, reports its choice, and is never worse than its grid's first point
    g = GRAPHS["unet3"]
    budget = budgets(g)[4]  # 0.6x: 1.255x the plain time
    a, b = get("lookahead")(g, budget), get("lookahead")(g, budget)
    assert a.ops == b.ops and a.report["replays"] == len(dtr.LOOKAHEAD_GRID) + dtr.LOOKAHEAD_RESTARTS
    assert {"numerator", "alpha", "noise", "seed"} <= set(a.report)
    plain = dtr.solve(g, budget, "lookahead", **dict(zip(("numerator", "alpha"), dtr.LOOKAHEAD_GRID[0])))
    assert simulate(g, a).time <= simulate(g, plain).time + 1e-12
    with pytest.raises(InvalidInputError, match="numerator"):
        dtr.solve(g, budget, "lookahead", numerator="bogus")


def test_dtr_peak_equals_simulator_peak_with_workspace_fixed_bytes_and_empty_nodes():
    base = random_layered(16, seed=5)
    nodes = [Node(v.id, v.name, v.kind, 0.0 if v.id % 7 == 3 else v.time, 0 if v.id % 5 == 2 else v.bytes,
                  (v.id % 3) * 2) for v in base.nodes]
    g = Graph(nodes, base.edges, 17, base.meta)
    full = full_peak(g)
    checked = 0
    for r in (1.0, 0.9, 0.8, 0.7, 0.6):
        budget = int(full * r)
        for name in DTR_NAMES:
            try:
                s = get(name)(g, budget)
            except InfeasibleBudgetError:
                continue
            res = simulate(g, s)
            assert res.valid and res.peak_bytes == s.report["peak_bytes"] <= budget, (name, r)
            checked += 1
    assert checked >= 12


# ---- theory: O(N) on a linear chain at a budget of about 2 sqrt(N) -------------------------
@pytest.mark.parametrize("name", ["dtr", "dtr-eq"])
def test_dtr_chain_compute_is_linear_at_two_sqrt_n(name):
    # c = 3 compute ops per layer (one forward pass, the loss, one backward pass: 2N+1, plus at
    # most N-1 rematerialisations), i.e. at most 4N time units (forward 1, backward 2)
    for n in (16, 32, 64, 128, 256):
        g = linear_chain(n)
        budget = math.ceil(2 * math.sqrt(n))
        s = get(name)(g, budget, thrash_factor=math.inf)
        res = simulate(g, s)
        assert res.valid and res.peak_bytes <= budget
        ops = sum(res.compute_counts)
        assert ops <= 3 * n, (n, ops)
        assert res.compute_time <= 4 * n, (n, res.compute_time)
        assert s.report["rematerializations"] > 0


def test_chain_bound_needs_the_neighbourhood_cost():
    # without e* (cost only of the tensor itself) the same budget costs more than the bound:
    # the bound above is not vacuous
    n = 256
    g = linear_chain(n)
    s = dtr.dtr_local(g, math.ceil(2 * math.sqrt(n)), thrash_factor=math.inf)
    assert sum(simulate(g, s).compute_counts) > 3 * n


# ---- failures as DTR reports them ----------------------------------------------------------
def test_out_of_memory_when_nothing_is_evictable():
    g = linear_chain(32)
    with pytest.raises(InfeasibleBudgetError, match="out of memory: nothing evictable") as e:
        dtr.dtr(g, 3)  # a backward node needs its gradient input, two activations and its output
    assert e.value.budget_bytes == 3
    g = linear_chain(8, fixed_bytes=50)
    with pytest.raises(InfeasibleBudgetError, match="out of memory: nothing evictable"):
        dtr.dtr_eq(g, 50)


def test_out_of_memory_when_only_gradients_remain():
    # backward outputs are never evicted while they have uses, even when that is all there is
    g = unet(3)
    with pytest.raises(InfeasibleBudgetError, match="out of memory") as e:
        dtr.dtr(g, int(full_peak(g) * 0.5))
    assert "grad_" in str(e.value)


def test_thrashing_past_twice_the_baseline_and_thrash_factor():
    g = linear_chain(32)
    with pytest.raises(InfeasibleBudgetError, match=r"thrashing: compute > 2x baseline"):
        dtr.dtr(g, 5)
    s = dtr.dtr(g, 5, thrash_factor=10.0)
    res = simulate(g, s)
    assert res.valid and res.peak_bytes <= 5 and res.compute_time > 2 * g.total_time
    with pytest.raises(InfeasibleBudgetError, match=r"thrashing: compute > 1.5x baseline"):
        dtr.dtr(g, 6, thrash_factor=1.5)
    with pytest.raises(InvalidInputError):
        dtr.dtr(g, 6, thrash_factor=0)


# ---- never better than the ILP's proven optimum ------------------------------------------
ILP_GRAPHS = {
    "chain8": linear_chain(8),
    "random10": random_layered(10, seed=1),
    "unet2": unet(2),
}


@pytest.mark.parametrize("gname", sorted(ILP_GRAPHS))
def test_dtr_never_beats_the_ilp_optimum(gname):
    g = ILP_GRAPHS[gname]
    full = full_peak(g)
    compared = 0
    for r in (0.9, 0.7):
        budget = int(full * r)
        opt = ilp.solve(g, budget, swap=False, time_limit=20)
        if opt.report["status"] != "optimal":
            continue
        for name in DTR_NAMES:
            try:
                s = get(name)(g, budget)
            except InfeasibleBudgetError:
                continue
            assert simulate(g, s).time >= opt.report["objective"] - 1e-9, (name, r)
            compared += 1
    assert compared >= 8


def _in_ilp_stage_model(g: Graph, sched, res) -> bool:
    """No stall anywhere, and every swap-in is issued at least one compute before its consumer:
    then the ILP's swap model (prefetch usable from the next stage, transfers within a stage)
    contains the schedule, and its optimum must be at least as fast."""
    if res.time > res.compute_time + 1e-9:
        return False
    ops = sched.ops
    for j, o in enumerate(ops):
        if o.op != "swap_in":
            continue
        nxt = next(p for p in ops[j + 1:] if p.op == "compute")
        if o.node in g.preds[nxt.node]:
            return False
    return True


def test_tflms_never_beats_the_ilp_optimum_in_its_model():
    compared = 0
    for g in (linear_chain(8, bandwidth=100), linear_chain(8, bandwidth=4), unet(2, bandwidth=100)):
        full = full_peak(g)
        for r in (0.9, 0.7, 0.5):
            budget = int(full * r)
            try:
                s = tflms.solve(g, budget, ahead=1)
            except InfeasibleBudgetError:
                continue
            res = simulate(g, s)
            if not _in_ilp_stage_model(g, s, res):
                continue
            opt = ilp.solve(g, budget, swap=True, time_limit=20)
            if opt.report["status"] != "optimal":
                continue
            assert res.time >= opt.report["objective"] - 1e-9, (g.meta, r)
            compared += 1
    assert compared >= 4


# ---- TFLMS -----------------------------------------------------------------------------------
def test_tflms_fits_a_budget_no_recompute_only_schedule_can():
    # a layer whose forward needs a 4-byte temporary: recomputing it during the backward holds
    # that workspace next to the live gradient, swapping runs it in the forward only
    g = with_forward_workspace(linear_chain(6, bandwidth=100), 4)
    found, lower = ilp.min_feasible_budget(g, swap=False)
    assert lower == found == 7  # proven: no recompute-only schedule peaks below 7
    s = tflms.solve(g, lower - 1)
    res = simulate(g, s)
    assert res.valid and res.peak_bytes <= lower - 1
    assert res.time <= 1.01 * g.total_time
    assert {"swap_out", "swap_in", "wait"} <= {o.op for o in s.ops}
    for name in DTR_NAMES:
        with pytest.raises(InfeasibleBudgetError):
            get(name)(g, lower - 1)


def test_tflms_reaches_the_single_node_floor_at_generous_bandwidth():
    # on the chain the floor (one backward node with its inputs: 4 bytes) is the same for
    # recomputation, but recomputation pays for it in time; swapping at 100x bandwidth does not
    g = linear_chain(32, bandwidth=100)
    assert analysis.node_need(g) == 4
    s = tflms.solve(g, 4)
    res = simulate(g, s)
    assert res.valid and res.peak_bytes == 4
    assert res.time <= 1.01 * g.total_time
    with pytest.raises(InfeasibleBudgetError, match="thrashing"):
        dtr.dtr(g, 5)


def test_tflms_parameters():
    g = linear_chain(16, bandwidth=4)
    full = full_peak(g)
    # nothing swapped: the checkpoint-all schedule's memory and time
    for kw in ({"n_tensors": 0}, {"threshold": 10_000}):
        s = tflms.solve(g, full, ahead=1, groupby=0, sync_out=False, **kw)
        res = simulate(g, s)
        assert s.report["swapped"] == 0 and res.peak_bytes == full and res.time == pytest.approx(g.total_time)
        assert not any(o.op.startswith("swap") for o in s.ops)
    # n_tensors limits how many tensors move; more moved, lower peak
    peaks = []
    for n in (2, 6, -1):
        s = tflms.solve(g, full, threshold=0, ahead=1, groupby=0, sync_out=True, n_tensors=n)
        res = simulate(g, s)
        assert s.report["swapped"] == (n if n >= 0 else 16)  # threshold 0: every forward tensor
        assert sum(o.op == "swap_out" for o in s.ops) == s.report["swapped"]
        peaks.append(res.peak_bytes)
    assert peaks[0] > peaks[1] > peaks[2]
    # a fixed setting that does not fit is an error, not a schedule over budget
    with pytest.raises(InfeasibleBudgetError, match="no setting fits"):
        tflms.solve(g, 5, threshold=10_000)
    with pytest.raises(InvalidInputError):
        tflms.solve(g, full, threshold=-1)
    with pytest.raises(InvalidInputError, match="no-swap"):
        tflms.solve(g, full, swap=False)


def test_tflms_ahead_prefetches_earlier_and_sync_out_trades_time_for_memory():
    g = linear_chain(16, bandwidth=1)
    full = full_peak(g)
    late = simulate(g, tflms.solve(g, full, threshold=0, ahead=0, groupby=0, sync_out=False))
    early = simulate(g, tflms.solve(g, full, threshold=0, ahead=3, groupby=0, sync_out=False))
    assert early.time < late.time and early.peak_bytes > late.peak_bytes
    slow = random_layered(12, seed=0, bandwidth=0.3)
    fast_free = simulate(slow, tflms.solve(slow, 10_000, threshold=0, ahead=1, groupby=0, sync_out=False))
    sync_free = simulate(slow, tflms.solve(slow, 10_000, threshold=0, ahead=1, groupby=0, sync_out=True))
    assert sync_free.peak_bytes < fast_free.peak_bytes and sync_free.time > fast_free.time


def test_tflms_auto_tuning_swaps_more_as_the_budget_shrinks():
    g = linear_chain(32)
    full = full_peak(g)
    prev_threshold, prev_swapped = math.inf, -1
    for r in (1.0, 0.8, 0.5, 0.3, 0.2):
        budget = int(full * r)
        s = tflms.solve(g, budget)
        res = simulate(g, s)
        assert res.valid and res.peak_bytes <= budget
        rep = s.report
        assert rep["tuned"] == ["threshold", "ahead", "groupby", "sync_out"]
        assert rep["threshold"] <= prev_threshold and rep["swapped"] >= prev_swapped
        prev_threshold, prev_swapped = rep["threshold"], rep["swapped"]
    assert prev_swapped > 20
    with pytest.raises(InfeasibleBudgetError, match="no setting fits"):
        tflms.solve(g, 3)


def test_levels():
    g = linear_chain(4)
    assert tflms.levels(g) == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    g = unet(2)
    lv = tflms.levels(g)
    assert all(lv[b] > lv[a] for a, b in g.edges)


# ---- through the API: plan, JSON, sweep ----------------------------------------------------
def test_plan_and_sweep_include_dtr_and_tflms(tmp_path):
    import remat
    from remat.core.plan import load_plan
    from remat.planning import sweep
    g = linear_chain(16)
    for name in ("dtr", "tflms"):
        p = remat.plan(g, "0.5x", name)
        path = tmp_path / f"{name}.json"
        p.save(path)
        q = load_plan(path)
        res = q.simulate()
        assert res.valid and res.peak_bytes <= q.budget_bytes
        assert q.schedule.ops == p.schedule.ops
    full = full_peak(g)
    rows = list(sweep(g, [full, full // 2, 3], ALL_NAMES))
    assert [r["solver"] for r in rows[:len(ALL_NAMES)]] == ALL_NAMES
    by = {(r["budget_bytes"], r["solver"]): r for r in rows}
    assert all(by[(full, n)]["overhead"] == pytest.approx(1.0) for n in ALL_NAMES)
    assert all(by[(3, n)]["status"] == "infeasible" for n in ALL_NAMES)
    assert by[(full // 2, "dtr")]["status"] == "heuristic"
