"""Layer placement with micro-batches (`remat.solvers.pipeline`, `remat.partitioning.
layer_placement`) run on `torch.distributed.pipelining` (`remat.pipelining`; gloo, CPU
processes): where stages may begin, the cut against brute force, and runs whose loss and
gradients are one process's, whose bytes sent are the plan's to the byte, and whose per-rank
peaks are within 10 % of each stage's prediction."""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from gloo import run_partition_plan, spawn_rows  # noqa: E402
from remat.core.errors import InvalidInputError  # noqa: E402
from remat.frontends.partitioning import op_graph  # noqa: E402
from remat.solvers import pipeline as pl  # noqa: E402

F = torch.nn.functional


def _gpt(layers=4):
    from remat.frontends.zoo import GPT
    torch.manual_seed(0)
    return GPT(vocab_size=128, block_size=32, n_layer=layers, n_head=4, n_embd=32, dropout=0.0)


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                        torch.nn.GELU())
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.body(x))


def _cross_entropy(out, x, y):
    return F.cross_entropy(out, y)


def _case(name):
    """(model, batch, loss_fn, model_inputs), the same in every process."""
    gen = torch.Generator().manual_seed(1)
    if name == "classifier":
        torch.manual_seed(0)
        return Classifier(), (torch.randn(8, 32, generator=gen), torch.randint(0, 10, (8,), generator=gen)), \
            _cross_entropy, 1
    return _gpt(), (torch.randint(0, 128, (8, 32), generator=gen),), None, None


def test_stages_begin_at_modules_that_are_called():
    """A stage may begin at a block or any module called once, never at a container that is
    never called (`transformer.h`, a ModuleList) and never at op 0."""
    g = op_graph(_gpt(), (torch.randint(0, 128, (2, 32)),))
    starts = pl.stage_starts(g)
    names = set(starts.values())
    assert {"transformer.h.1", "transformer.h.2", "transformer.h.3", "lm_head"} <= names
    assert "transformer.h" not in names and "transformer" not in names and 0 not in starts
    for i, name in starts.items():
        assert g.ops[i].module == name or g.ops[i].module.startswith(name + ".")
        assert not (g.ops[i - 1].module == name or g.ops[i - 1].module.startswith(name + "."))


@pytest.mark.parametrize("devices,balance", [(2, "memory"), (3, "memory"), (4, "memory"), (3, "time"), (4, "time")])
def test_the_cut_is_the_lightest_heaviest_stage(devices, balance):
    """The dynamic program's cut equals brute force over every choice of stage beginnings, by
    memory or by time."""
    from remat.solvers import tofu
    g = op_graph(_gpt(2), (torch.randint(0, 128, (2, 32)),))
    w = pl.op_weights(g) if balance == "memory" else pl.op_times(g)
    cross = [b if balance == "memory" else b / tofu.BYTES_PER_S for b in pl.crossing_bytes(g)]
    starts = sorted(pl.stage_starts(g))

    def heaviest(cuts):
        bounds = [0, *cuts, len(g.ops)]
        return max(sum(w[a:b]) + (cross[a] if a else 0) + (cross[b] if b < len(g.ops) else 0)
                   for a, b in zip(bounds, bounds[1:]))
    best = min(heaviest(list(c)) for c in itertools.combinations(starts, devices - 1))
    assert heaviest(pl.choose_cuts(g, devices, balance=balance)) == pytest.approx(best, rel=1e-12)


def test_micro_batches_divide_the_batch_and_in_flight_ones_cost_memory():
    g = op_graph(_gpt(), (torch.randint(0, 128, (8, 32)),))
    gm = pl.microbatch_graph(g, 4)
    ids = next(t for t in g.tensors.values() if t.kind == "input")
    assert gm.tensors[ids.id].shape == (2, 32)
    assert all(gm.tensors[t].shape == info.shape for t, info in g.tensors.items() if info.kind == "parameter")
    with pytest.raises(InvalidInputError, match="does not split into 3 equal micro-batches"):
        pl.microbatch_graph(g, 3)
    cuts = pl.choose_cuts(g, 2)
    gpipe = pl.stage_costs(g, cuts, 4, "gpipe")
    one_f = pl.stage_costs(g, cuts, 4, "1f1b")
    assert [c.inflight for c in gpipe] == [4, 4] and [c.inflight for c in one_f] == [2, 1]
    # 1F1B holds fewer micro-batches than GPipe, so its stages peak lower
    assert all(b.peak_bytes < a.peak_bytes for a, b in zip(gpipe, one_f))
    # the tied embedding / head: on both stages, its gradient all-reduced (2 (n - 1) x its bytes)
    holders = pl.parameter_holders(g, cuts)
    wte = next(t for t in holders if g.tensors[t].shape == (128, 32))
    assert holders[wte] == [0, 1]
    boundary = sum(g.tensors[t].bytes * 2 for t in {t for op in g.ops[cuts[0]:] for t in op.inputs}
                   if t in pl.producers(g) and pl.producers(g)[t] < cuts[0])
    assert pl.comm_bytes(g, cuts) == boundary + 2 * g.tensors[wte].bytes


