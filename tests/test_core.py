"""Graph validation and JSON, schedules, and the simulator against hand-computed figures."""
from __future__ import annotations

import json

import pytest

from remat import Graph, InvalidInputError, Node, Op, Schedule, Stage, simulate
from remat.generators import linear_chain, random_layered, unet
from remat.budget import parse_budget
from remat.core.schedule import solve_r_opt
from remat.core.simulate import compute_seconds


def tiny() -> Graph:
    # a -> b -> c, a -> c ; sizes 2, 3, 1; times 1, 2, 4; b has 5 bytes of workspace
    nodes = [Node(0, "a", "forward", 1.0, 2), Node(1, "b", "forward", 2.0, 3, 5), Node(2, "c", "loss", 4.0, 1)]
    return Graph(nodes, [(0, 1), (1, 2), (0, 2)], fixed_bytes=10, meta={"bandwidth": 1.0})


# ---- graph ------------------------------------------------------------------------------------
def test_graph_json_round_trip_and_hash(tmp_path):
    g = random_layered(12, seed=3)
    p = tmp_path / "g.json"
    g.save(p)
    h = Graph.load(p)
    assert h.to_dict() == g.to_dict()
    assert h.content_hash() == g.content_hash()
    d = g.to_dict()
    d["nodes"][3]["bytes"] += 1
    assert Graph.from_dict(d).content_hash() != g.content_hash()
    d2 = g.to_dict()
    d2["meta"]["note"] = "meta does not change the hash"
    assert Graph.from_dict(d2).content_hash() == g.content_hash()


def test_generators_shapes():
    g = linear_chain(32)
    assert g.n == 65 and len(g.edges) == 31 + 1 + 1 + 31 + 32 + 31
    assert [v.kind for v in g.nodes].count("backward") == 32
    assert g.total_time == 32 * 1 + 1 + 32 * 2
    u = unet(2)
    # each decoder concat reads its encoder level: a long skip edge into a forward node
    names = {v.name: v.id for v in u.nodes}
    assert (names["enc0_conv0"], names["dec0_cat"]) in u.edges
    for e in (g, u, random_layered(30, seed=1)):
        assert all(a < b for a, b in e.edges)


def _mut(path, value):
    def f(d):
        obj = d
        for k in path[:-1]:
            obj = obj[k]
        obj[path[-1]] = value
        return d
    return f


@pytest.mark.parametrize("mutate, needle", [
    (_mut(["nodes", 1, "kind"], "sideways"), "graph.nodes[1] ('f1').kind: unknown kind"),
    (_mut(["nodes", 2, "time"], -1.0), "graph.nodes[2] ('f2').time"),
    (_mut(["nodes", 0, "bytes"], -5), "graph.nodes[0] ('f0').bytes"),
    (_mut(["nodes", 0, "bytes"], 1.5), "graph.nodes[0] ('f0').bytes"),
    (_mut(["edges", 0], [0, 99]), "names a missing node"),
    (lambda d: d["edges"].append([4, 1]) or d, "cycle"),
    (lambda d: d["edges"].append([2, 2]) or d, "self-loop"),
    (_mut(["format"], "other"), "graph.format"),
    (_mut(["version"], 7), "graph.version"),
    (lambda d: d.pop("nodes") and d, "graph.nodes: missing"),
    (lambda d: d["nodes"][0].pop("kind") and d, "graph.nodes[0].kind: missing"),
    (_mut(["edges", 0], "0-1"), "graph.edges[0]"),
    (lambda d: d["nodes"][1].update(recompute_time=2.0) or d, "graph.nodes[1].recompute_time: not in version 1"),
    (lambda d: d.update(version=4) or d["nodes"][1].update(recompute_time=0.5) or d,
     "graph.nodes[1] ('f1').recompute_time: must be a finite number >= its time"),
])
def test_malformed_graph_names_the_field(mutate, needle):
    d = mutate(linear_chain(3).to_dict())
    with pytest.raises(InvalidInputError) as e:
        Graph.from_dict(json.loads(json.dumps(d)))
    assert needle in str(e.value)


