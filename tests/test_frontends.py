"""remat.trace, the model zoo, measure_peak and `remat trace`: graphs of real models against
hand-computed figures, against what autograd saves, and against the measured peak of a real step."""
from __future__ import annotations

import json
import logging
import math
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import remat  # noqa: E402
from remat.core.simulate import storage_view  # noqa: E402
from remat.cli import main  # noqa: E402
from remat.core.errors import InvalidInputError  # noqa: E402
from remat.frontends import measure_peak, trace, zoo  # noqa: E402
from remat.frontends.capture import CaptureError  # noqa: E402
from remat.frontends import plain_step_peaks  # noqa: E402
from remat.frontends.measuring import storage_key, unique_bytes  # noqa: E402
from remat.core.graph import Graph  # noqa: E402
from remat.solvers import get as solver  # noqa: E402

F32 = 4


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on a shared, loaded machine OpenMP threads waiting for a busy core
    make CPU kernels 10-100x slower; one thread keeps these tests fast and their timings sane."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


# ---- small hand-built models -------------------------------------------------------------------
class Tiny(nn.Module):
    """fc1 (8->16) -> ReLU (not in place) -> fc2 (16->4)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class ViewsInPlace(nn.Module):
    """Views and in-place ops inside one module: y = relu_(x * 2) saves y; tanh(y.view) saves its
    output; the module returns a view of that output."""

    def forward(self, x):
        y = x * 2
        y.relu_()
        t = torch.tanh(y.view(x.shape[0] * 2, -1))
        return t.t()


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.mid = ViewsInPlace()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.mid(self.fc(x)))


def _trace(model, inputs, **kw):
    kw.setdefault("profile", "flops")
    kw.setdefault("granularity", "module")
    kw.setdefault("depth", 1)
    return trace(model, inputs, **kw)


def test_hand_built_graph_nodes_edges_bytes():
    torch.manual_seed(0)
    g = _trace(Tiny(), torch.randn(2, 8))
    names = [v.name for v in g.nodes]
    assert names == ["fc1", "act", "fc2", "loss", "grad_fc2", "grad_act", "grad_fc1"]
    assert [v.kind for v in g.nodes] == ["forward"] * 3 + ["loss"] + ["backward"] * 3
    # forward: outputs [2,16], [2,16], [2,4]; linear saves its input (a producer's output or the
    # fixed input) and a view of its weight (a parameter): nothing of its own; ReLU saves its output
    assert [v.bytes for v in g.nodes[:3]] == [2 * 16 * F32, 2 * 16 * F32, 2 * 4 * F32]
    assert [v.extra["saved_bytes"] for v in g.nodes[:3]] == [0, 0, 0]
    # loss: sum; its gradient w.r.t. the output is an expanded scalar (one 4-byte storage)
    assert g.nodes[3].bytes == F32
    # backward: gradient w.r.t. the node's activation input; fc1's input is the user's x: none
    assert [v.bytes for v in g.nodes[4:]] == [2 * 16 * F32, 2 * 16 * F32, 0]
    # edges: forward chain, loss, gradient chain; backward reads only what autograd saved:
    # ReLU's output (for ReLU's and fc2's backward)
    assert set(g.edges) == {(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (1, 5), (1, 4)}
    params = (8 * 16 + 16 + 16 * 4 + 4) * F32
    # parameter gradients (PyTorch's default loop): each allocated by the backward node that
    # first accumulates it, so persistent bytes there, not fixed bytes
    assert g.meta["grads"] == "accumulated"
    assert [v.persistent_bytes for v in g.nodes] == [0] * 4 + [(16 * 4 + 4) * F32, 0, (8 * 16 + 16) * F32]
    assert g.meta["fixed_breakdown"] == {"parameters": params, "gradients": 0, "buffers": 0,
                                         "inputs": 2 * 8 * F32, "optimizer": 0}
    assert g.fixed_bytes == params + 2 * 8 * F32
    kept = _trace(Tiny(), torch.randn(2, 8), grads="resident")  # a loop that keeps them: fixed bytes
    assert kept.meta["fixed_breakdown"]["gradients"] == params and kept.fixed_bytes == 2 * params + 2 * 8 * F32
    assert kept.persistent_total == 0 and [v.bytes for v in kept.nodes] == [v.bytes for v in g.nodes]
    # Checkmate's rule (generators.from_forward) adds every v -> grad_v and input -> grad_v edge
    g_all = _trace(Tiny(), torch.randn(2, 8), backward_edges="all")
    assert set(g_all.edges) == set(g.edges) | {(0, 6), (0, 5), (2, 4)}
    g_adam = _trace(Tiny(), torch.randn(2, 8), optimizer="adam")
    assert g_adam.fixed_bytes == g.fixed_bytes + 2 * params


def test_meta_records_model_batch_dtype_device_torch_profiler():
    g = _trace(Tiny(), torch.randn(2, 8), name="tiny")
    m = g.meta
    assert m["model"] == "tiny" and m["batch"] == 2 and m["input_shapes"] == [[2, 8]]
    assert m["dtype"] == "float32" and m["device"] == "cpu" and m["torch"] == torch.__version__
    assert m["profiler"] == "flops" and m["granularity"] == "module" and m["capture"].startswith("torch.export")
    assert m["bandwidth"] == remat.core.graph.DEFAULT_BANDWIDTH and "default" in m["bandwidth_source"]
    assert g.bandwidth == m["bandwidth"]
    assert set(m["trace_seconds"]) == {"capture", "profile", "total"}


def _autograd_saved(module, x):
    """Unique storages autograd saves inside `module` (its input and parameters left out), and
    its output storages, from hooks on a plain eager call."""
    x = x.detach().requires_grad_()
    skip = {storage_key(x)} | {storage_key(p) for p in module.parameters()}
    saved = {}

    def pack(t):
        saved.setdefault(storage_key(t), t.untyped_storage().nbytes())
        return t.detach()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    outs = {storage_key(out): out.untyped_storage().nbytes()}
    own = {k: b for k, b in saved.items() if k not in skip and k not in outs}
    return sum(outs.values()), sum(own.values())


def test_saved_bytes_equal_what_autograd_saves_with_views_and_in_place():
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(2, 16)
    g = _trace(model, x)
    by_name = {v.name: v for v in g.nodes}
    mid = by_name["mid"]
    # hand count: x*2 is fresh (128 B), relu_ writes it in place and saves it (counted once);
    # tanh's output (128 B) is saved and returned through a view: output 128, saved 128
    assert (mid.extra["output_bytes"], mid.extra["saved_bytes"]) == (2 * 16 * F32, 2 * 16 * F32)
    assert mid.bytes == 4 * 16 * F32
    # and the same as a plain eager call under saved-tensor hooks, module by module
    h = model.fc(x).detach()
    assert _autograd_saved(model.mid, h) == (mid.extra["output_bytes"], mid.extra["saved_bytes"])
    assert _autograd_saved(model.fc, x) == (by_name["fc"].extra["output_bytes"], by_name["fc"].extra["saved_bytes"])
    # what the tracker sees alive after the node's forward agrees
    assert mid.extra["retained_bytes"] == mid.bytes


def test_in_place_module_and_view_glue_merge_with_their_producer():
    m, x = zoo.get("resnet18", batch=2, image_size=16)
    g = _trace(m, x)
    names = [g.nodes[i].name for i in g.forward_ids()]
    assert "bn1+relu" in names          # ReLU(inplace=True) writes bn1's output
    assert "avgpool+flatten" in names   # flatten returns a view of avgpool's output
    assert "relu" not in names and "flatten" not in names
    assert names[:3] == ["conv1", "bn1+relu", "maxpool"] and "layer1.0" in names and names[-1] == "fc"


def test_batchnorm_running_stats_restored_and_recorded():
    m, x = zoo.get("resnet18", batch=2, image_size=16)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    g = _trace(m, x)
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert set(g.meta["buffer_mutations"]["bn1+relu"]) == {"bn1.running_mean", "bn1.running_var",
                                                           "bn1.num_batches_tracked"}
    node = next(v for v in g.nodes if v.name == "bn1+relu")
    assert node.extra["mutates"] == g.meta["buffer_mutations"]["bn1+relu"]


def test_random_ops_are_recorded_for_rng_replay():
    m, x = zoo.get("gpt2")
    state = torch.get_rng_state()
    g = _trace(m, x)
    assert torch.equal(state, torch.get_rng_state())  # tracing leaves the global RNG alone
    rng = [g.nodes[i].name for i in g.meta["rng_nodes"]]
    assert "transformer.drop" in rng and "transformer.h.0" in rng
    assert all(g.nodes[i].extra.get("random") for i in g.meta["rng_nodes"])
    assert "transformer.wte" not in rng


class TwoInTwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(6, 4)
        self.shared = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.c.weight = self.shared.weight   # one parameter, two modules

    def forward(self, x, y, *, scale=1.0):
        h = self.shared(self.a(x) + self.b(y))
        return {"main": self.c(h) * scale, "aux": self.shared(h)}


def test_several_inputs_outputs_keyword_arguments_shared_parameters():
    model = TwoInTwoOut()
    x, y = torch.randn(3, 4), torch.randn(3, 6)
    g = _trace(model, (x, y), example_kwargs={"scale": 2.0})
    names = [g.nodes[i].name for i in g.forward_ids()]
    assert names[:2] == ["a", "b"] and "shared" in names and "shared#2" in names and "c" in names
    loss = next(v.id for v in g.nodes if v.kind == "loss")
    feeding = {g.nodes[u].name for u in g.preds[loss]}
    assert {"shared#2"} <= feeding and any(n.startswith("c") or n == "mul" for n in feeding)
    # the shared weight counts once in the fixed bytes
    unique = unique_bytes(model.parameters())
    assert g.meta["fixed_breakdown"]["parameters"] == unique
    assert unique < sum(p.numel() * F32 for p in model.parameters()) + 4 * 4 * F32
    assert g.meta["fixed_breakdown"]["inputs"] == (3 * 4 + 3 * 6) * F32
    # a custom loss gets (output, *inputs)
    seen = {}

    def loss_fn(out, xx, yy):
        seen["args"] = (set(out), xx.shape, yy.shape)
        return out["main"].pow(2).mean()
    _trace(model, (x, y), loss_fn=loss_fn, example_kwargs={"scale": 2.0})
    assert seen["args"] == ({"main", "aux"}, (3, 4), (3, 6))


def test_flops_profile_is_deterministic():
    m, x = zoo.get("resnet18", batch=2, image_size=16)
    g1 = _trace(m, x)
    g2 = _trace(m, x)
    assert g1.content_hash() == g2.content_hash()
    m, x = zoo.get("gpt2")  # dropout and attention
    g1 = _trace(m, x)
    g2 = _trace(m, x)
    assert g1.content_hash() == g2.content_hash()
    assert all(v.time > 0 for v in g1.nodes if v.kind == "forward")
    assert sum(v.extra.get("flops", 0) for v in g1.nodes) > 0


def test_measure_profile_positive_and_repeatable():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    x = torch.randn(64, 256)
    g1 = trace(model, x, repeats=5, granularity="module")
    g2 = trace(model, x, repeats=5, granularity="module")
    assert g1.meta["profiler"] == "measure" and g1.meta["profile_options"]["repeats"] == 5
    for g in (g1, g2):
        assert all(v.time > 0 for v in g.nodes)
    # the same model traced twice: same bytes and edges; times within a (loaded-machine) factor
    assert [v.bytes for v in g1.nodes] == [v.bytes for v in g2.nodes] and g1.edges == g2.edges
    ratio = g1.total_time / g2.total_time
    assert 1 / 3 < ratio < 3, ratio


def test_cold_factors_pair_a_run_after_a_cache_flush_with_one_at_once(monkeypatch):
    from remat.frontends import profile
    assert profile.cache_bytes(torch.device("cpu")) >= 8 << 20
    monkeypatch.setattr(profile, "cache_bytes", lambda device: 1 << 20)
    events = []
    real_zero = torch.Tensor.zero_

    def zero_(t):
        events.append(("flush", t.numel()))
        return real_zero(t)
    monkeypatch.setattr(torch.Tensor, "zero_", zero_)
    cold, warm = 3.0, 1.0   # ticks a unit of run: right after a flush, and again at once (factor 3)

    class FakeTimer:
        def __init__(self, device):
            self.t = 0.0

        def mark(self):
            return self.t

        def seconds(self, a, b):
            return b - a

    timer = FakeTimer(None)
    monkeypatch.setattr(profile, "Timer", lambda device: timer)
    runs = []
    for k in range(3):
        def run(k=k):
            after_flush = events[-1][0] == "flush"
            events.append(("run", k))
            timer.t += (cold if after_flush else warm) * (k + 1)
        runs.append(run)
    out = profile.cold_factors(runs, torch.device("cpu"), repeats=4)
    # one factor per run: the median of 4 pairs, each a run right after a flush of the cache's
    # bytes (3 ticks) and the same run again at once (1 tick), whatever each run's own length
    assert out == [3.0, 3.0, 3.0]
    pair = lambda k: [("flush", 1 << 20), ("run", k), ("run", k)]  # noqa: E731
    assert events == [e for k in range(3) for _ in range(4) for e in pair(k)]


def test_module_nodes_carry_a_cold_recompute_time_and_other_graphs_none(monkeypatch):
    from remat.frontends import modules, profile
    seen = []

    def cold_factors(runs, device, repeats):
        seen.append((len(runs), repeats))
        return profile.cold_factors(runs, device, repeats)
    monkeypatch.setattr(modules, "cold_factors", cold_factors)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    x = torch.randn(64, 256)
    g = trace(model, x, granularity="module")
    fwd = [v for v in g.nodes if v.kind == "forward"]
    # every forward module timed again cold, never below the first compute's time; nothing
    # else has a recompute time
    assert seen == [(len(fwd), g.meta["profile_options"]["repeats"])]
    assert all(v.recompute_time is not None and v.recompute_time >= v.time for v in fwd)
    assert all(v.recompute_time is None for v in g.nodes if v.kind != "forward")
    assert g.to_dict()["version"] == 4 and g.recompute_times[0] == fwd[0].recompute_time
    for other in (trace(model, x, granularity="module", profile="flops"), trace(model, x, granularity="joint"),
                  trace(model, x, granularity="op-stages")):
        assert not other.has_recompute_times
    assert len(seen) == 1


def test_calibrate_times_scales_each_direction_to_the_measured_step_within_its_range():
    from remat.core.graph import Node
    from remat.frontends.modules import SCALE_RANGE, calibrate_times
    nodes = [Node(0, "a", "forward", 1.0, 8, recompute_time=2.0), Node(1, "b", "forward", 3.0, 8),
             Node(2, "loss", "loss", 1.5, 4, extra={"forward_time": 0.5, "backward_time": 1.0}),
             Node(3, "grad_b", "backward", 2.0, 8, extra={"forward": 1}),
             Node(4, "grad_a", "backward", 4.0, 8, extra={"forward": 0})]
    out, f, b = calibrate_times(nodes, forward=9.0, backward=3.5)   # profiled 4.5 and 7.0
    assert (f, b) == (2.0, 0.5)
    assert [v.time for v in out] == [2.0, 6.0, 1.0 + 0.5, 1.0, 2.0]
    assert out[0].recompute_time == 4.0 and out[1].recompute_time is None
    assert out[2].extra["forward_time"] == 1.0 and out[2].extra["backward_time"] == 0.5
    assert sum(v.time for v in out if v.kind == "forward") + out[2].extra["forward_time"] == 9.0
    # a factor out of range is clamped (a measurement gone wrong), the inputs are left as they were
    _, f, b = calibrate_times(nodes, forward=1000.0, backward=0.001)
    assert (f, b) == (SCALE_RANGE[1], SCALE_RANGE[0]) and nodes[0].time == 1.0


def test_plain_step_seconds_leaves_buffers_rng_and_gradients_as_they_were():
    from remat.frontends.modules import plain_step_seconds
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    x = torch.randn(16, 8)
    model[0].weight.grad = torch.full_like(model[0].weight, 3.0)
    stats, rng = model[1].running_mean.clone(), torch.get_rng_state()
    fwd, bwd = plain_step_seconds(model, (x,), {}, lambda out, x: out.square().mean(), None,
                                  torch.device("cpu"), warmup=1, repeats=3)
    assert fwd > 0 and bwd > 0
    assert torch.equal(model[1].running_mean, stats) and torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 3.0)) and model[3].weight.grad is None


def test_a_measured_module_graph_sums_to_the_plain_step_it_timed(monkeypatch):
    from remat.frontends import modules
    timed = []

    def spy(*a, **k):
        timed.append(modules_plain(*a, **k))
        return timed[-1]
    modules_plain = modules.plain_step_seconds
    monkeypatch.setattr(modules, "plain_step_seconds", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 4))
    g = trace(model, torch.randn(4, 3, 8, 8), granularity="module")
    (fwd, bwd), = timed
    assert g.meta["plain_step_seconds"] == {"forward": fwd, "backward": bwd}
    loss = next(v for v in g.nodes if v.kind == "loss")
    lo, hi = modules.SCALE_RANGE
    for kind, part, measured in (("forward", "forward_time", fwd), ("backward", "backward_time", bwd)):
        total = sum(v.time for v in g.nodes if v.kind == kind) + loss.extra[part]
        assert math.isclose(total, measured, rel_tol=1e-9) or g.meta["time_scale"][kind] in (lo, hi)
    assert all(v.recompute_time >= v.time for v in g.nodes if v.kind == "forward")
    assert "time_scale" not in trace(model, torch.randn(4, 3, 8, 8), granularity="module", profile="flops").meta


def test_op_stages_one_node_per_op():
    g = _trace(Tiny(), torch.randn(2, 8), granularity="op-stages")
    fwd = [g.nodes[i] for i in g.forward_ids()]
    assert [v.name for v in fwd] == ["linear", "relu", "linear_1"]
    assert g.n == 7 and g.meta["granularity"] == "op-stages"


class BranchOnValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y * 2 if y.sum() > 0 else y


def test_op_granularity_is_the_joint_graph_and_falls_back_to_op_stages(caplog):
    g = _trace(Tiny(), torch.randn(2, 8), granularity="op")
    assert g.meta["granularity"] == "joint" and any(v.kind == "backward" for v in g.nodes)
    # data-dependent control flow: no joint graph; per-op stages from an eager recording, and
    # the log and the graph's notes say why
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="remat"):
        g = _trace(BranchOnValue(), torch.randn(2, 8), granularity="op")
    assert g.meta["granularity"] == "op-stages"
    assert "joint forward+backward graph cannot be captured" in caplog.text
    assert any("per-op stages" in note for note in g.meta["capture_notes"])


def test_module_depth():
    m, x, g1 = _zoo_graph("gpt2")
    g2 = _trace(m, x, depth=2)
    n1 = [g1.nodes[i].name for i in g1.forward_ids()]
    n2 = [g2.nodes[i].name for i in g2.forward_ids()]
    assert "transformer.h.0" in n1 and "transformer.h.0.attn" not in n1
    assert "transformer.h.0.attn" in n2 and "transformer.h.0.mlp" in n2 and len(n2) > len(n1)


# ---- the zoo: every model traces, validates, plans, and predicts its real peak -------------------
_GRAPHS: dict = {}


def _zoo_graph(name):
    if name not in _GRAPHS:
        model, inputs = zoo.get(name)
        _GRAPHS[name] = (model, inputs, _trace(model, inputs, name=name))
    return _GRAPHS[name]


@pytest.mark.parametrize("name", zoo.names())
def test_zoo_graph_validates_and_plans(name):
    _, _, g = _zoo_graph(name)
    again = Graph.from_dict(json.loads(json.dumps(g.to_dict())))
    assert again.content_hash() == g.content_hash()
    base = remat.simulate(g, solver("checkpoint-all")(g))
    assert base.valid and base.peak_bytes > g.fixed_bytes
    p = remat.plan(g, "1x", "checkpoint-all")
    assert p.fits
    p = remat.plan(g, "1x", "chen-greedy")
    assert p.fits and p.predicted["peak_bytes"] <= base.peak_bytes


def _real_peaks(model, inputs):
    """Peak of one plain training step, gradients kept and freed (frontends.measure)."""
    return plain_step_peaks(model, inputs)


@pytest.mark.parametrize("name", zoo.names())
def test_zoo_predicted_peak_within_10_percent_of_a_real_step(name):
    model, inputs, g = _zoo_graph(name)
    # (the storage accounting's view: kernels' own scratch, which the allocator sees, left out)
    predicted = remat.simulate(storage_view(g), solver("checkpoint-all")(g)).peak_bytes
    kept, freed = _real_peaks(model, inputs)
    # gradients allocated at their first accumulation, as the real step with set_to_none does;
    # a block's backward counted with all its gradients and saved tensors at once: at or above
    assert freed <= predicted <= 1.10 * freed, (predicted, freed)


@pytest.mark.parametrize("name", ["resnet18", "gpt2"])
def test_resident_gradients_predict_the_step_that_keeps_them(name):
    model, inputs = zoo.get(name)
    g = _trace(model, inputs, name=name, grads="resident")
    predicted = remat.simulate(storage_view(g), solver("checkpoint-all")(g)).peak_bytes
    kept, _ = _real_peaks(model, inputs)
    assert g.persistent_total == 0 and g.meta["grads"] == "resident"
    assert abs(predicted - kept) <= 0.02 * kept, (predicted, kept)


class RecurrentEncoder(nn.Module):
    """In-place ReLU on the user's input, an LSTM, a Transformer encoder (many intermediates
    freed inside each module call), a head."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h, _ = self.rnn(self.act(x))
        return self.head(self.enc(h))