def test_time_balanced_stages_are_faster_and_a_budget_moves_them_to_memory():
    """Balanced by time, the pipelined step (FLOP model) is no slower than balanced by memory;
    under a budget only the memory-balanced stages meet, the plan balances by memory and says
    so; under one neither meets, one line names the smallest peak."""
    from remat.core.errors import InfeasibleBudgetError
    from remat.partitioning import layer_placement
    g = op_graph(_gpt(), (torch.randint(0, 128, (8, 32)),))
    by_time = layer_placement(g, 4, 0.0, 8, "1f1b", "time")
    by_memory = layer_placement(g, 4, 0.0, 8, "1f1b", "memory")
    assert by_time.compute_time <= by_memory.compute_time
    assert by_memory.peak_bytes <= by_time.peak_bytes
    if by_memory.peak_bytes < by_time.peak_bytes:
        p = layer_placement(g, 4, 0.0, 8, "1f1b", "time", budget=by_memory.peak_bytes)
        assert p.search["pipeline"]["balance"] == "memory" and "balanced by memory instead" in p.search["pipeline"]["note"]
    with pytest.raises(InfeasibleBudgetError, match="the heaviest stage peaks at .* over the budget of 1.00 KiB"):
        layer_placement(g, 4, 0.0, 8, "1f1b", "time", budget=1024)


def test_a_loss_that_couples_the_examples_is_named():
    """Batch norm's statistics differ per micro-batch: neither the sum nor the mean of the
    micro-batches' losses, said in one line."""
    from remat.pipelining import loss_reduction
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    x = torch.randn(8, 8)
    with pytest.raises(InvalidInputError, match="neither the sum .* nor the mean"):
        loss_reduction(lambda b: net(b[0]).square().sum(), (x,), 2)
    assert loss_reduction(lambda b: net[0](b[0]).sum(), (x,), 2) == "sum"
    assert loss_reduction(lambda b: net[0](b[0]).mean(), (x,), 4) == "mean"


def _worker(rank, world, port, name, microbatches, schedule, out):
    import os
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        from remat.frontends.base import step_loss
        from remat.partitioning import layer_placement
        from remat.pipelining import PipelinedStep
        model, batch, loss_fn, count = _case(name)
        plan = layer_placement(op_graph(model, batch, loss_fn, model_inputs=count), world, 0.0, microbatches,
                               schedule)
        step = PipelinedStep(model, batch, plan, rank, world, torch.device("cpu"), loss_fn, count)
        own = step.step(batch)                     # (the first step makes the receive buffers)
        got = step.measured(batch)
        row = {"rank": rank, "own_loss": own, "loss": got["loss"], "sent": got["comm_bytes"],
               "peak": got["peak_bytes"], "predicted": got["predicted_peak"], "plan_comm": plan.comm_bytes,
               "reduction": step.reduction}
        ref_model, ref_batch, _, _ = _case(name)
        ref = step_loss(ref_model, loss_fn or (lambda o, *a: o.sum()), ref_batch, None, count)
        ref.backward()
        grads = dict(ref_model.named_parameters(remove_duplicate=False))
        row["ref_loss"] = float(ref.detach())
        row["grad_err"] = max(float((g - grads[n].grad).abs().max()) for n, g in got["grads"].items())
        row["grad_scale"] = max(float(p.grad.abs().max()) for p in ref_model.parameters())
        row["names"] = sorted(step.gradients())
        out.put(row)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,world,microbatches,schedule", [
    ("gpt", 2, 4, "1f1b"), ("gpt", 2, 2, "gpipe"), ("gpt", 4, 4, "1f1b"), ("classifier", 2, 4, "1f1b"),
])
def test_a_pipelined_step_trains_as_one_process_and_as_predicted(name, world, microbatches, schedule):
    rows = spawn_rows(_worker, world, name, microbatches, schedule)
    last = rows[-1]
    assert last["loss"] == pytest.approx(last["ref_loss"], rel=1e-5)
    assert last["own_loss"] == pytest.approx(last["ref_loss"], rel=1e-5)
    assert all(r["own_loss"] is None for r in rows[:-1])     # (the loss is the last stage's)
    assert all(r["loss"] == last["loss"] for r in rows)     # (then gathered to every rank)
    assert last["reduction"] == ("mean" if name == "classifier" else "sum")
    model, _, _, _ = _case(name)
    every = {n for r in rows for n in r["names"]}
    assert every == {n for n, _ in model.named_parameters()}     # every parameter on a stage (the tied one once)
    for r in rows:
        assert r["grad_err"] <= 1e-5 * max(1.0, r["grad_scale"]), r
    # the bytes sent (activations forward, their gradients back, the tied gradient's all-reduce)
    assert sum(r["sent"] for r in rows) == last["plan_comm"]
    for r in rows:
        assert 0.9 * r["predicted"] <= r["peak"] <= 1.1 * r["predicted"], r


FACTORY = '''
import torch
from remat.frontends.zoo import GPT


def make(batch=8):
    torch.manual_seed(0)
    return GPT(vocab_size=128, block_size=32, n_layer=4, n_head=4, n_embd=32, dropout=0.0), \\
        (torch.randint(0, 128, (batch, 32)),)
'''


