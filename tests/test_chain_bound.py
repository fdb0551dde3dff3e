"""Revolve's count as a lower bound on chains (`griewank.chain_bound`): the combinatorial model it
rests on against brute force, the bound against exact optima (never above, equal on unit chains),
and the exact ILP proving chain32 at 9 units through it."""
from __future__ import annotations

import itertools
import random

import pytest

from remat import simulate
from remat.generators import from_forward, linear_chain, random_layered
from remat.core.graph import Graph, Node
from remat.solvers import griewank, ilp
from remat.solvers.baselines import checkpoint_all
from remat.core.analysis import forced_need

from exhaustive import exhaustive_optimum


def reversal_brute_force(l: int, s: int) -> int:
    """Fewest advances to reverse l steps with s snapshots (x_0 in one), over every sequence of
    snapshot sets: before step j the cursor is x_{j-1} and the snapshots are a set C of x_1..x_{j-2}
    (|C| <= s-1); going from set A (before step j+1) to C pays, per gap of A + {x_0} that holds
    new values (C and the cursor, less A), the highest new index minus the gap's base.  The
    first sweep to x_{l-1} costs l-1 and may store any set."""
    def sets(top: int):
        items = range(1, top + 1)
        return [frozenset(c) for r in range(min(s - 1, max(0, top)) + 1) for c in itertools.combinations(items, r)]

    def cost(A: frozenset, new: set) -> int:
        bases = sorted(A | {0})
        total = 0
        for i, b in enumerate(bases):
            top = bases[i + 1] if i + 1 < len(bases) else l + 1
            inside = [p for p in new if b < p < top]
            total += max(inside) - b if inside else 0
        return total

    if l <= 1:
        return 0
    best = {A: l - 1 for A in sets(l - 2)}
    for j in range(l - 1, 0, -1):
        best = {C: min(v + cost(A, (C | {j - 1}) - A - {0}) for A, v in best.items()) for C in sets(j - 2)}
    return min(best.values())


@pytest.mark.parametrize("l", range(1, 10))
def test_the_reversal_model_costs_revolves_closed_form(l):
    for s in range(1, 5):
        assert reversal_brute_force(l, s) == griewank.binomial_cost(l, s), (l, s)


def odd_chain(seed: int) -> Graph:
    """A chain with uneven times and sizes, workspace on some layers and fixed bytes."""
    rng = random.Random(seed)
    n = rng.randint(4, 7)
    base = from_forward([float(rng.randint(1, 4)) for _ in range(n)], [rng.randint(1, 4) for _ in range(n)],
                        [(i, i + 1) for i in range(n - 1)], fixed_bytes=rng.choice([0, 3]))
    nodes = [Node(v.id, v.name, v.kind, v.time, v.bytes, (v.id % 2) if v.kind == "forward" else 0)
             for v in base.nodes]
    return Graph(nodes, base.edges, base.fixed_bytes, base.meta)


def budgets(g: Graph) -> range:
    return range(forced_need(g), simulate(g, checkpoint_all(g)).peak_bytes + 1)


def exact_optima(g: Graph) -> dict[int, dict]:
    """The exact ILP's report at every feasible budget, proven without revolve's bound."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(griewank, "chain_bound", lambda *a, **k: None)
        return {B: ilp.solve(g, B, swap=False, time_limit=60, threads=1, mode="exact").report for B in budgets(g)}


@pytest.mark.parametrize("layers", [3, 5, 7, 8])
def test_equal_to_the_exact_optimum_on_unit_chains(layers):
    g = linear_chain(layers)
    for B, r in exact_optima(g).items():
        assert r["status"] == "optimal", (layers, B, r)
        assert griewank.chain_bound(g, B) == pytest.approx(r["objective"]), (layers, B)


@pytest.mark.parametrize("seed", range(4))
def test_never_above_the_exact_optimum_on_uneven_chains(seed):
    g = odd_chain(seed)
    for B, r in exact_optima(g).items():
        bound = griewank.chain_bound(g, B)
        assert r["status"] == "optimal", (seed, B, r)
        assert bound is not None and g.total_time <= bound <= r["objective"] + 1e-9, (seed, B)


def test_never_above_brute_force_on_tiny_uneven_chains():
    # the exhaustive search (tests/exhaustive.py) shares no code with the ILP or the bound
    for seed in range(3):
        rng = random.Random(10 + seed)
        g = from_forward([float(rng.randint(1, 3)) for _ in range(4)], [rng.randint(1, 3) for _ in range(4)],
                         [(i, i + 1) for i in range(3)])
        for B in budgets(g):
            best = exhaustive_optimum(g, B, swap=False)
            bound = griewank.chain_bound(g, B)
            assert best is not None and bound is not None
            assert bound <= best + 1e-9, (seed, B, bound, best)


def test_chain32_at_9_units_is_proven_optimal_through_it():
    # CBC alone (Checkmate's model or the instant IP) stops at a bound of 122 after 600 s
    g = linear_chain(32)
    assert griewank.chain_bound(g, 9) == 126.0
    s = ilp.solve(g, 9, swap=False, time_limit=30, threads=1)
    r = s.report
    assert r["status"] == "optimal" and r["objective"] == 126.0 and r["lower_bound"] == 126.0, r
    assert r["bound_from"] == "chain (revolve)"
    res = simulate(g, s)
    assert res.valid and res.peak_bytes <= 9 and res.time == 126.0


def test_only_for_chains():
    assert griewank.chain_bound(random_layered(12, seed=0), 40) is None
    g = linear_chain(8)
    assert griewank.chain_bound(g, 2) is None  # nothing fits: the forced-need check speaks
    # more memory never raises the bound, and with enough of it the bound is the plain time
    values = [griewank.chain_bound(g, B) for B in budgets(g)]
    assert values == sorted(values, reverse=True) and values[-1] == g.total_time
