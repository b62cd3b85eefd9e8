"""Memory per device: the activations autograd saves, parameter, gradient and optimizer state,
and the temporaries of the optimizer step (`step_workspace`, torch.optim's implementations).

Activations are found, not modelled. `saved_activations` runs the traced graph on fake CPU
tensors (nothing is allocated: GPT-3 175B takes about 20 ms per block) under
`torch.autograd.graph.saved_tensors_hooks`, with an fx.Interpreter that knows which node
is running. Every tensor autograd saves is traced to its storage, and storages are what
count: a tensor saved by several ops, or through several views, counts once, and saving a
view (q, a slice of the fused qkv output) keeps its whole base alive. The graph runs at two
batch sizes; sizes are linear in the batch, so each storage's bytes is `a + b*BATCH`.

Attribution: a saved storage belongs to the *layer of the first op that saved it* (a
block's input, made by the previous block's residual add and saved by this block's norm,
is this block's memory, which is what a pipeline stage holding this block pays). Its
*producer* is the graph node whose output first held the storage; a storage made inside an
op (layer norm's mean and rstd, cross-entropy's log-probabilities, attention's logsumexp)
has no node of its own and is *internal* to the op that saved it.

Kernels are this machine's. On the CPU, scaled_dot_product_attention without dropout runs
a fused kernel that saves q, k, v, the output and the logsumexp, as flash attention does
on GPUs; with dropout it falls back to the math path, which saves the s x s scores,
probabilities and dropout mask (and dropout keeps a float mask, not a bool one). Those
s x s tensors, and the outputs of the nodes between an activation matmul, a softmax and
the next activation matmul, are tagged `attention_inside`: what Megatron's selective
recompute drops (Korthikanti et al. 2022, arXiv 2205.05198).

Under a tensor-parallel `Solution` each storage counts the share one device holds: its
producer's layout or, where the solver put a redistribution on the edge into the saving
op, the layout that op receives (a new tensor at run time; a parameter received that way,
such as a tied embedding re-laid out for the classifier under 2D, counts as an activation),
except where it only slices dim 0: that is a view, which keeps the producer's storage
(a slice of an input counts as the slice: a rank holds its part of the global batch).
An internal storage takes the shards of the saving op's output or input that split a dim
it shares with it (every size up to that dim equal): a norm's [b, s, 1] statistics keep
the batch split of a [b, s, h] input, not the hidden one. `micro_batch` is the batch of one
data-parallel replica for 2D, 2.5D and 3D too: their batch split is a layout on dim 0.

2D, 2.5D and 3D layers run kernels (`autopar.kernels.multid`) in place of some aten ops;
where a kernel saves other tensors than the op, the op's saved tensors are replaced by
the kernel's (`_kernel_saves`):

* 3D linear: x and W all-gathered over the input and weight groups, kept for backward:
  q x this rank's x block (whole / q^2) and q x its weight block (whole / q^2, a new
  tensor, so an activation), instead of the local x (whole / q^3). Three linears reading
  one input (q, k, v) gather three copies. This is large: on gpt-tiny at q = 2 and 256
  rows per replica it nearly doubles a block's activations.
* Norms over a split hidden dim (LayerNorm, RMSNorm ops): x-hat (x's local size, a new
  tensor) and rstd per row, instead of the input and, for LayerNorm, mean and rstd.
* SUMMA (2D, 2.5D linear) saves its local x and W, as the aten linear does: nothing to do.
  The embedding runs as the aten op on the local table and ids: nothing to do.
* Not modelled, as with the 1D vocabulary-parallel kernels: the multi-D cross-entropy
  saves two bool masks per local row (valid, inside) more than aten's, and its row count
  as a view of an 8-byte pair (0.04% of gpt-tiny's activations under 2D). RMSNorm written
  as elementwise ops (the llama zoo) is not a norm op and runs as aten ops.

Context parallelism (a `cp` axis, `autopar.kernels.sequence`): the ring and Ulysses
kernels save what aten's CPU flash attention saves (q, k, v, the output, the logsumexp, on
this rank's tokens), but return their output contiguous in [B, H, S, D], where aten's is
laid out [B, S, H, D]: the model's transpose(1, 2).reshape(B, S, H*D), a view in the traced
graph, copies at run time, and the next linear saves the copy (`_copied_on_the_way`
replays the view chain on the meta device from a contiguous tensor). Likewise a tensor
saved through a view of a redistributed one is the redistributed copy (a value gathered
over an axis and then reshaped: the op saves the gathered copy, not this rank's slice).

Two run-time effects stay outside the prediction: the vocabulary-parallel kernels save a
few bytes per token more than the ops they replace (masks, per-row scalars), and a
reshape that copies on one device can be a view on a shard (repeat_kv with one local
key/value head), so the prediction is within a few percent, not exact.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.cost.chunked_loss import chunked_activations
from autopar.cost.state import axis_sizes, held_fraction
from autopar.errors import PlanError
from autopar.graph.analysis import OpKind
from autopar.graph.opaque import MOE_KEY_ARG, described
from autopar.graph.trace import BATCH, TracedGraph
from autopar.modes import FULL, NO_RECOMPUTE, RECOMPUTE, SELECTIVE, TP_3D
from autopar.sharding.layout import Layout
from autopar.sharding.strategy import Rewrite

_BATCHES = (2, 3)  # the graph runs at these two batch sizes; every size is linear in between
_CACHE_ATTR = "_autopar_memory"  # on the TracedGraph: the analysis lives and dies with it


# ------------------------------------------------------------------------ saved activations
@dataclass(frozen=True, eq=False)
class SavedTensor:
    """One storage autograd keeps for the backward pass: global sizes, one micro-batch."""

    layer: str  # layer of the first op that saved it
    node: fx.Node  # producer: the node whose output first held it (the saving op if internal)
    savers: tuple  # ((op that saved it, the input node it came through or None), ...)
    dtype: torch.dtype
    shape: tuple  # sympy sizes in BATCH: the producer's output, or the saved view if internal
    fixed_bytes: int  # the storage's bytes are fixed_bytes + sample_bytes * batch
    sample_bytes: int
    internal: bool  # made inside the saving op, not the output of any graph node
    attention_inside: bool  # an s x s attention score, probability or dropout mask
    parameter: bool  # a parameter or buffer (or a view of one): not an activation

    @property
    def nbytes(self) -> sympy.Expr:
        """Bytes of the whole storage as a sympy expression in BATCH."""
        return self.fixed_bytes + self.sample_bytes * BATCH

    def bytes_at(self, micro_batch: int) -> int:
        return self.fixed_bytes + self.sample_bytes * micro_batch

    def __repr__(self) -> str:
        tags = [name for name, on in (("internal", self.internal),
                                      ("attention", self.attention_inside),
                                      ("parameter", self.parameter)) if on]
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"SavedTensor({self.layer}: {self.node.name} {tuple(self.shape)} {dtype} "
                f"{self.nbytes} B" + (f" [{', '.join(tags)}]" if tags else "") + ")")


def saved_activations(traced: TracedGraph) -> list[SavedTensor]:
    """Every storage autograd saves in one forward pass of `traced`, in the order first saved.

    Computed once per traced graph and cached on it. Parameters and buffers are listed too,
    tagged `parameter`, so nothing is hidden; `activation_bytes` leaves them out.
    """
    return _analysis(traced).saved


@dataclass(frozen=True)
class _Analysis:
    saved: list[SavedTensor]
    owners: dict  # node -> the node whose output holds its storage (views -> their base)


@dataclass
class _Record:
    key: int  # storage identity
    nbytes: int
    shape: tuple
    dtype: torch.dtype
    saver: fx.Node
    via: fx.Node | None


class _Recorder(fx.Interpreter):
    """Runs a graph on fake tensors and notes, for each tensor autograd saves, whose it is."""

    def __init__(self, traced: TracedGraph, batch: int):
        super().__init__(traced.gm)
        self.batch = batch
        self.current: fx.Node | None = None
        self.owner: dict[int, fx.Node] = {}  # storage -> first node whose output held it
        self.node_owner: dict[fx.Node, fx.Node] = {}
        self.param_keys: set[int] = set()
        self.records: list[_Record] = []
        self._by_input: dict[int, fx.Node] | None = None  # storages of the current op's inputs
        self._alive: list = []  # every storage stays referenced, so identities stay unique

    def run_node(self, n: fx.Node):
        self.current, self._by_input = n, None
        if n.target is torch.ops.aten._assert_tensor_metadata.default:
            return None  # a check of the traced device (meta), not a computation
        try:
            out = super().run_node(n)
        except Exception as error:  # noqa: BLE001 - say which node, whatever failed
            raise PlanError(f"memory analysis could not run {n.name} ({n.target}) on fake "
                            f"tensors: {type(error).__name__}: {error}") from error
        tensors = _tensors(out)
        for t in tensors:
            key = _key(t)
            if key not in self.owner:
                self.owner[key] = n
                self._alive.append(t.untyped_storage())
            if n.op == "get_attr":
                self.param_keys.add(key)
        if len(tensors) == 1:
            self.node_owner[n] = self.owner[_key(tensors[0])]
        return out

    def call_function(self, target, args, kwargs):
        # inputs and weights are made on the CPU here, but a graph traced on the meta device
        # (transformers' aranges take `device=input.device`) names meta on its factory ops
        args, kwargs = fx.node.map_aggregate((args, kwargs), _on_cpu)
        return super().call_function(target, args, kwargs)

    def placeholder(self, target, args, kwargs):
        val = self.current.meta.get("val")
        shape = [int(sympy.sympify(d).subs(BATCH, self.batch))
                 for d in self.current.meta["autopar"].shape]
        return torch.zeros(shape, dtype=val.dtype)

    def get_attr(self, target, args, kwargs):
        real = self.fetch_attr(target)
        if not isinstance(real, torch.Tensor):
            return real
        grad = isinstance(real, torch.nn.Parameter) and real.requires_grad and \
            real.dtype.is_floating_point
        return torch.empty(real.shape, dtype=real.dtype, requires_grad=grad)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._by_input is None:
            self._by_input = {}
            for inp in self.current.all_input_nodes:
                for v in _tensors(self.env.get(inp)):
                    self._by_input.setdefault(_key(v), inp)
        key = _key(t)
        self._alive.append(t.untyped_storage())
        self.records.append(_Record(key, t.untyped_storage().nbytes(), tuple(t.shape), t.dtype,
                                    self.current, self._by_input.get(key)))
        return t


def _on_cpu(value):
    return torch.device("cpu") if isinstance(value, torch.device) else value


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _record(traced: TracedGraph, batch: int) -> _Recorder:
    recorder = _Recorder(traced, batch)
    placeholders = sum(1 for n in traced.graph.nodes if n.op == "placeholder")
    with FakeTensorMode(), torch.enable_grad(), \
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        recorder.run(*[None] * placeholders)
    return recorder


def _analysis(traced: TracedGraph) -> _Analysis:
    cached = getattr(traced, _CACHE_ATTR, None)
    if cached is not None:
        return cached
    first, second = (_record(traced, b) for b in _BATCHES)
    if len(first.records) != len(second.records) or any(
            a.saver is not b.saver for a, b in zip(first.records, second.records)):
        raise PlanError(f"the graph saves different tensors at batch {_BATCHES[0]} and "
                        f"{_BATCHES[1]}; memory analysis needs saved tensors that only grow "
                        "with the batch.")
    inside = attention_nodes(traced.gm)
    merged: dict[int, dict] = {}
    for a, b in zip(first.records, second.records):
        entry = merged.get(a.key)
        if entry is not None:
            if (a.saver, a.via) not in entry["savers"]:
                entry["savers"].append((a.saver, a.via))
            continue
        internal = a.key not in first.owner
        producer = a.saver if internal else first.owner[a.key]
        shape = tuple(_linear(x, y) for x, y in zip(a.shape, b.shape)) if internal else \
            producer.meta["autopar"].shape
        per_sample = (b.nbytes - a.nbytes) // (_BATCHES[1] - _BATCHES[0])
        merged[a.key] = dict(layer=a.saver.meta["autopar"].layer, node=producer,
                             savers=[(a.saver, a.via)], dtype=a.dtype, shape=shape,
                             fixed_bytes=a.nbytes - per_sample * _BATCHES[0],
                             sample_bytes=per_sample, internal=internal,
                             attention_inside=_inside(producer, internal, shape, inside),
                             parameter=a.key in first.param_keys)
    saved = [SavedTensor(**{**e, "savers": tuple(e["savers"])}) for e in merged.values()]
    analysis = _Analysis(saved, first.node_owner)
    setattr(traced, _CACHE_ATTR, analysis)
    return analysis


def _linear(at_first: int, at_second: int) -> sympy.Expr:
    b1, b2 = _BATCHES
    return sympy.expand(at_first + sympy.Rational(at_second - at_first, b2 - b1) * (BATCH - b1))


def attention_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes between an activation matmul and the next one, through a softmax: the s x s core.

    From each activation x activation matmul, walk forward through elementwise, softmax,
    dropout and view ops; the nodes that also reach a matmul that way, when a softmax is
    among them, are attention's inside (QK^T, its scaling and mask, the probabilities and
    their dropout), together with the QK^T matmul itself.
    """
    passing = {OpKind.ELEMENTWISE, OpKind.SOFTMAX, OpKind.DROPOUT, OpKind.VIEW}

    def kind(node: fx.Node) -> OpKind | None:
        info = node.meta.get("autopar")
        return info.kind if info is not None else None

    matmuls = [n for n in gm.graph.nodes if kind(n) is OpKind.MATMUL]
    reaches_matmul: set[fx.Node] = set()
    stack = [a for m in matmuls for a in m.all_input_nodes]
    while stack:
        node = stack.pop()
        if node not in reaches_matmul and kind(node) in passing:
            reaches_matmul.add(node)
            stack.extend(node.all_input_nodes)
    inside: set[fx.Node] = set()
    for m in matmuls:
        region, stack = set(), list(m.users)
        while stack:
            node = stack.pop()
            if node not in region and kind(node) in passing:
                region.add(node)
                stack.extend(node.users)
        region &= reaches_matmul
        if any(kind(n) is OpKind.SOFTMAX for n in region):
            inside |= region | {m}
    return inside


