"""Budgets, plans and their JSON format (planner/budget.py, planner/plan.py)."""
from __future__ import annotations

import copy
import json
import math

import pytest

import remat
from remat.budget import budget_list, format_bytes, parse_budget
from remat.core.errors import InfeasibleBudgetError, InvalidInputError
from remat.generators import linear_chain
from remat.core.plan import Plan
from remat.planning import SWEEP_COLUMNS, sweep


@pytest.fixture(scope="module")
def chain8():
    return linear_chain(8)  # checkpoint-all peak: 10 bytes


@pytest.fixture(scope="module")
def chain8_fixed():
    return linear_chain(8, fixed_bytes=3)  # checkpoint-all peak 13, smallest feasible 7


# ---- budgets -------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    (123, 123),
    ("123", 123),
    (" 42 ", 42),
    ("7B", 7),
    ("1KB", 1000),
    ("2MB", 2_000_000),
    ("3GB", 3_000_000_000),
    ("1TB", 10 ** 12),
    ("1KiB", 1024),
    ("512MiB", 512 * 2 ** 20),
    ("1.5GiB", 1_610_612_736),
    ("2TiB", 2 * 2 ** 40),
    ("1.5 kib", 1536),
    (".5KiB", 512),
    ("1.0", 1),
])
def test_parse_budget_absolute(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text, expected", [("0.5x", 5), ("1x", 10), ("1.0x", 10), ("0.29x", 2),
                                            ("0.3X", 3), ("2x", 20)])
def test_parse_budget_relative_to_checkpoint_all_peak(chain8, text, expected):
    assert parse_budget(text, chain8) == expected


def test_relative_budget_includes_fixed_bytes(chain8_fixed):
    assert parse_budget("1x", chain8_fixed) == 13
    assert parse_budget("0.5x", chain8_fixed) == 6


@pytest.mark.parametrize("bad", ["", "abc", "5Q", "-1", "1e3", "1.5", "0.1B", "0x", "x", "GiB",
                                 "1 2", True, None, 2.5, 0, -5])
def test_parse_budget_rejects(chain8, bad):
    with pytest.raises(InvalidInputError, match="--budget"):
        parse_budget(bad, chain8)


def test_parse_budget_error_names_forms():
    with pytest.raises(InvalidInputError) as e:
        parse_budget("lots")
    assert "--budget" in str(e.value) and "GiB" in str(e.value) and "0.5x" in str(e.value)


def test_relative_budget_needs_graph():
    with pytest.raises(InvalidInputError, match="needs a graph"):
        parse_budget("0.5x")


def test_budget_list(chain8):
    assert budget_list("0.2x:1.0x:9", chain8) == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert budget_list("1KB:2KB:3") == [1000, 1500, 2000]
    assert budget_list("0.5x:0.5x:1", chain8) == [5]
    assert budget_list("0.5x, 8,1KiB", chain8) == [5, 8, 1024]
    for bad in ["1:2", "0.2x:5:3", "1:2:x", "1:2:0", "1x,foo", ""]:
        with pytest.raises(InvalidInputError, match="--budgets"):
            budget_list(bad, chain8)


def test_format_bytes():
    assert format_bytes(10) == "10 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(5 * 2 ** 20) == "5.00 MiB"
    assert format_bytes(int(1.25 * 2 ** 30)) == "1.25 GiB"
    assert format_bytes(None) == "-"


# ---- plans ---------------------------------------------------------------------------
def _plan(graph, budget="1x", solver="checkpoint-all"):
    return remat.plan(graph, budget=budget, solver=solver)


def test_plan_fills_predicted_and_solver(chain8_fixed):
    p = _plan(chain8_fixed)
    assert p.budget_bytes == 13
    assert p.predicted["peak_bytes"] == 13
    assert p.predicted["fixed_bytes"] == 3
    assert p.predicted["activation_peak_bytes"] == 10
    assert p.predicted["time"] == pytest.approx(25.0)
    assert p.predicted["overhead"] == pytest.approx(1.0)
    assert p.predicted["compute_time"] == pytest.approx(25.0)
    assert p.predicted["transfer_time"] == 0
    assert p.predicted["host_peak_bytes"] == 0
    assert p.solver["name"] == "checkpoint-all" and p.solver["status"] == "heuristic"
    assert p.solver["objective"] == pytest.approx(25.0)
    assert {"lower_bound", "gap", "wall_time"} <= set(p.solver)
    assert p.fits and p.graph_hash == chain8_fixed.content_hash()


