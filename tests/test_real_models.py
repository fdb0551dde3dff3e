"""The real-model suite: tiny configurations of Hugging Face transformers models (GPT-2 with
dropout, BERT with its tied masked-LM head, a Llama-style decoder) and of torchvision and timm
classifiers (ResNet-50's bottlenecks with batch norm, ViT-B/16's encoder with dropout, ConvNeXt,
timm's ViT with dropout; cross entropy over labels that are inputs of the step), traced with the
defaults (``granularity="auto"``, ``depth="auto"``), planned at 0.7x, 0.5x and the smallest
feasible budget of the plain peak, applied, and trained one step in PyTorch's default loop
(gradients set to None before the step): the measured peak is within the budget and within 2 %
of predicted, the loss and every gradient equal plain autograd's (dropout masks included), and
a parameter the loss does not reach keeps ``.grad`` None as in plain autograd.

Each family is skipped when its package is not installed (`make install` installs
transformers, torchvision and timm)."""
from __future__ import annotations

import copy
import importlib.util

import pytest

torch = pytest.importorskip("torch")

import remat  # noqa: E402
from remat.core.analysis import forced_need  # noqa: E402
from remat.core.errors import InfeasibleBudgetError, SolverError  # noqa: E402
from remat.frontends import measure_peak  # noqa: E402
from remat.frontends.tracing import FEW_NODES  # noqa: E402
from remat.frontends.segments import auto_depth, group_modules, repeated_blocks  # noqa: E402

PEAK_TOLERANCE = 0.02   # the bar: measured within 2 % of predicted
# the executors measure up to 8 bytes above the plan: the step returns the loss and autograd's
# seed for ``loss.backward()`` beside the plan's own loss node (loss value and seed, 8 bytes)
STEP_SCALARS = 8
VOCAB, SEQ, BATCH = 96, 32, 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _gpt2():
    import transformers
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                  resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _bert():
    import transformers
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def _llama():
    import transformers
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                   intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                   bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


LANGUAGE = {"gpt2": _gpt2, "bert": _bert, "llama": _llama}
VISION = ("resnet50", "vit_b_16", "convnext", "timm_vit")   # remat.frontends.vision
PACKAGE = {**{n: "transformers" for n in LANGUAGE}, **{n: "torchvision" for n in VISION}, "timm_vit": "timm"}
MODELS = sorted(LANGUAGE) + sorted(VISION)
ATTENTION_DROPOUT = ("vit_b_16", "timm_vit")   # scaled_dot_product_attention with dropout_p > 0


def lm_loss(out, ids):
    """Next-token cross entropy over the logits, the loss a user's loop computes."""
    return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class Case:
    """One model of the suite: a fresh copy of it, its batch, the loss and the step's options."""

    def __init__(self, name: str):
        if importlib.util.find_spec(PACKAGE[name]) is None:
            pytest.skip(f"{PACKAGE[name]} is not installed")
        self.name = name
        if name in LANGUAGE:
            torch.manual_seed(0)
            self.model = LANGUAGE[name]()
            self.model.train()
            self.batch = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)),)
            self.loss_fn, self.options = lm_loss, {}
        else:
            from remat.frontends import vision
            self.model, self.batch = vision.get(name, batch=8 if name != "convnext" else 4)
            # timm's blocks take an optional attention mask: the labels are the loss's, say so
            self.loss_fn, self.options = vision.cross_entropy, {"model_inputs": 1}

    def step(self, model, seed):
        """One plain step of `model` (the user's loop): (loss, {name: grad})."""
        torch.manual_seed(seed)
        x = self.batch[0]
        loss = self.loss_fn(model(x), *self.batch)
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    def resident(self, model):
        return list(model.parameters()) + list(model.buffers()) + list(self.batch)


def _case(name):
    c = Case(name)
    return c.model, c.batch[0]


@pytest.fixture(scope="module", params=MODELS)
def traced(request):
    case = Case(request.param)
    graph = remat.trace(case.model, case.batch, loss_fn=case.loss_fn, profile="flops", **case.options)
    budgets, plans = _budgets(graph)
    return case, graph, budgets, plans


def _budgets(graph):
    """0.7x and 0.5x of the plain peak, and the smallest budget the planner finds: the one its
    infeasibility message names, or (when the scalable ILP can neither plan nor refute the
    lower bound in its time limit) the least of a short bisection above that bound, with the
    plan found there (the scalable mode's time limit makes a re-plan at a bisected budget
    machine-dependent): ``({which: budget}, {budget: plan})``."""
    plain = remat.plan(graph, "1.0x", solver="checkpoint-all").predicted["peak_bytes"]
    budgets = {"0.7x": int(0.7 * plain), "0.5x": int(0.5 * plain)}
    low, plans = forced_need(graph), {}
    try:
        plans[low] = remat.plan(graph, low, swap=False, time_limit=10)
        return {**budgets, "tightest": low}, plans
    except InfeasibleBudgetError as e:
        if e.min_feasible_bytes is not None:
            return {**budgets, "tightest": e.min_feasible_bytes}, plans
    except SolverError:
        pass
    high = None
    for top in (budgets["0.5x"], budgets["0.7x"], plain):   # the bisection's top: a budget that plans
        try:
            plans[top], high = remat.plan(graph, top, swap=False, time_limit=10), top
            break
        except (InfeasibleBudgetError, SolverError):
            low = max(low, top)
    for _ in range(3):
        mid = (low + high) // 2
        try:
            plans[mid], high = remat.plan(graph, mid, swap=False, time_limit=10), mid
        except (InfeasibleBudgetError, SolverError):
            low = mid
    return {**budgets, "tightest": high}, plans