def _inside(producer: fx.Node, internal: bool, shape: tuple, inside: set[fx.Node]) -> bool:
    """Is a saved storage one of attention's s x s tensors?

    A node's own output is when the node is inside (see `attention_nodes`). A storage made
    inside an op is when the op is inside or is fused attention and the storage ends in the
    score's sizes [..., query length, key length] (a matmul's folded copy of q is not).
    """
    if not internal:
        return producer in inside
    if producer.meta["autopar"].kind is OpKind.ATTENTION:
        query, key = producer.args[0], producer.args[1]
        score = (query.meta["autopar"].shape[-2], key.meta["autopar"].shape[-2])
    elif producer in inside:
        score = tuple(producer.meta["autopar"].shape[-2:])
    else:
        return False
    return len(shape) >= 2 and tuple(shape[-2:]) == score


# ------------------------------------------------------------------------ bytes per device
def activation_bytes(traced: TracedGraph, solution=None, micro_batch: int = 1,
                     recompute: str | dict[str, str] = NO_RECOMPUTE,
                     chunked_loss: bool = True) -> dict[str, int]:
    """Bytes of saved activations one device holds after the forward pass, per layer.

    `solution`: a tensor-parallel Solution (None: one device). `micro_batch`: the batch one
    device runs (the global batch over data-parallel ranks and micro-batches).
    `recompute`: "none", "selective" (attention's s x s tensors are dropped and recomputed),
    "full" (a layer keeps only the activations it reads from outside itself), given for all
    transformer blocks (the layers whose name ends in an index, as Megatron recomputes
    whole blocks), or a dict from layer name to mode (missing layers: "none"). A storage
    kept by several layers counts once, in the first layer that keeps it. `chunked_loss`:
    a classifier's cross-entropy runs chunked, as the engine runs it by default
    (`autopar.cost.chunked_loss`).
    """
    modes = _recompute_modes(traced, recompute)
    saves = _layer_saves(traced, solution, micro_batch)
    reads = _layer_reads(traced, solution, micro_batch) if FULL in modes.values() else {}
    seen: set = set()
    out: dict[str, int] = {}
    for layer in traced.layers:
        mode = modes[layer.name]
        kept = reads.get(layer.name, {}) if mode == FULL else saves.get(layer.name, {})
        total = 0
        for key, (nbytes, attention_inside) in kept.items():
            if key in seen or (mode == SELECTIVE and attention_inside):
                continue
            seen.add(key)
            total += nbytes
        out[layer.name] = total
    return chunked_activations(traced, solution, micro_batch, out) if chunked_loss else out