def test_plan_round_trip(tmp_path, chain8_fixed):
    p = _plan(chain8_fixed, budget="0.7x", solver="checkpoint-last-node")
    path = tmp_path / "plan.json"
    p.save(path)
    raw = json.loads(path.read_text())
    assert raw["format"] == "remat.plan" and raw["version"] == 1
    assert raw["graph"]["format"] == "remat.graph"
    assert raw["graph_hash"] == chain8_fixed.content_hash()
    assert set(raw["predicted"]) >= {"peak_bytes", "time", "overhead", "host_peak_bytes"}
    assert {"op", "node", "stage"} <= set(raw["schedule"]["ops"][0])
    q = remat.load_plan(path)
    assert q.schedule == p.schedule
    assert q.predicted == p.predicted
    assert q.solver == p.solver
    assert q.budget_bytes == p.budget_bytes == 9
    assert q.graph_hash == p.graph_hash
    assert q.to_dict() == raw


def test_plan_accepts_graph_path(tmp_path, chain8):
    chain8.save(tmp_path / "g.json")
    p = remat.plan(str(tmp_path / "g.json"), budget=10, solver="checkpoint-all")
    assert p.graph_hash == chain8.content_hash()


def test_plan_unknown_solver(chain8):
    with pytest.raises(InvalidInputError, match="unknown solver"):
        remat.plan(chain8, budget="1x", solver="no-such-solver")


def test_plan_bad_budget(chain8):
    with pytest.raises(InvalidInputError, match="--budget"):
        remat.plan(chain8, budget="lots", solver="checkpoint-all")


def _mutations():
    def set_(key, value):
        def f(d):
            d[key] = value
        return f

    def schedule_op(idx, **kw):
        def f(d):
            d["schedule"]["ops"][idx].update(kw)
        return f

    def drop(key):
        def f(d):
            del d[key]
        return f

    def tamper_graph(d):
        d["graph"]["nodes"][0]["bytes"] += 1

    def drop_compute(d):  # stage-free op list with a node never computed: invalid in the simulator
        d["schedule"].pop("stages", None)
        ops = d["schedule"]["ops"]
        last = max(i for i, o in enumerate(ops) if o["op"] == "compute")
        del ops[last]

    def swap_first_ops(d):  # compute 1 before compute 0: its input is not resident
        d["schedule"].pop("stages", None)
        ops = d["schedule"]["ops"]
        first = [i for i, o in enumerate(ops) if o["op"] == "compute"][:2]
        ops[first[0]], ops[first[1]] = ops[first[1]], ops[first[0]]

    def edit_ops_keep_stages(d):
        d["schedule"]["ops"].pop()

    return [
        ("wrong format", set_("format", "remat.graph"), "plan.format"),
        ("wrong version", set_("version", 2), "plan.version"),
        ("missing graph", drop("graph"), "plan.graph"),
        ("malformed graph", lambda d: d["graph"]["nodes"][1].update(kind="sideways"), "plan.graph.nodes[1]"),
        ("tampered graph", tamper_graph, "plan.graph_hash"),
        ("missing hash", drop("graph_hash"), "plan.graph_hash"),
        ("missing schedule", drop("schedule"), "plan.schedule"),
        ("unknown op kind", schedule_op(0, op="teleport"), "plan.schedule.ops[0].op"),
        ("node out of range", schedule_op(1, node=99), "plan.schedule.ops[1].node"),
        ("negative node", schedule_op(2, node=-1), "plan.schedule.ops[2].node"),
        ("bad budget", set_("budget_bytes", "lots"), "plan.budget_bytes"),
        ("missing solver", drop("solver"), "plan.solver"),
        ("solver without name", lambda d: d["solver"].pop("name"), "plan.solver.name"),
        ("missing predicted", drop("predicted"), "plan.predicted"),
        ("predicted without peak", lambda d: d["predicted"].pop("peak_bytes"), "plan.predicted.peak_bytes"),
        ("stages disagree with ops", edit_ops_keep_stages, "plan.schedule.stages"),
        ("node never computed", drop_compute, "plan.schedule"),
        ("input not resident", swap_first_ops, "plan.schedule"),
    ]


@pytest.mark.parametrize("case, mutate, field", _mutations(), ids=[m[0] for m in _mutations()])
def test_malformed_plan_names_field(tmp_path, chain8, case, mutate, field):
    good = _plan(chain8, budget="0.6x", solver="checkpoint-last-node").to_dict()
    bad = copy.deepcopy(good)
    mutate(bad)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(InvalidInputError) as e:
        remat.load_plan(path)
    assert str(e.value).startswith(field), str(e.value)


def test_tampered_graph_says_replan(chain8):
    d = _plan(chain8).to_dict()
    d["graph"]["edges"].append([2, 16])  # not an edge of the chain
    with pytest.raises(InvalidInputError, match="edited or belongs to another graph"):
        Plan.from_dict(d)


