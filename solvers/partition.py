"""Tofu's operator descriptions: how one op of a training graph can be split across k devices.

The first layer of operator partitioning (Wang et al., EuroSys 2019; docs/references.md, "Tofu"):
how each op can be split, from which the search (`remat.solvers.tofu`) chooses.  `RULES` holds
the textbook forms; `rule_for` describes an ATen op as the captured graph runs it, at its real
ranks and shapes (broadcasting, reshapes, layer norms over the last dimensions, attention with a
mask, convolutions, pooling, losses); an op it does not know gets every index fixed (it runs
whole on every device).

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
  convolution's window, attention's keys): no strategy along it (`OpRule.fixed`, with the reason);
* an index the op's *statistics* are taken over (training batch norm's batch and space,
  `OpRule.synced`): split with the statistics synchronised, as `SyncBatchNorm` does: each device
  sums its part, an all-reduce of the per-channel sums (letters `OpRule.stats`) makes them whole,
  twice in the forward (the mean, then the variance about it) and once, of two vectors, in the
  backward (`Strategy.sync`: the statistics' letters; the search adds the all-reduces' bytes).

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
           "memory_per_device", "redistribute_bytes", "rule_for", "letter_sizes", "LIGHT", "BATCH_NORMS"]


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
    (biases), which go partial where a summed index is split; `synced`: indices that split with
    the op's statistics (letters `stats`) all-reduced (module docstring)."""
    spec: str
    fixed: tuple = ()
    added: tuple = ()
    synced: tuple = ()
    stats: str = ""

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
    """The op split along `index`: each input's and output's placement, whether the output
    needs a reduction (`partial`) to be whole, and `sync`: the letters of the statistics the split
    all-reduces (empty for most ops)."""
    index: str
    inputs: tuple
    outputs: tuple
    sync: str = ""

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
        out.append(Strategy(c, tuple(ins), outs, rule.stats if c in rule.synced else ""))
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
    "batch_norm": OpRule("bchw,c,c->bchw", synced=("b", "h", "w"), stats="c"),
    "embedding": OpRule("ve,bs->bse", fixed=(("v", "a vocabulary split needs a masked lookup (not modelled)"),)),
    "scaled_dot_product_attention": OpRule("bhld,bhmd,bhmd->bhld", fixed=(
        ("m", "the softmax over the keys couples them (ring attention not modelled)"),
        ("d", "the scores sum over it inside the softmax"))),
    "transpose": OpRule("ab->ba"),
    "cross_entropy_sum": OpRule("bc,b->", fixed=(("c", _NORM),)),
}


# ---- ATen ops with their real shapes -------------------------------------------------------
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_POINTWISE = {"add", "sub", "rsub", "mul", "div", "gelu", "relu", "silu", "tanh", "sigmoid", "dropout", "neg",
              "pow", "rsqrt", "sqrt", "exp", "log", "abs", "where", "masked_fill", "clone", "contiguous", "alias",
              "detach", "_to_copy", "to", "type_as", "native_dropout", "copy", "add_", "mul_", "relu_", "gelu_",
              "dropout_", "div_", "sub_", "fill_", "zeros_like", "ones_like", "full_like", "rand_like",
              "erf", "reciprocal", "clamp", "clamp_min", "minimum", "maximum", "hardtanh", "hardtanh_",
              "silu_", "sigmoid_", "tanh_", "lift_fresh_copy", "expand", "expand_as", "bitwise_not", "eq", "ne",
              "lt", "gt", "le", "ge", "logical_not", "triu", "tril", "masked_fill_", "alpha_dropout",
              "feature_dropout", "_assert_tensor_metadata", "scalar_tensor", "square"}
# ops whose work is proportional to their bytes: they may run replicated (every device the whole
# op, no communication) where their inputs are whole; the heavy ops (products, convolutions,
# attention, lookups) are always split, as Tofu splits every op
LIGHT = _POINTWISE | {"layer_norm", "rms_norm", "native_layer_norm", "softmax", "_softmax", "log_softmax",
                      "_log_softmax", "view", "reshape", "_unsafe_view", "flatten", "transpose", "t", "permute",
                      "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "cat", "slice",
                      "select", "narrow", "sum", "mean", "arange", "zeros", "ones", "full", "empty",
                      "cross_entropy_loss", "nll_loss", "batch_norm", "max_pool2d", "max_pool2d_with_indices",
                      "avg_pool2d", "adaptive_avg_pool2d", "opaque"}