def _recompute_modes(traced: TracedGraph, recompute) -> dict[str, str]:
    names = [layer.name for layer in traced.layers]
    if isinstance(recompute, dict):
        unknown = sorted(set(recompute) - set(names))
        if unknown:
            raise PlanError(f"recompute names {', '.join(unknown)}, which are not layers of this "
                            f"graph; its layers are {', '.join(names)}.")
        modes = {name: recompute.get(name, NO_RECOMPUTE) for name in names}
    else:
        modes = {name: recompute if name.rsplit(".", 1)[-1].isdigit() else NO_RECOMPUTE
                 for name in names}
    for mode in set(modes.values()):
        if mode not in RECOMPUTE:
            raise PlanError(f"recompute {mode!r} is not one of {', '.join(RECOMPUTE)}.")
    return modes


def _copies(solution) -> dict[tuple[fx.Node, fx.Node], Layout]:
    """Edges (producer, consumer) where a redistribution hands the consumer its own layout."""
    out = {}
    for t in solution.transitions:
        if all(step.kind == "sum_grads" for step in t.steps):
            continue  # a view: the consumer sees the producer's own storage
        for consumer in t.consumers:
            out[(t.producer, consumer)] = t.need.layout
    return out


def _views(traced: TracedGraph, solution) -> set[tuple[fx.Node, fx.Node]]:
    """Edges whose redistribution hands the consumer a view of an activation's storage.

    A split of dim 0 (one block) of a contiguous tensor is a slice, which keeps the whole
    storage alive when saved (bert's token-type ids, zeros made whole and split on the
    batch). Slices of the inputs are left out: a rank holds its slice of the global batch.
    """
    owners = _analysis(traced).owners
    out = set()
    for t in solution.transitions:
        if not all(step.kind == "sum_grads" or (step.kind == "split" and step.dim == 0 and
                                                step.groups == 1) for step in t.steps):
            continue
        if owners.get(t.producer, t.producer).op == "placeholder":
            continue
        out.update((t.producer, consumer) for consumer in t.consumers)
    return out


