"""granularity="joint": one node per allocating ATen op of the joint forward+backward graph
(frontends/joint.py) and the executor that runs plans over it (frontends/joint_executor.py).

A hand-checked Linear-ReLU-Linear graph; ILP plans at 1.0x and at the smallest feasible budget
train as plain autograd (loss, gradients, BatchNorm statistics, dropout masks) with the measured
peak at the predicted one; GPT-2 (zoo, small) traces, validates, plans and runs."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

from test_executor import DropoutMLP, _plain_and_planned as _plain_and_planned_step  # noqa: E402
from test_frontends import BranchOnValue  # noqa: E402
import remat  # noqa: E402
from remat.core.errors import InvalidInputError  # noqa: E402
from remat.frontends import default_loss, measure_peak, zoo  # noqa: E402
from remat.frontends.capture import CaptureError  # noqa: E402
from remat.frontends import apply  # noqa: E402
from remat.frontends.joint_executor import PlannedJointStep  # noqa: E402
from remat.frontends.applying import PlainExecution  # noqa: E402
from remat.frontends.run import gradients_to_none, run_plan  # noqa: E402
from remat.core.plan import Plan  # noqa: E402
from remat.core.schedule import Op, Schedule  # noqa: E402
from remat.solvers.ilp import min_feasible_budget  # noqa: E402

PEAK_TOLERANCE = 0.10   # docs/design.md, "Predict = execute"
EXACT_TOLERANCE = 0.01  # what the CPU accounting actually gives (a few bytes)
F32 = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- the hand-checked graph -----------------------------------------------------------------------
def _small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (torch.randn(5, 8),)


@pytest.fixture(scope="module")
def small_graph():
    model, inputs = _small()
    return model, inputs, remat.trace(model, inputs, granularity="joint", profile="flops")


def test_linear_relu_linear_graph_matches_hand_computed_nodes_edges_and_bytes(small_graph):
    model, inputs, g = small_graph
    B, I, H, O = 5, 8, 16, 4
    # (name, kind, bytes, workspace, persistent): a parameter gradient is its node's workspace while
    # it runs and, as the parameter's first gradient of the step (PyTorch's default loop), its
    # persistent bytes: it becomes .grad as it is (autograd's steal) and stays to the step's end
    expected = [
        ("addmm", "forward", B * H * F32, 0, 0),            # x @ W1^T + b1
        ("relu", "forward", B * H * F32, 0, 0),             # (its detach aliases merged in)
        ("addmm_1", "forward", B * O * F32, 0, 0),          # logits
        ("loss", "loss", 2 * F32, 0, 0),                    # sum + its seed ones_like
        ("mm", "backward", B * H * F32, 0, 0),              # dL/d relu = seed.expand @ W2
        ("mm_1", "backward", 0, O * H * F32, O * H * F32),  # dL/dW2 -> .grad
        ("sum_2", "backward", 0, O * F32, O * F32),         # dL/db2 -> .grad
        ("threshold_backward", "backward", B * H * F32, 0, 0),
        ("mm_2", "backward", 0, H * I * F32, H * I * F32),  # dL/dW1 -> .grad
        ("sum_3", "backward", 0, H * F32, H * F32),         # dL/db1 -> .grad
    ]
    # (workspace as the storages show it: a kernel's own allocations, `scratch_bytes`, come on top;
    # here mm's contiguous copy of the expanded seed, as the CPU kernel makes it)
    assert [(v.name, v.kind, v.bytes, v.workspace_bytes - v.extra.get("scratch_bytes", 0), v.persistent_bytes)
            for v in g.nodes] == expected
    assert g.edges == [(0, 1), (1, 2), (1, 5), (1, 7), (2, 3), (3, 4), (3, 5), (3, 6), (4, 7), (7, 8), (7, 9)]
    assert [v.extra.get("param_grads") for v in g.nodes][5:] == [["2.weight"], ["2.bias"], None, ["0.weight"],
                                                                ["0.bias"]]
    params = (I * H + H + H * O + O) * F32
    assert g.fixed_bytes == params + B * I * F32   # parameters + input (the gradients: persistent bytes)
    assert g.persistent_total == params
    kept = remat.trace(model, inputs, granularity="joint", profile="flops", grads="resident")
    # a loop that keeps its gradients: fixed bytes, and each new one a transient added into them
    assert kept.fixed_bytes == 2 * params + B * I * F32 and kept.persistent_total == 0
    assert [(v.bytes, v.workspace_bytes - v.extra.get("scratch_bytes", 0)) for v in kept.nodes] == \
        [(b, w) for _, _, b, w, _ in expected]
    assert g.meta["granularity"] == "joint" and g.meta["joint"]["seed"] == "ones_like"
    assert all(v.time > 0 for v in g.nodes)
    # JSON round trip: what apply needs (op names) survives
    assert remat.Graph.from_dict(g.to_dict()).content_hash() == g.content_hash()


def test_checkpoint_all_simulates_as_a_training_graph(small_graph):
    _, _, g = small_graph
    plan = remat.plan(g, "1.0x", solver="checkpoint-all", swap=False)
    res = remat.simulate(g, plan.schedule)
    assert res.valid and res.compute_counts == [1] * g.n
    # no recomputation: the peak is fixed + the largest set of values alive at once
    assert res.peak_bytes == plan.predicted["peak_bytes"]


class CubicBlocks(nn.Module):
    """Residual blocks whose activation's derivative has a part that reads only the forward's
    value: the backward of ``x.pow(3)`` computes ``x.pow(2)`` (transformers' tanh-GELU has it)."""

    def __init__(self, width=16, blocks=3):
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, 64)

    def forward(self, x):
        for fc in self.fcs:
            h = fc(x)
            x = x + torch.tanh(h + 0.04 * h.pow(3))
        return self.head(x)