def test_recompute_times_price_later_computes_and_round_trip_as_version_4():
    g = linear_chain(3)  # unit times
    nodes = [Node(v.id, v.name, v.kind, v.time, v.bytes, recompute_time=3.0 if v.id == 0 else None) for v in g.nodes]
    cold = Graph(nodes, g.edges, g.fixed_bytes, g.meta)
    assert cold.recompute_times == [3.0] + g.times[1:]
    again = Graph.from_dict(json.loads(json.dumps(cold.to_dict())))
    assert cold.to_dict()["version"] == 4 and again.nodes[0].recompute_time == 3.0
    assert again.content_hash() == cold.content_hash() != g.content_hash()
    # node 0 computed twice: its first compute at 1 s, the second at 3 s
    ops = [Op("compute", 0, 0), Op("compute", 1, 1), Op("free", 0, 1), Op("compute", 0, 2), Op("free", 0, 2)]
    assert simulate(cold, ops).compute_time == 1 + 1 + 3
    assert simulate(g, ops).compute_time == 3
    assert compute_seconds(cold, ops) == 5


def test_backward_edge_without_cycle_asks_for_renumbering():
    nodes = [Node(0, "a", "forward", 1.0, 1), Node(1, "b", "forward", 1.0, 1)]
    with pytest.raises(InvalidInputError, match="topological order"):
        Graph(nodes, [(1, 0)])


def test_load_missing_and_invalid_json(tmp_path):
    with pytest.raises(InvalidInputError, match="does not exist"):
        Graph.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        Graph.load(tmp_path / "bad.json")


# ---- schedule ---------------------------------------------------------------------------------
def test_solve_r_opt_recomputes_what_the_next_stage_keeps():
    g = tiny()
    S = [set(), {0}, {1}]          # stage 2 needs a and b; only b is kept, so a is recomputed
    R = solve_r_opt(g, S)
    assert R == [{0}, {1}, {0, 2}]


def test_ops_from_stages_follow_the_contract():
    g = tiny()
    s = Schedule.from_sets(g, [set(), {0}, {0, 1}])
    ops = [(o.op, o.node, o.stage) for o in s.ops]
    # stage 0 computes a and keeps it; stage 1 computes b (a is kept into stage 2, so not freed)
    assert ops[:2] == [("compute", 0, 0), ("compute", 1, 1)]
    # stage 2: c runs, then its inputs a and b are released (last reader, not kept), then c
    assert ops[2:] == [("compute", 2, 2), ("free", 0, 2), ("free", 1, 2), ("free", 2, 2)]


# ---- simulator --------------------------------------------------------------------------------
def test_peak_counts_fixed_outputs_and_workspace():
    g = tiny()
    r = simulate(g, Schedule.from_sets(g, [set(), {0}, {0, 1}]), timeline=True)
    assert r.valid
    # while b runs: fixed 10 + a 2 + b 3 + workspace 5 = 20
    assert r.peak_bytes == 20 and r.activation_peak_bytes == 10
    assert r.time == 7.0 and r.compute_time == 7.0 and r.transfer_time == 0
    assert [t["device_bytes"] for t in r.timeline][:3] == [12, 20, 16]


def test_transfers_overlap_compute_and_swap_in_waits():
    g = tiny()
    ops = [Op("compute", 0), Op("swap_out", 0), Op("compute", 1), Op("wait", 0), Op("free", 0),
           Op("swap_in", 0), Op("compute", 2)]
    r = simulate(g, ops)
    assert r.valid, r.violation
    # a out: t=1..3 (2 bytes at 1 B/s) under b's compute (1..3); a in: 3..5; c waits, runs 5..9
    assert r.time == 9.0
    assert r.transfer_time == 4.0 and r.host_peak_bytes == 2
    # with a faster link the swap-in hides: 1+2 compute, in 3..3.2, c 3.2..7.2
    assert simulate(g, ops, bandwidth=10.0).time == pytest.approx(7.2)


