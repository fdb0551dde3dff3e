"""Tofu's operator descriptions: how one op of a training graph can be split across k devices.

The first layer of operator partitioning (Wang et al., EuroSys 2019; docs/references.md, "Tofu"):
a table of rules, one per op, from which the partition search will choose.  Not built yet: the
recursive 2-way search, the per-device memory from the simulator, the baselines in this cost
model and execution on ``torch.distributed`` (`search` raises NotImplementedError).

An op is described in index notation, as Tofu describes operators: every dimension of every
tensor carries an index letter, ``"ik,kj->ij"`` being a matrix product.  Splitting the op k ways
along one index is one *strategy*:

* an index of the output: every tensor that has it is split along it (``Shard(dim)``), the others
  are whole on every device (`REPLICATE`); each device computes its slice of the output, with no
  communication;
* an index summed away (in some input, not in the output): the inputs that have it are split, an
  input without it that is *added* to the result (a bias) is held by one device and zeros by the
  others (`PARTIAL`: its shards sum to it), and each device's output is a partial sum (`PARTIAL`)
  that an all-reduce (or a reduce-scatter) makes whole;
* an index the op couples across (a softmax's or a layer norm's normalised dimension, a
  convolution's window, attention's keys): no strategy along it (`OpRule.fixed`, with the reason).

Memory per device: a split tensor's bytes / k, a replicated or partial one's whole bytes.
Communication between placements (`redistribute_bytes`), per device, ring algorithms over k
devices: all-gather (Shard -> Replicate) and reduce-scatter (Partial -> Shard) move
(k - 1) / k of the tensor, all-reduce (Partial -> Replicate) twice that, all-to-all (Shard(a) ->
Shard(b)) (k - 1) / k of a shard; Replicate -> Shard and Replicate -> Partial are local.

Torch-free: the tests check every rule op by op, the sharded op on k simulated shards against the
unsharded one.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Placement", "Shard", "REPLICATE", "PARTIAL", "OpRule", "Strategy", "RULES", "strategies",
           "memory_per_device", "redistribute_bytes", "search"]


@dataclass(frozen=True)
class Placement:
    """How a tensor lies across the devices: ``"shard"`` along `dim`, ``"replicate"`` (whole on
    each), or ``"partial"`` (each holds a summand; the sum is the tensor)."""
    kind: str
    dim: int | None = None

    def __str__(self) -> str:
        return f"Shard({self.dim})" if self.kind == "shard" else self.kind.capitalize()


def Shard(dim: int) -> Placement:  # noqa: N802 - named as DTensor's placement
    return Placement("shard", dim)


REPLICATE = Placement("replicate")
PARTIAL = Placement("partial")


@dataclass(frozen=True)
class OpRule:
    """One op's description: `spec` in index notation (inputs, comma-separated, ``->`` outputs);
    `fixed`: {index: why it cannot be split}; `added`: positions of inputs added to the result
    (biases), which go partial where a summed index is split."""
    spec: str
    fixed: tuple = ()
    added: tuple = ()

    @property
    def inputs(self) -> list[str]:
        return self.spec.split("->")[0].split(",")

    @property
    def outputs(self) -> list[str]:
        return self.spec.split("->")[1].split(",")

    @property
    def indices(self) -> list[str]:
        seen: list[str] = []
        for t in self.inputs + self.outputs:
            for c in t:
                if c not in seen:
                    seen.append(c)
        return seen


@dataclass(frozen=True)
class Strategy:
    """The op split along `index`: each input's and output's placement, and whether the output
    needs a reduction (`partial`) to be whole."""
    index: str
    inputs: tuple
    outputs: tuple

    @property
    def partial(self) -> bool:
        return any(p == PARTIAL for p in self.outputs)


def strategies(rule: OpRule) -> list[Strategy]:
    """Every one-index split of `rule`, in index order (module docstring)."""
    fixed = {i for i, _ in rule.fixed}
    out: list[Strategy] = []
    produced = "".join(rule.outputs)
    for c in rule.indices:
        if c in fixed:
            continue
        summed = c not in produced
        ins = []
        for pos, t in enumerate(rule.inputs):
            if c in t:
                ins.append(Shard(t.index(c)))
            elif summed and pos in rule.added:
                ins.append(PARTIAL)
            else:
                ins.append(REPLICATE)
        outs = tuple(Shard(t.index(c)) if c in t else (PARTIAL if summed else REPLICATE) for t in rule.outputs)
        out.append(Strategy(c, tuple(ins), outs))
    return out


def memory_per_device(placement: Placement, nbytes: int, k: int) -> int:
    """Bytes of a tensor of `nbytes` on each of k devices under `placement` (ceil for shards)."""
    return -(-nbytes // k) if placement.kind == "shard" else nbytes


def redistribute_bytes(src: Placement, dst: Placement, nbytes: int, k: int) -> int:
    """Bytes each device sends to turn a tensor of `nbytes` from `src` into `dst` placement over k
    devices (ring all-gather / reduce-scatter / all-reduce, pairwise all-to-all)."""
    if src == dst or k == 1 or dst == PARTIAL and src == REPLICATE:
        return 0
    if src == REPLICATE:                       # -> a shard: a local slice
        return 0
    part = (k - 1) * nbytes // k
    if src.kind == "shard":
        if dst == REPLICATE:                   # all-gather
            return part
        if dst.kind == "shard":                # all-to-all: each sends k - 1 of its k pieces
            return part // k
        return part                            # -> partial: gathered, then held as a summand
    if dst == REPLICATE:                       # partial -> all-reduce
        return 2 * part
    return part                                # partial -> shard: reduce-scatter


_WINDOW = "a convolution's window couples neighbouring positions (halo exchange not modelled)"
_NORM = "normalised over it: the statistics couple the whole dimension"

# op name (the ATen op's name without namespace and overload) -> its description.  Ranks are
# those the graphs hold: 2-D matrix products, ``linear`` on (batch, features), convolutions on
# NCHW images, attention on (batch, heads, length, head dim), elementwise ops on 3-D activations.
RULES: dict[str, OpRule] = {
    "mm": OpRule("ik,kj->ij"),
    "bmm": OpRule("bik,bkj->bij"),
    "addmm": OpRule("j,ik,kj->ij", added=(0,)),
    "linear": OpRule("bk,jk,j->bj", added=(2,)),
    "convolution": OpRule("bchw,ocuv,o->bohw", added=(2,),
                          fixed=(("h", _WINDOW), ("w", _WINDOW), ("u", _WINDOW), ("v", _WINDOW))),
    "add": OpRule("bsf,bsf->bsf"),
    "mul": OpRule("bsf,bsf->bsf"),
    "gelu": OpRule("bsf->bsf"),
    "relu": OpRule("bsf->bsf"),
    "sum": OpRule("bsf->bs"),
    "softmax": OpRule("bsf->bsf", fixed=(("f", _NORM),)),
    "layer_norm": OpRule("bsf,f,f->bsf", fixed=(("f", _NORM),)),
    "batch_norm": OpRule("bchw,c,c->bchw", fixed=(("b", "training statistics are over the batch and space"),
                                                  ("h", _NORM), ("w", _NORM))),
    "embedding": OpRule("ve,bs->bse", fixed=(("v", "a vocabulary split needs a masked lookup (not modelled)"),)),
    "scaled_dot_product_attention": OpRule("bhld,bhmd,bhmd->bhld", fixed=(
        ("m", "the softmax over the keys couples them (ring attention not modelled)"),
        ("d", "the scores sum over it inside the softmax"))),
    "transpose": OpRule("ab->ba"),
    "cross_entropy_sum": OpRule("bc,b->", fixed=(("c", _NORM),)),
}


def search(graph, devices: int, budget_bytes: int):
    """Tofu's recursive 2-way partition search over `graph` (issue 29): not built yet."""
    raise NotImplementedError("remat.solvers.partition.search: Tofu's recursive 2-way search, its per-device "
                              "memory from the simulator and the partition plan format are not implemented yet; "
                              "only the operator descriptions (RULES, strategies) exist")