def test_peak_of_recurrent_and_attention_modules():
    torch.manual_seed(0)
    model, x = RecurrentEncoder(), torch.randn(4, 10, 8)
    g = _trace(model, x.clone())
    assert [g.nodes[i].name for i in g.forward_ids()] == ["act", "rnn", "enc", "head"]
    assert g.nodes[0].bytes == 0   # writes the user's input in place: no bytes of its own
    # (the storage accounting's view: the saved generator states are no tensor storages)
    predicted = remat.simulate(storage_view(g), solver("checkpoint-all")(g)).peak_bytes
    _, freed = _real_peaks(model, (x.clone(),))
    assert abs(predicted - freed) <= 0.05 * freed, (predicted, freed)


def test_measure_peak_counts_storages_once():
    x = torch.randn(256, 256)          # 256 KiB, resident

    def step():
        y = x * 2                      # +256 KiB
        v = y.view(-1)                 # a view: nothing new
        y.add_(1)                      # in place: nothing new
        z = torch.tanh(v)              # +256 KiB -> peak 3 x 256 KiB with x
        del y, v, z
    assert measure_peak(step, resident=[x, x.view(-1)]) == 3 * 256 * 256 * F32


# ---- errors ----------------------------------------------------------------------------------
class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.gate = Gate()
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.gate(self.a(x)))


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:            # data-dependent control flow
            return self.lin(x)
        return -self.lin(x)