@pytest.mark.parametrize("ops, needle", [
    ([Op("compute", 1)], "input 0 (a) of node 1 (b) is needed but it is not resident"),
    ([Op("compute", 0), Op("swap_out", 0), Op("wait", 0), Op("free", 0), Op("compute", 1)],
     "it is on the host"),
    ([Op("compute", 0), Op("swap_out", 0), Op("free", 0)], "while its transfer is in flight"),
    ([Op("compute", 0), Op("compute", 0)], "already resident"),
    ([Op("free", 0)], "not resident"),
    ([Op("swap_in", 0)], "no host copy"),
    ([Op("compute", 0), Op("wait", 0)], "has no transfer"),
    ([Op("compute", 0), Op("compute", 1)], "node 2 (c) (a loss node) is never computed"),
])
def test_violations_are_reported(ops, needle):
    r = simulate(tiny(), ops)
    assert not r.valid
    assert needle in str(r.violation)


def test_sim_state_one_op_at_a_time_is_the_simulator():
    # every replay that builds a schedule step by step (DTR, rotor, TFLMS, stage_order, viz) uses
    # SimState: op by op it says what simulate's timeline says, swaps included
    from remat.core.errors import InfeasibleBudgetError
    from remat.core.simulate import SimState
    from remat.solvers import get
    swaps = 0
    for g in (linear_chain(8), unet(3), random_layered(15, seed=1)):
        for solver, budget in (("checkpoint-all", None), ("lookahead", "0.6x"), ("tflms", "0.8x"), ("tflms", "0.6x")):
            try:
                sched = get(solver)(g, parse_budget(budget, g)) if budget else get(solver)(g)
            except InfeasibleBudgetError:
                continue
            swaps += any(op.op == "swap_out" for op in sched.ops)
            res = simulate(g, sched, timeline=True)
            state = SimState(g)
            for op, row in zip(sched.ops, res.timeline):
                assert state.apply(op) is None
                assert (state.during + g.fixed_bytes, state.live + g.fixed_bytes, state.host) == \
                    (row["device_bytes"], row["after_bytes"], row["host_bytes"])
                assert (state.last_start, state.last_end) == (row["start"], row["end"])
                assert sum(state.bytes_by_origin.values()) == state.live
            assert state.peak + g.fixed_bytes == res.peak_bytes
            assert max(state.clock, state.xclock) == res.time and state.host_peak == res.host_peak_bytes
    assert swaps >= 2


def test_sim_state_of_a_fragment_counts_what_it_adds_above_its_start():
    from remat.core.simulate import SimState
    g = tiny()
    # a resident (counted by the caller: live 0), b runs beside it: b 3 + workspace 5
    state = SimState(g, resident=[0], live_bytes=0)
    assert state.compute(1) is None and state.peak == 8 and state.live == 3
    assert state.free(0) is None and state.live == 1  # (a's bytes were the caller's)
    # counting the resident values themselves (the default), and a rule broken
    state = SimState(g, resident=[0])
    assert state.live == 2 and state.compute_peak(1) == 10
    assert "already resident" in state.compute(0)


def test_gradient_never_produced_is_named():
    g = linear_chain(2)
    ops = [Op("compute", i) for i in range(4)]
    r = simulate(g, ops)
    assert "a gradient" in str(r.violation) and "never computed" in str(r.violation)


def test_schedule_json_round_trip():
    g = random_layered(6, seed=2)
    from remat.solvers.baselines import checkpoint_all
    s = checkpoint_all(g)
    back = Schedule.from_dict(json.loads(json.dumps(s.to_dict())), g)
    assert back.ops == s.ops and back.stages == s.stages
    assert simulate(g, back).time == simulate(g, s).time


def test_stage_matrices():
    g = tiny()
    s = Schedule.from_stages(g, [Stage([0]), Stage([1], [0]), Stage([2], [0, 1])])
    R, S, SO, SI = s.matrices(g.n)
    assert R.tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    assert S.tolist() == [[0, 0, 0], [1, 0, 0], [1, 1, 0]]
    assert SO.sum() == 0 and SI.sum() == 0


