"""The rotor-style block DP (solvers/rotor.py): cuts, validity, predicted = simulated, against revolve."""
import pytest

from remat.core.errors import InfeasibleBudgetError, InvalidInputError
from remat.generators import from_forward, linear_chain, random_layered, unet
from remat.core.graph import Graph, Node
from remat.core.simulate import simulate
from remat.solvers import get, rotor
from remat.solvers.griewank import chain_bound


def residual_chain(blocks: int, *, wide: int = 4, narrow: int = 1) -> "Graph":
    """Blocks of conv -> conv -> add(block input, conv): cuts only at the adds."""
    times, sizes, edges = [1.0], [wide], []
    for _ in range(blocks):
        a = len(times) - 1
        times += [1.0, 2.0, 0.5]
        sizes += [narrow, wide, wide]
        edges += [(a, a + 1), (a + 1, a + 2), (a + 2, a + 3), (a, a + 3)]
    return from_forward(times, sizes, edges, loss_bytes=1)


def test_cuts_of_a_chain_are_every_position_and_of_a_residual_chain_the_adds():
    g = linear_chain(6)
    assert rotor.cut_points(g, 6) == [0, 1, 2, 3, 4]
    r = residual_chain(3)
    assert rotor.cut_points(r, 10) == [0, 3, 6]  # the stem and the first two adds
    ch = rotor.chain_of_blocks(r)
    assert ch.out == [-1, 0, 3, 6, 10] and ch.fwd[2] == [1, 2, 3]
    assert ch.bwd[2] == sorted(2 * 10 - v for v in (1, 2, 3))
    # the gradient of block 3's input flows through both of its branches: two values cross
    assert len(ch.cross[2]) == 2
    u = unet(4)
    m = u.n // 2
    assert all(p < 2 or p > m - 4 for p in rotor.cut_points(u, m))  # the skips span the middle


def test_merges_long_chains_into_max_blocks():
    ch = rotor.chain_of_blocks(linear_chain(40), max_blocks=8)
    assert ch.L == 8 and sorted(v for f in ch.fwd for v in f) == list(range(41))


@pytest.mark.parametrize("make,ratios", [
    (lambda: linear_chain(12), (1.0, 0.6, 0.4)),
    (lambda: linear_chain(9, size=3, fixed_bytes=5), (0.7, 0.5)),
    (lambda: residual_chain(4), (1.0, 0.7, 0.5)),
    (lambda: residual_chain(6, wide=6, narrow=2), (0.6, 0.45)),
])
def test_plans_fit_and_the_dp_predicts_the_simulated_time(make, ratios):
    g = make()
    peak_all = simulate(g, get("checkpoint-all")(g)).peak_bytes
    for ratio in ratios:
        budget = int(ratio * peak_all)
        sched = get("rotor")(g, budget)
        res = simulate(g, sched)
        assert res.valid and res.peak_bytes <= budget
        assert res.time == pytest.approx(sched.report["predicted"], rel=1e-12)
        assert res.time >= g.total_time - 1e-9
        if ratio == 1.0:
            assert res.time == pytest.approx(g.total_time)  # nothing to recompute


def test_never_slower_than_revolve_on_unit_chains_and_never_below_the_chain_bound():
    strictly = 0
    for layers in range(3, 15):
        g = linear_chain(layers)
        for budget in range(2, layers + 2):
            try:
                rev = simulate(g, get("griewank")(g, budget)).time
            except InfeasibleBudgetError:
                continue
            t = simulate(g, get("rotor")(g, budget)).time
            assert t <= rev + 1e-9
            strictly += t < rev - 1e-9
            bound = chain_bound(g, budget)
            assert bound is None or t >= bound - 1e-9
    assert strictly >= 10  # the per-block keep choice and held outputs beat plain revolve
    # where the chain bound proves it, the DP meets the optimum (32 layers at 10 units: 121)
    g = linear_chain(32)
    assert simulate(g, get("rotor")(g, 10)).time == pytest.approx(121) == chain_bound(g, 10)


def test_infeasible_budget_reports_a_budget_that_works():
    g = residual_chain(4)
    with pytest.raises(InfeasibleBudgetError) as e:
        get("rotor")(g, 6)
    least = e.value.min_feasible_bytes
    assert least is not None and least > 6
    res = simulate(g, get("rotor")(g, least))
    assert res.peak_bytes <= least
    # a graph without cut points is one block: the DP still plans it when the budget allows
    g = random_layered(8, seed=1)
    res = simulate(g, get("rotor")(g, None))
    assert res.valid and res.time == pytest.approx(g.total_time)


def test_rejects_graphs_without_checkmate_layout():
    g = Graph([Node(0, "a", "forward", 1.0, 1), Node(1, "b", "backward", 1.0, 1)], [(0, 1)])
    with pytest.raises(InvalidInputError, match="Checkmate's layout"):
        get("rotor")(g, 10)
