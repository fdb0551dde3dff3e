"""remat.viz and `remat show` / `remat sweep --plot`: what each figure draws for a known plan,
that files are written, that bad input gets the loader's error; and the notebooks execute."""
from __future__ import annotations

import csv
import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import remat
from remat.cli import main
from remat.generators import linear_chain
from remat.core.schedule import Schedule, Stage

viz = pytest.importorskip("remat.viz")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
BLUE, VERMILLION = viz.COLORS["kept"], viz.COLORS["recomputed"]


# ---- a plan whose every entry is known ---------------------------------------------------
def known_graph() -> remat.Graph:
    """linear_chain(3) (f0 f1 f2 loss g2 g1 g0), 3 fixed bytes, 2 workspace bytes and 1
    persistent byte (a parameter gradient) on g2 (node 4)."""
    g = linear_chain(3, fixed_bytes=3)
    nodes = [dataclasses.replace(v, workspace_bytes=2, persistent_bytes=1) if v.id == 4 else v for v in g.nodes]
    return remat.Graph(nodes, g.edges, g.fixed_bytes, g.meta)


# stage t computes node t; f0 is swapped out in stage 1 and back in during stage 3; f1 is freed
# after stage 2 and recomputed in stage 4 for g2
KNOWN_STAGES = [
    Stage([0]),
    Stage([1], keep=[0], swap_out=[0]),
    Stage([2], keep=[1]),
    Stage([3], keep=[2], swap_in=[0]),
    Stage([1, 4], keep=[0, 2, 3]),
    Stage([5], keep=[0, 1, 4]),
    Stage([6], keep=[0, 5]),
]


@pytest.fixture()
def known():
    g = known_graph()
    sched = Schedule.from_stages(g, KNOWN_STAGES)
    res = remat.simulate(g, sched)
    assert res.valid, res.violation
    return g, sched


@pytest.fixture()
def known_plan(known):
    g, sched = known
    res = remat.simulate(g, sched)
    from remat.core.plan import predicted_from
    return remat.Plan(g, sched, budget_bytes=res.peak_bytes + 1, solver={"name": "hand", "status": "heuristic"},
                      predicted=predicted_from(g, res))


def by_gid(fig, gid):
    found = fig.findobj(lambda a: a.get_gid() == gid)
    assert len(found) == 1, f"{len(found)} artists with gid {gid!r}"
    return found[0]