@pytest.mark.parametrize("g", [linear_chain(16), unet(2), random_layered(12, seed=0)], ids=str)
def test_stages_from_dtr_ops_keep_its_time_and_fit(g):
    from remat.core.schedule import stages_from_ops
    from remat.solvers import get
    from remat.solvers.baselines import checkpoint_all
    full = simulate(g, checkpoint_all(g)).peak_bytes
    cast = 0
    for ratio in (0.9, 0.7, 0.5):
        budget = int(full * ratio)
        try:
            d = get("dtr-eq")(g, budget)
        except Exception:
            continue
        st = stages_from_ops(g, d.ops)
        assert st is not None
        staged = simulate(g, Schedule.from_stages(g, st))
        assert staged.valid and staged.peak_bytes <= budget
        assert staged.time == simulate(g, d).time
        cast += 1
    assert cast >= 1


def test_stages_from_ops_rejects_what_it_cannot_stage():
    from remat.core.schedule import stages_from_ops
    g = tiny()
    assert stages_from_ops(g, [Op("compute", 1), Op("compute", 0), Op("compute", 2)]) is None
    assert stages_from_ops(g, [Op("compute", 0), Op("swap_out", 0)]) is None


def test_the_storage_view_leaves_out_kernel_scratch_and_saved_generator_states():
    """A node's ``scratch_bytes`` (inside its workspace) and ``meta["rng_state_bytes"]`` (inside the
    fixed bytes) are bytes the allocator holds and no tensor storage shows: the plan's peak counts
    them, `Plan.storage_peak_bytes` (what the CPU's storage accounting is compared with) does not."""
    from remat.core.plan import Plan
    from remat.core.simulate import storage_view
    nodes = [Node(0, "f", "forward", 1.0, 100, 40, {"scratch_bytes": 30}), Node(1, "loss", "loss", 1.0, 10),
             Node(2, "b", "backward", 1.0, 0, 70, {"scratch_bytes": 70, "forward": 0})]
    g = Graph(nodes, [(0, 1), (1, 2), (0, 2)], fixed_bytes=1000, meta={"rng_state_bytes": 50})
    view = storage_view(g)
    assert [v.workspace_bytes for v in view.nodes] == [10, 0, 0] and view.fixed_bytes == 950
    sched = Schedule.keep_all(g)
    whole = simulate(g, sched).peak_bytes
    assert whole == 1000 + 100 + 10 + 70            # at the backward: f's output, the loss's, its workspace
    plan = Plan(g, sched, whole, {}, {"peak_bytes": whole})
    assert plan.storage_peak_bytes == 950 + 100 + 10 == simulate(view, sched).peak_bytes
    plain = Graph([Node(0, "f", "forward", 1.0, 100, 40), nodes[1]], [(0, 1)], fixed_bytes=5)
    assert storage_view(plain) is plain


# ---- the plain class: plans run as the model's own autograd -----------------------------------
def test_plain_obstacle_names_what_keeps_a_plan_from_running_as_plain_autograd():
    import remat as api
    from remat.core.plain import plain_obstacle, plain_prediction
    g = linear_chain(4)
    keep = api.plan(g, "1.0x", solver="checkpoint-all").schedule
    budget = api.plan(g, "1.0x", solver="checkpoint-all").predicted["peak_bytes"]
    assert "measured no plain step" in plain_obstacle(g, keep, budget)
    g.meta["input_shapes"] = [[8, 16]]
    g.meta["plain_step"] = {"peak_bytes": budget, "storage_peak_bytes": budget - 4, "input_shapes": [[8, 16]]}
    assert plain_obstacle(g, keep, budget) is None
    assert "over the budget" in plain_obstacle(g, keep, budget - 1)
    pred = plain_prediction(g, keep)
    assert (pred["peak_bytes"], pred["storage_peak_bytes"], pred["host_peak_bytes"]) == (budget, budget - 4, 0)
    assert pred["overhead"] == pytest.approx(1.0)
    last = api.plan(g, "1.0x", solver="checkpoint-last-node").schedule   # recomputes the chain
    assert plain_obstacle(g, last, budget).startswith("it recomputes")
    swapped = Schedule(keep.ops[:1] + [Op("swap_out", keep.ops[0].node)] + keep.ops[1:])
    assert plain_obstacle(g, swapped, budget).startswith("it swaps")
    g.meta["input_shapes"] = [[16, 16]]   # (a graph of a family scaled to another batch keeps the meta)
    assert "other input shapes" in plain_obstacle(g, keep, budget)
