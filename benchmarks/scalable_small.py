"""The scalable mode against the exact ILP on graphs small enough for both (33-61 nodes).

Each graph at 0.4x, 0.6x and 0.8x: the exact ILP (15 s) and the scalable mode forced to coarsen to
about a third of the nodes (20 s), recompute only, CBC with one thread.  Prints one line per case.

    python benchmarks/scalable_small.py
"""
import time
from remat.generators import linear_chain, random_layered, unet
from remat.budget import parse_budget
from remat.solvers import ilp
from remat.solvers.ilp import scalable
from remat.core.errors import InfeasibleBudgetError
graphs = [("chain16", linear_chain(16)), ("chain24", linear_chain(24)), ("unet3", unet(3)), ("unet4", unet(4)),
          ("random15s1", random_layered(15, seed=1)), ("random20s2", random_layered(20, seed=2)), ("random30s0", random_layered(30, seed=0))]
for name, g in graphs:
    for r in ("0.4x", "0.6x", "0.8x"):
        B = parse_budget(r, g)
        t = time.time()
        try:
            e = ilp.solve(g, B, swap=False, time_limit=15, threads=1, mode="exact")
        except InfeasibleBudgetError:
            print(name, g.n, r, "infeasible", flush=True); continue
        te = time.time() - t
        t = time.time()
        try:
            s = scalable.solve(g, B, swap=False, time_limit=20, threads=1, coarse_nodes=max(9, g.n // 3))
        except Exception as ex:
            print(name, g.n, r, "exact", e.report["status"], "scalable error", type(ex).__name__, ex, flush=True); continue
        ts = time.time() - t
        rep = s.report
        print(f"{name} n={g.n} {r} exact {e.report['status']} {e.report['objective']:.1f} lb {e.report['lower_bound']:.1f} ({te:.1f}s) | scalable {rep['objective']:.1f} lb {rep['lower_bound']:.2f} ratio {rep['objective']/e.report['objective']:.4f} from {rep['incumbent_from']} bound {rep['bound_from']} coarse {rep['coarse_nodes']} ({ts:.1f}s)", flush=True)
