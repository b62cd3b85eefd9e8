"""What a catalog rule sees of the op it decides (`RuleContext`), and the helpers every rule
family shares: the replicated and follow strategies, tensor inputs, byte counts."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

import sympy
import torch
import torch.fx as fx

from autopar.graph.analysis import NodeInfo, OpKind
from autopar.graph.ir import BATCH
from autopar.sharding.axes import TensorMesh
from autopar.sharding.layout import Layout, Shard, divisible, tokens_seen_on
from autopar.sharding.strategy import CommOp, Need, Rewrite, Strategy


@dataclass
class RuleContext:
    """What a rule may ask about the op it is deciding."""

    node: fx.Node
    axis: str
    size: int  # ranks on the axis
    mode: str  # the layer's tensor-parallel mode
    layouts: dict  # node -> Layout (or list for multi-output ops); params absent while free
    hints: dict  # node name -> ("groups", g) | ("replicate",)
    new_hints: dict  # filled by rules that need a producer to choose differently
    mesh: TensorMesh | None = None  # every tensor axis and its size (None: `axis` only)
    requires_grad: dict = field(default_factory=dict)  # node -> whether autograd tracks it
    # Megatron sequence parallelism (1D layers only): `sp` when this op's layer runs it,
    # `seq` the tokens per sample (the size of the sequence dim), `grad_summed` the values
    # whose gradient a gather_sum_grads before them already sums (a view feeding column
    # linears), `sp_failures` layer -> why an op there could not be sequence-split.
    sp: bool = False
    seq: int | None = None
    grad_summed: set = field(default_factory=set)
    sp_failures: dict = field(default_factory=dict)
    sequence_mode: str | None = None  # "ring" | "ulysses" when the mesh has a cp axis
    # whether the graph sums parameters' gradients over cp (False: the step's data-parallel
    # sync does, in one all-reduce over dp x cp; rules leave those sums out)
    cp_grads: bool = True
    # the tensor inputs of `node` (`tensor_inputs`), found once: rules read them many times
    node_inputs: tuple | None = None

    @property
    def inputs(self) -> tuple[fx.Node, ...]:
        """The tensor-valued nodes among the op's arguments, in order, each once."""
        if self.node_inputs is None:
            self.node_inputs = tuple(tensor_inputs(self.node))
        return self.node_inputs

    def seq_dim(self, node: fx.Node | None = None) -> int | None:
        """The sequence dim of a [batch, ..., sequence, ..., hidden] value (of this op's output
        by default): the first dim after the batch and before the last of size `seq`."""
        return self._seq_dim_of(self.shape(node) if node is not None else self.info.shape)

    def _seq_dim_of(self, shape) -> int | None:
        if self.seq is None:
            return None
        if shape is None or len(shape) < 3 or not batch_like(shape[0]):
            return None
        for d in range(1, len(shape) - 1):
            if sympy.sympify(shape[d]) == self.seq:
                return d
        return None

    def token_shard(self, shape: tuple | None = None) -> Shard | None:
        """Where a Megatron-SP sequence split lies in a value of `shape` (this op's output by
        default): its sequence dim, whole (`seq_dim`); or, when batch and sequence were
        flattened into one leading dim of B x `seq` (OPT's decoder before its MLP), that dim
        as `seq` tokens per sample, each sample's run split alike (`S(tp)/seq`: exactly the
        rows the [B, S, ...] split holds, flattened). None when neither."""
        shape = self.info.shape if shape is None else shape
        d = self._seq_dim_of(shape)
        if d is not None:
            return Shard(d, self.axis)
        if self.seq is None or shape is None or len(shape) < 2:
            return None
        per_sample = sympy.simplify(sympy.sympify(shape[0]) / BATCH)
        if batch_like(shape[0]) and per_sample == self.seq:
            return Shard(0, self.axis, -int(self.seq))
        return None

    def sp_fail(self, why: str) -> None:
        self.sp_failures.setdefault(self.info.layer, f"{self.node.name} {why}")

    def sequence_split(self, x: fx.Node) -> Layout | None:
        """x split on its sequence over this axis (Megatron-SP; a flattened batch x sequence
        dim per sample, `token_shard`), or None with the reason recorded when x has no
        sequence or it does not divide."""
        shard = self.token_shard(self.shape(x))
        if shard is None:
            self.sp_fail(f"reads a partial sum of shape {tuple(self.shape(x))} with no "
                         f"sequence dim of {self.seq} tokens")
            return None
        if not divisible(self.seq, self.size):
            self.sp_fail(f"has a sequence of {self.seq} tokens, which does not split "
                         f"over {self.size} ranks")
            return None
        return Layout.replicated(len(self.shape(x))).with_shard(shard.dim, self.axis,
                                                                 shard.groups)

    @property
    def sizes(self) -> dict[str, int]:
        """Ranks on every tensor axis a layout may use."""
        return self.mesh.sizes if self.mesh is not None else {self.axis: self.size}

    @property
    def all_layouts(self) -> Mapping:
        """Every value's layout on every axis, even in a context restricted to one axis."""
        return self.layouts.full if isinstance(self.layouts, _Restricted) else self.layouts

    def on_axis(self, axis: str) -> RuleContext:
        """The same op seen on one axis: layouts restricted to it, `size` its ranks."""
        size = self.sizes.get(axis, self.size)
        seen = object.__new__(RuleContext)  # (dataclasses.replace, without its field walk)
        seen.__dict__.update(self.__dict__)
        seen.axis, seen.size, seen.layouts = axis, size, _Restricted(self.layouts, axis)
        return seen

    def local_bytes(self, node: fx.Node, layout: Layout | None = None) -> sympy.Expr:
        """Bytes of the block of `node` one rank holds under `layout` (its own by default)."""
        info = node.meta["autopar"]
        layout = layout if layout is not None else self.layouts.get(node)
        n = sympy.Mul(*info.shape)
        if isinstance(layout, Layout):
            n = n / layout.parts(self.sizes)
        return n * itemsize(info.dtype)

    @property
    def info(self) -> NodeInfo:
        return self.node.meta["autopar"]

    def layout(self, node: fx.Node):
        """The layout of a value; a parameter no op has placed yet reads as replicated."""
        if node not in self.layouts and node.op == "get_attr":
            return Layout.replicated(len(self.shape(node)))
        return self.layouts.get(node)

    def placed(self, node: fx.Node) -> Layout | None:
        """A parameter's layout once an earlier op fixed it, else None."""
        return self.layouts.get(node)

    def shape(self, node: fx.Node) -> tuple:
        return node.meta["autopar"].shape

    def hint(self):
        return self.hints.get(self.node.name)

    def bytes_of(self, node: fx.Node) -> sympy.Expr:
        info = node.meta["autopar"]
        return sympy.Mul(*info.shape) * itemsize(info.dtype)

    def comm(self, op: str, node: fx.Node, phase: str = "forward") -> CommOp:
        return CommOp(op, self.axis, phase, self.bytes_of(node), self.node.name)

    def comm_on(self, op: str, axis: str, nbytes, phase: str = "forward", times=1) -> \
            list[CommOp]:
        """One collective of `nbytes` on `axis` run `times` times (as one record)."""
        return [CommOp(op, axis, phase, nbytes * times, self.node.name)]

    def ask_producer(self, node: fx.Node, hint: tuple) -> bool:
        """Ask the linear layer that produced `node` to lay its output out differently."""
        source = _producing_linear(node)
        if source is None or self.hints.get(source.name) == hint:
            return False
        self.new_hints[source.name] = hint
        return True