_HEAVY_WHY = "coupled inside the op"
# ATen's batch norms that take statistics of their input (training); evaluation's
# ``_native_batch_norm_legit_no_training`` uses the running ones
BATCH_NORMS = {"batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional"}


class _Fresh:
    """Fresh index letters, in order."""

    def __init__(self) -> None:
        self.used = 0

    def __call__(self, n: int = 1) -> str:
        if self.used + n > len(_LETTERS):
            raise ValueError("partition: an op with more than 52 distinct dimensions")
        out = _LETTERS[self.used:self.used + n]
        self.used += n
        return out


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _broadcast(ins: list, out_shape: tuple, out: str, fresh: _Fresh) -> tuple[list, list]:
    """Letters of inputs broadcast to an output of shape `out_shape` and letters `out` (aligned
    from the right); a dimension of size 1 against a larger one gets a letter of its own, fixed."""
    letters, fixed = [], []
    rank = len(out_shape)
    for shape in ins:
        s = ""
        for i, n in enumerate(shape):
            j = rank - len(shape) + i
            if n == 1 and out_shape[j] != 1:
                c = fresh()
                fixed.append((c, "broadcast"))
                s += c
            else:
                s += out[j]
        letters.append(s)
    return letters, fixed


def _reshape(src: tuple, dst: tuple, fresh: _Fresh) -> tuple[str, str, list]:
    """Letters of a reshape from `src` to `dst`: dimensions grouped where the running products of
    sizes meet; a group of one dimension on each side keeps its letter, and in a merged or split
    group only the outermost dimensions share one (a block split of the outer dimension is a block
    split of the merged one), the inner ones are fixed."""
    a, b, fixed = "", "", []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [i], [j]
        pi = src[i] if i < len(src) else 1
        pj = dst[j] if j < len(dst) else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= src[i]
                gi.append(i)
                i += 1
            else:
                pj *= dst[j]
                gj.append(j)
                j += 1
        gi = [x for x in gi if x < len(src)]
        gj = [x for x in gj if x < len(dst)]
        lead = fresh()
        for k, _ in enumerate(gi):
            if k == 0 and gj:
                a += lead
            else:
                c = fresh()
                fixed.append((c, "reshaped together with another dimension"))
                a += c
        for k, _ in enumerate(gj):
            if k == 0 and gi:
                b += lead
            else:
                c = fresh()
                fixed.append((c, "reshaped together with another dimension"))
                b += c
        if not gi or not gj:
            fixed.append((lead, "size 1"))
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            c = fresh()
            fixed.append((c, "size 1"))
            a += c
            i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            c = fresh()
            fixed.append((c, "size 1"))
            b += c
            j += 1
    return a, b, fixed


