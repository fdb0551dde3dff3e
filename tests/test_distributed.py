"""Partition plans run on torch.distributed (gloo, CPU processes; `remat.distributed`): the loss
and gradients of one process (dropout included), the bytes sent at the collectives equal to the
plan's, and each rank's measured peak (the storage accounting) at most 2 % above the plan's
per-device prediction and at most 5-10 % below it."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from gloo import run_partition_plan, spawn_rows  # noqa: E402

F = torch.nn.functional


class MLP(torch.nn.Module):
    def __init__(self, width=64, hidden=256):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)
        self.head = torch.nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


class CNNBN(torch.nn.Module):
    """Convolutions with batch norm in training (a batch split must synchronise the statistics)
    and in-place ReLUs, as torchvision's ResNets have them (replayed out of place)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 16, 3, padding=1, bias=False), torch.nn.BatchNorm2d(16)
        self.head = torch.nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x)), inplace=True), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x)), inplace=True), 2)
        return self.head(x.flatten(1))


def _square(out, *_):
    return out.square().mean()


def _cross_entropy(out, x, y):
    return F.cross_entropy(out, y)


def _case(name):
    """(model, batch, loss_fn, model_inputs) with the same values in every process."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "mlp":
        return MLP(), (torch.randn(8, 64, generator=gen),), _square, None
    if name in ("cnn", "cnn-bn"):
        return (CNN() if name == "cnn" else CNNBN()), \
            (torch.randn(8, 3, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen)), _cross_entropy, 1
    if name == "deep":    # activations outweigh the weights; gradients gathered and scattered along dimension 1
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                    torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
        return model, (torch.randn(256, 64, generator=gen),), _square, None
    if name == "resnet18":    # the zoo's ResNet-18 (in-place ReLUs, batch norm) in float64: float32's
        from remat.frontends import zoo  # channel partial sums differ from one process's by rounding
        model, inputs = zoo.get("resnet18")
        return model.double(), tuple(x.double() for x in inputs), _square, None
    from remat.frontends.zoo import GPT
    model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.1 if "dropout" in name else 0.0)
    ids = torch.randint(0, 64, (128 if "wide" in name else 4, 16), generator=gen)   # (wide: activations outweigh)
    return model, (ids, torch.roll(ids, -1, 1)), None, None


def _worker(rank, world, port, name, which, out):
    import os
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        from remat.distributed import mesh_for, train_step
        from remat.frontends.partitioning import capture_step
        from remat.partitioning import baseline, partition
        model, batch, loss_fn, count = _case(name)
        cap = capture_step(model, batch, loss_fn, count)
        if which.startswith("search@"):   # a budget below every searched split's peak: the devices recompute
            from remat.core.simulate import keep_all_peak
            from remat.solvers import tofu
            g = cap.graph
            least = min(keep_all_peak(tofu.device_graph(g, tofu.split(g, world, lam))) for lam in (0.0, 1e-2, 1, 1e4))
            plan = partition(g, world, int(float(which[7:]) * least), baselines_too=False)
            assert plan.search["recompute"]["ops"]
        else:
            plan = (partition(cap.graph, world, baselines_too=False) if which == "search"
                    else baseline(cap.graph, world, which))
        state = torch.get_rng_state()        # (the same on every rank: seeded alike)
        got = train_step(model, batch, plan, mesh_for(world), loss_fn, capture=cap, meter=True)
        row = {"rank": rank, "loss": got["loss"], "comm": got["comm_bytes"], "peak": got["peak_bytes"],
               "plan_comm": plan.comm_bytes, "plan_peak": plan.peak_bytes, "budget": plan.budget_bytes}
        if rank == 0:
            from remat.frontends.base import step_loss
            torch.set_rng_state(state)          # one process's step draws what the ranks drew
            ref = step_loss(model, loss_fn or (lambda o, *a: o), batch, None, count)
            ref.backward()
            row["ref_loss"] = float(ref.detach())
            row["grad_err"] = max(float((got["grads"][n] - p.grad).abs().max()) for n, p in model.named_parameters())
            row["grad_scale"] = max(float(p.grad.abs().max()) for p in model.parameters())
        out.put(row)
        dist.barrier()  # every rank tears gloo down together: one that leaves early can abort at exit
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name,which,world", [
    ("mlp", "search", 2), ("mlp", "data-parallel", 2), ("mlp", "fsdp", 2), ("mlp", "megatron", 2),
    ("mlp", "search", 4), ("mlp", "fsdp", 4),
    ("cnn", "search", 2), ("cnn", "data-parallel", 2),
    ("cnn-bn", "search", 2), ("cnn-bn", "data-parallel", 4),
    ("gpt", "search", 2), ("gpt", "megatron", 2),
    ("gpt-dropout", "search", 2), ("gpt-dropout", "data-parallel", 4),
    ("resnet18", "search", 2),
    # the devices recompute (ops on their own parts, once, in the backward): dropout included
    ("gpt-wide-dropout", "search@0.8", 2), ("deep", "search@0.93", 2),
])
def test_a_partitioned_step_trains_as_one_process_and_as_predicted(name, which, world):
    rows = spawn_rows(_worker, world, name, which)
    head = rows[0]
    assert head["loss"] == pytest.approx(head["ref_loss"], rel=1e-5)
    assert head["grad_err"] <= 1e-5 * max(1.0, head["grad_scale"]), head
    assert all(r["loss"] == pytest.approx(head["loss"], rel=1e-6) for r in rows)
    # the bytes sent at the collectives, summed over the ranks, are the plan's
    assert sum(r["comm"] for r in rows) == head["plan_comm"]
    # each rank's peak at most 2 % above the plan's per-device prediction, and below it by at
    # most 5 % (10 % on the transformers, whose predictions are 1-6 % above what they measure);
    # on 4 processes too, where a two-step conversion's intermediate form goes before its op
    # computes (FSDP-style MLP at 4: 16 % under when the prediction held it beside the result)
    low = 0.90 if name.startswith("gpt") else 0.95
    for r in rows:
        assert low * r["plan_peak"] <= r["peak"] <= 1.02 * r["plan_peak"], r
        if which.startswith("search@"):   # (a plan that recomputes fills its budget: it must hold)
            assert 0.95 * r["plan_peak"] <= r["peak"] <= r["budget"], r


def test_a_collectives_output_is_waited_for_until_its_last_other_owner_lets_go():
    """gloo's worker drops a finished collective's work (which holds its output and views of it)
    a moment after ``wait_tensor`` returns; if the step let go of the output first, the worker's
    drop would free it only once it got the interpreter's lock, several ops later.  `released`
    yields until the output's other owners are gone: here a thread holding a view of it for
    30 ms, as the worker does for microseconds."""
    import threading
    import time

    from remat.distributed import owners, released
    t = torch.empty(1000)
    callers = owners(t)
    holder = [t[:10]]      # a view: the tensor's count and its storage's both rise
    assert all(n > c for n, c in zip(owners(t), callers))

    def drop():
        time.sleep(0.03)
        holder.clear()
    thread = threading.Thread(target=drop)
    t0 = time.perf_counter()
    thread.start()
    assert released(t, callers, limit_s=5.0)
    waited = time.perf_counter() - t0
    thread.join()
    assert waited >= 0.025 and owners(t) == callers, waited
    holder.append(t[:10])  # an owner that stays: the wait gives up at its limit and says so
    t0 = time.perf_counter()
    assert not released(t, callers, limit_s=0.02)
    assert 0.02 <= time.perf_counter() - t0 < 1.0


def test_a_wait_that_gives_up_is_counted_and_said_once(caplog):
    """Under `CommCounter` a waited output that some other owner still holds after the wait's
    limit is counted (``lingering``) and warned about once per counter, not passed over."""
    import logging

    from remat.distributed import CommCounter
    t = torch.empty(1000)
    with CommCounter() as counter, caplog.at_level(logging.WARNING, logger="remat.distributed"):
        torch.ops._c10d_functional.wait_tensor(t)        # (nothing else holds it)
        assert counter.lingering == 0
        holder = [t[:10]]
        for _ in range(2):
            torch.ops._c10d_functional.wait_tensor(t)
    assert counter.lingering == 2 and holder
    assert len([r for r in caplog.records if "still held" in r.getMessage()]) == 1


def test_a_plan_for_another_world_size_says_so():
    from remat.distributed import PartitionedStep
    from remat.frontends.partitioning import capture_step
    from remat.partitioning import partition
    model, batch, loss_fn, count = _case("mlp")
    cap = capture_step(model, batch, loss_fn, count)
    plan = partition(cap.graph, 2, baselines_too=False)

    class OneDevice:
        def size(self):
            return 1
    from remat.core.errors import InvalidInputError
    with pytest.raises(InvalidInputError, match="for 2 devices; this process group has 1: launch 2 processes"):
        PartitionedStep(cap, plan, OneDevice())


def test_a_plan_whose_devices_recompute_runs_through_the_cli(tmp_path, capsys):
    """Under a budget only recomputation meets, the partition's per-device peak is the compiled
    class's program of the device graph (ops that run on their own parts, recomputed once in the
    backward); `remat run --plan` runs it: each step's loss one process's (the zoo's GPT-2 has
    dropout), the bytes sent the plan's (recomputation communicates nothing), each rank's peak
    within the budget and within 5 % of the plan's.  A plan file that says it recomputes but not
    which ops (an older remat's) is refused in one line."""
    import json

    from remat.cli import main
    from remat.partitioning import PartitionPlan
    whole, path = tmp_path / "whole.json", tmp_path / "partition.json"
    assert main(["partition", "gpt2", "--devices", "2", "--batch", "32", "-o", str(whole)]) == 0
    tight = int(0.8 * PartitionPlan.load(whole).peak_bytes)
    assert main(["partition", "gpt2", "--devices", "2", "--batch", "32", "--budget", str(tight), "-o", str(path)]) == 0
    out = capsys.readouterr().out
    plan = PartitionPlan.load(path)
    assert plan.search["recompute"]["ops"] and plan.peak_bytes <= tight, out
    assert "recomputes" in out
    steps, peaks, out = run_partition_plan(main, path, capsys)
    assert len(peaks) == 4 and all(-5.0 <= p <= 5.0 for p in peaks), out
    assert all(plan.peak_bytes * (1 + p / 100) <= tight * 1.001 for p in peaks), out   # (peaks printed to 0.1 %)
    old = json.loads(path.read_text())
    del old["search"]["recompute"]["ops"]
    path.write_text(json.dumps(old))
    assert main(["run", "--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert "partition the model again" in err and len(err.strip().splitlines()) == 1, err


FACTORY = '''
import torch


def make(batch=8):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    return model, (torch.randn(batch, 64),)
'''


def test_remat_run_launches_a_partition_plan(tmp_path, capsys):
    """``remat partition`` then ``remat run --plan PARTITION.json``: one process a device, each
    step's loss that of one process on the same parameters and batch, the bytes sent the plan's,
    each rank's peak near the plan's; a process count other than the plan's is a one-line error."""

    from remat.cli import main
    model = tmp_path / "mlp.py"
    model.write_text(FACTORY)
    plan = tmp_path / "partition.json"
    assert main(["partition", f"{model}:make", "--devices", "2", "-o", str(plan)]) == 0
    capsys.readouterr()
    steps, peaks, out = run_partition_plan(main, plan, capsys)
    assert float(steps[1][1]) != float(steps[0][1])          # the parameters moved between the steps
    assert len(peaks) == 4 and all(-10.0 <= p <= 10.0 for p in peaks), out
    assert main(["run", "--plan", str(plan), "--nproc", "4"]) == 2
    err = capsys.readouterr().err
    assert "the partition plan is for 2 devices, --nproc is 4" in err and len(err.strip().splitlines()) == 1


def test_random_ops_drawn_whole_are_one_process_draws():
    """What a split random op draws on every rank (`dropout_factors` at the global shape, attention
    computed with them as ATen's math path computes it) is what one process's eager op draws from
    the same generator state, bit for bit on the CPU."""
    from remat.distributed import attention_with_noise, dropout_factors
    x = torch.randn(4, 16, 32)
    torch.manual_seed(5)
    eager = F.dropout(x, 0.1, True)
    torch.manual_seed(5)
    assert torch.equal(x * dropout_factors(x.shape, 0.1, x), eager)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    for causal in (False, True):
        torch.manual_seed(5)
        eager = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=causal)
        torch.manual_seed(5)
        ours = attention_with_noise(q, k, v, None, causal, None, dropout_factors((2, 4, 16, 16), 0.1, q))
        assert torch.allclose(ours, eager, atol=1e-6, rtol=0), causal
