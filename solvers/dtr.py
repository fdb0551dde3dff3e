r"""Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021) replayed as a static schedule.

DTR is an online policy: it runs the program in order and, when memory runs out, evicts the
resident tensor with the smallest score, recomputing evicted tensors when an op needs them.
Here the program is the training graph in id order (forward, loss, backward) and the replay's
trace becomes an ordinary bare op list (``compute`` / ``free``, ``stages`` None), which the
simulator validates and the executor runs.

The runtime loop (docs/references.md, "DTR"), per program op ``k`` (stage ``k`` in the emitted ops):

1. *materialise inputs*: stamp each input's last access with the clock, lock the resident
   ones, rematerialise the evicted ones recursively (each rematerialisation is the same
   procedure on its own inputs), lock them;
2. *fit*: while ``fixed + live + bytes(k) + workspace(k) > budget`` evict the pool member with
   the smallest score; an empty pool is a failure ("out of memory: nothing evictable");
3. *run*: ``compute k``; the clock advances by k's time (the compute clock: staleness is in
   compute time, so the replay is deterministic); unlock the inputs;
4. *release*: an input (or k itself) with no remaining program uses is freed at once: banished
   (gone for good) when no rematerialisable descendant that is still needed could ask for it,
   otherwise evicted eagerly (freed, lineage kept, part of evicted neighbourhoods).  Tensors that
   step 1 rematerialised only to rebuild others are released the same way at the end of the op.

The pool: resident tensors that are rematerialisable, unlocked and non-empty.  Rematerialisable
= a forward node all of whose inputs are rematerialisable (graph inputs and parameters are
fixed bytes, always resident).  Loss and backward outputs are never evicted while they have
uses: autograd evaluates each of them exactly once (the executability rule of this project), so
when only they remain the replay fails with out of memory.  Thrash guard: when the total compute
exceeds ``thrash_factor`` (2) times one plain pass, the replay fails ("thrashing").

Heuristics (c = compute time of the producing node, m = bytes, s = staleness = clock - last
access; evict the minimum; a zero denominator gives infinity; ties go to the smaller id):

=============  ==================================================================
``dtr``        h_DTR = (c(t) + sum_{u in e*(t)} c(u)) / (m s); e*(t) = the evicted
               tensors connected to t through evicted tensors (inputs t would need to
               be rebuilt, and evicted consumers that would need t): exact, the union
               of the connected components of the evicted set adjacent to t
``dtr-eq``     h_DTR-eq: as h_DTR with e* over-approximated by equivalence classes
               (union-find: an eviction makes class {t} valued c(t) and merges it with
               each evicted neighbour's class; a rematerialisation subtracts c(t) but
               never splits the class)
``dtr-local``  c(t) / (m s)
``dtr-lru``    last access (evict the least recently used)
``dtr-size``   1 / m (evict the largest)
``dtr-msps``   (c(t) + sum c(evicted ancestors of t)) / m  (Capuchin's MSPS; no staleness)
``lookahead``  (c(t) [+ sum c(evicted ancestors of t)]) / (m d^alpha), d = the program's plain
               compute time from the current op to t's next use (not DTR: an offline policy)
=============  ==================================================================

``lookahead`` is ours, not the paper's: a static planner knows the whole program, so instead of
staleness (how long ago t was used: DTR's runtime guess at how soon it is needed again) it
can use how soon t is needed again, as Belady's MIN does for pages.  With no program use left
(t is kept only to rebuild evicted descendants) d is the time to the end of the program.
`lookahead_search` (the registered ``lookahead`` solver) replays a small grid of (numerator,
alpha), then the best of them with its scores perturbed at random (seeded), and keeps the
fastest schedule: each replay takes milliseconds to a few tenths of a second on 200-node
graphs (its figures against DTR's heuristics: docs/results.md).

Memory and the clock are the simulator's own (`remat.core.simulate.SimState`, op by op: outputs
allocated at compute, workspace only while the node runs, released at ``free``), and the budget
is a hard cap checked before every compute, so the replay's own peak equals
``simulate(...).peak_bytes`` and never exceeds the budget.  Nothing here imports torch.
"""
from __future__ import annotations

import math
import random
import sys
from typing import Callable

from remat.core.errors import InfeasibleBudgetError, InvalidInputError
from remat.core.graph import Graph
from remat.core.schedule import Op, Schedule
from remat.core.simulate import SimState

from .registry import register