def png_ok(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    import matplotlib.image
    h, w = matplotlib.image.imread(path).shape[:2]
    assert h > 300 and w > 300


# ---- memory breakdown ----------------------------------------------------------------------
def test_memory_breakdown_categories(known):
    g, sched = known
    mb = viz.memory_breakdown(g, sched)
    ops = [(o.op, o.node, o.stage) for o in sched.ops]
    k = ops.index(("compute", 4, 4))  # g2: f0 swapped in, f1 recomputed, f2 loss g2 kept, workspace
    assert {c: int(mb.during[c][k]) for c in viz.CATEGORIES} == {
        "fixed": 3, "gradients": 0, "kept": 3, "recomputed": 1, "swapped in": 1, "workspace": 2}
    assert mb.after["workspace"][k] == 0
    # g2's persistent byte counts from the next compute on (g1's), to the end
    k5 = ops.index(("compute", 5, 5))
    assert list(mb.after["gradients"][:k5]) == [0] * k5 and set(mb.during["gradients"][k5:]) == {1}
    assert mb.peak_bytes == remat.simulate(g, sched).peak_bytes == int(mb.device_bytes.max())
    assert mb.recomputed_nodes == {1}
    assert int(mb.first_compute.sum()) == 7
    # host bytes: f0's copy from its swap-out on
    assert mb.host[ops.index(("swap_out", 0, 1))] == 1 and mb.host[-1] == 1


def test_memory_breakdown_rejects_invalid_schedule():
    g = linear_chain(3)
    with pytest.raises(remat.InvalidInputError, match="invalid"):
        viz.memory_breakdown(g, [remat.Op("compute", 1)])


# ---- matrices ------------------------------------------------------------------------------
def test_matrices_one_cell_per_entry(known, tmp_path):
    g, sched = known
    fig = viz.plot_matrices(g, sched)
    R = by_gid(fig, "R")
    assert len(R.get_paths()) == sum(len(s.compute) for s in sched.stages) == 8
    colors = [tuple(c) for c in R.get_facecolors()]
    import matplotlib.colors as mc
    assert colors.count(mc.to_rgba(BLUE)) == 7 and colors.count(mc.to_rgba(VERMILLION)) == 1
    assert len(by_gid(fig, "S").get_paths()) == sum(len(s.keep) for s in sched.stages) == 11
    assert len(by_gid(fig, "SO").get_paths()) == 1
    assert len(by_gid(fig, "SI").get_paths()) == 1
    # the recomputation of f1 is drawn in row 4, column 1
    verts = R.get_paths()[[i for i, c in enumerate(colors) if c == mc.to_rgba(VERMILLION)][0]].vertices
    assert verts[:4].mean(axis=0) == pytest.approx([1.0, 4.0])
    fig.savefig(tmp_path / "m.png")
    png_ok(tmp_path / "m.png")


def test_matrices_of_a_bare_op_list(known):
    g, sched = known
    bare = Schedule(list(sched.ops))  # stages None: one row per compute op
    fig = viz.plot_matrices(g, bare)
    assert len(by_gid(fig, "R").get_paths()) == 8
    assert len(by_gid(fig, "SO").get_paths()) == 1 and len(by_gid(fig, "SI").get_paths()) == 1
    assert any("compute op" in ax.get_ylabel() for ax in fig.axes)


def test_matrices_need_a_schedule():
    with pytest.raises(remat.InvalidInputError, match="schedule"):
        viz.plot_matrices(linear_chain(2))


# ---- memory --------------------------------------------------------------------------------
@pytest.mark.parametrize("x", ["time", "op"])
def test_memory_plot_artists(known_plan, tmp_path, x):
    fig = viz.plot_memory(known_plan, x=x)
    for gid in viz.CATEGORIES:  # every category occurs in this plan
        by_gid(fig, gid)
    counts = {key: len(by_gid(fig, key).get_paths()) for key in ("compute", "recompute", "swap out", "swap in")}
    assert counts == {"compute": 7, "recompute": 1, "swap out": 1, "swap in": 1}
    texts = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
    assert f"budget {known_plan.budget_bytes} B" in texts
    assert any(t.startswith("peak ") for t in texts)
    labels = [ax.get_xlabel() for ax in fig.axes] + [ax.get_ylabel() for ax in fig.axes]
    assert "device memory (B)" in labels
    assert any(("simulated time (s)" if x == "time" else "op index") in lab for lab in labels)
    fig.savefig(tmp_path / "mem.png")
    png_ok(tmp_path / "mem.png")


def test_memory_plot_top_equals_peak(known_plan):
    """The stacked areas reach the simulated peak exactly (x=op: one column per op)."""
    fig = viz.plot_memory(known_plan, x="op")
    top = max(p.get_paths()[0].vertices[:, 1].max() for p in fig.findobj(lambda a: a.get_gid() in viz.CATEGORIES))
    assert top == known_plan.predicted["peak_bytes"]


def test_units_by_magnitude():
    assert viz.byte_unit(13) == (1.0, "B")  # synthetic graphs
    assert viz.byte_unit(5000)[1] == "B" and viz.byte_unit(50_000)[1] == "KiB"
    assert viz.byte_unit(7 * 1024 ** 2) == (1024.0 ** 2, "MiB")
    assert viz.byte_unit(3 * 1024 ** 3)[1] == "GiB"
    assert viz.time_unit(120.0)[1] == "s" and viz.time_unit(0.25)[1] == "ms"


def test_plot_plan_both(known_plan, tmp_path):
    fig = viz.plot_plan(known_plan, "both")
    by_gid(fig, "R")
    by_gid(fig, "compute")
    with pytest.raises(remat.InvalidInputError, match="--kind"):
        viz.plot_plan(known_plan, "pie")


def test_plot_functions_leave_pyplot_alone(known_plan):
    import matplotlib.pyplot as plt
    before = plt.get_fignums()
    viz.plot_plan(known_plan)
    viz.plot_sweep(SWEEP_ROWS)
    assert plt.get_fignums() == before


# ---- sweep ---------------------------------------------------------------------------------
def _row(b, solver, status, overhead=None, lb=None):
    return {"budget_bytes": b, "budget_ratio": b / 10, "solver": solver, "status": status,
            "time": None if overhead is None else overhead * 20.0, "overhead": overhead,
            "peak_bytes": None if overhead is None else b, "lower_bound": lb, "gap": None, "wall_time": 0.1}


SWEEP_ROWS = [
    _row(2, "ilp", "infeasible"), _row(2, "chen", "infeasible"),
    _row(4, "ilp", "feasible", 1.5, lb=24.0), _row(4, "chen", "infeasible"),
    _row(6, "ilp", "optimal", 1.2, lb=24.0), _row(6, "chen", "heuristic", 1.4),
    _row(10, "ilp", "optimal", 1.0, lb=20.0), _row(10, "chen", "heuristic", 1.0),
]


def test_sweep_plot_curves_bound_and_infeasible_region(tmp_path):
    fig = viz.plot_sweep(SWEEP_ROWS)
    ilp = by_gid(fig, "overhead:ilp")
    assert list(ilp.get_xdata()) == [0.4, 0.6, 1.0] and list(ilp.get_ydata()) == [1.5, 1.2, 1.0]
    assert list(by_gid(fig, "overhead:chen").get_xdata()) == [0.6, 1.0]
    bound = by_gid(fig, "bound")  # lower_bound / no-recompute time (20 s, read off time / overhead)
    assert list(bound.get_ydata()) == [1.2, 1.2, 1.0] and bound.get_linestyle() == "--"
    shade = by_gid(fig, "infeasible")  # up to the largest budget where every solver failed
    xy = shade.get_xy()  # axvspan: a Rectangle (matplotlib >= 3.9) or a Polygon, x in data units
    right = shade.get_x() + shade.get_width() if isinstance(xy, tuple) else max(xy[:, 0])
    assert right == pytest.approx(0.2)
    ax = fig.axes[0]
    assert "budget" in ax.get_xlabel() and "overhead" in ax.get_ylabel()
    fig.savefig(tmp_path / "s.png")
    png_ok(tmp_path / "s.png")


def test_sweep_plot_of_several_sweeps():
    fig = viz.plot_sweep({"swap": SWEEP_ROWS, "no swap": SWEEP_ROWS[:4]})
    by_gid(fig, "overhead:swap: ilp")
    by_gid(fig, "overhead:no swap: ilp")
    by_gid(fig, "bound:swap")


def test_sweep_csv_round_trip(tmp_path):
    from remat.planning import SWEEP_COLUMNS
    path = tmp_path / "s.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(SWEEP_COLUMNS))
        w.writeheader()
        for r in SWEEP_ROWS:
            w.writerow({k: "" if r[k] is None else r[k] for k in SWEEP_COLUMNS})
    assert viz.read_sweep_csv(path) == SWEEP_ROWS
    fig = viz.plot_sweep(path)
    assert list(by_gid(fig, "overhead:ilp").get_ydata()) == [1.5, 1.2, 1.0]
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(remat.InvalidInputError, match="missing columns"):
        viz.read_sweep_csv(tmp_path / "bad.csv")


# ---- CLI -----------------------------------------------------------------------------------
def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.mark.parametrize("kind", ["matrices", "memory", "both"])
def test_show_writes_png(capsys, tmp_path, known_plan, kind):
    known_plan.save(tmp_path / "plan.json")
    code, out, err = run(capsys, "show", tmp_path / "plan.json", "-o", tmp_path / "p.png", "--kind", kind,
                         "--dpi", 80)
    assert code == 0, err
    assert "wrote" in out
    png_ok(tmp_path / "p.png")


def test_show_malformed_plan_gives_the_loaders_error(capsys, tmp_path, known_plan):
    d = known_plan.to_dict()
    d["schedule"]["ops"][2]["node"] = 99
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(remat.InvalidInputError) as loader:
        remat.load_plan(bad)
    code, out, err = run(capsys, "show", bad, "-o", tmp_path / "p.png")
    assert code == 2
    assert err.strip() == f"remat: error: {loader.value}"
    assert "plan.schedule.ops[2].node" in err
    assert not (tmp_path / "p.png").exists()


def test_show_bad_output(capsys, tmp_path, known_plan):
    known_plan.save(tmp_path / "plan.json")
    code, _, err = run(capsys, "show", tmp_path / "plan.json", "-o", tmp_path / "p.nope")
    assert code == 2 and "image format" in err
    code, _, err = run(capsys, "show", tmp_path / "plan.json", "-o", tmp_path / "no" / "p.png")
    assert code == 2 and "does not exist" in err
    code, _, err = run(capsys, "show", tmp_path / "missing.json", "-o", tmp_path / "p.png")
    assert code == 2 and "does not exist" in err


def test_sweep_plot_option(capsys, tmp_path):
    linear_chain(8, fixed_bytes=3).save(tmp_path / "g.json")
    code, out, err = run(capsys, "sweep", tmp_path / "g.json", "--budgets", "0.3x:1x:4",
                         "--solvers", "checkpoint-all,chen-greedy,griewank", "--no-progress",
                         "-o", tmp_path / "s.csv", "--plot", tmp_path / "s.png")
    assert code == 0, err
    png_ok(tmp_path / "s.png")
    # a bad --plot path fails before any solving
    code, out, err = run(capsys, "sweep", tmp_path / "g.json", "--budgets", "0.3x:1x:4", "--no-progress",
                         "-o", tmp_path / "s2.csv", "--plot", tmp_path / "no" / "s.png")
    assert code == 2 and "--plot" in err and not (tmp_path / "s2.csv").exists()


def test_import_remat_stays_light():
    code = "import remat, remat.cli, sys; assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- notebooks -----------------------------------------------------------------------------
def test_notebooks_are_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    assert NOTEBOOKS, "no notebooks found"
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: strip the outputs"


def _missing_requirements(nb) -> list[str]:
    """Dotted names in the notebook's metadata ``remat.requires`` that do not exist yet
    (``remat.trace``: module remat, attribute trace; or a module)."""
    missing = []
    for name in nb.metadata.get("remat", {}).get("requires", []):
        mod, _, attr = name.rpartition(".")
        try:
            importlib.import_module(name)
            continue
        except ImportError:
            pass
        try:
            if mod and hasattr(importlib.import_module(mod), attr):
                continue
        except ImportError:
            pass
        missing.append(name)
    return missing


@pytest.mark.notebooks
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    missing = _missing_requirements(nb)
    if missing:
        pytest.skip(f"{path.name} needs {', '.join(missing)}, not built yet")
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    images = sum("image/png" in out.get("data", {}) for cell in nb.cells if cell.cell_type == "code"
                 for out in cell.outputs)
    assert images >= 1, f"{path.name} drew no figure"


def test_memory_axis_zooms_when_fixed_bytes_dominate(known):
    g, sched = known
    big = remat.Graph(g.nodes, g.edges, 100, g.meta)  # 100 fixed bytes against at most 7 of the rest
    fig = viz.plot_memory(big, sched)
    ax = fig.axes[0]
    assert 90 < ax.get_ylim()[0] < 100 and "axis starts at" in ax.get_ylabel()
    fig = viz.plot_memory(big, sched, zoom=False)
    assert fig.axes[0].get_ylim()[0] == 0
