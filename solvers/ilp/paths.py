r"""Path rows: valid inequalities against the instant IP's LP rebuilding values in slivers.

The LP relaxation rebuilds a value in slivers: with its input u held at 0.06 from instant t1 on,
it may rebuild v by 0.06 in each of sixteen intervals and hold v whole at t2, paying for u a
sixteenth of its bytes.  No integral solution can: v resident at t2 and not at t1 was rebuilt in
some interval s in (t1, t2], which needed u then, so u was resident at t1 or rebuilt in (t1, s].
Following a path of inputs v <- u_1 <- ... <- u_k back from v (each u_i resident at t1 or
rebuilt after it, and a rebuild needs its input likewise):

    path     P[t2,v] <= P[t1,v] + sum_i P[t1,u_i] + sum_{t1 < r <= t2} N[r,u_k]

for every value v, instants t1 < t2 with P[t2,v] and P[t1,.] on the path (values first computed
after t1 make no row: they are fresh there).  Each follows from the keep and rebuild rows for
integral points alone (every instant model has them: with rebuild moments, keep is P <= H + N
with H <= P[t-1]), so the rows cut off LP points and no solution (tested at integral solutions
of the model under random objectives and at every baseline's schedule, and the models prove the
optima they proved without them: tests/test_instant_ip.py).

`path_rows` separates them against an LP point: for each v and t1, the cheapest path for every
t2 at once (a shortest-path recursion over the inputs in id order, numpy over t2), the most
violated t1 per (v, t2).  `add_path_rows` runs rounds of it against the LP (`Relaxation`: HiGHS's
in memory, else CBC's).  The LP rises fast where slivers are what it leans on; where it leans on
other things it rises less and the rows cost the MIP its speed, so the rounds stop when the LP
stalls (`PATH_STALL`) and the rows are kept only where they lifted it by `PATH_KEEP_GAIN`, and
then only those tight at the last LP.  A chain's LP does not move (its weakness is elsewhere).
"""
from __future__ import annotations

import logging
import math
import time as _time
from typing import TYPE_CHECKING

import pulp

from remat.core.graph import Graph

from . import mip

if TYPE_CHECKING:  # pragma: no cover  (the model type only; instant imports this module)
    from .instant import InstantModel

log = logging.getLogger(__name__)

PATH_ROUNDS = 30       # path rows: at most this many rounds of separation against the LP,
PATH_PER_ROUND = 400   # adding at most this many rows a round (the most violated),
PATH_SHARE = 0.25      # within this share of the solve's time limit
PATH_EPS = 1e-3        # (a row is added when the LP violates it by more than this)
PATH_STALL = 0.01      # and while the LP's recomputation still rises by this share
PATH_STALL_ROUNDS = 3  # over this many rounds; the rows are kept only if they lifted it by
PATH_KEEP_GAIN = 0.02  # this share (where they lift it less, hundreds of tight rows only slow the MIP)


def highs_lp(m: InstantModel):
    """`m` as a silent HiGHS model in memory (`m.prob.solverModel`; each variable's `index` is
    its column), for LPs solved and changed in place."""
    import highspy
    mip.highs_ready()
    m.prob.solverModel = h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    pulp.HiGHS(mip=False, msg=False).buildSolverModel(m.prob)
    return h


