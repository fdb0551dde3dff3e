"""Checkpoint-set baselines (checkpoint-all, checkpoint-last-node, Chen sqrt(n) and greedy, with
and without articulation points) and Griewank's revolve: validity in the simulator, budgets,
errors, and the numbers each strategy promises."""
from __future__ import annotations

import math

import pytest

from remat import InfeasibleBudgetError, InvalidInputError, simulate
from remat.generators import linear_chain, random_layered, unet
from remat.solvers import baselines, chen, griewank
from remat.solvers.registry import _REGISTRY

CHEN = {
    "chen-sqrtn": chen.chen_sqrtn,
    "chen-sqrtn-ap": chen.chen_sqrtn_ap,
    "chen-greedy": chen.chen_greedy,
    "chen-greedy-ap": chen.chen_greedy_ap,
}
FIXED = {
    "checkpoint-all": baselines.checkpoint_all,
    "checkpoint-last-node": baselines.checkpoint_last_node,
}
OURS = {**CHEN, "griewank": griewank.griewank}

CHAINS = [linear_chain(n) for n in (1, 2, 5, 16)] + [linear_chain(12, fixed_bytes=100, size=3)]
DAGS = [random_layered(n, seed=seed) for n, seed in ((12, 0), (20, 1), (16, 3))] + [unet(2), unet(3)]
GRAPHS = CHAINS + DAGS


def gid(g) -> str:
    return f"{g.meta['model']}+{g.fixed_bytes}"


def solvers_for(g) -> dict:
    out = {**FIXED, **CHEN}
    if g in CHAINS:
        out["griewank"] = griewank.griewank
    return out


def fwd_time(g) -> float:
    return sum(g.nodes[v].time for v in g.forward_ids())


def test_registered_under_their_names():
    for name, fn in OURS.items():  # (wrapped for graphs with parts, `remat.solvers.parts`, unless they plan them)
        assert getattr(_REGISTRY[name], "__wrapped__", _REGISTRY[name]) is fn


# ---- every baseline: valid, honest report, within its budget ---------------------------------
@pytest.mark.parametrize("g", GRAPHS, ids=gid)
def test_every_baseline_is_valid_and_reports_what_simulate_says(g):
    all_res = simulate(g, baselines.checkpoint_all(g))
    assert all_res.valid
    assert all_res.time == pytest.approx(g.total_time)
    for name, fn in solvers_for(g).items():
        sched = fn(g)
        res = simulate(g, sched)
        assert res.valid, (name, res.violation)
        assert sched.report["name"] == name
        assert sched.report["objective"] == pytest.approx(res.time)
        assert res.peak_bytes >= g.fixed_bytes
        # checkpoint-all never recomputes, so nothing is faster
        assert res.time >= all_res.time - 1e-9, name
        counts = res.compute_counts
        if name != "checkpoint-last-node":
            # the shared pipeline never recomputes the loss or a gradient (the executor cannot)
            assert all(counts[v.id] == 1 for v in g.nodes if v.kind != "forward"), name
        if name in OURS:
            assert sched.report["peak_bytes"] == res.peak_bytes
            # checkpoint-all has the largest peak of the checkpoint-set strategies.
            # (checkpoint-last-node is exempt: on DAGs it recomputes a node's whole ancestry, the
            # loss and gradients included, inside one stage, and on random_layered that peaks
            # above checkpoint-all, e.g. 102 vs 99 bytes on random_layered(20, seed=1).)
            assert res.peak_bytes <= all_res.peak_bytes, name


@pytest.mark.parametrize("g", GRAPHS, ids=gid)
def test_budget_is_respected_and_one_byte_less_is_infeasible(g):
    for name, fn in solvers_for(g).items():
        smallest = simulate(g, fn(g)).peak_bytes  # without a budget: the strategy's smallest peak
        sched = fn(g, smallest)
        assert simulate(g, sched).peak_bytes <= smallest, name
        with pytest.raises(InfeasibleBudgetError) as err:
            fn(g, smallest - 1)
        assert err.value.budget_bytes == smallest - 1
        if name in OURS:  # ours name the smallest budget they can meet
            assert err.value.min_feasible_bytes == smallest, name


@pytest.mark.parametrize("g", GRAPHS, ids=gid)
def test_one_byte_budget_is_infeasible_for_every_baseline(g):
    for name, fn in solvers_for(g).items():
        with pytest.raises(InfeasibleBudgetError):
            fn(g, 1)


@pytest.mark.parametrize("g", GRAPHS, ids=gid)
def test_sweeping_strategies_trade_memory_for_time(g):
    """With more budget a sweeping strategy is never slower, and the budget still holds."""
    names = ["chen-greedy", "chen-greedy-ap"] + (["griewank"] if g in CHAINS else [])
    all_peak = simulate(g, baselines.checkpoint_all(g)).peak_bytes
    for name in names:
        fn = OURS[name]
        tight = fn(g)
        tight_res = simulate(g, tight)
        mid_budget = (tight_res.peak_bytes + all_peak) // 2
        mid_res = simulate(g, fn(g, mid_budget))
        loose_res = simulate(g, fn(g, all_peak))
        assert mid_res.peak_bytes <= mid_budget
        assert loose_res.peak_bytes <= all_peak
        assert mid_res.time <= tight_res.time + 1e-9, name
        assert loose_res.time <= mid_res.time + 1e-9, name


