"""How large a batch (or sequence) fits a memory: the search behind ``remat capacity``.

`GraphFamily` is one model's graph at any size, built from graphs traced at a few sizes: the
same nodes and edges (checked), every cost (``time``, ``bytes``, ``workspace_bytes``,
``persistent_bytes`` per node, and ``fixed_bytes``) a polynomial in the size through the traced
points, least squares of degree ``min(len(sizes) - 1, degree)``: degree 1 for a batch (inputs,
activations and times grow linearly with it, parameters stay), degree 2 for a sequence length
(attention scores grow with its square; three traced lengths fit it exactly).  Values are exact
at the traced sizes when there are no more points than coefficients, rounded to whole bytes and
never negative.  Past the largest traced size a node's time is never below its time there:
measured times of small ops at small sizes are mostly noise, and a line through two of them can
fall to zero further on, which would make their recomputation look free.

`search` answers, per overhead level (a cap on the predicted step time over the time without
recomputation: 1.0 is "no recomputation"), the largest size whose fastest plan within `memory`
stays within the level.  Each size is probed once (`Probe`, shared by every level):

1. keep everything (`Schedule.keep_all`) fits -> overhead 1, no solve;
2. a bound proves nothing fits (the largest node with its inputs, `analysis.node_need`; without
   swap also `analysis.forced_need`) -> does not fit;
3. else the solver at budget `memory`: its plan and overhead, infeasible, or no plan found in the
   time limit.

Sizes double from the largest traced size while the level holds, then bisect.  The search relies
on what these graphs obey: a larger size needs no less memory at any point of the step, so its
fastest plan within the same memory is no faster.  An answer is *proven* when the size above it
was refuted by a bound, a proof of infeasibility or an optimal plan over the level; a probe that
ran out of time leaves the answer a lower bound, and the result says so.

Plain autograd's answer (`plain_size`) is the largest size whose keep-everything peak fits.
Nothing here imports torch; tracing at the sizes is `remat.sizing` (``remat.capacity``).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from remat.core.analysis import forced_need, node_need
from remat.core.errors import InfeasibleBudgetError, InvalidInputError, SolverError
from remat.core.graph import Graph, Node
from remat.core.plan import Plan
from remat.core.simulate import keep_all_peak
from remat.core.units import format_bytes

from .planning import plan as make_plan

log = logging.getLogger(__name__)

DIMS = {"batch": 1, "seq": 2}  # the dimension a family varies -> its polynomial degree
MAX_SIZE = 1 << 20             # the search stops growing here
LEVEL_EPS = 1e-9               # overheads within this of a level count as within it
_COSTS = ("time", "bytes", "workspace_bytes", "persistent_bytes")


def fit_polynomial(xs: Sequence[float], ys: Sequence[float], degree: int) -> list[float]:
    """Coefficients (constant first) of the least-squares polynomial of `degree` through the
    points; the normal equations solved exactly (tiny systems, centred sizes for conditioning)."""
    n = degree + 1
    a = [[sum(x ** (i + j) for x in xs) for j in range(n)] for i in range(n)]
    b = [sum(y * x ** i for x, y in zip(xs, ys)) for i in range(n)]
    for col in range(n):  # Gauss-Jordan with partial pivoting
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[piv], b[col], b[piv] = a[piv], a[col], b[piv], b[col]
        for r in range(n):
            if r != col and a[r][col]:
                f = a[r][col] / a[col][col]
                a[r] = [u - f * v for u, v in zip(a[r], a[col])]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(n)]


def polynomial_value(coef: Sequence[float], x: float) -> float:
    """The polynomial with coefficients `coef` (constant first) at `x`."""
    return sum(c * x ** k for k, c in enumerate(coef))


class GraphFamily:
    """One model's graph at any size of `dim` ("batch" or "seq"), from `graphs` traced at two or
    more sizes (module docstring).  ``at(size)`` -> the graph at that size (cached);
    ``sizes`` -> the traced sizes.  Raises `InvalidInputError` when the traced graphs differ in
    structure (nodes, kinds, edges) or do not grow with the size."""

    def __init__(self, graphs: "dict[int, Graph]", dim: str = "batch"):
        if dim not in DIMS:
            raise InvalidInputError(f"dim: expected one of {tuple(DIMS)}, got {dim!r}")
        if len(graphs) < 2:
            raise InvalidInputError("capacity: trace the model at two or more sizes")
        self.dim = dim
        self.sizes = sorted(int(s) for s in graphs)
        self.graphs = {int(s): g for s, g in graphs.items()}
        first = self.graphs[self.sizes[0]]
        for s in self.sizes[1:]:
            g = self.graphs[s]
            same = (g.n == first.n and g.edges == first.edges
                    and all((u.name, u.kind, u.part_of) == (v.name, v.kind, v.part_of)
                            for u, v in zip(g.nodes, first.nodes)))
            if not same:
                raise InvalidInputError(
                    f"capacity: the graphs traced at {dim} {self.sizes[0]} and {s} differ in structure "
                    f"({first.n} and {g.n} nodes); the sizes must trace to the same graph (try --granularity "
                    "module, or sizes of the same shape class, e.g. not 1)")
        self.degree = min(len(self.sizes) - 1, DIMS[dim])
        xs = [float(s) for s in self.sizes]
        self._node_fits = [{key: fit_polynomial(xs, [getattr(self.graphs[s].nodes[i], key) for s in self.sizes], self.degree)
                            for key in _COSTS} for i in range(first.n)]
        # a recomputation's seconds scale like the first compute's: the ratio at the largest size
        self._recompute_ratio = [v.recompute_cost / v.time if v.recompute_time is not None and v.time > 0 else None
                                 for v in self.graphs[self.sizes[-1]].nodes]
        # byte counts a frontend keeps beside the costs (output_bytes, saved_bytes...) scale alike
        self._extra_fits = [{key: fit_polynomial(xs, [self.graphs[s].nodes[i].extra[key] for s in self.sizes], self.degree)
                             for key, val in v.extra.items() if key.endswith("_bytes") and isinstance(val, int)
                             and all(isinstance(self.graphs[s].nodes[i].extra.get(key), int) for s in self.sizes)}
                            for i, v in enumerate(first.nodes)]
        self._fixed_fit = fit_polynomial(xs, [self.graphs[s].fixed_bytes for s in self.sizes], self.degree)
        self._cache: dict[int, Graph] = {}
        grow = sum(v.bytes for v in self.graphs[self.sizes[-1]].nodes) - sum(v.bytes for v in first.nodes)
        if grow <= 0:
            raise InvalidInputError(
                f"capacity: the activations do not grow from {dim} {self.sizes[0]} to {self.sizes[-1]} "
                f"({format_bytes(sum(v.bytes for v in first.nodes))} at both): the model's inputs have no "
                f"{'batch' if dim == 'batch' else 'sequence'} dimension that the sizes change")

    def at(self, size: int) -> Graph:
        size = int(size)
        if size < 1:
            raise InvalidInputError(f"capacity: a size must be >= 1, got {size}")
        if size in self.graphs:
            return self.graphs[size]
        if size not in self._cache:
            base = self.graphs[self.sizes[-1]]
            nodes = []
            for v, fits, extra_fits in zip(base.nodes, self._node_fits, self._extra_fits):
                vals = {key: max(0.0, polynomial_value(fits[key], size)) for key in _COSTS}
                if size > self.sizes[-1]:  # (past the traced sizes a node takes no less time than at the largest)
                    vals["time"] = max(vals["time"], v.time)
                extra = {**v.extra, **{key: int(round(max(0.0, polynomial_value(c, size)))) for key, c in extra_fits.items()}}
                ratio = self._recompute_ratio[v.id]
                nodes.append(Node(v.id, v.name, v.kind, vals["time"], *(int(round(vals[k])) for k in _COSTS[1:3]),
                                  extra=extra, persistent_bytes=int(round(vals["persistent_bytes"])),
                                  part_of=v.part_of, recompute_time=None if ratio is None else vals["time"] * ratio))
            fixed = int(round(max(0.0, polynomial_value(self._fixed_fit, size))))
            # (a plain step measured at the traced size is not one at this size: `core.plain`)
            meta = {**{k: v for k, v in base.meta.items() if k != "plain_step"},
                    "batch" if self.dim == "batch" else "seq_len": size,
                    "capacity": {"dim": self.dim, "traced_sizes": self.sizes, "degree": self.degree}}
            self._cache[size] = Graph(nodes, base.edges, fixed, meta)
        return self._cache[size]


@dataclass
class Probe:
    """What fits at one size.  `status`: "keep-all" (no recomputation needed; optimal),
    "optimal" / "feasible" (the solver's plan; feasible: not proven fastest), "infeasible"
    (proven: no plan fits), "bound" (a lower bound on the peak is over the memory), or
    "no plan found" (the solver's time ran out without one: unknown)."""
    size: int
    status: str
    keep_all_bytes: int
    overhead: float | None = None
    peak_bytes: int | None = None
    plan: Plan | None = field(default=None, repr=False)

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def within(self, level: float) -> bool:
        return self.fits and self.overhead is not None and self.overhead <= level + LEVEL_EPS

    def refutes(self, level: float) -> bool:
        """Proven: no plan at this size is within `level`."""
        if self.status in ("infeasible", "bound"):
            return True
        return self.status in ("optimal", "keep-all") and not self.within(level)


@dataclass
class LevelAnswer:
    level: float
    size: int             # 0: not even size 1
    proven: bool          # the size above was refuted (module docstring)
    capped: bool = False  # the search stopped at `max_size`

    def describe(self, dim: str) -> str:
        if self.capped:
            return f">= {self.size} (the search stops at {self.size})"
        return str(self.size) + ("" if self.proven else f" (at least; {dim} {self.size + 1} was not decided)")


@dataclass
class CapacityResult:
    memory: int
    dim: str
    levels: list[LevelAnswer]
    plain_size: int
    probes: dict[int, Probe]

    def best(self) -> LevelAnswer:
        """The answer at the largest overhead level."""
        return self.levels[-1]

    def plan(self) -> Plan | None:
        """The plan at the largest size within the largest level (None if nothing fits)."""
        b = self.best()
        return self.probes[b.size].plan if b.size else None

    def table(self) -> list[Probe]:
        return [self.probes[s] for s in sorted(self.probes)]


def levels_for(max_overhead: float) -> list[float]:
    """The overhead levels of a search: no recomputation, <= 1.1x, <= the cap."""
    if not max_overhead >= 1.0 or math.isinf(max_overhead):
        raise InvalidInputError(f"--max-overhead: must be a finite number >= 1, got {max_overhead}")
    return sorted({1.0, min(1.1, max_overhead), float(max_overhead)})


class Prober:
    """Probes sizes of a family against a memory, once each (module docstring, steps 1-3)."""

    def __init__(self, family: GraphFamily, memory: int, *, swap: bool = False, solver: str = "ilp",
                 on_probe: Callable[[Probe], None] | None = None, **options):
        self.family, self.memory, self.swap, self.solver = family, int(memory), bool(swap), solver
        self.options, self.on_probe = options, on_probe
        self.probes: dict[int, Probe] = {}

    def __call__(self, size: int) -> Probe:
        if size not in self.probes:
            self.probes[size] = p = self._probe(size)
            log.info("capacity: %s %d: %s", self.family.dim, size, p.status)
            if self.on_probe is not None:
                self.on_probe(p)
        return self.probes[size]

    def _probe(self, size: int) -> Probe:
        g, memory = self.family.at(size), self.memory
        keep = keep_all_peak(g)
        if keep <= memory:
            p = make_plan(g, memory, "checkpoint-all", swap=False)
            return Probe(size, "keep-all", keep, 1.0, p.predicted["peak_bytes"], p)
        if node_need(g) > memory or (not self.swap and forced_need(g) > memory):
            return Probe(size, "bound", keep)
        try:
            p = make_plan(g, memory, self.solver, swap=self.swap, explain=False, **self.options)
        except InfeasibleBudgetError:
            return Probe(size, "infeasible", keep)
        except SolverError as e:
            log.info("capacity: %s %d: %s", self.family.dim, size, e)
            return Probe(size, "no plan found", keep)
        status = "optimal" if p.solver.get("status") == "optimal" else "feasible"
        return Probe(size, status, keep, p.predicted["overhead"], p.predicted["peak_bytes"], p)


def _bisect(holds: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest size in [lo, hi) where `holds`, given holds(lo) (or lo == 0) and not holds(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo


def largest(holds: Callable[[int], bool], start: int, max_size: int = MAX_SIZE) -> tuple[int, bool]:
    """(the largest size in 1..max_size where `holds`, assuming it holds up to some size and not
    above; whether the search reached max_size).  Doubles from `start`, then bisects."""
    if not holds(1):
        return 0, False
    lo, s = 1, max(2, int(start))
    while s <= max_size and holds(s):
        lo, s = s, s * 2
    if s > max_size:
        if lo == max_size or holds(max_size):
            return max_size, True
        s = max_size
    return _bisect(holds, lo, s), False


def largest_near(holds: Callable[[int], bool], guess: int, max_size: int = MAX_SIZE) -> int:
    """The largest size in 1..max_size where `holds` (0 if none; the same assumption as
    `largest`), probing outward from `guess` in doubling steps, then bisecting: about
    2 log2 |answer - guess| probes when the guess is close."""
    g = min(max(1, int(guess)), max_size)
    step = 1
    if holds(g):
        lo = g
        while True:
            s = lo + step
            if s > max_size:
                if lo == max_size or holds(max_size):
                    return max_size
                hi = max_size
                break
            if not holds(s):
                hi = s
                break
            lo, step = s, step * 2
    else:
        hi = g
        while True:
            s = hi - step
            if s < 1:
                lo = 0
                break
            if holds(s):
                lo = s
                break
            hi, step = s, step * 2
    return _bisect(holds, lo, hi)


def search(family: GraphFamily, memory: int, levels: Iterable[float] = (1.0, 1.1, 1.3), *, swap: bool = False,
           solver: str = "ilp", max_size: int = MAX_SIZE, on_probe: Callable[[Probe], None] | None = None,
           **options) -> CapacityResult:
    """The largest size per overhead level within `memory` bytes (module docstring).  `options`
    go to the solver (``time_limit``, ``gap``...).  Raises `InvalidInputError` when `memory` is
    below what size 1 holds before any activation."""
    memory = int(memory)
    g1 = family.at(1)
    if g1.fixed_bytes >= memory:
        raise InvalidInputError(
            f"--memory {format_bytes(memory)} is below the fixed bytes of {family.dim} 1 "
            f"({format_bytes(g1.fixed_bytes)}: parameters, inputs, optimizer state), so no {family.dim} fits; "
            "give more memory")
    probe = Prober(family, memory, swap=swap, solver=solver, on_probe=on_probe, **options)
    start = family.sizes[-1]
    answers = []
    for level in sorted(set(levels)):
        size, capped = largest(lambda s: probe(s).within(level), start, max_size)
        above = probe.probes.get(size + 1)
        if above is None and not capped:
            above = probe(size + 1)
        proven = capped or (above is not None and above.refutes(level))
        answers.append(LevelAnswer(level, size, proven, capped))
    plain, _ = largest(lambda s: keep_all_peak(family.at(s)) <= memory, start, max_size)
    return CapacityResult(memory, family.dim, answers, plain, probe.probes)


__all__ = ["fit_polynomial", "polynomial_value", "GraphFamily", "Probe", "LevelAnswer", "CapacityResult", "Prober", "search", "largest", "largest_near", "levels_for",
           "DIMS", "MAX_SIZE"]