def test_untraceable_module_is_named_and_falls_back_to_eager(caplog):
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match=r"module 'gate' \(Gate\).*data-dependent control flow"):
        _trace(DataDependent(), torch.randn(2, 4), capture_with="export")
    with caplog.at_level(logging.WARNING, logger="remat"):
        g = _trace(DataDependent(), torch.randn(2, 4))
    assert "falling back to an eager recording" in caplog.text and "'gate'" in caplog.text
    assert g.meta["capture"].startswith("eager") and g.meta["capture_notes"]
    assert [g.nodes[i].name for i in g.forward_ids()] == ["a", "gate", "b"]


class NoModes(nn.Module):
    """Refuses to run under any dispatch mode (as code that checks for fake tensors might)."""

    def __init__(self):
        super().__init__()
        self.inner = Refuse()

    def forward(self, x):
        return self.inner(x)


class Refuse(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if torch._C._len_torch_dispatch_stack() > 0:
            raise RuntimeError("refusing to run under a dispatch mode")
        return self.lin(x)


def test_model_neither_capture_handles_is_a_clear_error():
    with pytest.raises(CaptureError, match=r"module 'inner' \(Refuse\).*refusing to run under a dispatch mode"):
        _trace(NoModes(), torch.randn(2, 4))


def test_wrong_input_shape_names_the_module():
    m, _ = zoo.get("resnet18")
    with pytest.raises(InvalidInputError, match=r"module 'conv1' \(Conv2d\).*expected input.*3 channels"):
        _trace(m, torch.randn(2, 5, 32, 32))


def test_bad_arguments():
    with pytest.raises(InvalidInputError, match="granularity"):
        trace(Tiny(), torch.randn(2, 8), granularity="layer")
    with pytest.raises(InvalidInputError, match="profile"):
        trace(Tiny(), torch.randn(2, 8), profile="guess")
    with pytest.raises(InvalidInputError, match="optimizer"):
        trace(Tiny(), torch.randn(2, 8), optimizer="sgdd")
    with pytest.raises(InvalidInputError, match="scalar"):
        _trace(Tiny(), torch.randn(2, 8), loss_fn=lambda out, x: out)


# ---- CLI ---------------------------------------------------------------------------------
def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def test_cli_trace_zoo_model(tmp_path, capsys):
    out_path = tmp_path / "g.json"
    code, out, err = run(capsys, "trace", "vgg16", "--batch", "1", "--input-shape", "3,32,32", "--profile", "flops",
                         "--no-progress", "-o", out_path)
    assert code == 0, err
    g = Graph.load(out_path)
    assert g.meta["model"] == "vgg16" and g.meta["batch"] == 1 and g.meta["profiler"] == "flops"
    assert "checkpoint-all peak" in out and "profiling" in out and f"wrote      {out_path}" in out
    assert g.meta["grads"] == "accumulated" and "allocated in the backward" in out
    # --grads resident: the gradients are fixed bytes, counted in the summary as such
    code, out, err = run(capsys, "trace", "vgg16", "--batch", "1", "--input-shape", "3,32,32", "--profile", "flops",
                         "--no-progress", "--grads", "resident", "-o", out_path)
    kept = Graph.load(out_path)
    assert code == 0 and kept.meta["grads"] == "resident" and kept.persistent_total == 0
    assert kept.fixed_bytes == g.fixed_bytes + g.persistent_total


def test_cli_trace_factory_file_and_input_shape(tmp_path, capsys):
    src = tmp_path / "mymodel.py"
    src.write_text("import torch.nn as nn\n"
                   "def make():\n    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))\n"
                   "def with_inputs(batch=3):\n    import torch\n"
                   "    return nn.Sequential(nn.Linear(5, 5), nn.Tanh()), (torch.randn(batch, 5),)\n")
    code, out, err = run(capsys, "trace", f"{src}:with_inputs", "--batch", "4", "--profile", "flops",
                         "--no-progress", "-o", tmp_path / "a.json")
    assert code == 0, err
    assert Graph.load(tmp_path / "a.json").meta["batch"] == 4
    code, out, err = run(capsys, "trace", f"{src}:make", "--profile", "flops", "--no-progress",
                         "-o", tmp_path / "b.json")
    assert code == 2 and "--input-shape" in err
    code, out, err = run(capsys, "trace", f"{src}:make", "--input-shape", "3,8,8", "--profile", "flops",
                         "--no-progress", "-o", tmp_path / "b.json")
    assert code == 0, err
    # a factory taking **kwargs (torchvision's, timm's) passes them to the model: --batch sizes the
    # input, not the factory
    src.write_text(src.read_text() + "def wide(**kwargs):\n    return make(**kwargs)\n")
    code, out, err = run(capsys, "trace", f"{src}:wide", "--batch", "3", "--input-shape", "3,8,8",
                         "--profile", "flops", "--no-progress", "-o", tmp_path / "c.json")
    assert code == 0 and Graph.load(tmp_path / "c.json").meta["batch"] == 3, err


@pytest.mark.parametrize("model, message", [
    ("no_such_model", "unknown model 'no_such_model'"),
    ("missing_file.py:make", "the file 'missing_file.py' does not exist"),
    ("json:no_factory", "'json' has no factory 'no_factory'"),
    ("no_such_package_xyz.mod:make", "cannot import module 'no_such_package_xyz.mod'"),
])
def test_cli_trace_bad_model(tmp_path, capsys, model, message):
    code, out, err = run(capsys, "trace", model, "--no-progress", "-o", tmp_path / "g.json")
    assert code == 2 and message in err and err.startswith("remat: error:")


def test_cli_trace_wrong_input_shape(tmp_path, capsys):
    code, out, err = run(capsys, "trace", "resnet18", "--input-shape", "3,8,9", "-o", tmp_path / "g.json")
    assert code == 2 and "(3, H, W) with H = W" in err


def test_cli_plan_accepts_a_model(tmp_path, capsys):
    src = tmp_path / "mlp.py"
    src.write_text("import torch, torch.nn as nn\n"
                   "def mlp():\n    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)), "
                   "(torch.randn(4, 8),)\n")
    code, out, err = run(capsys, "plan", f"{src}:mlp", "--budget", "1x", "--solver", "checkpoint-all",
                         "--granularity", "module", "--no-progress", "-o", tmp_path / "plan.json")
    assert code == 0, err
    p = remat.load_plan(tmp_path / "plan.json")
    assert p.graph.meta["model"] == "mlp:mlp" and p.graph.meta["profiler"] == "measure"
    assert [p.graph.nodes[i].name for i in p.graph.forward_ids()] == ["0", "1", "2"]
    # by default the CLI says which granularity it chose and why
    code, out, err = run(capsys, "trace", f"{src}:mlp", "--profile", "flops", "--no-progress",
                         "-o", tmp_path / "g.json")
    assert code == 0, err
    chosen = [ln for ln in out.splitlines() if ln.startswith("chosen     granularity auto: ")]
    assert len(chosen) == 1 and remat.Graph.load(tmp_path / "g.json").meta["granularity"] in chosen[0].replace(
        "op, the joint graph", "joint")


def test_import_remat_does_not_import_torch():
    import subprocess
    code = ("import sys, remat; assert 'torch' not in sys.modules, 'torch imported'; "
            "remat.trace; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_bytes_round_cuda_storages_to_the_allocators_512_byte_blocks():
    from remat.frontends.measuring import block_bytes
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [block_bytes(n, cuda) for n in (0, 1, 512, 513, 4096 + 1)] == [512, 512, 512, 1024, 4608]
    assert [block_bytes(n, cpu) for n in (0, 1, 513)] == [0, 1, 513]


def test_unowned_bytes_are_the_blocks_no_live_tensor_holds():
    # what remat.trace counts as the CUDA libraries' workspaces: allocator blocks no tensor (nor a
    # leaf's .grad) starts in; views and fake tensors of a captured graph own nothing extra
    from torch._subclasses.fake_tensor import FakeTensorMode
    from remat.frontends.measuring import unowned_bytes
    p = torch.nn.Parameter(torch.randn(64))
    p.grad = torch.zeros(64)
    x = torch.randn(8, 8)
    view = x[2:]
    with FakeTensorMode():
        fake = torch.empty(1000)
    blocks = {p.data_ptr(): 512, p.grad.data_ptr(): 512, x.data_ptr(): 512, 12345: 32 << 20, 67890: 1 << 20}
    assert unowned_bytes(blocks, [p, view, fake], "cpu") == (32 << 20) + (1 << 20)
    assert unowned_bytes(blocks, [p], "cpu") == (32 << 20) + (1 << 20) + 512        # x's block is nobody's
    assert unowned_bytes(blocks, [p, x], "cuda") == sum(blocks.values())            # another device's tensors
    p.grad = None
    assert unowned_bytes(blocks, [p, x], "cpu") == (32 << 20) + (1 << 20) + 512     # the grad's block


def test_runtime_bytes_and_allocator_windows_are_cuda_only():
    from remat.frontends.measuring import AllocatorWindow, LibraryWorkspaces, StorageTracker, untracked_device_bytes
    cpu = torch.device("cpu")
    with LibraryWorkspaces(cpu) as libs, AllocatorWindow(cpu) as w:
        torch.randn(256, 256) @ torch.randn(256, 256)
    assert libs.bytes == 0 and w.peak == 0 and w.hidden(StorageTracker(), 0) == 0 and untracked_device_bytes(cpu) == 0
    model = torch.nn.Sequential(torch.nn.Linear(8, 4))
    g = remat.trace(model, (torch.randn(2, 8),), profile="flops")
    assert "runtime" not in g.meta["fixed_breakdown"]   # only a CUDA trace measures the libraries


def test_host_pool_counts_what_each_buffer_stands_for_and_reuses_buffers_by_size():
    # a swapped-out CUDA storage of 100 bytes frees a 512-byte block: the pool counts 512 (as the
    # plan does) but holds a 100-byte buffer, handed out again in the next step
    from remat.frontends.measuring import on_autograd_thread
    from remat.frontends.transfer import HostPool
    pool = HostPool(pin=False)
    a = pool.take(100, counted=512)
    b = pool.take(64)
    assert a.numel() == 100 and b.numel() == 64 and pool.in_use == pool.peak == 576 and pool.capacity == 164
    pool.release_all()
    assert pool.in_use == 0 and pool.take(100, counted=512) is a and pool.capacity == 164
    called = []
    on_autograd_thread(lambda: called.append(torch.is_grad_enabled()), torch.device("cpu"))
    assert called == [False]   # run as a backward runs: grad mode off


def test_a_model_that_traces_to_a_few_nodes_gets_a_warning_naming_the_finer_options(caplog):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.c(torch.relu(self.b(torch.relu(self.a(x)))))

    class Wrapper(nn.Module):  # one child: at depth 1 the whole network is one node
        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x):
            return self.net(x)

    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="remat"):
        g = trace(Wrapper(), (x,), profile="flops", granularity="module", depth=1)
    assert len(g.forward_ids()) == 1
    assert "traced to 1 forward node at depth 1" in caplog.text and "depth=2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat"):
        g = trace(Wrapper(), (x,), profile="flops", depth=2, granularity="module")
    assert len(g.forward_ids()) >= 4 and "forward node" not in caplog.text
    # the defaults look through the wrapper (depth auto: 2) and say what they chose
    g = trace(Wrapper(), (x,), profile="flops", granularity="module")
    assert g.meta["depth"] == 2 and "depth auto: 2" in " ".join(g.meta["capture_notes"])
    g = trace(Wrapper(), (x,), profile="flops")
    notes = " ".join(g.meta["capture_notes"])
    assert g.meta["granularity_auto"] and "granularity auto: " in notes
    assert (g.meta["granularity"] == "joint") == ("granularity auto: op" in notes)
    assert len(g.forward_ids()) >= 4


