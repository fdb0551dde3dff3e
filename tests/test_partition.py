"""Tofu's operator descriptions (`remat.solvers.partition`), op by op: every strategy of every
rule, run on k simulated shards (each input split, replicated or given as summands as the
strategy places it, the op run per shard, the outputs concatenated or summed as placed) equals
the unsharded op; and the cost model's memory and communication figures."""
from __future__ import annotations

import pytest

from remat.solvers.partition import (PARTIAL, REPLICATE, RULES, OpRule, Shard, memory_per_device,
                                     redistribute_bytes, strategies)

torch = pytest.importorskip("torch")
F = torch.nn.functional

from shards import combine, place, synced_batch_norm  # noqa: E402


def _g(*shape):
    return torch.randn(*shape, generator=_GEN, dtype=torch.float64)


_GEN = torch.Generator().manual_seed(0)

# op -> (function, example inputs); every dimension of size 4 or 8, so k = 2 and 4 divide them
CASES = {
    "mm": (torch.mm, lambda: (_g(4, 8), _g(8, 4))),
    "bmm": (torch.bmm, lambda: (_g(4, 4, 8), _g(4, 8, 4))),
    "addmm": (torch.addmm, lambda: (_g(4), _g(8, 4), _g(4, 4))),
    "linear": (F.linear, lambda: (_g(8, 4), _g(4, 4), _g(4))),
    "convolution": (lambda x, w, b: F.conv2d(x, w, b, padding=1), lambda: (_g(4, 4, 8, 8), _g(8, 4, 3, 3), _g(8))),
    "add": (torch.add, lambda: (_g(4, 8, 4), _g(4, 8, 4))),
    "mul": (torch.mul, lambda: (_g(4, 8, 4), _g(4, 8, 4))),
    "gelu": (F.gelu, lambda: (_g(4, 8, 4),)),
    "relu": (F.relu, lambda: (_g(4, 8, 4),)),
    "sum": (lambda x: x.sum(-1), lambda: (_g(4, 8, 4),)),
    "softmax": (lambda x: torch.softmax(x, -1), lambda: (_g(4, 8, 4),)),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (4,), w, b), lambda: (_g(4, 8, 4), _g(4), _g(4))),
    "batch_norm": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                   lambda: (_g(4, 8, 4, 4), _g(8), _g(8))),
    "embedding": (lambda w, ids: F.embedding(ids, w), lambda: (_g(8, 4), torch.randint(0, 8, (4, 8), generator=_GEN))),
    "scaled_dot_product_attention": (F.scaled_dot_product_attention,
                                     lambda: (_g(4, 4, 8, 4), _g(4, 4, 8, 4), _g(4, 4, 8, 4))),
    "transpose": (lambda x: x.t(), lambda: (_g(4, 8),)),
    "cross_entropy_sum": (lambda x, y: F.cross_entropy(x, y, reduction="sum"),
                          lambda: (_g(8, 4), torch.randint(0, 4, (8,), generator=_GEN))),
}


def test_every_rule_has_a_case_and_the_cases_match_their_specs():
    assert set(CASES) == set(RULES)
    for name, (fn, make) in CASES.items():
        rule, args = RULES[name], make()
        assert [t.dim() for t in args] == [len(s) for s in rule.inputs], name
        assert fn(*args).dim() == len(rule.outputs[0]), name


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name", sorted(RULES))
def test_the_sharded_op_equals_the_unsharded_one(name, k):
    fn, make = CASES[name]
    args = make()
    want = fn(*args)
    found = strategies(RULES[name])
    assert found, name
    for s in found:
        placed = [place(t, p, k) for t, p in zip(args, s.inputs)]
        if s.sync:           # the statistics all-reduced (batch norm along its batch or space)
            assert name == "batch_norm" and s.sync == "c"
            parts = synced_batch_norm(*placed)
        else:
            parts = [fn(*[p[d] for p in placed]) for d in range(k)]
        got = combine(parts, s.outputs[0])
        assert torch.allclose(got, want, atol=1e-10), (name, s)


def test_strategies_follow_the_index_notation():
    by = {s.index: s for s in strategies(RULES["mm"])}
    assert set(by) == {"i", "j", "k"}
    assert by["i"].inputs == (Shard(0), REPLICATE) and by["i"].outputs == (Shard(0),) and not by["i"].partial
    assert by["j"].inputs == (REPLICATE, Shard(1)) and by["j"].outputs == (Shard(1),)
    assert by["k"].inputs == (Shard(1), Shard(0)) and by["k"].outputs == (PARTIAL,) and by["k"].partial
    # the bias goes partial where the summed index is split, sharded along its own index
    lin = {s.index: s for s in strategies(RULES["linear"])}
    assert lin["k"].inputs == (Shard(1), Shard(1), PARTIAL) and lin["j"].inputs == (REPLICATE, Shard(0), Shard(0))
    # coupled indices give no strategy
    assert {s.index for s in strategies(RULES["softmax"])} == {"b", "s"}
    assert {s.index for s in strategies(RULES["scaled_dot_product_attention"])} == {"b", "h", "l"}
    # batch norm in training: along its batch and space with the statistics synchronised
    assert {(s.index, s.sync) for s in strategies(RULES["batch_norm"])} == {("b", "c"), ("c", ""), ("h", "c"),
                                                                            ("w", "c")}
    assert strategies(OpRule("ab->ab", fixed=(("a", "x"), ("b", "y")))) == []


def test_memory_and_communication_per_device():
    n = 1000
    assert memory_per_device(Shard(0), n, 4) == 250 and memory_per_device(REPLICATE, n, 4) == n
    assert memory_per_device(PARTIAL, n, 4) == n and memory_per_device(Shard(1), 10, 4) == 3
    assert redistribute_bytes(Shard(0), Shard(0), n, 4) == 0
    assert redistribute_bytes(REPLICATE, Shard(1), n, 4) == 0 and redistribute_bytes(REPLICATE, PARTIAL, n, 4) == 0
    assert redistribute_bytes(Shard(0), REPLICATE, n, 4) == 750            # all-gather
    assert redistribute_bytes(PARTIAL, Shard(0), n, 4) == 750              # reduce-scatter
    assert redistribute_bytes(PARTIAL, REPLICATE, n, 4) == 1500            # all-reduce
    assert redistribute_bytes(Shard(0), Shard(1), n, 4) == 187             # all-to-all
    assert redistribute_bytes(PARTIAL, REPLICATE, n, 1) == 0