class _Restricted(Mapping):
    """A read-only view of a layouts dict with every layout restricted to one axis."""

    def __init__(self, layouts, axis: str):
        self._layouts, self._axis = layouts, axis

    @property
    def full(self):
        return self._layouts

    def __getitem__(self, node):
        return _restrict(self._layouts[node], self._axis)

    def __iter__(self):
        return iter(self._layouts)

    def __len__(self):
        return len(self._layouts)

    def __contains__(self, node):
        return node in self._layouts


def _restrict(layout, axis: str):
    if isinstance(layout, Layout):
        return tokens_seen_on(layout, axis).restricted((axis,))
    if isinstance(layout, list):
        return [_restrict(v, axis) for v in layout]
    return layout


def itemsize(dtype) -> int:
    """Bytes per element of `dtype` (0 for a value without one)."""
    return dtype.itemsize if dtype is not None else 0


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued nodes among an op's arguments, in order, each once."""
    seen: dict[fx.Node, None] = {}

    def visit(a: fx.Node) -> fx.Node:
        if a not in seen:
            info = a.meta.get("autopar")
            if info and info.shape is not None:
                seen[a] = None
        return a

    fx.node.map_arg((node.args, node.kwargs), visit)
    return list(seen)


def _producing_linear(node: fx.Node) -> fx.Node | None:
    while node is not None:
        kind = node.meta["autopar"].kind
        if kind is OpKind.LINEAR:
            return node
        if kind not in (OpKind.VIEW, OpKind.ELEMENTWISE, OpKind.DROPOUT):
            return None
        inputs = tensor_inputs(node)
        node = inputs[0] if len(inputs) >= 1 else None
    return None


def rep(node: fx.Node) -> Layout:
    """The replicated layout of a value."""
    return Layout.replicated(len(node.meta["autopar"].shape))


def out_layouts(ctx: RuleContext, layout_fn: Callable[[tuple], Layout]):
    """`layout_fn` of the op's output shape, or of each output of a multi-output op."""
    val = ctx.node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return [layout_fn(tuple(v.shape)) if isinstance(v, torch.Tensor) else None for v in val]
    if ctx.info.shape is None:
        return None
    return layout_fn(ctx.info.shape)


def replicate(ctx: RuleContext, note: str = "") -> Strategy:
    """Every input whole on every rank; the op runs unchanged."""
    needs = {n: Need(rep(n)) for n in ctx.inputs}
    out = out_layouts(ctx, lambda shape: Layout.replicated(len(shape)))
    return Strategy("replicate", needs, out, note=note)


def follow(ctx: RuleContext, x: fx.Node, out: Layout, name: str = "follow",
           rewrite: Rewrite | None = None) -> Strategy:
    """One tensor input keeps its layout; the others (weights, masks) stay replicated."""
    needs = {n: Need(rep(n)) for n in ctx.inputs if n is not x}
    needs[x] = Need(ctx.layout(x))
    return Strategy(name, needs, out, rewrite=rewrite)


def splits(size, parts: int) -> bool:
    """A size splits into `parts` when it divides, or when it is a whole multiple of the batch
    (the engine refuses batches the batch split does not divide)."""
    return divisible(size, parts) or batch_like(size)


def batch_like(size) -> bool:
    """Whether a size is a positive whole multiple of the batch symbol."""
    return _batch_like(sympy.sympify(size))


@functools.lru_cache(maxsize=1024)
def _batch_like(size: sympy.Expr) -> bool:
    ratio = sympy.simplify(size / BATCH)
    return size.free_symbols == {BATCH} and ratio.is_number and ratio.is_integer \
        and bool(ratio > 0)


def shard_dim(ctx: RuleContext, node: fx.Node) -> int | None:
    """The dim `node` is split on over the rule's axis, in one block; else None."""
    layout = ctx.layout(node)
    shard = layout.shard_on(ctx.axis) if layout is not None else None
    return shard.dim if shard is not None and shard.groups == 1 else None