def test_cpu_scratch_compares_the_log_and_the_tracker_counted_alike():
    # a block that lets go of a storage made before it and then allocates as much: no kernel
    # scratch; the CPU's log counts no free of a block allocated before its window, so the
    # tracker's peak must leave such frees out too (`own_frees_only`), or the free shows as scratch
    from remat.frontends.measuring import AllocatorWindow, StorageTracker
    cpu = torch.device("cpu")
    tracker = StorageTracker(record_events=True)
    n = 1 << 20
    with tracker:
        held = [torch.ones(n // 4)]                 # (4 bytes an element: n bytes)
        start = tracker.mark()
        with AllocatorWindow(cpu, cpu_events=True) as w:
            held.pop()
            made = torch.ones(n // 4)
        assert tracker.peak_between(start) == 0     # the free, then the allocation
        assert tracker.peak_between(start, own_frees_only=True) == n
        assert w.peak == n and w.hidden(tracker, start) == 0
        # a kernel's own temporary, which no storage shows: hidden
        start = tracker.mark()
        with AllocatorWindow(cpu, cpu_events=True) as w2:
            torch.ops.aten.native_dropout_backward.default(made, made > 0, 2.0)   # (a float copy of the mask inside)
        visible = tracker.peak_between(start, own_frees_only=True)
        assert w2.hidden(tracker, start) == w2.peak - visible >= n