def test_invalid_schedule_reports_violation(chain8):
    d = _plan(chain8).to_dict()
    d["schedule"].pop("stages")
    d["schedule"]["ops"] = [o for o in d["schedule"]["ops"] if not (o["op"] == "compute" and o["node"] == 0)]
    with pytest.raises(InvalidInputError, match=r"plan\.schedule: the schedule is invalid.*input 0"):
        Plan.from_dict(d)


def test_load_plan_file_errors(tmp_path):
    with pytest.raises(InvalidInputError, match="does not exist"):
        remat.load_plan(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(InvalidInputError, match="not valid JSON"):
        remat.load_plan(tmp_path / "junk.json")


def test_jsonable_solver_report(tmp_path, chain8):
    import numpy as np
    p = _plan(chain8)
    p.solver.update(gap=float("inf"), lower_bound=np.float64(24.5), iterations=np.int64(7), obj=object())
    p.save(tmp_path / "p.json")
    q = remat.load_plan(tmp_path / "p.json")
    assert q.solver["gap"] is None and q.solver["lower_bound"] == 24.5 and q.solver["iterations"] == 7
    assert isinstance(q.solver["obj"], str)


# ---- infeasible budgets ----------------------------------------------------------------
def test_infeasible_budget_names_smallest_feasible(chain8_fixed):
    # 8 nodes of 1 byte plus 3 fixed: some schedule needs 7 bytes (the ILP finds and proves it)
    with pytest.raises(InfeasibleBudgetError) as e:
        remat.plan(chain8_fixed, budget=5, solver="checkpoint-all", time_limit=20)
    err = e.value
    assert err.budget_bytes == 5 and err.fixed_bytes == 3
    assert err.min_feasible_bytes is not None and 5 < err.min_feasible_bytes <= 7
    assert err.min_feasible_lower_bound is None or err.min_feasible_lower_bound <= err.min_feasible_bytes
    msg = str(err)
    assert "budget 5 B is below the smallest feasible budget" in msg
    assert f"A budget of {err.min_feasible_bytes} bytes or more fits." in msg and "--budget" not in msg
    assert err.cli_hint == f"Use --budget {err.min_feasible_bytes} or more."  # (what the command line adds)
    assert "3 B of it are fixed" in msg


def test_infeasible_ilp(chain8_fixed):
    with pytest.raises(InfeasibleBudgetError) as e:
        remat.plan(chain8_fixed, budget=4, solver="ilp", time_limit=20)
    assert e.value.min_feasible_bytes == 7
    assert "A budget of 7 bytes or more fits" in str(e.value)


def test_heuristic_infeasible_above_minimum_suggests_ilp(chain8_fixed):
    # checkpoint-all needs 13 bytes; 8 fits the ILP: the message says so instead of "below the minimum"
    with pytest.raises(InfeasibleBudgetError) as e:
        remat.plan(chain8_fixed, budget=8, solver="checkpoint-all", time_limit=20)
    assert "plan with the solver 'ilp'" in str(e.value) and "--solver" not in str(e.value)
    assert "--solver ilp" in e.value.cli_hint
    assert e.value.min_feasible_bytes <= 8


def test_explain_infeasible_falls_back_to_baselines(chain8_fixed, monkeypatch):
    import remat.solvers.ilp as ilp
    from remat.planning import explain_infeasible

    def broken(*a, **k):
        raise remat.SolverError("no incumbent")
    monkeypatch.setattr(ilp, "min_feasible_budget", broken)
    err = explain_infeasible(chain8_fixed, 2, "checkpoint-all",
                             InfeasibleBudgetError("x", 2, fixed_bytes=3))
    # checkpoint-last-node peaks at fixed 3 + 4; a backward node with its three inputs needs 3 + 4
    assert err.min_feasible_bytes == 7 and err.min_feasible_lower_bound == 7
    assert "found by checkpoint-last-node" in str(err) and "proven lower bound 7 B" in str(err)


def test_explain_infeasible_on_a_large_graph_keeps_to_its_time(monkeypatch):
    # a 401-node graph: Checkmate's model would take minutes to build, outside any time limit; the
    # smallest budget comes from DTR's replays instead, checked and bounded, within the limit
    import time

    import remat.solvers.ilp as ilp
    from remat.generators import random_layered
    from remat.planning import explain_infeasible

    def not_asked(*a, **k):
        raise AssertionError("the full model was built")
    monkeypatch.setattr(ilp, "min_feasible_budget", not_asked)
    g = random_layered(200, seed=0)
    t0 = time.perf_counter()
    err = explain_infeasible(g, 10, "dtr", InfeasibleBudgetError("x", 10), swap=False, time_limit=5)
    assert time.perf_counter() - t0 < 5.0
    found, bound = err.min_feasible_bytes, err.min_feasible_lower_bound
    assert bound <= found and remat.simulate(g, remat.solvers.get("dtr")(g, found)).peak_bytes <= found
    assert "below the smallest feasible budget" in str(err)


def test_a_graph_traced_on_a_cpu_is_planned_without_swap_unless_asked():
    # on a CPU the "host" is the same RAM: a swap saves nothing there
    g = linear_chain(8)  # a unit chain with a slow host link: at 0.4x the ILP swaps when it may
    cpu = remat.Graph(g.nodes, g.edges, g.fixed_bytes, {**g.meta, "device": "cpu"})

    def swaps(p):
        return sum(op.op == "swap_out" for op in p.schedule.ops)
    assert swaps(remat.plan(g, "0.4x", time_limit=20)) > 0  # (no device: as before, swap allowed)
    auto = remat.plan(cpu, "0.4x", time_limit=20)
    assert swaps(auto) == 0 and auto.solver["options"]["swap"] is False
    assert swaps(remat.plan(cpu, "0.4x", swap=True, time_limit=20)) > 0
    assert remat.plan(cpu, "0.6x", "tflms").solver["options"]["swap"] is True  # (it only swaps)


# ---- ILP through the API ---------------------------------------------------------------
def test_plan_with_ilp_round_trip(tmp_path, chain8_fixed):
    p = remat.plan(chain8_fixed, budget=7, solver="ilp", time_limit=30)
    assert p.predicted["peak_bytes"] <= 7
    assert p.solver["name"] == "ilp"
    assert p.solver["status"] in ("optimal", "feasible")
    assert p.solver["objective"] == pytest.approx(p.predicted["time"])  # promise 1
    if p.solver["status"] == "optimal":
        assert p.solver["lower_bound"] == pytest.approx(p.solver["objective"], rel=1e-6)
    p.save(tmp_path / "p.json")
    q = remat.load_plan(tmp_path / "p.json")
    assert q.schedule == p.schedule and q.predicted == p.predicted


# ---- sweep ---------------------------------------------------------------------------
def test_sweep_rows(chain8_fixed):
    rows = list(sweep(chain8_fixed, [5, 13], ["checkpoint-all", "checkpoint-last-node"]))
    assert [(r["budget_bytes"], r["solver"], r["status"]) for r in rows] == [
        (5, "checkpoint-all", "infeasible"), (5, "checkpoint-last-node", "infeasible"),
        (13, "checkpoint-all", "heuristic"), (13, "checkpoint-last-node", "heuristic")]
    assert all(set(r) == set(SWEEP_COLUMNS) for r in rows)
    assert rows[2]["peak_bytes"] == 13 and rows[2]["overhead"] == pytest.approx(1.0)
    assert rows[3]["peak_bytes"] == 7 and rows[3]["overhead"] > 1.0
    assert rows[0]["time"] is None and rows[0]["budget_ratio"] == pytest.approx(5 / 13)
    assert not math.isnan(rows[3]["wall_time"])


def test_import_is_light():
    import subprocess
    import sys
    code = ("import sys, remat; heavy = [m for m in sys.modules if m.split('.')[0] in "
            "('pulp', 'matplotlib', 'torch', 'tqdm')]; print(heavy); sys.exit(1 if heavy else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_sweep_records_solver_failures(chain8, monkeypatch, caplog):
    from remat.solvers import registry

    def broken(graph, budget_bytes, **options):
        raise RuntimeError("backend crashed")
    monkeypatch.setitem(registry._REGISTRY, "broken", broken)
    rows = list(sweep(chain8, [10], ["broken", "checkpoint-all"]))
    assert [r["status"] for r in rows] == ["error", "heuristic"]
    assert "backend crashed" in caplog.text


def test_sweep_records_solvers_that_do_not_apply():
    from remat.generators import unet
    from remat.planning import sweep
    g = unet(2)
    rows = list(sweep(g, [10**6], ["griewank", "checkpoint-all"]))
    assert [r["status"] for r in rows] == ["n/a", "heuristic"]


def test_bandwidth_option_is_the_plans_own():
    # the solver, the prediction and a re-simulation of the saved plan use one bandwidth
    import remat
    from remat.generators import linear_chain
    g = linear_chain(8, bandwidth=1.0)
    p = remat.plan(g, 6, solver="ilp", swap=True, bandwidth=4.0, time_limit=30)
    assert p.graph.bandwidth == 4.0 and p.graph_hash == g.content_hash()
    assert p.predicted["time"] == remat.simulate(p.graph, p.schedule).time == p.solver["objective"]