HEURISTICS = ("dtr", "dtr-eq", "dtr-local", "dtr-lru", "dtr-size", "dtr-msps", "lookahead")
LOOKAHEAD_GRID = tuple((num, a) for num in ("ancestors", "local") for a in (0.25, 0.5, 0.75, 1.0, 1.5))
LOOKAHEAD_NOISE = 0.3      # sigma of the log-normal factor on each score in the perturbed replays
LOOKAHEAD_RESTARTS = 24    # perturbed replays of the best grid point
INF = math.inf


class _Failure(Exception):
    """Raised inside the replay; `solve` turns it into InfeasibleBudgetError."""


class DTRRuntime:
    """One DTR run of `graph` under `budget_bytes` with one heuristic.  `run()` fills `ops`; memory and
    the compute clock are the simulator's (`SimState`), op by op."""

    def __init__(self, graph: Graph, budget_bytes: int, heuristic: str = "dtr", thrash_factor: float = 2.0,
                 alpha: float = 1.0, numerator: str = "ancestors", noise: float = 0.0, seed: int = 0):
        if heuristic not in HEURISTICS:
            raise InvalidInputError(f"heuristic: unknown DTR heuristic {heuristic!r}; expected one of {HEURISTICS}")
        self.g = graph
        self.budget = int(budget_bytes)
        self.heuristic = heuristic
        self.thrash_limit = thrash_factor * graph.total_time
        n = graph.n
        self.preds = [sorted(set(p)) for p in graph.preds]
        self.succs = [sorted(set(s)) for s in graph.succs]
        self.size = graph.sizes
        self.cost = graph.recompute_times  # (every compute DTR chooses is a rematerialisation)
        self.ws = [v.workspace_bytes for v in graph.nodes]
        remat_ok = [False] * n
        for v in graph.nodes:
            remat_ok[v.id] = v.kind == "forward" and all(remat_ok[u] for u in self.preds[v.id])
        self.remat_ok = remat_ok
        # replay state: what is resident, the bytes and the compute clock (sum of the times of all
        # computes) are the simulator's
        self.state = SimState(graph, check=False)  # (its ops are valid by construction)
        self.computed = [False] * n          # computed at least once (has a lineage)
        self.remaining = [len(s) for s in self.succs]  # program uses not yet run
        self.needed = [True] * n             # may still be read, directly or to rebuild a descendant
        self.lock = [0] * n
        self.last_access = [0.0] * n
        self.evicted: set[int] = set()       # not resident, computed, still needed
        self.ops: list[Op] = []
        self.stage = -1
        self.stats = {"computes": 0, "rematerializations": 0, "evictions": 0, "eager_evictions": 0,
                      "banished": 0}
        # union-find for dtr-eq: each eviction of a tensor gets a fresh handle
        self._uf_parent: list[int] = []
        self._uf_value: list[float] = []
        self._handle: list[int] = [-1] * n
        self._score: Callable[[int], float] = {
            "dtr": self._score_dtr, "dtr-eq": self._score_eq, "dtr-local": self._score_local,
            "dtr-lru": self._score_lru, "dtr-size": self._score_size, "dtr-msps": self._score_msps,
            "lookahead": self._score_ahead,
        }[heuristic]
        # lookahead: plain-program time before each op, the exponent, the numerator, the perturbation
        if numerator not in ("ancestors", "local"):
            raise InvalidInputError(f"numerator: expected 'ancestors' or 'local', got {numerator!r}")
        self._at = [0.0] * (n + 1)
        for k in range(n):
            self._at[k + 1] = self._at[k] + self.cost[k]
        self._alpha, self._ancestors = float(alpha), numerator == "ancestors"
        self._noise = float(noise)
        self._rng = random.Random(seed)
        self._factor: dict[tuple[int, int], float] = {}
        self._components: dict[int, int] | None = None  # e* cache, dropped whenever `evicted` changes
        self._component_cost: list[float] = []

    @property
    def clock(self) -> float:
        return self.state.clock

    @property
    def peak(self) -> int:
        """Whole-step peak bytes so far (fixed bytes included)."""
        return self.g.fixed_bytes + self.state.peak

    def material(self, t: int) -> bool:
        return t in self.state.origin

    def emit(self, op: Op) -> None:
        self.ops.append(op)
        self._ok(self.state.apply(op))

    @staticmethod
    def _ok(message: str | None) -> None:
        if message is not None:  # a bug in the replay, never the user's problem
            raise AssertionError(f"dtr: the replay broke a rule of the simulator: {message}")

    # ---- the program ---------------------------------------------------------------------
    def run(self) -> list[Op]:
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, 4 * self.g.n + 1000))
        try:
            for k in range(self.g.n):
                self.stage = k
                self._perform(k, remat=False)
                for u in self.preds[k]:
                    self.remaining[u] -= 1
                self._release()
        finally:
            sys.setrecursionlimit(old)
        return self.ops

    def _perform(self, v: int, remat: bool) -> None:
        ins = self.preds[v]
        for u in ins:
            self.last_access[u] = self.clock
        resident = [u for u in ins if self.material(u)]
        for u in resident:
            self.lock[u] += 1
        for u in ins:
            if u in resident:
                continue
            if not self.material(u):  # (it may have come back while rebuilding an earlier input)
                assert self.computed[u] and self.remat_ok[u], f"node {u} is missing and cannot be rebuilt"
                self._perform(u, remat=True)
            self.lock[u] += 1
        need = self.size[v] + self.ws[v]
        fixed = self.g.fixed_bytes
        while fixed + self.state.compute_peak(v) > self.budget:
            self._evict_one(v, need)
        self.emit(Op("compute", v, self.stage))
        self.last_access[v] = self.clock
        self.stats["computes"] += 1
        if remat:
            self.stats["rematerializations"] += 1
            self._unevict(v)
        self.computed[v] = True
        for u in ins:
            self.lock[u] -= 1
        if self.clock > self.thrash_limit * (1 + 1e-12) and self.thrash_limit > 0:
            raise _Failure(f"thrashing: compute > {self.thrash_limit / self.g.total_time:g}x baseline "
                           f"(total compute reached {self.clock:g} against one pass of {self.g.total_time:g}, "
                           f"at node {v} of program op {self.stage})")

    def _release(self) -> None:
        """After a program op: free every resident tensor with no remaining uses (module docstring, 4)."""
        dead = self._dead_candidates()
        for u in dead:
            self._update_needed(u)
        for u in dead:
            if self.material(u) and self.remaining[u] == 0 and self.lock[u] == 0:
                self._free(u, eager=True)

    def _dead_candidates(self) -> list[int]:
        # inputs of the op just run, the op itself, and anything its rematerialisations left behind
        k = self.stage
        cand = set(self.preds[k]) | {k}
        for o in reversed(self.ops):
            if o.stage != k:
                break
            if o.op == "compute":
                cand.add(o.node)
                cand.update(self.preds[o.node])
        return sorted(u for u in cand if self.material(u) and self.remaining[u] == 0)

    def _update_needed(self, u: int) -> None:
        stack = [u]
        while stack:
            x = stack.pop()
            if not self.needed[x] or self.remaining[x] > 0:
                continue
            if any(self.needed[c] and self.remat_ok[c] for c in self.succs[x]):
                continue
            self.needed[x] = False
            if x in self.evicted:  # evicted and now nobody can ask for it: banish
                self.evicted.discard(x)
                self._components = None
                self._uf_remove(x)
                self.stats["banished"] += 1
            stack.extend(self.preds[x])

    # ---- eviction ------------------------------------------------------------------------
    def _evict_one(self, v: int, need: int) -> None:
        best, best_key = -1, (INF, INF)
        resident = self.state.origin
        for t in range(self.g.n):
            if t in resident and self.lock[t] == 0 and self.remat_ok[t] and self.size[t] > 0:
                key = (self._score(t), t)
                if best < 0 or key < best_key:
                    best, best_key = t, key
        if best < 0:
            held = sorted(self.state.origin)
            raise _Failure(
                f"out of memory: nothing evictable at node {v} ({self.g.nodes[v].name}) of program op "
                f"{self.stage}: it needs {need} bytes with {self.state.live} activation bytes resident and "
                f"{self.g.fixed_bytes} fixed, over the budget of {self.budget}; resident and pinned "
                f"(locked inputs, loss/backward outputs still in use): {held[:12]}"
                + ("..." if len(held) > 12 else ""))
        self.stats["evictions"] += 1
        self._free(best, eager=False)

    def _free(self, t: int, eager: bool) -> None:
        self.emit(Op("free", t, self.stage))
        if self.remat_ok[t] and self.needed[t]:
            self.evicted.add(t)
            self._components = None
            self._uf_add(t)
            if eager:
                self.stats["eager_evictions"] += 1
        else:
            self.needed[t] = False
            self.stats["banished"] += 1
            for p in self.preds[t]:
                self._update_needed(p)

    def _unevict(self, t: int) -> None:
        if t in self.evicted:
            self.evicted.discard(t)
            self._components = None
            self._uf_remove(t)

    # ---- scores --------------------------------------------------------------------------
    def _staleness(self, t: int) -> float:
        return self.clock - self.last_access[t]

    def _ratio(self, num: float, den: float) -> float:
        return INF if den <= 0 else num / den

    def _score_local(self, t: int) -> float:
        return self._ratio(self.cost[t], self.size[t] * self._staleness(t))

    def _score_lru(self, t: int) -> float:
        return self.last_access[t]

    def _score_size(self, t: int) -> float:
        return self._ratio(1.0, self.size[t])

    def _neighbours(self, t: int) -> list[int]:
        return [u for u in self.preds[t] + self.succs[t] if u in self.evicted]

    def _score_dtr(self, t: int) -> float:
        comp = self._evicted_components()
        seen: set[int] = set()
        extra = 0.0
        for u in self._neighbours(t):
            c = comp[u]
            if c not in seen:
                seen.add(c)
                extra += self._component_cost[c]
        return self._ratio(self.cost[t] + extra, self.size[t] * self._staleness(t))

    def _evicted_components(self) -> dict[int, int]:
        """Connected components of the evicted set (undirected, through graph edges): e*'s regions."""
        if self._components is not None:
            return self._components
        comp: dict[int, int] = {}
        costs: list[float] = []
        for s in sorted(self.evicted):
            if s in comp:
                continue
            cid = len(costs)
            total = 0.0
            comp[s] = cid
            stack = [s]
            while stack:
                x = stack.pop()
                total += self.cost[x]
                for y in self.preds[x] + self.succs[x]:
                    if y in self.evicted and y not in comp:
                        comp[y] = cid
                        stack.append(y)
            costs.append(total)
        self._components, self._component_cost = comp, costs
        return comp

    def _score_eq(self, t: int) -> float:
        roots: set[int] = set()
        extra = 0.0
        for u in self._neighbours(t):
            r = self._uf_find(self._handle[u])
            if r not in roots:
                roots.add(r)
                extra += self._uf_value[r]
        return self._ratio(self.cost[t] + extra, self.size[t] * self._staleness(t))

    def _score_msps(self, t: int) -> float:
        return self._ratio(self._rebuild_cost(t), self.size[t])

    def _rebuild_cost(self, t: int) -> float:
        """c(t) plus the cost of t's evicted ancestors (what rebuilding t would recompute)."""
        seen: set[int] = set()
        stack = [u for u in self.preds[t] if u in self.evicted]
        extra = 0.0
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            extra += self.cost[x]
            stack.extend(u for u in self.preds[x] if u in self.evicted and u not in seen)
        return self.cost[t] + extra

    def _score_ahead(self, t: int) -> float:
        k = self.stage
        nxt = min((c for c in self.succs[t] if c >= k), default=None)
        d = (self._at[nxt] if nxt is not None else self._at[-1]) - self._at[k]
        num = self._rebuild_cost(t) if self._ancestors else self.cost[t]
        score = self._ratio(num, self.size[t] * max(d, 1e-9 * self._at[-1]) ** self._alpha)
        if self._noise > 0:  # one factor per (tensor, eviction): a replay is a fixed function of its seed
            key = (t, self.stats["evictions"])
            if key not in self._factor:
                self._factor[key] = math.exp(self._noise * self._rng.gauss(0.0, 1.0))
            score *= self._factor[key]
        return score

    # ---- union-find (dtr-eq) -------------------------------------------------------------
    def _uf_find(self, h: int) -> int:
        p = self._uf_parent
        root = h
        while p[root] != root:
            root = p[root]
        while p[h] != root:
            p[h], h = root, p[h]
        return root

    def _uf_add(self, t: int) -> None:
        if self.heuristic != "dtr-eq":
            return
        h = len(self._uf_parent)
        self._uf_parent.append(h)
        self._uf_value.append(self.cost[t])
        self._handle[t] = h
        for u in self._neighbours(t):
            a, b = self._uf_find(h), self._uf_find(self._handle[u])
            if a != b:
                self._uf_parent[b] = a
                self._uf_value[a] += self._uf_value[b]

    def _uf_remove(self, t: int) -> None:
        """Rematerialised (or banished): subtract its cost from its class, never split."""
        if self.heuristic != "dtr-eq" or self._handle[t] < 0:
            return
        r = self._uf_find(self._handle[t])
        self._uf_value[r] = max(0.0, self._uf_value[r] - self.cost[t])
        self._handle[t] = -1