def test_a_backward_formulas_part_on_forward_values_comes_right_after_its_input():
    # traced after the loss, x.pow(2) is a forward node (the solvers may recompute it); placed at
    # the end of the forward it would need every block's input at the head's instant
    torch.manual_seed(0)
    model, inputs = CubicBlocks(), (torch.randn(4, 16),)
    g = remat.trace(model, inputs, granularity="joint", profile="flops")
    loss = next(v.id for v in g.nodes if v.kind == "loss")
    # 3 * x.pow(2): a pow of the block's addmm and a mul that only the backward reads
    scaled = [v for v in g.nodes if v.kind == "forward" and v.extra["op"].startswith("mul")
              and all(g.nodes[s].kind == "backward" for s in g.succs[v.id])]
    assert len(scaled) == 3, [v.name for v in g.nodes]
    for v in scaled:
        (square,) = g.preds[v.id]
        (made,) = g.preds[square]
        assert g.nodes[square].extra["op"].startswith("pow") and g.nodes[made].extra["op"].startswith("addmm")
        assert v.id == square + 1 == made + 2 < loss - 2, (v.name, g.nodes[made].name)
    res = remat.simulate(g, remat.plan(g, "1.0x", solver="checkpoint-all").schedule)
    assert res.valid and res.compute_counts == [1] * g.n


def test_forward_order_moves_parts_traced_after_the_loss_behind_their_latest_input():
    from remat.frontends.joint import forward_order
    kinds = ["forward", "forward", "forward", "loss", "forward", "forward", "backward", "forward"]
    preds = [[], [0], [1], [2], [0], [4, 1], [3, 5], []]
    # 4 reads 0: after 0; 5 reads 4 and 1: after 1; 7 reads nothing of the step: where traced
    assert forward_order(kinds, preds) == [0, 4, 1, 5, 2, 7]


# ---- plans run as plain autograd ----------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return DropoutMLP(width=24, layers=3), (torch.randn(16, 24),)


def _cnn():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                      nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    return m, (torch.randn(2, 3, 8, 8),)


MODELS = {"mlp-dropout": _mlp, "cnn-batchnorm": _cnn}


@pytest.fixture(scope="module", params=sorted(MODELS))
def planned(request):
    model, inputs = MODELS[request.param]()
    model.train()
    graph = remat.trace(model, inputs, granularity="joint", profile="flops")
    full = remat.plan(graph, "1.0x", solver="ilp", swap=False, time_limit=20)
    tightest = min_feasible_budget(graph, swap=False, time_limit=5)[0]
    tight = remat.plan(graph, tightest, solver="ilp", swap=False, time_limit=20)
    # swaps nearly free at this bandwidth: the ILP swaps where it would otherwise recompute
    swapped = remat.plan(graph, tightest, solver="ilp", swap=True, time_limit=20, bandwidth=1e13)
    return request.param, model, inputs, graph, {"1.0x": full, "tightest": tight, "swap": swapped}