def test_remat_partition_pipeline_then_remat_run(tmp_path, capsys):
    """``remat partition --pipeline`` writes a layer placement plan; ``remat run --plan`` trains it
    with torch.distributed.pipelining: each step's loss one process's, the bytes sent the plan's,
    each rank's peak within 10 % of its stage's; bad options are one-line errors."""
    from remat.cli import main
    model = tmp_path / "gpt.py"
    model.write_text(FACTORY)
    plan = tmp_path / "pipe.json"
    assert main(["partition", f"{model}:make", "--devices", "2", "--pipeline", "--microbatches", "4",
                 "-o", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 stages balanced by time, 4 micro-batches, 1f1b" in out and "stage 1: from module" in out
    steps, peaks, out = run_partition_plan(main, plan, capsys)
    assert len(peaks) == 4 and all(-10.0 <= p <= 10.0 for p in peaks[2:]), out
    for argv, message in [
        (["--devices", "2", "--pipeline", "--microbatches", "3"], "does not split into 3 equal micro-batches"),
        (["--devices", "4", "--pipeline", "--microbatches", "2"], "1F1B runs at least one micro-batch a stage"),
        (["--devices", "2", "--microbatches", "2"], "--microbatches, --schedule and --balance are for --pipeline"),
    ]:
        assert main(["partition", f"{model}:make", *argv, "-o", str(tmp_path / "x.json")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def _apply_worker(rank, world, port, which, out):
    import os
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        import remat
        from remat.frontends.base import step_loss
        from remat.partitioning import layer_placement, partition
        model, batch, loss_fn, count = _case("classifier")
        g = op_graph(model, batch, loss_fn, model_inputs=count)
        plan = layer_placement(g, world, 0.0, 4, "1f1b") if which == "pipeline" else partition(g, world,
                                                                                                baselines_too=False)
        step = remat.apply(model, plan, batch, loss_fn, model_inputs=count)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):                     # the user's loop, unchanged but for the step
            opt.zero_grad()
            loss = step(*batch)
            opt.step()
        ref, ref_batch, _, _ = _case("classifier")
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for _ in range(2):
            ref_opt.zero_grad()
            ref_loss = step_loss(ref, loss_fn, ref_batch, None, count)
            ref_loss.backward()
            ref_opt.step()
        theirs = dict(ref.named_parameters())
        out.put({"rank": rank, "loss": loss, "ref_loss": float(ref_loss.detach()), "sent": step.last["comm_bytes"],
                 "param_err": max(float((p - theirs[n]).abs().max()) for n, p in model.named_parameters())})
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("which", ["search", "pipeline"])
def test_remat_apply_runs_a_partition_plan_in_the_users_loop(which):
    """``step = remat.apply(model, partition_plan, batch, loss_fn)`` in each rank; the user's
    loop (`zero_grad`, ``loss = step(*batch)``, `optimizer.step()`) trains as one process does."""
    rows = spawn_rows(_apply_worker, 2, which)
    for r in rows:
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), r
        assert r["param_err"] <= 1e-5, r
        assert r["sent"] > 0


def test_remat_apply_on_a_partition_plan_needs_a_process_group(tmp_path):
    import remat
    from remat.partitioning import layer_placement
    model, batch, loss_fn, count = _case("classifier")
    plan = layer_placement(op_graph(model, batch, loss_fn, model_inputs=count), 2, 0.0, 2, "1f1b")
    plan.save(tmp_path / "p.json")
    with pytest.raises(InvalidInputError, match="runs in a process group; call torch.distributed.init_process_group"):
        remat.apply(model, str(tmp_path / "p.json"), batch, loss_fn)


def test_a_product_by_a_number_does_not_hold_its_input():
    """GPT-2's tanh GELU scales tensors by constants: such a product's backward reads none of its
    inputs, so a stage holds less; a product of two tensors reads both."""
    from remat.solvers import tofu

    class Gelu(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.fc(x)
            return 0.5 * h * (1.0 + torch.tanh(0.8 * (h + 0.044715 * torch.pow(h, 3.0))))
    g = op_graph(Gelu(), (torch.randn(4, 16),))
    muls = [op for op in g.ops if op.op == "mul"]
    assert [len(op.inputs) for op in muls].count(1) == 3 and [len(op.inputs) for op in muls].count(2) == 1
    assert [tofu.reads_inputs(op) for op in muls] == [len(op.inputs) == 2 for op in muls]
    dg = tofu.device_graph(g, pl.one_device(g))
    made = {t: op.id for op in g.ops for t in op.outputs}
    node = {v.name: v.id for v in dg.nodes}
    for op in muls:
        back = next(i for n, i in node.items() if n.endswith(f"#{op.id}:bwd"))
        readers = {a for a, b in dg.edges if b == back}
        held = {next(i for n, i in node.items() if n.endswith(f"#{made[t]}")) for t in op.inputs}
        assert (held <= readers) == (len(op.inputs) == 2), op