def _internal_layout(saved: SavedTensor, solution, copies) -> Layout | None:
    """An internal storage's layout: the shards of the op's output or first input that split
    a dim it shares (every size up to that dim equal, or their product: a math-path attention
    kernel's [b * heads, s, d] copies keep the heads split of its [b, heads, s, d] output): a
    norm's [b, s, 1] statistics keep the batch split of its [b, s, h] input, not the hidden
    one."""
    op = saved.node
    candidates = [(op, solution.layouts.get(op))]
    candidates += [(i, copies.get((i, op), solution.layouts.get(i))) for i in op.all_input_nodes]
    best: Layout | None = None
    for node, layout in candidates:
        shape = node.meta["autopar"].shape
        if not isinstance(layout, Layout) or not layout.shards or shape is None:
            continue
        kept = tuple(k for k in (_folded_shard(saved.shape, shape, s) for s in layout.shards)
                     if k is not None)
        if len(kept) == len(layout.shards):
            return Layout(len(saved.shape), kept)
        if kept and best is None:
            best = Layout(len(saved.shape), kept)
    return best


def _folded_shard(saved_shape: tuple, shape: tuple, shard):
    """`shard` of a tensor of `shape` as a split of the saved storage's dim that ends where
    its dim ends (the saved sizes before it multiply to the same), or None if none does."""
    if shard.dim >= len(shape):
        return None
    whole = sympy.Mul(*shape[:shard.dim + 1])
    for k in range(len(saved_shape)):
        if sympy.expand(sympy.Mul(*saved_shape[:k + 1]) - whole) == 0:
            return dataclasses.replace(shard, dim=k)
    return None