class Relaxation:
    """The LP relaxation of `m` with rows added as they are separated: in HiGHS (highspy) in
    memory, each solve from the last basis; without highspy, CBC through PuLP (the rows go
    into `m.prob` at once, the LP is written out and solved from scratch each round)."""

    def __init__(self, m: InstantModel):
        self.m = m
        self.cols = m.prob.variables()
        self.in_model = set(self.cols)
        self.rows: list[tuple[str, dict]] = []
        self.highs = mip.highs_available()
        self.h = None
        if self.highs:
            self.h = highs_lp(m)
            self.first_row = self.h.getNumRow()

    def solve(self) -> dict | None:
        """Solve; {variable: value} at the LP optimum (None if it has none), and `objective`
        (model units, the objective's constant included)."""
        constant = self.m.prob.objective.constant or 0.0
        if self.highs:
            self.h.run()
            if self.h.modelStatusToString(self.h.getModelStatus()) != "Optimal":
                return None
            self.h.setOptionValue("presolve", "off")  # (later solves start from this basis)
            self.objective = self.h.getInfo().objective_function_value + constant
            value = self.h.getSolution().col_value
            return {var: value[var.index] for var in self.cols}
        self.m.prob.solve(pulp.PULP_CBC_CMD(msg=False, mip=False, threads=1))
        if self.m.prob.status != pulp.LpStatusOptimal:
            return None
        self.objective = pulp.value(self.m.prob.objective)
        return {var: var.varValue or 0.0 for var in self.cols}

    def add(self, row: dict) -> bool:
        """Add the row `sum <= 0`, unless a variable of it is in no row of the model (it sits at
        its bound there); whether it was added."""
        if not all(var in self.in_model for var in row):
            return False
        name = f"path_{len(self.rows)}"
        self.rows.append((name, row))
        if self.highs:
            self.h.addRow(-math.inf, 0.0, len(row), [var.index for var in row], list(row.values()))
        else:
            self.m.prob.addConstraint(pulp.LpAffineExpression(list(row.items())) <= 0, name)
        return True

    def keep(self, solved: int, worth: bool = True) -> int:
        """Leave in `m.prob` the rows tight at the last solve (which had the first `solved` rows)
        and those added after it, none unless `worth`; the model's variables lose the LP's values.
        Returns how many."""
        prob = self.m.prob
        if self.highs:
            activity = self.h.getSolution().row_value if solved else []
            tight = [worth and (j >= solved or activity[self.first_row + j] > -1e-7) for j in range(len(self.rows))]
            prob.solverModel = None
            for (name, row), keep in zip(self.rows, tight):
                if keep:
                    prob.addConstraint(pulp.LpAffineExpression(list(row.items())) <= 0, name)
        else:
            tight = [worth and (j >= solved or prob.constraints[name].value() > -1e-7)
                     for j, (name, _) in enumerate(self.rows)]
            for (name, _), keep in zip(self.rows, tight):
                if not keep:
                    del prob.constraints[name]
            for var in self.cols:
                var.varValue = None
        return sum(tight)


def path_rows(graph: Graph, m: InstantModel, x, *, eps: float = PATH_EPS, most: int = PATH_PER_ROUND) -> list:
    """Path rows ("Path rows" in the module docstring) that the point `x` (a value per P and N
    variable: `x[var]`) violates by more than `eps`, the most violated first, at most `most`:
    each {variable: coefficient} for `sum <= 0` (a path's values are distinct, so no variable
    comes twice).  For every value v, instant t2 and
    instant t1 < t2, the cheapest path is found for all t2 at once (numpy over t2)."""
    import numpy as np
    n = graph.n
    values = sorted({v for _, v in m.P})
    tracked = set(values)
    ins = {v: sorted(u for u in set(graph.preds[v]) if u in tracked) for v in values}
    P = {v: np.zeros(n) for v in values}
    has = {v: np.zeros(n, dtype=bool) for v in values}
    cumN = {v: np.zeros(n) for v in values}
    for (t, v), var in m.P.items():
        P[v][t] = x[var] if var in x else (var.lowBound or 0.0)  # (one in no row: at its bound)
        has[v][t] = True
    for (t, v), var in m.N.items():
        cumN[v][t] += x.get(var, 0.0)
    for v in values:
        cumN[v] = np.cumsum(cumN[v])
    times = sorted({t for (t, _) in m.P})

    def cheapest(t1: int) -> dict[int, np.ndarray]:  # per value: the cheapest way to have it between t1 and t2
        f: dict[int, np.ndarray] = {}
        for y in values:
            if not has[y][t1]:
                continue  # (computed for the first time after t1, or not tracked: no row through it)
            best = cumN[y] - cumN[y][t1]
            for u in ins[y]:
                if u in f:
                    best = np.minimum(best, P[u][t1] + f[u])
            f[y] = best
        return f

    found: dict[tuple[int, int], tuple[float, int]] = {}  # (v, t2) -> (violation, t1), the best t1
    for t1 in times:
        f = cheapest(t1)
        for v in values:
            if not has[v][t1] or not any(u in f for u in ins[v]):
                continue
            via = np.min([P[u][t1] + f[u] for u in ins[v] if u in f], axis=0)
            viol = P[v] - P[v][t1] - via
            viol[: t1 + 1] = 0.0
            viol[~has[v]] = 0.0
            for t2 in np.nonzero(viol > eps)[0]:
                if viol[t2] > found.get((v, int(t2)), (0.0, 0))[0]:
                    found[v, int(t2)] = (float(viol[t2]), t1)
    chosen = sorted(found.items(), key=lambda kv: -kv[1][0])[:most]
    rows = []
    by_t1: dict[int, list] = {}
    for (v, t2), (_, t1) in chosen:
        by_t1.setdefault(t1, []).append((v, t2))
    for t1, cuts in by_t1.items():
        f = cheapest(t1)
        for v, t2 in cuts:
            row = {m.P[t2, v]: 1.0, m.P[t1, v]: -1.0}
            y = v
            while True:  # follow the cheapest path back to where it stops (its rebuilds after t1)
                y = min((u for u in ins[y] if u in f), key=lambda u: P[u][t1] + f[u][t2])
                row[m.P[t1, y]] = -1.0
                if cumN[y][t2] - cumN[y][t1] <= f[y][t2] + 1e-12:
                    row.update({m.N[r, y]: -1.0 for r in range(t1 + 1, t2 + 1) if (r, y) in m.N})
                    break
            rows.append(row)
    return rows