def solve(graph: Graph, budget_bytes: int, heuristic: str = "dtr", thrash_factor: float = 2.0,
          alpha: float = 1.0, numerator: str = "ancestors", noise: float = 0.0, seed: int = 0,
          **_: object) -> Schedule:
    """DTR's replay under `budget_bytes` (whole-step bytes, fixed included) as a bare op list.

    `alpha`, `numerator`, `noise` and `seed` are the ``lookahead`` heuristic's (module docstring).
    Raises InfeasibleBudgetError ("out of memory: nothing evictable" or "thrashing: compute >
    2x baseline") when DTR's runtime would fail.
    """
    if thrash_factor <= 0:
        raise InvalidInputError(f"thrash_factor: must be > 0, got {thrash_factor!r}")
    rp = DTRRuntime(graph, budget_bytes, heuristic, thrash_factor, alpha=alpha, numerator=numerator, noise=noise,
                seed=seed)
    try:
        ops = rp.run()
    except _Failure as e:
        raise InfeasibleBudgetError(f"{heuristic}: {e}", int(budget_bytes), fixed_bytes=graph.fixed_bytes) from None
    base = graph.total_time
    sched = Schedule(ops, None)
    sched.report = {"name": heuristic, "status": "heuristic", "objective": rp.clock, "compute_time": rp.clock,
                    "overhead": rp.clock / base if base > 0 else 1.0, "peak_bytes": rp.peak,
                    "thrash_factor": thrash_factor, **rp.stats}
    if heuristic == "lookahead":
        sched.report.update(alpha=alpha, numerator=numerator, noise=noise, seed=seed)
    return sched