def test_random_and_mutating_nodes_are_marked(planned):
    name, _, _, graph, _ = planned
    if name == "mlp-dropout":
        assert len(graph.meta["rng_nodes"]) == 3
        assert all(graph.nodes[i].extra["random"] and graph.nodes[i].kind == "forward" for i in graph.meta["rng_nodes"])
    else:
        mutated = sorted(b for bs in graph.meta["buffer_mutations"].values() for b in bs)
        assert mutated == sorted(n for n, _ in _cnn()[0].named_buffers())


def test_tight_plan_recomputes(planned):
    name, _, _, graph, plans = planned
    counts = remat.simulate(graph, plans["tightest"].schedule).compute_counts
    assert any(c > 1 for c in counts), name
    assert plans["tightest"].predicted["peak_bytes"] < plans["1.0x"].predicted["peak_bytes"]


def _plain_and_planned(model, inputs, plan):
    out = _plain_and_planned_step(model, inputs, plan)
    assert isinstance(out[2], PlannedJointStep)   # remat.apply dispatched to the joint executor
    return out


@pytest.mark.parametrize("budget", ["1.0x", "tightest", "swap"])
def test_gradients_and_buffers_equal_plain_autograd(planned, budget):
    name, model, inputs, _, plans = planned
    ref, mine, _, loss_ref, loss = _plain_and_planned(model, inputs, plans[budget])
    assert torch.allclose(loss, loss_ref, rtol=1e-6, atol=1e-7), (name, loss.item(), loss_ref.item())
    for (n, p), q in zip(ref.named_parameters(), mine.parameters()):
        assert q.grad is not None, n
        assert torch.allclose(q.grad, p.grad, rtol=1e-6, atol=1e-7), (name, n, (q.grad - p.grad).abs().max())
    for (n, b), c in zip(ref.named_buffers(), mine.buffers()):   # running statistics: updated once
        assert torch.equal(b, c), (name, n)


def test_measured_peak_is_the_predicted_peak(planned):
    name, model, inputs, _, plans = planned
    for budget, plan in plans.items():
        mine = copy.deepcopy(model)
        step = apply(mine, plan, inputs)
        step(*inputs).backward()   # gradients exist from now on, as in a training loop
        mine.zero_grad(set_to_none=gradients_to_none(plan))
        resident = list(mine.parameters()) + list(mine.buffers()) + list(inputs) + [p.grad for p in mine.parameters()
                                                                                    if p.grad is not None]
        peak = measure_peak(lambda: step(*inputs).backward(), resident=resident)
        predicted = plan.storage_peak_bytes   # (the storage accounting: no kernel scratch)
        assert abs(peak - predicted) <= PEAK_TOLERANCE * predicted, (name, budget, peak, predicted)
        assert abs(peak - predicted) <= EXACT_TOLERANCE * predicted, (name, budget, peak, predicted)
        # the allocator's own figure, kernels' scratch and the saved generator states included, is
        # the predicted peak, within the budget
        whole = remat.measure(lambda: step(*inputs).backward(), "cpu", resident=resident, meter="allocator").peak_bytes
        # (at most one saved generator state under it: a first compute does not save the state a
        # recomputation saves beside the node's own, and the model counts it at every compute)
        state = torch.get_rng_state().numel()
        assert plan.predicted["peak_bytes"] - state - 0.01 * whole <= whole <= plan.predicted["peak_bytes"] + 8, \
            (name, budget, whole, plan.predicted["peak_bytes"])
        # swapped bytes live on the host, exactly as many as the simulator says
        assert step.host_peak_bytes == plan.predicted["host_peak_bytes"], (name, budget)
    assert any(o.op == "swap_out" for o in plans["swap"].schedule.ops), name
    assert plans["swap"].predicted["host_peak_bytes"] > 0, name


