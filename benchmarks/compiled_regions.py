"""remat.compiler on steps torch.compile splits into regions, and on models with batch norm.

Cases (aot_eager: the partitioner's graphs run op by op, so the replay is exact; the allocator
meter, `remat.measure(meter="allocator")`, which sees inside compiled code and kernels' scratch):

* ``broken-mlp``: the MLP of `tests/test_compiled.py` twice, with ``torch._dynamo.graph_break()``
  between the halves and the loss inside the second region (batch 2048);
* ``hf-gpt2``: a transformers GPT2LMHeadModel (2 layers, width 64, vocabulary 256, dropout 0.1,
  batch 4, sequence 64) trained with ``model(input_ids=ids, labels=ids).loss``; transformers logs
  a warning inside ``loss_function`` on every call for this class, a graph break before the loss:
  run as it is (two regions, the second needs ``reserve=``) and with ``model.loss_type =
  "ForCausalLM"`` (one region);
* ``resnet18-bn``: the zoo's ResNet-18 (batch 8, 64 px unless ``--resnet BATCH,PX``; batch
  norm, in-place ReLUs) with ``out.square().mean()`` inside the region.

``--backend`` (default aot_eager): the backend remat's partition is compiled by; with
``inductor`` the prediction models inductor's channels-last copies and kernels
(`remat.frontends.compiled`).

For each budget (a fraction of the step's keep-all compiled peak, measured first with a budget
nothing constrains): the budget, each region's share and predicted peak, the step's predicted
peak (`RematCompiler.step_peak_bytes`: each region with what the regions before it hold and the
later regions' parameters and gradients), the measured peak, and whether loss and
gradients equal eager autograd's.

    python benchmarks/compiled_regions.py [--cases broken-mlp,hf-gpt2,resnet18-bn] [--budgets 0.9,0.8,0.7]
        [--backend inductor] [--resnet 32,128] [--buffers]
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from csvout import write_csv  # noqa: E402

import torch  # noqa: E402

import remat  # noqa: E402
from remat.frontends import zoo  # noqa: E402
from remat.frontends.measuring import measure  # noqa: E402

COLUMNS = ("case", "fraction", "budget_bytes", "reserve_bytes", "regions", "shares", "region_peaks",
           "predicted_peak_bytes", "peak_bytes", "measured_over_predicted", "within_budget", "recomputed_ops",
           "gradients_equal_eager", "note")


class Halves(torch.nn.Module):
    def __init__(self):
        super().__init__()

        def blocks():
            return torch.nn.Sequential(*[torch.nn.Sequential(
                torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 64),
                torch.nn.LayerNorm(64)) for _ in range(3)])
        self.a, self.b = blocks(), blocks()

    def forward(self, x):
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(y).square().mean()


class SquareLoss(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x).square().mean()


RESNET = (8, 64)   # (batch, pixels) of the resnet18-bn case (`--resnet`)


def case(name: str):
    """(model, batch as kwargs, the tensors the loop holds)."""
    torch.manual_seed(0)
    if name == "broken-mlp":
        x = torch.randn(2048, 64)
        return Halves().train(), {"x": x}, [x]
    if name == "resnet18-bn":
        m, x = zoo.get("resnet18", batch=RESNET[0], image_size=RESNET[1])
        x = x[0] if isinstance(x, tuple) else x
        return SquareLoss(m).train(), {"x": x}, [x]
    from remat.frontends import vision
    vision.prepare()
    import transformers
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, resid_pdrop=0.1,
                                  attn_pdrop=0.1, embd_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    m = transformers.GPT2LMHeadModel(cfg).train()
    if name == "hf-gpt2-one-region":
        m.loss_type = "ForCausalLM"
    ids = torch.randint(0, 256, (4, 64))
    return m, {"input_ids": ids, "labels": ids, "use_cache": False}, [ids]


def step(model, batch):
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(7)
    out = model(**batch)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return loss.detach()


def run(name: str, fraction: float | None, budget: int, reserve: int = 0,
        backend: str = "aot_eager", buffers: bool = False) -> tuple[dict, str | None]:
    model, batch, held = case(name)
    eager = copy.deepcopy(model)
    loss0 = step(eager, batch)
    torch._dynamo.reset()
    m = copy.deepcopy(model)
    rc = remat.compiler(budget, backend=backend, time_limit=10, reserve=reserve, buffers=buffers)
    c = torch.compile(m, backend=rc)
    try:
        loss = step(c, batch)
    except Exception as e:  # noqa: BLE001  (a budget that does not fit: the row says why)
        msg = str(e).split("InfeasibleBudgetError: ")[-1].splitlines()[0]
        found = re.search(r"reserve=(\d+)", msg)
        return {"case": name, "fraction": fraction, "budget_bytes": budget, "reserve_bytes": reserve,
                "note": msg}, found.group(1) if found else None
    equal = torch.equal(loss, loss0) and all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(),
                                                                                           eager.parameters()))
    measured = measure(lambda: step(c, batch), meter="allocator", resident=list(m.parameters()) + held).peak_bytes
    predicted = rc.step_peak_bytes
    return {"case": name, "fraction": fraction, "budget_bytes": budget, "reserve_bytes": reserve,
            "regions": len(rc.regions), "shares": " ".join(str(r.budget_bytes) for r in rc.regions),
            "region_peaks": " ".join(str(r.program.peak_bytes) for r in rc.regions),
            "predicted_peak_bytes": predicted, "peak_bytes": measured,
            "measured_over_predicted": round(measured / predicted, 4), "within_budget": measured <= budget,
            "recomputed_ops": " ".join(str(len(r.recomputed_ops)) for r in rc.regions),
            "gradients_equal_eager": equal, "note": rc.report().replace("\n", " | ")}, None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="broken-mlp,hf-gpt2,hf-gpt2-one-region,resnet18-bn")
    ap.add_argument("--budgets", default="0.9,0.8,0.7", help="fractions of the step's keep-all compiled peak")
    ap.add_argument("--backend", default="aot_eager", choices=("aot_eager", "aot_eager_decomp_partition", "inductor"))
    ap.add_argument("--resnet", default="8,64", help="batch,pixels of the resnet18-bn case")
    ap.add_argument("--buffers", action="store_true", help="remat.compiler(buffers=True): inductor's buffer rewrites")
    ap.add_argument("-o", "--output", default=str(Path(__file__).resolve().parent / "results" / "compiled-regions.csv"))
    args = ap.parse_args(argv)
    global RESNET
    RESNET = tuple(int(v) for v in args.resnet.split(","))
    torch.set_num_threads(1)
    rows = []
    for name in args.cases.split(","):
        top, _ = run(name, None, 10 ** 12, backend=args.backend, buffers=args.buffers)
        keep_all = top["predicted_peak_bytes"]
        top.update(fraction=1.0, budget_bytes=keep_all, within_budget=top["peak_bytes"] <= keep_all)
        rows.append(top)
        print(name, top, flush=True)
        for f in (float(b) for b in args.budgets.split(",")):
            row, reserve = run(name, f, int(f * keep_all), backend=args.backend, buffers=args.buffers)
            if reserve is not None:   # (what the error names, tried once)
                rows.append(row)
                print(name, row, flush=True)
                row, _ = run(name, f, int(f * keep_all), int(reserve), backend=args.backend, buffers=args.buffers)
            rows.append(row)
            print(name, row, flush=True)
    write_csv(args.output, COLUMNS, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
