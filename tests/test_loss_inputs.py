"""Inputs of the step that the model does not take (a classifier's labels): they go to the loss
only, at every granularity and through every executor, and the step trains as plain autograd's
``loss_fn(model(images), labels)``."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import remat  # noqa: E402
from remat.core.errors import InvalidInputError  # noqa: E402
from remat.frontends import measure_peak  # noqa: E402
from remat.frontends.base import model_inputs  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1)) for _ in range(4)])
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.blocks(x))


class Masked(nn.Module):
    """A forward with an optional second input, as timm's blocks have."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, x, mask=None):
        return self.lin(x if mask is None else x * mask)


def xent(out, x, y):
    return F.cross_entropy(out, y)


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 32, generator=g), torch.randint(0, 5, (64,), generator=g)


def test_the_model_takes_the_inputs_its_forward_has_positions_for_unless_told():
    x, y, m = torch.ones(2, 8), torch.zeros(2, dtype=torch.long), torch.ones(2, 8)
    assert model_inputs(Classifier(), (x, y)) == (x,)
    assert model_inputs(Masked(), (x, m)) == (x, m)           # a mask the model can take goes to it
    assert model_inputs(Masked(), (x, y), count=1) == (x,)    # said: the rest are the loss's
    assert model_inputs(Masked(), (x, m), {"mask": m}) == (x,)
    assert model_inputs(torch.compile(Classifier()), (x, y)) == (x,)  # (compiled: its module's signature)
    with pytest.raises(InvalidInputError, match="model_inputs: expected a whole number from 0 to 2"):
        remat.trace(Masked(), (x, y), loss_fn=lambda out, a, b: out.sum(), model_inputs=3, profile="flops")


@pytest.mark.parametrize("granularity,executor", [("module", "interpreter"), ("module", "native"),
                                                  ("joint", "interpreter")])
def test_labels_reach_the_loss_and_the_plan_runs_as_predicted(granularity, executor):
    torch.manual_seed(0)
    model = Classifier().train()
    batch = _batch()
    graph = remat.trace(model, batch, loss_fn=xent, granularity=granularity, profile="flops", model_inputs=1)
    assert graph.meta["model_inputs"] == 1
    plan = remat.plan(graph, "0.7x", swap=False, time_limit=10)
    work = copy.deepcopy(model)
    planned = remat.apply(work, plan, batch, loss_fn=xent, executor=executor)
    resident = list(work.parameters()) + list(work.buffers()) + list(batch)
    torch.manual_seed(3)
    box = {}
    peak = measure_peak(lambda: box.setdefault("loss", planned(*batch)).backward(), resident=resident)
    if executor == "interpreter":
        assert abs(peak - plan.storage_peak_bytes) <= 0.02 * plan.storage_peak_bytes + 8
    ref = copy.deepcopy(model)
    torch.manual_seed(3)
    loss = F.cross_entropy(ref(batch[0]), batch[1])
    loss.backward()
    assert torch.equal(box["loss"].detach(), loss.detach())
    for p, q in zip(work.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7)