def _layer_saves(traced: TracedGraph, solution, micro_batch: int) -> dict[str, dict]:
    """Per layer: each distinct storage its ops save -> (bytes per device, attention_inside).

    Ops the runtime runs as a multi-D kernel that saves other tensors than the aten op
    (`_kernel_saves`) count the kernel's tensors instead of the op's. A parameter saved
    through a redistribution (a tied weight laid out otherwise for a second user) is a new
    tensor at run time, and counts; one saved through a slice (`_views`) is the parameter.
    """
    sizes = axis_sizes(solution)
    copies = _copies(solution) if solution is not None else {}
    views = _views(traced, solution) if solution is not None else set()
    replaced, kernels = _kernel_saves(solution, micro_batch) if solution is not None else \
        (set(), {})
    out: dict[str, dict] = {layer: dict(keys) for layer, keys in kernels.items()}
    for node, nbytes in _moe_saves(traced, micro_batch, solution).items():
        out.setdefault(node.meta["autopar"].layer, {})[("moe", node)] = (nbytes, False)
    for i, saved in enumerate(saved_activations(traced)):
        whole = saved.bytes_at(micro_batch)
        if solution is None or saved.internal:
            if saved.parameter or saved.node in replaced:
                continue
            layout = _internal_layout(saved, solution, copies) if solution is not None else None
            out.setdefault(saved.layer, {})[("saved", i)] = (
                math.ceil(whole * held_fraction(layout, sizes)), saved.attention_inside)
            continue
        for op, via in saved.savers:
            if op in replaced:
                continue
            need = copies.get((via, op)) if via is not None and (via, op) not in views \
                else None
            if need is None and via is not None and \
                    _copied_on_the_way(traced, solution, saved.node, via, copies, views,
                                       micro_batch):
                # a view of a redistributed or kernel-made tensor that is no view there
                key = ("copy", via, solution.layouts.get(via))
                nbytes = _node_bytes(via, micro_batch) * \
                    held_fraction(solution.layouts.get(via), sizes)
                out.setdefault(op.meta["autopar"].layer, {})[key] = (math.ceil(nbytes),
                                                                      saved.attention_inside)
                continue
            if need is None:
                if saved.parameter:
                    continue  # the weight itself: state, not an activation
                key = ("saved", i)
                nbytes = whole * held_fraction(solution.layouts.get(saved.node), sizes)
            else:  # the op saves the redistributed copy it received
                key = ("copy", via, need)
                nbytes = _node_bytes(via, micro_batch) * held_fraction(need, sizes)
            out.setdefault(op.meta["autopar"].layer, {})[key] = (math.ceil(nbytes),
                                                                  saved.attention_inside)
    return out


