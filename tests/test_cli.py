"""The `remat` command line: output, files and exit codes (0 ok, 1 runtime failure, 2 bad input)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

import remat
from remat.cli import main
from remat.generators import linear_chain


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.fixture()
def graph_path(tmp_path):
    path = tmp_path / "chain8.json"
    linear_chain(8, fixed_bytes=3).save(path)  # checkpoint-all peak 13 B, smallest feasible 7 B
    return path


@pytest.fixture()
def plan_path(tmp_path, graph_path, capsys):
    path = tmp_path / "plan.json"
    code, out, _ = run(capsys, "plan", graph_path, "--budget", "1x", "--solver", "checkpoint-all", "-o", path)
    assert code == 0, out
    return path


# ---- help --------------------------------------------------------------------------
@pytest.mark.parametrize("sub", ["plan", "simulate", "sweep", "solvers", "generate", "generate chain"])
def test_help(capsys, sub):
    code, out, _ = run(capsys, *sub.split(), "--help")
    assert code == 0
    assert out.startswith(f"usage: remat {sub}")


def test_no_command_is_usage_error(capsys):
    code, _, err = run(capsys)
    assert code == 2 and err.startswith("remat: error:")


# ---- generate ------------------------------------------------------------------------
@pytest.mark.parametrize("argv, n", [(["chain", "--layers", "5"], 11), (["unet", "--depth", "2"], 23),
                                     (["random", "--nodes", "12", "--seed", "3"], 25)])
def test_generate(capsys, tmp_path, argv, n):
    path = tmp_path / "g.json"
    code, out, _ = run(capsys, "generate", *argv, "-o", path)
    assert code == 0 and "wrote" in out
    g = remat.Graph.load(path)
    assert g.n == n


def test_generate_bad_args(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "chain", "--layers", "0", "-o", tmp_path / "g.json")
    assert code == 2 and err.startswith("remat: error:") and "--layers" in err
    code, _, err = run(capsys, "generate", "chain", "-o", tmp_path / "no" / "such" / "dir.json")
    assert code == 2 and "does not exist" in err


# ---- plan ----------------------------------------------------------------------------
def test_plan_writes_plan(capsys, tmp_path, graph_path):
    out_path = tmp_path / "p.json"
    code, out, err = run(capsys, "plan", graph_path, "--budget", "0.6x", "--solver", "checkpoint-last-node",
                         "-o", out_path)
    assert code == 0, err
    p = remat.load_plan(out_path)
    assert p.budget_bytes == 7  # floor(0.6 * 13)
    assert p.predicted["peak_bytes"] == 7
    assert "checkpoint-last-node" in out and "heuristic" in out and "peak 7 B" in out
    assert "overhead" in out


def test_plan_with_ilp(capsys, tmp_path, graph_path):
    out_path = tmp_path / "p.json"
    code, out, err = run(capsys, "plan", graph_path, "--budget", "7", "--time-limit", "30", "--no-swap",
                         "-o", out_path)
    assert code == 0, err
    p = remat.load_plan(out_path)
    assert p.solver["name"] == "ilp" and p.predicted["peak_bytes"] <= 7
    assert "lower bound" in out and "gap" in out


def test_plan_infeasible_exits_1_and_names_smallest_budget(capsys, tmp_path, graph_path):
    code, out, err = run(capsys, "plan", graph_path, "--budget", "5", "--time-limit", "20",
                         "-o", tmp_path / "p.json")
    assert code == 1
    assert err.startswith("remat: error: budget 5 B is below the smallest feasible budget")
    assert "Use --budget 7 or more" in err
    assert err.count("\n") == 1  # one line
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--budget", "lots"], "--budget"),
    (["--budget", "1x", "--solver", "nope"], "unknown solver"),
    (["--budget", "1x", "--backend", "gurobi"], "--backend"),
    (["--budget", "1x", "--time-limit", "-3"], "--time-limit"),
    (["--budget", "1x", "--time-limit", "0"], "--time-limit"),
    (["--budget", "1x", "--gap", "x"], "--gap"),
    ([], "--budget"),
])
def test_plan_bad_input_exits_2(capsys, tmp_path, graph_path, argv, needle):
    code, _, err = run(capsys, "plan", graph_path, *argv, "-o", tmp_path / "p.json")
    assert code == 2
    assert err.startswith("remat: error:") and needle in err


def test_plan_missing_or_malformed_graph_exits_2(capsys, tmp_path):
    code, _, err = run(capsys, "plan", tmp_path / "missing.json", "--budget", "1x", "-o", tmp_path / "p.json")
    assert code == 2 and "does not exist" in err
    bad = tmp_path / "bad.json"
    d = linear_chain(3).to_dict()
    d["nodes"][2]["bytes"] = -1
    bad.write_text(json.dumps(d))
    code, _, err = run(capsys, "plan", bad, "--budget", "1x", "-o", tmp_path / "p.json")
    assert code == 2 and "graph.nodes[2]" in err and "bytes" in err


# ---- simulate --------------------------------------------------------------------------
def test_simulate(capsys, plan_path):
    code, out, err = run(capsys, "simulate", plan_path)
    assert code == 0, err
    assert "peak       13 B" in out
    assert "fixed 3 B, activations 10 B, host 0 B" in out
    assert "overhead 1.000x" in out
    assert "fits yes" in out


def _swap_plan() -> remat.Plan:
    """Checkpoint-all on a 3-layer chain, with node 0 swapped out after compute 1 and back in
    before the backward pass: a bare op list with two transfers of 1 byte each."""
    from remat.core.plan import predicted_from
    from remat.core.schedule import Op
    g = linear_chain(3, bandwidth=1.0)
    base = remat.plan(g, budget="1x", solver="checkpoint-all")
    ops = []
    for o in base.schedule.ops:
        if (o.op, o.node) == ("compute", 5):  # grad_f1 reads node 0
            ops += [Op("swap_in", 0), Op("wait", 0)]
        ops.append(Op(o.op, o.node))
        if (o.op, o.node) == ("compute", 1):
            ops += [Op("swap_out", 0), Op("wait", 0), Op("free", 0)]
    sched = remat.Schedule(ops)
    res = remat.simulate(g, sched)
    assert res.valid, res.violation
    return remat.Plan(g, sched, res.peak_bytes, dict(base.solver), predicted_from(g, res))


def test_simulate_bandwidth_changes_swap_time(capsys, tmp_path):
    p = _swap_plan()
    assert p.predicted["transfer_time"] == pytest.approx(2.0)
    p.save(tmp_path / "swap.json")
    assert remat.load_plan(tmp_path / "swap.json").schedule.ops == p.schedule.ops
    code, out1, _ = run(capsys, "simulate", tmp_path / "swap.json")
    code2, out2, _ = run(capsys, "simulate", tmp_path / "swap.json", "--bandwidth", "0.01")
    assert code == code2 == 0
    assert "swap-outs 1" in out1 and "host 1 B" in out1
    assert "transfers 2 s" in out1 and "transfers 200 s" in out2


def test_simulate_over_budget_exits_1(capsys, tmp_path, plan_path):
    d = json.loads(plan_path.read_text())
    d["budget_bytes"] = 8
    path = tmp_path / "tight.json"
    path.write_text(json.dumps(d))
    code, out, err = run(capsys, "simulate", path)
    assert code == 1
    assert "fits NO" in out and "over its budget" in err


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d.update(version=9), "plan.version"),
    (lambda d: d["graph"]["nodes"][0].update(time=5.0), "plan.graph_hash"),
    (lambda d: d["schedule"]["ops"][0].update(op="jump"), "plan.schedule.ops[0].op"),
])
def test_simulate_malformed_plan_exits_2(capsys, tmp_path, plan_path, edit, needle):
    d = json.loads(plan_path.read_text())
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    code, _, err = run(capsys, "simulate", path)
    assert code == 2 and err.startswith(f"remat: error: {needle}")


def test_simulate_a_graph_file_exits_2(capsys, graph_path):
    code, _, err = run(capsys, "simulate", graph_path)
    assert code == 2 and "plan.format" in err


def test_bad_bandwidth(capsys, plan_path):
    code, _, err = run(capsys, "simulate", plan_path, "--bandwidth", "0")
    assert code == 2 and "--bandwidth" in err


# ---- sweep -----------------------------------------------------------------------------
def test_sweep_writes_csv(capsys, tmp_path, graph_path):
    out_path = tmp_path / "sweep.csv"
    code, out, err = run(capsys, "sweep", graph_path, "--budgets", "0.5x:1.0x:3",
                         "--solvers", "checkpoint-all,checkpoint-last-node", "--no-progress", "-o", out_path)
    assert code == 0, err
    rows = list(csv.DictReader(out_path.open()))
    assert list(rows[0]) == ["budget_bytes", "budget_ratio", "solver", "status", "time", "overhead",
                             "peak_bytes", "lower_bound", "gap", "wall_time"]
    # budgets floor(0.5*13)=6, floor(0.75*13)=9, 13
    got = [(int(r["budget_bytes"]), r["solver"], r["status"], r["peak_bytes"]) for r in rows]
    assert got == [
        (6, "checkpoint-all", "infeasible", ""), (6, "checkpoint-last-node", "infeasible", ""),
        (9, "checkpoint-all", "infeasible", ""), (9, "checkpoint-last-node", "heuristic", "7"),
        (13, "checkpoint-all", "heuristic", "13"), (13, "checkpoint-last-node", "heuristic", "7")]
    assert float(rows[4]["overhead"]) == pytest.approx(1.0)
    assert float(rows[4]["budget_ratio"]) == pytest.approx(1.0)
    assert "6 rows (3 solved, 3 infeasible)" in out


def test_sweep_with_ilp_and_progress_bar(capsys, tmp_path, graph_path):
    out_path = tmp_path / "sweep.csv"
    code, out, err = run(capsys, "sweep", graph_path, "--budgets", "5,7,13", "--solvers", "ilp,checkpoint-all",
                         "--time-limit", "20", "-o", out_path)
    assert code == 0, err
    assert "6/6" in err  # tqdm on stderr
    rows = list(csv.DictReader(out_path.open()))
    by = {(int(r["budget_bytes"]), r["solver"]): r for r in rows}
    assert len(rows) == 6
    assert by[(5, "ilp")]["status"] == "infeasible"
    assert by[(7, "ilp")]["status"] in ("optimal", "feasible") and int(by[(7, "ilp")]["peak_bytes"]) <= 7
    assert by[(7, "checkpoint-all")]["status"] == "infeasible"
    assert by[(13, "ilp")]["status"] == "optimal"
    assert float(by[(13, "ilp")]["overhead"]) == pytest.approx(1.0)


@pytest.mark.parametrize("argv, needle", [
    (["--budgets", "1:2", "--solvers", "checkpoint-all"], "--budgets"),
    (["--budgets", "1x", "--solvers", "checkpoint-all,bogus"], "--solvers"),
])
def test_sweep_bad_input_exits_2(capsys, tmp_path, graph_path, argv, needle):
    code, _, err = run(capsys, "sweep", graph_path, *argv, "-o", tmp_path / "s.csv")
    assert code == 2 and needle in err
    assert not (tmp_path / "s.csv").exists()


# ---- solvers ---------------------------------------------------------------------------
def test_solvers_lists_registry(capsys):
    code, out, _ = run(capsys, "solvers")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()]
    assert names == remat.solvers.names()
    assert "checkpoint-all" in names and "ilp" in names
    assert all(len(line.split(None, 1)) == 2 for line in out.splitlines())  # each has a description


# ---- as a process: exit codes and no tracebacks ------------------------------------------
def _proc(*argv):
    return subprocess.run([sys.executable, "-m", "remat.cli", *map(str, argv)], capture_output=True, text=True,
                          timeout=120)


def test_process_exit_codes(tmp_path, graph_path):
    ok = _proc("plan", graph_path, "--budget", "1x", "--solver", "checkpoint-all", "-o", tmp_path / "p.json")
    assert ok.returncode == 0, ok.stderr
    bad = _proc("plan", graph_path, "--budget", "1.5", "-o", tmp_path / "p.json")
    assert bad.returncode == 2 and bad.stderr.startswith("remat: error: --budget")
    infeasible = _proc("plan", graph_path, "--budget", "2", "--solver", "checkpoint-all", "--time-limit", "20",
                       "-o", tmp_path / "q.json")
    assert infeasible.returncode == 1 and "smallest feasible budget" in infeasible.stderr
    for r in (ok, bad, infeasible):
        assert "Traceback" not in r.stderr


def test_debug_shows_traceback(tmp_path):
    r = _proc("--debug", "plan", tmp_path / "missing.json", "--budget", "1", "-o", tmp_path / "p.json")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_plan_of_a_cpu_graph_swaps_only_with_swap(capsys, tmp_path):
    g = linear_chain(8)
    path = tmp_path / "cpu.json"
    remat.Graph(g.nodes, g.edges, g.fixed_bytes, {**g.meta, "device": "cpu"}).save(path)
    swaps = {}
    for flag in ("", "--swap", "--no-swap"):
        out = tmp_path / f"p{flag}.json"
        code, _, err = run(capsys, "plan", path, "--budget", "0.4x", "--time-limit", "20", *([flag] if flag else []),
                           "-o", out)
        assert code == 0, err
        swaps[flag] = sum(op.op == "swap_out" for op in remat.load_plan(out).schedule.ops)
    assert swaps[""] == 0 == swaps["--no-swap"] and swaps["--swap"] > 0
    code, _, err = run(capsys, "plan", path, "--budget", "0.4x", "--swap", "--no-swap", "-o", tmp_path / "x.json")
    assert code == 2 and "not allowed with" in err