def test_auto_depth_looks_through_the_wrappers_to_the_repeated_blocks():
    for name, blocks in (("gpt2", ["transformer.h.0", "transformer.h.1"]),
                         ("bert", ["bert.encoder.layer.0", "bert.encoder.layer.1"]),
                         ("llama", ["model.layers.0", "model.layers.1"])):
        model, _ = _case(name)
        assert len(group_modules(model, 1)) < 4, name    # depth 1: the wrapper and the head
        d = auto_depth(model)
        assert d > 1, name
        assert set(blocks) <= set(repeated_blocks(group_modules(model, d))), name


def test_default_trace_says_what_it_chose_and_is_finer_than_the_wrapper(traced):
    case, graph, budgets, plans = traced
    name = case.name
    notes = graph.meta["capture_notes"]
    assert any(n.startswith("granularity auto") for n in notes), notes
    # not the wrapper and its head: the joint graph, or the module graph of the blocks
    if graph.meta["granularity"] == "joint":
        assert len(graph.forward_ids()) > 4 * FEW_NODES, name
    else:
        assert graph.meta["depth"] > 1 and len(graph.forward_ids()) >= FEW_NODES, name
        assert sum(".layers." in v.name or ".h." in v.name or ".layer." in v.name for v in graph.nodes
                   if v.kind == "forward") == 2, [v.name for v in graph.nodes]


@pytest.mark.parametrize("which", ["0.7x", "0.5x", "tightest"])
def test_plans_fit_run_as_predicted_and_train_as_plain_autograd(traced, which):
    case, graph, budgets, plans = traced
    name, budget = case.name, budgets[which]
    if budget < budgets["tightest"]:
        # below the smallest feasible budget (a tiny model's parameters and gradients): refused
        with pytest.raises(InfeasibleBudgetError):
            remat.plan(graph, budget, swap=False, time_limit=10)
        return
    plan = plans.get(budget) or remat.plan(graph, budget, swap=False, time_limit=10)
    assert plan.predicted["peak_bytes"] <= budget
    work = copy.deepcopy(case.model)
    planned = remat.apply(work, plan, case.batch, loss_fn=case.loss_fn)
    for p in work.parameters():
        p.grad = None
    torch.manual_seed(7)
    loss_box = {}
    peak = measure_peak(lambda: loss_box.setdefault("loss", planned(*case.batch)).backward(),
                        resident=case.resident(work))
    predicted = plan.storage_peak_bytes   # (what the storage accounting sees: no kernel scratch)
    assert peak <= budget + STEP_SCALARS, (name, which, peak, budget)
    assert abs(peak - predicted) <= PEAK_TOLERANCE * predicted, (name, which, peak, predicted)
    ref_loss, ref_grads = case.step(copy.deepcopy(case.model), 7)
    assert torch.allclose(loss_box["loss"].detach(), ref_loss, rtol=1e-5, atol=1e-6)
    for n, p in work.named_parameters():
        if ref_grads[n] is None:
            assert p.grad is None, n
        else:
            assert p.grad is not None and torch.allclose(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6), (name, n)


def test_the_predicted_plain_peak_is_the_measured_plain_autograd_peak(traced):
    case, graph, budgets, plans = traced
    name = case.name
    predicted = remat.plan(graph, "1.0x", solver="checkpoint-all").storage_peak_bytes
    ref = copy.deepcopy(case.model)
    measured = measure_peak(lambda: case.step(ref, 0), resident=case.resident(ref))
    if graph.meta["granularity"] == "joint" and name in ATTENTION_DROPOUT:
        # eager attention with dropout on the CPU runs SDPA's math kernel, which saves a float
        # noise tensor per attention matrix; the joint graph's decomposition saves a bool mask
        # (native_dropout): the planned program holds less than plain autograd, never more
        assert predicted < measured, (name, predicted, measured)
        pytest.xfail(f"{name}: the joint program's keep-all peak is {predicted / measured:.3f}x plain autograd's "
                     "(attention dropout decomposed differently from eager's SDPA math kernel)")
    assert abs(predicted - measured) <= 0.10 * measured, (name, graph.meta["granularity"], predicted, measured)


def test_gpt2_without_a_cache_captures_its_joint_graph():
    # use_cache=False (training) sends transformers through a packed-sequence check that reads a
    # tensor's value unless the model runs as torch.export runs it
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    import transformers

    from remat.frontends.joint import capture_joint
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    cap = capture_joint(model, (ids,), {}, lm_loss)
    assert any("scaled_dot_product" in str(n.target) or "bmm" in str(n.target) for n in cap.gm.graph.nodes)
    assert any("as torch.export runs the model" in n for n in cap.notes), cap.notes
    assert not torch.compiler.is_compiling()      # the state is left as it was