def test_a_plan_that_asks_nothing_runs_as_plain_autograd_where_plains_measured_peak_fits():
    """``executor="auto"`` on a plan that computes every node once and swaps nothing, at a budget
    that plain autograd's measured peak fits: the model runs unchanged (`PlainExecution`), predicted
    by the plain step the trace measured, on both meters (here below the plan's own peak: plain
    autograd keeps no generator states for recomputations).  A plan that recomputes, a budget
    below plain's measured peak (the zoo GPT-2: eager's CPU dropout keeps float masks where the
    joint graph keeps bool ones) and the interpreter asked for by name run the plan's own code."""
    model, inputs = _mlp()
    model.train()
    graph = remat.trace(model, inputs, granularity="joint", profile="measure")
    measured = graph.meta["plain_step"]
    assert measured["input_shapes"] == [list(inputs[0].shape)]
    keep_all = remat.plan(graph, "1.0x", solver="checkpoint-all", swap=False)
    assert measured["peak_bytes"] < keep_all.predicted["peak_bytes"]
    assert isinstance(apply(copy.deepcopy(model), keep_all, inputs, executor="auto"), PlainExecution)
    for meter, key in (("allocator", "peak_bytes"), ("storage", "storage_peak_bytes")):
        rep = run_plan(copy.deepcopy(model), inputs, keep_all, steps=2, executor="auto", meter=meter)
        assert rep.executor == "plain" and rep.predicted["peak_bytes"] == measured[key], meter
        assert abs(rep.peak_bytes - measured[key]) <= 0.001 * measured[key], (meter, rep.peak_bytes, measured)
        assert max(m.peak_bytes for m in rep.plain_steps) == rep.peak_bytes, meter
    assert isinstance(apply(copy.deepcopy(model), keep_all, inputs), PlannedJointStep)   # (asked for by name)
    recomputes = remat.plan(graph, "1.0x", solver="checkpoint-last-node", swap=False)
    assert isinstance(apply(copy.deepcopy(model), recomputes, inputs, executor="auto"), PlannedJointStep)
    gpt, x = zoo.get("gpt2", n_layer=1, seq_len=32, batch=2)
    x = x if isinstance(x, tuple) else (x,)
    graph = remat.trace(gpt, x, granularity="joint", profile="measure")
    keep_all = remat.plan(graph, "1.0x", solver="checkpoint-all", swap=False)
    assert keep_all.predicted["peak_bytes"] < graph.meta["plain_step"]["peak_bytes"]
    assert isinstance(apply(copy.deepcopy(gpt), keep_all, x, executor="auto"), PlannedJointStep)


def test_straight_line_code_runs_what_the_interpreter_runs(planned):
    """The plan written as Python (`joint_codegen`) against the op-by-op interpreter: same loss,
    bit-identical gradients and statistics, the same measured peak and host bytes."""
    name, model, inputs, _, plans = planned
    for budget in ("1.0x", "tightest", "swap"):
        got = {}
        for straight in (True, False):
            mine = copy.deepcopy(model)
            step = apply(mine, plans[budget], inputs)
            assert step.code is not None and step.interpreted_because is None, (name, budget)
            step.straight_line = straight
            torch.manual_seed(3)
            peak = measure_peak(lambda: step(*inputs).backward(),
                                resident=list(mine.parameters()) + list(mine.buffers()) + list(inputs))
            got[straight] = (peak, step.host_peak_bytes, [p.grad for p in mine.parameters()], list(mine.buffers()))
        assert got[True][:2] == got[False][:2], (name, budget, got[True][:2], got[False][:2])
        for a, b in zip(got[True][2] + got[True][3], got[False][2] + got[False][3]):
            assert torch.equal(a, b), (name, budget)
    assert any(o.op == "swap_in" for o in plans["swap"].schedule.ops), name


def test_straight_line_code_is_refused_for_a_plan_that_reads_a_freed_value(small_graph):
    model, inputs, g = small_graph
    plan = remat.plan(g, "1.0x", solver="checkpoint-all", swap=False)
    ops = list(plan.schedule.ops)
    # free the first forward node right after its compute: a later node reads it
    k = next(k for k, o in enumerate(ops) if o.op == "compute" and g.nodes[o.node].kind == "forward")
    broken = Plan(g, Schedule(ops[:k + 1] + [Op("free", ops[k].node)] + ops[k + 1:]), plan.budget_bytes,
                  plan.solver, plan.predicted)
    step = apply(copy.deepcopy(model), broken, inputs)
    assert step.code is None and "not resident" in step.interpreted_because
    with pytest.raises(RuntimeError, match="not resident"):   # the interpreter says where, at run time
        step(*inputs).backward()