# ---- Chen -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 7, 16])
def test_articulation_points_of_a_chain_are_all_forward_nodes(n):
    g = linear_chain(n)
    assert chen.articulation_points(g) == g.forward_ids()


@pytest.mark.parametrize("depth", [2, 3])
def test_articulation_points_of_a_unet_skip_nothing_inside_a_skip(depth):
    g = unet(depth)
    names = {v.name: v.id for v in g.nodes}
    first, cat, last = names["enc0_conv0"], names["dec0_cat"], g.forward_ids()[-1]
    ap = chen.articulation_points(g)
    # the outermost skip enc0_conv0 -> dec0_cat spans every node strictly between them
    assert ap == [first, cat, last]
    assert not set(ap) & set(range(first + 1, cat))


def test_greedy_rule_cuts_after_the_segment_budget():
    g = linear_chain(16)  # unit bytes: acc > 3 at every 4th node
    assert chen.greedy_checkpoints(g, g.forward_ids(), 3) == [3, 7, 11, 15]
    assert chen.greedy_checkpoints(g, g.forward_ids(), 0) == g.forward_ids()
    assert chen.greedy_checkpoints(g, g.forward_ids(), 16) == []
    assert chen.greedy_checkpoints(g, [5, 6], 3) == [5]  # only candidates can be cut
    budgets = chen.segment_budgets(random_layered(200, seed=0))
    assert budgets == sorted(budgets) and budgets[0] == 0
    assert len(budgets) <= chen.MAX_SEGMENT_BUDGETS + 1 + len(chen._SQRT_FACTORS)


def test_chen_sqrtn_on_a_chain_saves_memory_for_at_most_one_extra_forward():
    g = linear_chain(16)
    all_res = simulate(g, baselines.checkpoint_all(g))
    sched = chen.chen_sqrtn(g)
    res = simulate(g, sched)
    assert sched.report["checkpoints"] == [3, 7, 11, 15]
    assert res.peak_bytes < all_res.peak_bytes
    assert g.total_time < res.time <= g.total_time + fwd_time(g)


@pytest.mark.parametrize("g", [linear_chain(16), linear_chain(32), unet(3), random_layered(20, seed=1)],
                         ids=gid)
def test_chen_greedy_halfway_fits_and_beats_checkpoint_last_node(g):
    last = simulate(g, baselines.checkpoint_last_node(g))
    all_res = simulate(g, baselines.checkpoint_all(g))
    smallest = simulate(g, chen.chen_greedy(g)).peak_bytes  # the sweep's smallest peak
    budget = (smallest + all_res.peak_bytes) // 2
    sched = chen.chen_greedy(g, budget)
    res = simulate(g, sched)
    assert res.peak_bytes <= budget
    assert res.time <= last.time
    assert sched.report["segment_budget"] in chen.segment_budgets(g)
    # the pinned segment budget reproduces the chosen schedule
    again = simulate(g, chen.chen_greedy(g, budget, segment_budget=sched.report["segment_budget"]))
    assert (again.peak_bytes, again.time) == (res.peak_bytes, res.time)


def test_chen_greedy_without_budget_returns_its_smallest_peak():
    g = unet(3)
    best = simulate(g, chen.chen_greedy(g)).peak_bytes
    for b in chen.segment_budgets(g):
        assert simulate(g, chen.chen_greedy(g, segment_budget=b)).peak_bytes >= best


# ---- Griewank / revolve ----------------------------------------------------------------------
def test_revolve_dp_matches_the_closed_form():
    t, arg = griewank.revolve_table(40, 6)
    for l in range(1, 41):
        assert t[l][1] == l * (l - 1) // 2
        for s in range(1, 7):
            assert t[l][s] == griewank.binomial_cost(l, s), (l, s)
            if s >= l - 1:
                assert t[l][s] == max(0, l - 1), (l, s)
            if l >= 2 and s >= 2:
                assert griewank.best_split(l, s) == arg[l][s], (l, s)
    # a few values by hand: t(3,2) = 1 + t(2,1) + t(1,2) = 2; t(10,2): r = 3, 30 - C(5,3) = 20
    assert t[3][2] == 2 and t[10][2] == 20 and griewank.binomial_cost(10, 2) == 20


def test_snapshot_sets_use_at_most_s_slots():
    for l in range(1, 30):
        for s in range(1, 7):
            sets = griewank.snapshot_sets(l, s)
            assert all(0 in sets[i] and len(sets[i]) <= s for i in range(1, l + 1)), (l, s)
            assert all(max(sets[i]) < i for i in range(1, l + 1))