def add_path_rows(graph: Graph, m: InstantModel, *, time_limit: float | None = None,
                  rounds: int = PATH_ROUNDS, keep_gain: float | None = None) -> dict:
    """Strengthen a recompute-only model with the path rows its LP relaxation violates, round by
    round, until none is violated, `rounds` have run, `time_limit` is spent or the LP stalls
    (its recomputation rose less than `PATH_STALL` over the last `PATH_STALL_ROUNDS` rounds).
    Where the rounds lifted the LP's recomputation by `keep_gain` (default `PATH_KEEP_GAIN`) or
    more, the rows tight at the last LP (and those added after it) go into `m.prob`, named
    path_k; the others, and all of them where the LP hardly rose, would only slow the MIP down.  Returns {"rows": kept,
    "separated": added in all, "rounds": run, "lp": the LP value of the model as left, in
    seconds, or None}.  The LP is HiGHS's where highspy is installed, else CBC's (`Relaxation`)."""
    out = {"rows": 0, "separated": 0, "rounds": 0, "lp": None}
    if m.swap or not m.N:
        return out
    t0 = _time.perf_counter()
    lp = Relaxation(m)
    solved = 0  # rows added before the last LP
    base = (m.prob.objective.constant or 0.0) * m.time_unit
    history: list[float] = []
    for k in range(rounds):
        if time_limit is not None and _time.perf_counter() - t0 > time_limit:
            break
        if len(history) > PATH_STALL_ROUNDS and \
                history[-1] - history[-1 - PATH_STALL_ROUNDS] < PATH_STALL * (history[-1] - base):
            break
        x = lp.solve()
        if x is None:
            break
        solved = len(lp.rows)
        out["lp"] = lp.objective * m.time_unit
        history.append(out["lp"])
        rows = path_rows(graph, m, x)
        out["rounds"] = k + 1
        if not rows:
            break
        for row in rows:
            lp.add(row)
    # (rows that hardly lift the LP only slow the MIP down: none are kept then)
    gain = PATH_KEEP_GAIN if keep_gain is None else keep_gain
    worth = len(history) > 1 and history[-1] - history[0] >= gain * (history[0] - base)
    out["rows"] = lp.keep(solved, worth)
    if not worth and history:
        out["lp"] = history[0]
    out["separated"] = len(lp.rows)
    log.info("instant IP: %d path rows (of %d) in %d rounds, LP %s (%.1f s)", out["rows"], out["separated"], out["rounds"],
             None if out["lp"] is None else round(out["lp"] / graph.total_time, 4), _time.perf_counter() - t0)
    return out


def path_rows_within(graph: Graph, m: InstantModel, limit: float | None, *, least: float) -> float | None:
    """`add_path_rows` for up to `PATH_SHARE` of a solve's time `limit`; returns what it leaves
    of the limit for the solve (at least `least`; None without a limit)."""
    t0 = _time.perf_counter()
    add_path_rows(graph, m, time_limit=None if limit is None else PATH_SHARE * limit)
    return None if limit is None else max(least, limit - (_time.perf_counter() - t0))


__all__ = ["path_rows", "add_path_rows", "path_rows_within", "Relaxation", "highs_lp", "PATH_SHARE"]