def rule_for(op: str, ins: list, outs: list, args: tuple = ()) -> OpRule:
    """The description of one ATen op as it runs: `op` its name (``"linear"``, ``"view"``, ...),
    `ins` the shapes of its tensor inputs in order, `outs` of its tensor outputs, `args` its
    positional arguments with every tensor replaced by None (dims, sizes, flags).  An op not
    described here gets every index fixed: it runs replicated (``opaque``)."""
    fresh = _Fresh()
    ins, outs = [tuple(s) for s in ins], [tuple(s) for s in outs]

    def spec(in_letters, out_letters, fixed=(), added=(), synced=(), stats=""):
        return OpRule(",".join(in_letters) + "->" + ",".join(out_letters), tuple(fixed), tuple(added), tuple(synced),
                      stats)

    def opaque(why="not described"):
        letters = [fresh(len(s)) for s in ins]
        out_letters = [fresh(len(s)) for s in outs]
        return spec(letters, out_letters, [(c, why) for c in "".join(letters + out_letters)])

    def arg(i, default=None):
        return args[i] if i < len(args) and args[i] is not None else default

    if not outs:
        return opaque()
    o = outs[0]
    try:
        if op in _POINTWISE and all(len(s) <= len(o) for s in ins):
            out = fresh(len(o))
            letters, fixed = _broadcast(ins, o, out, fresh)
            return spec(letters, [out] * len(outs) if all(s == o for s in outs) else [out] + [fresh(len(s)) for s in outs[1:]],
                        fixed)
        if op in ("linear",):
            batch = fresh(len(ins[0]) - 1)
            k, j = fresh(2)
            return spec([batch + k, j + k] + ([j] if len(ins) > 2 else []), [batch + j], added=(2,) if len(ins) > 2 else ())
        if op in ("mm", "bmm", "matmul", "addmm", "baddbmm") and all(len(s) >= 2 for s in ins[-2:]):
            x, w = ins[-2], ins[-1]
            rank = max(len(x), len(w))
            batch = fresh(rank - 2)
            i, k, j = fresh(3)
            bshape = tuple(max(p, q) for p, q in zip((1,) * (rank - len(x)) + x[:-2], (1,) * (rank - len(w)) + w[:-2]))
            bx, fx = _broadcast([x[:-2], w[:-2]], bshape, batch, fresh)
            letters = [bx[0] + i + k, bx[1] + k + j]
            if len(ins) == 3:
                bias, more = _broadcast([ins[0]], o, batch + i + j, fresh)
                return spec(bias + letters, [batch + i + j], fx + more, added=(0,))
            return spec(letters, [batch + i + j], fx)
        if op in ("layer_norm", "native_layer_norm", "rms_norm"):
            x = ins[0]
            m = len(arg(1, (x[-1],)))
            lead, norm = fresh(len(x) - m), fresh(m)
            fixed = [(c, _NORM) for c in norm]
            stats = [lead + fresh(len(s) - len(lead)) for s in outs[1:]]
            fixed += [(c, _NORM) for s in stats for c in s[len(lead):]]
            return spec([lead + norm] + [norm] * (len(ins) - 1), [lead + norm] + stats, fixed)
        if op in ("softmax", "_softmax", "log_softmax", "_log_softmax"):
            d = _dim(arg(1, -1), len(o))
            out = fresh(len(o))
            return spec([out], [out], [(out[d], _NORM)])
        if op in ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"):
            q, kv = ins[0], ins[1]
            batch = fresh(len(q) - 2)
            l, m, d, e = fresh(4)
            letters = [batch + l + d, batch + m + d, batch + m + e]
            fixed = [(m, "the softmax over the keys couples them (ring attention not modelled)"),
                     (d, "the scores sum over it inside the softmax")]
            if len(ins) > 3:   # an attention mask, broadcast to (batch, l, m)
                mask, more = _broadcast([ins[3]], q[:-2] + (q[-2], kv[-2]), batch + l + m, fresh)
                letters += mask
                fixed += more
            extra = [batch + fresh(len(s) - len(batch)) for s in outs[1:]]
            fixed += [(c, "statistics") for s in extra for c in s[len(batch):]]
            return spec(letters, [batch + l + e] + extra, fixed)
        if op == "embedding":
            v, e = fresh(2)
            ids = fresh(len(ins[1]))
            return spec([v + e, ids], [ids + e], [(v, "a vocabulary split needs a masked lookup (not modelled)")])
        if op in ("view", "reshape", "_unsafe_view", "flatten"):
            a, b, fixed = _reshape(ins[0], o, fresh)
            return spec([a], [b], fixed)
        if op in ("transpose", "t"):
            x = fresh(len(ins[0]))
            d0, d1 = (_dim(arg(1, 0), len(x)), _dim(arg(2, 1), len(x))) if op == "transpose" else (0, 1)
            y = list(x)
            y[d0], y[d1] = y[d1], y[d0]
            return spec([x], ["".join(y)])
        if op == "permute":
            x = fresh(len(ins[0]))
            return spec([x], ["".join(x[_dim(d, len(x))] for d in arg(1))])
        if op in ("unsqueeze", "squeeze"):
            a, b, fixed = _reshape(ins[0], o, fresh)
            return spec([a], [b], fixed)
        if op in ("split", "split_with_sizes", "chunk", "unbind", "slice", "select", "narrow"):
            x = fresh(len(ins[0]))
            d = _dim(arg(2, 0) if op in ("split", "split_with_sizes", "chunk") else arg(1, 0), len(x))
            fixed = [(x[d], "the op cuts along it")]
            if op in ("unbind", "select"):
                out = x[:d] + x[d + 1:]
            else:
                out = x
            return spec([x], [out] * len(outs), fixed)
        if op == "cat":
            x = fresh(len(o))
            d = _dim(arg(1, 0), len(x))
            return spec([x] * len(ins), [x], [(x[d], "the op joins along it")])
        if op in ("sum", "mean"):
            x = fresh(len(ins[0]))
            dims = arg(1, None)
            dims = list(range(len(x))) if dims in (None, [], ()) else [_dim(d, len(x)) for d in
                                                                       (dims if isinstance(dims, (list, tuple)) else [dims])]
            keep = bool(arg(2, False))
            out = "".join(c if i not in dims else (fresh() if keep else "") for i, c in enumerate(x))
            fixed = [(c, "size 1") for c in out if c not in x]
            return spec([x], [out], fixed)
        if op in ("cross_entropy_loss", "nll_loss", "nll_loss_forward"):
            x, t = ins[0], ins[1]
            n, c = fresh(2)
            rest = fresh(len(x) - 2) if len(x) > 2 else ""
            reduction = arg(3, 1) if op != "nll_loss_forward" else arg(3, 1)
            out = "" if reduction != 0 else n + rest
            letters = [n + c + rest if len(x) > 1 else c, (n + rest)[:len(t)]] + [c] * (len(ins) - 2)
            return spec(letters, [out] + ["" for _ in outs[1:]], [(c, _NORM)])
        if op in ("convolution", "conv2d", "conv1d", "conv3d"):
            x, w = ins[0], ins[1]
            nsp = len(x) - 2
            b, ci, co = fresh(3)
            xs, ws, os = fresh(nsp), fresh(nsp), fresh(nsp)
            groups = arg(8, 1) if op == "convolution" else arg(6, 1)
            fixed = [(c, _WINDOW) for c in xs + ws + os]
            if groups != 1:
                fixed += [(ci, "grouped convolution"), (co, "grouped convolution")]
            letters = [b + ci + xs, co + ci + ws] + ([co] if len(ins) > 2 else [])
            return spec(letters, [b + co + os], fixed, added=(2,) if len(ins) > 2 else ())
        if op in BATCH_NORMS or op == "_native_batch_norm_legit_no_training":
            x = ins[0]
            b, c = fresh(2)
            sp = fresh(len(x) - 2)
            letters = [b + c + sp] + [c] * (len(ins) - 1)
            outs_ = [b + c + sp] + [c if len(s) == 1 else fresh(len(s)) for s in outs[1:]]
            no_stats = op == "_native_batch_norm_legit" and len(args) == 6   # (its .no_stats overload)
            training = op != "_native_batch_norm_legit_no_training" and bool(arg(3 if no_stats else 5, True))
            # training: the statistics are over the batch and space (synchronised where split);
            # evaluation: running statistics, an elementwise op
            return spec(letters, outs_, synced=(b,) + tuple(sp) if training else (), stats=c if training else "")
        if op in ("max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d"):
            x = ins[0]
            b, c = fresh(2)
            xs, os = fresh(len(x) - 2), fresh(len(o) - 2)
            return spec([b + c + xs], [b + c + os] * len(outs), [(s, _WINDOW) for s in xs + os])
        if op in ("arange", "zeros", "ones", "full", "empty", "randn", "rand", "new_zeros", "new_ones",
                  "new_empty", "new_full"):
            return spec([fresh(len(s)) for s in ins], [fresh(len(s)) for s in outs])
    except (IndexError, TypeError, ValueError):
        pass
    return opaque()


def letter_sizes(rule: OpRule, ins: list, outs: list) -> dict:
    """{index letter: its size} from the op's shapes."""
    sizes: dict = {}
    for letters, shape in zip(rule.inputs + rule.outputs, list(ins) + list(outs)):
        for c, n in zip(letters, shape):
            sizes.setdefault(c, n)
    return sizes