@pytest.mark.parametrize("l,s", [(1, 1), (2, 1), (5, 1), (5, 2), (8, 3), (13, 2), (20, 3), (20, 4),
                                 (32, 5), (10, 9), (10, 12)])
def test_griewank_recompute_count_is_what_revolve_predicts(l, s):
    # Revolve performs t(l, s) advances plus l recorded re-runs (one per reversed step).  In
    # Checkmate's model the backward of layer i reads x_i, which is already resident (it was an
    # input of layer i+1's backward, or of the loss), so no recorded re-run is needed and the
    # initial forward computation of x_l plays the role of the last one: forward nodes are
    # computed exactly t(l, s) + 1 times, i.e. compute_counts - l == t(l, s) - (l - 1).
    g = linear_chain(l)
    sched = griewank.griewank(g, snapshots=s)
    res = simulate(g, sched)
    assert res.valid
    forward = sum(res.compute_counts[v] for v in g.forward_ids())
    assert forward - l == griewank.binomial_cost(l, s) - (l - 1)
    assert all(res.compute_counts[v.id] == 1 for v in g.nodes if v.kind != "forward")
    assert sched.report["snapshots"] == s
    # time = one pass + the recomputed forward layers (unit forward time)
    assert res.time == pytest.approx(g.total_time + forward - l)


def test_griewank_more_snapshots_buy_time_with_memory():
    g = linear_chain(20)
    results = [simulate(g, griewank.griewank(g, snapshots=s)) for s in range(1, 20)]
    peaks = [r.peak_bytes for r in results]
    times = [r.time for r in results]
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]
    assert times == sorted(times, reverse=True) and times[-1] < times[0]
    assert times[-1] == pytest.approx(g.total_time)  # s = l-1 snapshots: no recomputation


def test_griewank_beats_chen_sqrtn_at_equal_peak_on_a_chain():
    g = linear_chain(32)
    sq = simulate(g, chen.chen_sqrtn(g))
    sched = griewank.griewank(g, sq.peak_bytes)
    gr = simulate(g, sched)
    assert gr.peak_bytes <= sq.peak_bytes
    assert gr.time < sq.time  # measured: 119 vs 122 at 13 bytes
    assert 1 <= sched.report["snapshots"] <= 32


@pytest.mark.parametrize("g", [unet(2), random_layered(12, seed=0)], ids=gid)
def test_griewank_rejects_a_non_chain(g):
    with pytest.raises(InvalidInputError, match="chain.*chen-greedy or ilp"):
        griewank.griewank(g)


def test_griewank_rejects_zero_snapshots():
    with pytest.raises(InvalidInputError, match="snapshots"):
        griewank.griewank(linear_chain(4), snapshots=0)


def test_snapshot_sweep_for_long_chains_is_thinned():
    assert griewank.snapshot_counts(10) == list(range(1, 11))
    counts = griewank.snapshot_counts(1000)
    assert counts[:16] == list(range(1, 17)) and counts[-1] == 1000
    assert len(counts) <= griewank.MAX_SWEEP + 2
    assert all(math.isfinite(c) for c in counts) and counts == sorted(set(counts))


def test_checkpoint_all_is_plain_autograds_schedule_and_keeping_every_forward_node():
    # Schedule.keep_all (each value from its compute to its last use) is the checkpoint pipeline
    # with every forward node a checkpoint, op for op and stage for stage
    from remat.core.schedule import Schedule
    graphs = ([linear_chain(n) for n in (1, 2, 7)] + [unet(d) for d in (1, 3)]
              + [random_layered(n, seed=s) for n in (12, 40) for s in range(3)])
    for g in graphs:
        keep = Schedule.keep_all(g)
        via_checkpoints = baselines.schedule_from_checkpoints(g, g.forward_ids())
        assert keep.ops == via_checkpoints.ops and keep.stages == via_checkpoints.stages, g.n
        assert baselines.checkpoint_all(g).ops == keep.ops
        res = simulate(g, keep)
        assert res.valid and sum(o.op == "compute" for o in keep.ops) == g.n   # nothing recomputed


def test_a_value_every_segment_reads_is_held_not_recomputed_per_stage():
    # a transformer's attention mask: made once at the start, read by every layer.  Checkpointing
    # every third layer holds it (rule 6 of schedule_from_checkpoints) and recomputes each other
    # forward node once for the backward, never once per stage of a later segment
    from remat.generators import from_forward
    n = 12
    edges = [(i, i + 1) for i in range(1, n)] + [(0, i) for i in range(1, n + 1)]
    g = from_forward([1.0] * (n + 1), [4] + [1] * n, edges)
    sched = baselines.schedule_from_checkpoints(g, [3, 6, 9])
    res = simulate(g, sched)
    counts = [sum(1 for o in sched.ops if o.op == "compute" and o.node == v) for v in g.forward_ids()]
    assert res.valid
    assert counts[0] == 1 and max(counts) <= 2, counts
    assert res.compute_time <= g.total_time + (n + 1)    # at most one forward pass more