def _moe_saves(traced: TracedGraph, micro_batch: int, solution=None) -> dict[fx.Node, int]:
    """Bytes autograd saves inside each opaque MoE op (`autopar::moe`, whose fake kernel
    saves nothing), as the zoo's SparseMoE and autopar's kernel save them in the
    grouped-matmul trace of the same layer: its input x [T, H] (the router's and shared
    expert's operand, unless another op saves it); the router's fp32 scores [T, E], top-k
    indices (int64) and, normalised, its sums and weights; per dispatched row (T·k): its
    expert (int64), the gathered row [H], SwiGLU's w1 and w3 outputs, silu and product [F],
    the inverse permutation (int64) and the fp32 expert output [H] the combine weights; the
    experts' offsets (int32, E); a shared expert's four [T, F_s] values, its fp32 gate and
    output [T, H]. Under 1D tensor parallelism's expert split (the rule's TENSOR_EXPERTS)
    the values of the FFN width, [T·k, F] and [T, F_s], are 1/tp per rank; the rest is
    replicated over tp."""
    saved_nodes = {s.node for s in saved_activations(traced) if not s.internal}
    out = {}
    for node in traced.gm.graph.nodes:
        info = node.meta.get("autopar")
        if info is None or info.kind is not OpKind.MOE:
            continue
        spec = described(node.args[MOE_KEY_ARG])
        x = node.args[0]
        xi = x.meta["autopar"]
        size = _itemsize(xi.dtype)
        t = int(sympy.Mul(*xi.shape[:-1]).subs(BATCH, micro_batch))
        e, k, h, f, fs = spec.experts, spec.top_k, spec.hidden, spec.ffn, spec.shared_ffn
        rows = t * k
        strategy = solution.strategies.get(node) if solution is not None else None
        parts = solution.size if strategy is not None and \
            strategy.rewrite is Rewrite.TENSOR_EXPERTS else 1
        nbytes = 0 if x in saved_nodes else t * h * size
        nbytes += t * e * 4 + t * k * 8 + (t * 4 + 2 * t * k * 4 if spec.router.normalize else 0)
        nbytes += rows * (8 + h * size + 4 * f // parts * size + 8 + h * 4) + e * 4
        if fs:
            nbytes += 4 * t * fs // parts * size + t * 4 + t * h * size
        out[node] = nbytes
    return out


_VIEW_OPS = {"view", "reshape", "_unsafe_view"}  # take the node's own (global) sizes


def _view_chain(producer: fx.Node, via: fx.Node, owners: dict) -> list[fx.Node] | None:
    """The nodes from `producer` (exclusive) to `via` (inclusive), each a view of the one
    before (its first argument) sharing `producer`'s storage; None if there is no such chain."""
    chain, node = [], via
    while node is not producer:
        if owners.get(node) is not producer or not node.args or \
                not isinstance(node.args[0], fx.Node):
            return None
        chain.append(node)
        node = node.args[0]
    return chain[::-1]


def _copied_on_the_way(traced: TracedGraph, solution, producer: fx.Node, via: fx.Node,
                       copies, views, micro_batch: int) -> bool:
    """Does the tensor an op saves through `via`, a view of `producer`'s storage in the
    traced graph, become a new storage at run time?

    Two cases. A redistribution on an edge of the view chain (a value gathered over an
    axis, then reshaped: the op keeps the gathered copy, not this rank's slice). And a sequence-parallel attention kernel (ring, Ulysses) in place of aten's
    CPU flash attention: aten's output is laid out [B, S, H, D] in memory, so the model's
    transpose(1, 2).reshape(B, S, H*D) is a view of it, while the kernels return a
    contiguous [B, H, S, D] tensor, which that reshape copies; the next linear saves the
    copy (one more [B, S_local, hidden] per block). The chain is replayed on the meta device
    from a contiguous tensor to find out.
    """
    if solution is None or via is producer:
        return False
    chain = _view_chain(producer, via, _analysis(traced).owners)
    if not chain:
        return False
    edges = zip([producer] + chain[:-1], chain)
    if any(e in copies and e not in views for e in edges):
        return True
    strategy = solution.strategies.get(producer)
    if strategy is None or "sequence" not in (strategy.args or {}):
        return False
    t = torch.empty(_sizes(producer, micro_batch), device="meta")
    base = t
    for node in chain:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if name in _VIEW_OPS:
            t = t.reshape(_sizes(node, micro_batch))
        elif not any(isinstance(a, fx.Node) for a in node.args[1:]) and \
                callable(node.target):
            t = node.target(t, *node.args[1:], **node.kwargs)
        else:
            return False  # not an op this replay knows: keep the traced answer
        if t._base is not base and t is not base:
            return True
    return False


def _sizes(node: fx.Node, micro_batch: int) -> list[int]:
    return [int(sympy.sympify(d).subs(BATCH, micro_batch)) for d in node.meta["autopar"].shape]


def _kernel_saves(solution, micro_batch: int) -> tuple[set, dict[str, dict]]:
    """What the 2D, 2.5D and 3D kernels (`autopar.kernels.multid`) save where it differs
    from the aten op they replace: (the ops whose own saved tensors do not count, per layer
    {key: (bytes per device, False)} of the kernels' tensors).

    3D linear: x and W all-gathered over the input and weight groups (q times this rank's
    blocks), kept for the backward pass, instead of the local x the aten linear saves; the
    gathered weight is an activation (a new tensor), not a parameter. Norm (LayerNorm,
    RMSNorm over a split hidden dim): the normalized input x-hat (x's local size, a new
    tensor) and one statistic per row (rstd), instead of the input and, for LayerNorm,
    mean and rstd. SUMMA (2D, 2.5D) saves its local x and W as the aten linear does.
    """
    sizes = axis_sizes(solution)
    replaced: set = set()
    out: dict[str, dict] = {}
    for node, strategy in solution.strategies.items():
        args = strategy.args
        layer = node.meta["autopar"].layer
        if strategy.rewrite == "grid_linear" and args.get("mode") == TP_3D:
            x, w = (node.args[1], node.args[2]) if args["transposed"] else node.args[:2]
            inp, wgt, _ = args["grid"]
            for key, src, axis in (("gathered input", x, inp), ("gathered weight", w, wgt)):
                nbytes = _node_bytes(src, micro_batch) * \
                    held_fraction(strategy.needs[src].layout, sizes) * sizes[axis]
                out.setdefault(layer, {})[(key, node)] = (math.ceil(nbytes), False)
            replaced.add(node)
        elif strategy.rewrite == "grid_norm":
            x = node.args[0]
            local = _node_bytes(x, micro_batch) * held_fraction(strategy.needs[x].layout, sizes)
            width = Fraction(int(x.meta["autopar"].shape[-1]), sizes[args["hidden"]])
            keys = out.setdefault(layer, {})
            keys[("normalized", node)] = (math.ceil(local), False)
            keys[("rstd", node)] = (math.ceil(local / width), False)
            replaced.add(node)
    return replaced, out


def _layer_reads(traced: TracedGraph, solution, micro_batch: int) -> dict[str, dict]:
    """Per layer: the activations it reads from outside itself, which full recompute keeps."""
    sizes = axis_sizes(solution)
    analysis = _analysis(traced)
    params = {s.node for s in analysis.saved if s.parameter}
    saved_as = {}  # a producer -> its storage's key among the saved tensors
    for i, saved in enumerate(analysis.saved):
        if not saved.internal:
            saved_as.setdefault(saved.node, ("saved", i))
    out: dict[str, dict] = {}
    for layer in traced.layers:
        members = set(layer.nodes)
        reads = out.setdefault(layer.name, {})
        for node in layer.nodes:
            if node.op != "call_function":
                continue
            for inp in node.all_input_nodes:
                src = analysis.owners.get(inp, inp)
                info = src.meta["autopar"]
                if inp in members or src.op == "get_attr" or src in params or \
                        info.shape is None or info.dtype is None:
                    continue
                layout = solution.layouts.get(src) if solution is not None else None
                nbytes = _node_bytes(src, micro_batch) * held_fraction(layout, sizes)
                reads[saved_as.get(src, ("read", src))] = (math.ceil(nbytes), False)
    return out


def _node_bytes(node: fx.Node, micro_batch: int) -> int:
    info = node.meta["autopar"]
    return int(sympy.Mul(*info.shape).subs(BATCH, micro_batch)) * _itemsize(info.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()
