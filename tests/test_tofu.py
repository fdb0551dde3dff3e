"""Tofu's partition search (`remat.solvers.tofu`, `remat.partition`): ATen ops described at their
real shapes (each strategy on simulated shards equals the op), the dynamic program against brute
force, the recursion's accounting, the baselines, the budget, the plan file and the CLI."""
from __future__ import annotations

import itertools
import json
import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from remat.core.errors import InfeasibleBudgetError, InvalidInputError  # noqa: E402
from remat.core.simulate import keep_all_peak  # noqa: E402
from remat.frontends.partitioning import op_graph  # noqa: E402
from remat.partitioning import PartitionPlan, baseline, partition  # noqa: E402
from remat.solvers import tofu  # noqa: E402
from remat.solvers.partition import PARTIAL, letter_sizes, rule_for, strategies  # noqa: E402
from shards import combine, place, synced_batch_norm  # noqa: E402

_GEN = torch.Generator().manual_seed(0)


def _g(*shape):
    return torch.randn(*shape, generator=_GEN, dtype=torch.float64)


def _ids(n, *shape):
    return torch.randint(0, n, shape, generator=_GEN)


# name -> (ATen op name, function of the tensors, tensors, positional args as the graph has them)
ATEN = {
    "linear 3-d": ("linear", F.linear, lambda: (_g(4, 6, 8), _g(4, 8), _g(4)), ()),
    "matmul broadcast": ("matmul", torch.matmul, lambda: (_g(2, 4, 6, 8), _g(8, 4)), ()),
    "addmm": ("addmm", torch.addmm, lambda: (_g(4), _g(6, 8), _g(8, 4)), ()),
    "add broadcast": ("add", torch.add, lambda: (_g(4, 6, 8), _g(6, 8)), ()),
    "mul by a column": ("mul", torch.mul, lambda: (_g(4, 6, 8), _g(4, 1, 8)), ()),
    "view merge": ("view", lambda x: x.reshape(-1, x.shape[-1]), lambda: (_g(4, 6, 8),), (None, [24, 8])),
    "view split": ("view", lambda x: x.reshape(*x.shape[:-1], x.shape[-1] // 4, 4), lambda: (_g(4, 6, 8),), (None, [4, 6, 2, 4])),
    "transpose": ("transpose", lambda x: x.transpose(1, 2), lambda: (_g(4, 6, 8),), (None, 1, 2)),
    "permute": ("permute", lambda x: x.permute(2, 0, 1), lambda: (_g(4, 6, 8),), (None, [2, 0, 1])),
    "unsqueeze": ("unsqueeze", lambda x: x.unsqueeze(1), lambda: (_g(4, 8),), (None, 1)),
    "layer_norm": ("layer_norm", lambda x, w, b: F.layer_norm(x, (8,), w, b), lambda: (_g(4, 6, 8), _g(8), _g(8)),
                   (None, [8], None, None)),
    "softmax middle": ("_softmax", lambda x: torch.softmax(x, 1), lambda: (_g(4, 6, 8),), (None, 1, False)),
    "sdpa": ("scaled_dot_product_attention", F.scaled_dot_product_attention,
             lambda: (_g(2, 4, 6, 8), _g(2, 4, 6, 8), _g(2, 4, 6, 4)), ()),
    "sdpa with a mask": ("scaled_dot_product_attention", F.scaled_dot_product_attention,
                         lambda: (_g(2, 4, 6, 8), _g(2, 4, 6, 8), _g(2, 4, 6, 4), _g(2, 1, 6, 6)), ()),
    "embedding": ("embedding", lambda w, i: F.embedding(i, w), lambda: (_g(10, 8), _ids(10, 4, 6)), ()),
    "sum of a dim": ("sum", lambda x: x.sum(1), lambda: (_g(4, 6, 8),), (None, [1])),
    "mean of all": ("mean", lambda x: x.mean(), lambda: (_g(4, 6, 8),), (None,)),   # partial means: averaged
    "cross entropy": ("cross_entropy_loss", lambda x, y: F.cross_entropy(x, y, reduction="sum"),
                      lambda: (_g(8, 6), _ids(6, 8)), (None, None, None, 2)),
    "conv2d": ("convolution", lambda x, w, b: F.conv2d(x, w, b, padding=1),
               lambda: (_g(4, 4, 6, 6), _g(8, 4, 3, 3), _g(8)), (None, None, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
    "batch_norm": ("batch_norm", lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                   lambda: (_g(4, 8, 4, 4), _g(8), _g(8)), ()),
    "max_pool2d": ("max_pool2d", lambda x: F.max_pool2d(x, 2), lambda: (_g(4, 8, 6, 6),), (None, [2, 2])),
    "cat": ("cat", lambda a, b: torch.cat([a, b], 2), lambda: (_g(4, 6, 8), _g(4, 6, 8)), (None, 2)),
}


@pytest.mark.parametrize("case", sorted(ATEN))
def test_aten_ops_at_their_shapes_split_as_described(case):
    op, fn, make, args = ATEN[case]
    tensors = make()
    want = fn(*tensors)
    rule = rule_for(op, [t.shape for t in tensors], [want.shape], args)
    sizes = letter_sizes(rule, [t.shape for t in tensors], [want.shape])
    found = [s for s in strategies(rule) if sizes[s.index] % 2 == 0]
    assert found, (case, rule)
    for s in found:
        placed = [place(t, p, 2) for t, p in zip(tensors, s.inputs)]
        if s.sync:           # the statistics all-reduced (batch norm along its batch or space)
            assert op == "batch_norm" and s.sync == rule.inputs[1]
            parts = synced_batch_norm(*placed)
        else:
            parts = [fn(*[p[d] for p in placed]) for d in range(2)]
        got = combine(parts, s.outputs[0])
        if op == "mean" and s.outputs[0] == PARTIAL:
            got = got / 2                      # (DTensor's Partial("avg"): the same communication)
        assert torch.allclose(got.double(), want.double(), atol=1e-9), (case, rule.spec, s)


def test_coupled_and_unknown_ops_are_not_split():
    assert {s.index for s in strategies(rule_for("_softmax", [(4, 6, 8)], [(4, 6, 8)], (None, 1, False)))} == {"a", "c"}
    opaque = rule_for("some_custom_op", [(4, 6)], [(4, 6)])
    assert strategies(opaque) == []
    # a reshape that merges dimensions keeps only the outer one of them splittable
    r = rule_for("view", [(4, 6, 8)], [(4, 48)], (None, [4, 48]))
    assert r.spec == "abc->ab" and [s.index for s in strategies(r)] == ["a", "b"]


# ---- small graphs ------------------------------------------------------------------------------
class MLP(torch.nn.Module):
    def __init__(self, width=64, hidden=256):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _square(out, *_):
    return out.square().mean()


def _mlp_graph(batch=8, width=64, hidden=256):
    torch.manual_seed(0)
    return op_graph(MLP(width, hidden), (torch.randn(batch, width),), _square)


def _brute_force(g, shapes):
    """The least communication over every placement of every tensor (each op then takes its
    cheapest strategy: given the placements, the ops' costs are independent)."""
    tensors = sorted(g.tensors)
    strat = [tofu.op_strategies(g, op, shapes) for op in g.ops]
    best = None
    for ps in itertools.product(*[tofu.placements(shapes[t]) for t in tensors]):
        place = dict(zip(tensors, ps))
        total = sum(min(tofu.op_cost(g, shapes, op, s, place) for s in ss) for op, ss in zip(g.ops, strat))
        best = total if best is None else min(best, total)
    return best


def test_the_dynamic_program_equals_brute_force():
    g = _mlp_graph(batch=4, width=4, hidden=8)
    shapes = {t: i.shape for t, i in g.tensors.items()}
    c = tofu.cut(g, shapes)
    assert c.exact
    assert tofu.evaluate(g, shapes, c.placement, c.strategy) == c.comm
    assert c.comm == _brute_force(g, shapes)


@pytest.mark.parametrize("lam", [0.0, 0.5])
def test_the_integer_program_proves_the_dynamic_program_and_bounds_a_truncated_one(lam):
    from remat.solvers import tofu_ilp
    for batch, width, hidden in [(4, 4, 8), (8, 64, 256), (4096, 16, 32)]:
        g = _mlp_graph(batch, width, hidden)
        shapes = {t: i.shape for t, i in g.tensors.items()}
        exact = tofu.cut(g, shapes, lam)
        assert exact.exact
        cold = tofu_ilp.cut_ilp(g, shapes, lam)           # from nothing: the same optimum, proven
        assert cold.proven and cold.objective == pytest.approx(tofu_ilp.objective(exact, lam))
        assert tofu.evaluate(g, shapes, cold.cut.placement, cold.cut.strategy) == cold.cut.comm
        # the program keeping one state: worse where the batch is large; the integer program
        # started from its cut finds the optimum and proves it
        short = tofu.cut(g, shapes, lam, max_states=1)
        cert = tofu_ilp.cut_ilp(g, shapes, lam, warm=short)
        assert cert.proven and cert.objective == pytest.approx(tofu_ilp.objective(exact, lam))
        assert cert.objective <= tofu_ilp.objective(short, lam)
        if batch == 4096 and lam == 0.0:     # (the case where keeping one state loses: 524,416 B for 8,584 B)
            assert tofu_ilp.objective(short, lam) > 10 * cert.objective


def test_a_wide_mlp_at_a_small_batch_gets_megatrons_split():
    # weights (2 x 64 x 256) far outweigh the activations (8 x 256): split the weights, column then row
    g = _mlp_graph(batch=8)
    p = partition(g, 2)
    strategy = {o["op"] + str(o["id"]): o["strategy"][0] for o in p.ops}
    by_op = [o for o in p.ops if o["op"] == "linear"]
    names = {t["name"]: t["placements"][0] for t in p.tensors}
    assert names["p_model_fc1_weight"] == "Shard(0)" and names["p_model_fc2_weight"] == "Shard(1)", (names, strategy)
    # one all-reduce of the (8, 64) output (2 x its 2,048 bytes across the cut), and of fc2's
    # bias gradient (the bias was added on one device under the row split: 2 x 256 bytes)
    assert p.comm_bytes == 2 * 8 * 64 * 4 + 2 * 64 * 4
    assert by_op[0]["strategy"] != by_op[1]["strategy"]
    meg = p.baselines["megatron"]
    assert p.comm_bytes <= meg["comm_bytes"]


def test_a_large_batch_gets_data_parallel():
    # activations (4096 x 256) far outweigh the weights: split the batch, all-reduce the gradients
    g = _mlp_graph(batch=4096, width=16, hidden=32)
    p = partition(g, 2)
    dp = p.baselines["data-parallel"]
    # the gradients all-reduced (2 x their bytes across the cut) and the loss's partial means (2 x 4 bytes)
    assert p.comm_bytes == dp["comm_bytes"] == 2 * sum(t.bytes for t in g.tensors.values() if t.kind == "parameter") + 8
    assert all(o["strategy"][0] in ("a", "replicated") for o in p.ops), p.ops


def test_a_cnn_with_batch_norm_gets_data_parallel_with_synchronised_statistics():
    # a training batch norm splits along the batch when its statistics are all-reduced: per batch
    # norm 4 all-reduces of its C channels (sum and squares in the forward, two sums in the
    # backward), 2 x the bytes across the cut each; without them the batch could not be split
    bn = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                             torch.nn.ReLU(), torch.nn.Conv2d(8, 16, 3, padding=1, bias=False),
                             torch.nn.BatchNorm2d(16))
    torch.manual_seed(0)
    g = op_graph(bn, (torch.randn(64, 3, 16, 16),), _square)
    p = partition(g, 2)
    params = sum(t.bytes for t in g.tensors.values() if t.kind == "parameter" and t.grad)   # (not running stats)
    syncs = sum(4 * 2 * 4 * c for c in (8, 16))
    assert p.comm_bytes == p.baselines["data-parallel"]["comm_bytes"] == 2 * params + 8 + syncs
    norms = [o for o in p.ops if o["op"] == "batch_norm"]
    assert len(norms) == 2 and all(o["strategy"] == ["a"] for o in norms), norms
    # two levels: the statistics all-reduced along both mesh dimensions, as DTensor's mesh runs them
    p4 = partition(g, 4)
    assert all(o["strategy"] == ["a", "a"] for o in p4.ops if o["op"] == "batch_norm")
    assert p4.comm_bytes == p4.baselines["data-parallel"]["comm_bytes"]


def test_the_recursion_counts_each_level_once_per_group():
    g = _mlp_graph(batch=64)
    sp = tofu.split(g, 4)
    assert len(sp.levels) == 2
    assert sp.comm == sp.levels[0].comm + 2 * sp.levels[1].comm
    for t, info in g.tensors.items():
        halvings = sum(p.kind == "shard" for p in sp.placement[t])
        assert math.prod(sp.shapes[t]) * 2 ** halvings == math.prod(info.shape)


def test_per_device_memory_falls_with_the_devices_and_the_planner_composes():
    g = _mlp_graph(batch=256, width=64, hidden=256)
    one = tofu.device_graph(g, tofu.split(g, 1))
    assert one.fixed_bytes == sum(t.bytes for t in g.tensors.values() if t.kind in ("parameter", "input"))
    peaks = [partition(g, k, baselines_too=False).peak_bytes for k in (1, 2, 4)]
    assert peaks[0] == keep_all_peak(one)
    assert peaks[0] > peaks[1] > peaks[2]
    # under a budget below every split's keep-everything peak, the planner recomputes per device
    tight = int(0.9 * min(keep_all_peak(tofu.device_graph(g, tofu.split(g, 2, lam))) for lam in (0.0, 1e4)))
    try:
        p = partition(g, 2, tight, baselines_too=False)
    except InfeasibleBudgetError as e:
        assert "smallest per-device peak" in str(e)
    else:
        assert p.peak_bytes <= tight and p.search["recompute"]["overhead"] >= 1.0


def test_a_budget_trades_communication_for_memory():
    g = _mlp_graph(batch=64)
    free = partition(g, 2, baselines_too=False)
    least = min(keep_all_peak(tofu.device_graph(g, tofu.split(g, 2, lam))) for lam in (1e-3, 1e-1, 10.0, 1e3))
    assert least < free.peak_bytes
    p = partition(g, 2, least, baselines_too=False, recompute=False)
    assert p.peak_bytes <= least and p.comm_bytes >= free.comm_bytes


def test_bad_input_says_what_to_do():
    g = _mlp_graph()
    with pytest.raises(InvalidInputError, match="power of 2"):
        partition(g, 3)
    with pytest.raises(InfeasibleBudgetError, match="smallest per-device peak found is .*more devices"):
        partition(g, 2, 1000, recompute=False)
    with pytest.raises(InvalidInputError, match="more devices than"):
        tofu.split(_mlp_graph(batch=1, width=1, hidden=1), 4)


def test_the_plan_file_round_trips_and_names_its_format(tmp_path):
    g = _mlp_graph()
    p = partition(g, 2)
    path = tmp_path / "partition.json"
    p.save(path)
    d = json.loads(path.read_text())
    assert d["format"] == "remat.partition" and d["version"] == 1 and d["mesh"] == [2]
    q = PartitionPlan.load(path)
    assert q.to_dict() == p.to_dict()
    path.write_text(json.dumps({**d, "format": "remat.plan"}))
    with pytest.raises(InvalidInputError, match="not a partition plan"):
        PartitionPlan.load(path)


def test_baselines_are_what_they_say():
    g = _mlp_graph(batch=64)
    dp, fsdp, meg = (baseline(g, 2, n) for n in ("data-parallel", "fsdp", "megatron"))
    names = lambda p: {t["name"]: t["placements"][0] for t in p.tensors}  # noqa: E731
    assert all(v == "Replicate" for k, v in names(dp).items() if k.startswith("p_"))
    assert names(fsdp)["p_model_fc1_weight"] == "Shard(0)"
    assert names(meg)["args_0"] == "Replicate"
    assert fsdp.peak_bytes < dp.peak_bytes
    layers = baseline(g, 2, "layers")
    assert layers.comm_bytes > 0 and len(layers.search["pipeline"]["stages"]) == 2
    with pytest.raises(InvalidInputError, match="unknown"):
        baseline(g, 2, "zero-4")


def test_a_transformer_block_partitions_no_worse_than_megatron_at_its_memory():
    from remat.frontends import zoo
    model, ex = zoo.get("gpt2")
    g = op_graph(model, ex if isinstance(ex, tuple) else (ex,))
    meg = baseline(g, 2, "megatron")
    p = partition(g, 2, meg.peak_bytes, baselines_too=False, recompute=False)
    assert p.peak_bytes <= meg.peak_bytes and p.comm_bytes <= meg.comm_bytes


def test_cli_partition_writes_the_plan(tmp_path, capsys):
    from remat.cli import main
    out = tmp_path / "p.json"
    assert main(["partition", "gpt2", "--devices", "4", "--prove", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "4 devices" in text and "baselines" in text
    assert "level 0: the dynamic program's cut is optimal (proven" in text and "level 1:" in text, text
    assert [c["gap"] for c in PartitionPlan.load(out).search["certificates"]] == [0.0, 0.0]
    assert main(["partition", "gpt2", "--devices", "2", "-o", str(out)]) == 0
    capsys.readouterr()
    assert PartitionPlan.load(out).devices == 2
    assert main(["partition", "gpt2", "--devices", "3", "-o", str(out)]) == 2


@pytest.mark.parametrize("dims", [2, 3])
def test_the_cost_model_converts_in_dtensors_order(dims):
    """`tofu.mesh_steps` (what the cost model charges, one mesh dimension at a time) is the plan
    DTensor's own redistribution planner makes, for every pair of placements on a (2,) * dims
    mesh (a fake process group in this process: nothing is sent)."""
    dist = pytest.importorskip("torch.distributed")
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard as DShard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from remat.solvers.partition import REPLICATE, Shard

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", rank=0, world_size=2 ** dims, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,) * dims)
        meta = TensorMeta(torch.Size((8, 8)), (8, 1), torch.float32)
        ours = {"R": REPLICATE, "P": PARTIAL, "S0": Shard(0), "S1": Shard(1)}
        theirs = {"R": Replicate(), "P": Partial(), "S0": DShard(0), "S1": DShard(1)}

        def back(p):
            return Shard(p.dim) if isinstance(p, DShard) else PARTIAL if isinstance(p, Partial) else REPLICATE
        pairs = 0
        for src in itertools.product(ours, repeat=dims):
            for dst in itertools.product(["R", "S0", "S1"], repeat=dims):   # (no target is partial)
                plan = _gen_transform_infos(DTensorSpec(mesh, tuple(theirs[p] for p in src), tensor_meta=meta),
                                            DTensorSpec(mesh, tuple(theirs[p] for p in dst), tensor_meta=meta))
                got = [(t.mesh_dim, back(t.src_dst_placements[0]), back(t.src_dst_placements[1])) for t in plan]
                assert tofu.mesh_steps(tuple(ours[p] for p in src), tuple(ours[p] for p in dst)) == got, (src, dst)
                pairs += 1
        assert pairs == 4 ** dims * 3 ** dims
    finally:
        dist.destroy_process_group()


def test_the_devices_recompute_only_what_runs_on_their_own_parts():
    """The device graph pins (``always_saved``) what the distributed executor cannot recompute
    without communicating: what a backward keeps beside an op's output, and every op that does not
    run on its devices' own parts; a recomputing partition names its ops, each one that runs
    locally, and its peak is the compiled class's program of that device graph."""
    from remat.core import compiled
    torch.manual_seed(0)
    deep = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    g = op_graph(deep, (torch.randn(256, 64),), _square)
    splits = [tofu.split(g, 2, lam) for lam in (0.0, 1e-2, 1, 1e4)]
    for sp in splits:
        dg = tofu.device_graph(g, sp)
        free = compiled.recomputable(dg)
        for v in dg.nodes:
            if v.kind != "forward":
                continue
            op = g.ops[v.extra["op"]]
            local = tofu.runs_locally(op, sp.strategy[op.id], sp.placement) and not v.name.endswith(":saved")
            assert (v.id in free) == local, v.name
    tight = int(0.93 * min(keep_all_peak(tofu.device_graph(g, sp)) for sp in splits))
    p = partition(g, 2, tight, baselines_too=False)
    ops = p.search["recompute"]["ops"]
    assert ops and p.peak_bytes <= tight
    chosen = next(sp for sp in splits if tofu.mesh_comm(g, sp, "cpu") == p.comm_bytes)
    assert all(tofu.runs_locally(g.ops[v], chosen.strategy[v], chosen.placement) for v in ops)
    assert {g.ops[v].op for v in ops} <= {"linear", "gelu", "tanh"}
    # an op that communicates is never local: a linear whose input is converted
    gathered = [(op, sp) for sp in splits for op in g.ops if op.op == "linear" and any(
        tofu.placed(s, "in", 0) != q for s, q in zip(sp.strategy[op.id], sp.placement[op.inputs[0]]))]
    assert gathered and not any(tofu.runs_locally(op, sp.strategy[op.id], sp.placement) for op, sp in gathered)