@register("lookahead", "offline eviction replay: (cost [+ evicted ancestors]) / (bytes x time to next use^alpha), "
                       "best of a small grid and seeded perturbations")
def lookahead_search(graph: Graph, budget_bytes: int, *, grid: tuple = LOOKAHEAD_GRID,
                     restarts: int = LOOKAHEAD_RESTARTS, noise: float = LOOKAHEAD_NOISE,
                     thrash_factor: float = 2.0, **_: object) -> Schedule:
    """The fastest ``lookahead`` replay over `grid` ((numerator, alpha) pairs), then over `restarts`
    perturbed replays (seeds 1..restarts, log-normal factor `noise`) of the best grid point.
    Deterministic.  Raises InfeasibleBudgetError when every replay fails (the first failure's)."""
    best: Schedule | None = None
    first_error: InfeasibleBudgetError | None = None
    replays = 0

    def replay(**kw: object) -> None:
        nonlocal best, first_error, replays
        replays += 1
        try:
            sched = solve(graph, budget_bytes, "lookahead", thrash_factor, **kw)
        except InfeasibleBudgetError as e:
            first_error = first_error or e
            return
        if best is None or sched.report["objective"] < best.report["objective"]:
            best = sched

    for num, a in grid:
        replay(numerator=num, alpha=a)
    if best is None:
        raise first_error or InfeasibleBudgetError("lookahead: no replay fits", int(budget_bytes),
                                                   fixed_bytes=graph.fixed_bytes)
    point = {k: best.report[k] for k in ("numerator", "alpha")}
    for s in range(1, restarts + 1):
        replay(**point, noise=noise, seed=s)
    best.report["replays"] = replays
    return best


def _make(heuristic: str, description: str) -> Callable:
    @register(heuristic, description)
    def _solve(graph: Graph, budget_bytes: int, **options: object) -> Schedule:
        options.pop("heuristic", None)
        return solve(graph, budget_bytes, heuristic=heuristic, **options)
    _solve.__name__ = _solve.__qualname__ = heuristic.replace("-", "_")
    return _solve


dtr = _make("dtr", "DTR replay, h_DTR with the exact evicted neighbourhood e* (Kirisame et al. 2021)")
dtr_eq = _make("dtr-eq", "DTR replay, h_DTR-eq: e* over-approximated by union-find equivalence classes")
dtr_local = _make("dtr-local", "DTR replay, h_DTR-local: cost / (bytes x staleness), no neighbourhood")
dtr_lru = _make("dtr-lru", "DTR replay, h_LRU: evict the least recently used tensor")
dtr_size = _make("dtr-size", "DTR replay, h_size: evict the largest tensor")
dtr_msps = _make("dtr-msps", "DTR replay, h_MSPS (Capuchin): (cost + evicted ancestors' cost) / bytes")