def test_gradients_accumulate_and_the_loss_gradient_is_honoured():
    model, inputs = _cnn()
    graph = remat.trace(model, inputs, granularity="joint", profile="flops")
    plan = remat.plan(graph, "1.0x", solver="checkpoint-all", swap=False)
    ref, mine = copy.deepcopy(model), copy.deepcopy(model)
    step = apply(mine, Plan.from_dict(plan.to_dict()), inputs)    # through JSON: re-captured, not pickled
    for _ in range(2):   # two steps without zero_grad: gradients add up, as with autograd
        (3.0 * default_loss(ref(*inputs), *inputs)).backward()
        (3.0 * step(*inputs)).backward()
    for (n, p), q in zip(ref.named_parameters(), mine.parameters()):
        assert torch.allclose(q.grad, p.grad, rtol=1e-6, atol=1e-6), (n, (q.grad - p.grad).abs().max())
    for b, c in zip(ref.buffers(), mine.buffers()):
        assert torch.allclose(b, c)
    mine.eval()   # eval mode runs the plain model
    assert torch.equal(step(*inputs), default_loss(mine(*inputs), *inputs))


# ---- errors -----------------------------------------------------------------------------------------
def test_bad_input_and_foreign_plans_are_refused(small_graph):
    model, inputs, g = small_graph
    plan = remat.plan(g, "1.0x", solver="checkpoint-all", swap=False)
    with pytest.raises(InvalidInputError, match="shapes"):
        apply(copy.deepcopy(model), plan, (torch.randn(7, 8),))
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))
    with pytest.raises(InvalidInputError, match="re-plan"):
        apply(other, plan, inputs)
    with pytest.raises(InvalidInputError, match="scalar"):
        remat.trace(model, inputs, loss_fn=lambda out, x: out, granularity="joint", profile="flops")
    with pytest.raises(InvalidInputError, match="profile"):
        remat.trace(model, inputs, granularity="joint", profile="fast")
    b = next(v.id for v in g.nodes if v.kind == "backward" and v.bytes > 0)
    k = next(k for k, o in enumerate(plan.schedule.ops) if o.op == "compute" and o.node == b)
    swapping = Plan(g, Schedule(list(plan.schedule.ops[:k + 1]) + [Op("swap_out", b), Op("wait", b)]
                                + list(plan.schedule.ops[k + 1:])), plan.budget_bytes, plan.solver, plan.predicted)
    with pytest.raises(NotImplementedError, match="forward nodes only"):
        apply(copy.deepcopy(model), swapping, inputs)


def test_capture_failure_names_the_reason():
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match="joint capture .* failed"):
        remat.trace(BranchOnValue(), (torch.randn(2, 8),), granularity="joint", profile="flops")


# ---- GPT-2 ---------------------------------------------------------------------------------------------
def test_gpt2_traces_validates_plans_and_runs():
    torch.manual_seed(0)
    model, inputs = zoo.get("gpt2")
    model.train()
    g = remat.trace(model, inputs, granularity="joint", profile="flops")
    g = remat.Graph.from_dict(g.to_dict())   # validates
    kinds = [v.kind for v in g.nodes]
    assert kinds.count("loss") == 1 and kinds.index("loss") == kinds.count("forward")
    fb = g.meta["fixed_breakdown"]
    # (and the generator state the executor keeps per random node, which no op makes)
    assert g.meta["rng_state_bytes"] == fb["rng_states"] == len(g.meta["rng_nodes"]) * torch.get_rng_state().numel()
    assert len(g.meta["rng_nodes"]) > 0 and g.fixed_bytes == fb["parameters"] + fb["buffers"] + fb["inputs"] + \
        fb["rng_states"]
    # the tied embedding / head weight: one gradient, allocated by the first node that makes it
    # (the head's), added into by the embedding's backward
    assert g.persistent_total == fb["parameters"]
    plan = remat.plan(g, "1.0x", solver="ilp", swap=False, time_limit=15)
    assert remat.simulate(g, plan.schedule).valid
    _, _, _, loss_ref, loss = _plain_and_planned(model, inputs, plan)
    assert torch.allclose(loss, loss_ref, rtol=1e-6, atol=1e-7)
