"""The strategy catalog: for each op kind, how it runs under each tensor-parallel mode.

A rule looks at the layouts of an op's inputs and returns a `Strategy`: the layout each
input must have (the solver inserts the redistribution), the output layout, the
collectives the op runs itself, and the sharded form the rewrite pass gives it. The same
entry is what the cost model prices, what the rewrite emits and what explain prints.

Modes: "1d" (Megatron-style: linear layers split by columns then rows, attention by
heads, vocabulary-parallel embedding and cross-entropy), "2d", "2.5d" and "3d" (linear
layers, norms, embeddings and the classifier's cross-entropy in the block layouts of
`autopar.kernels.multid`, activations split on batch and hidden) and "replicate" (every
input gathered, the op run whole on every rank). Rules are found by op kind, or by target
for ops the analysis leaves unclassified (concatenation, narrow). An op with no entry runs
replicated, and the strategy says so.

Generic rules (elementwise, views, softmax, dropout, reductions, concatenation, narrow,
attention, matmul) are written for one axis. On a layout split over several axes, `decide`
runs the rule once per axis on the layout restricted to that axis and merges the results;
an axis whose result would clash with an earlier one (the same dim, or a shared physical
mesh dim) is gathered instead.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Callable

import sympy
import torch
import torch.fx as fx

from autopar.graph.analysis import NodeInfo, OpKind
from autopar.graph.masks import is_causal_mask, too_large
from autopar.graph.trace import BATCH
from autopar.sharding.axes import GRIDS, MULTI_D, TensorMesh, role_spec
from autopar.sharding.layout import Layout, Shard, divisible
from autopar.sharding.strategy import CommOp, Need, Strategy

aten = torch.ops.aten


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

    def seq_dim(self, node: fx.Node | None = None) -> int | None:
        """The sequence dim of a [batch, ..., sequence, ..., hidden] value (of this op's output
        by default): the first dim after the batch and before the last of size `seq`."""
        if self.seq is None:
            return None
        shape = self.shape(node) if node is not None else self.info.shape
        if shape is None or len(shape) < 3 or not _batch_like(shape[0]):
            return None
        for d in range(1, len(shape) - 1):
            if sympy.sympify(shape[d]) == self.seq:
                return d
        return None

    def sp_fail(self, why: str) -> None:
        self.sp_failures.setdefault(self.info.layer, f"{self.node.name} {why}")

    @property
    def sizes(self) -> dict[str, int]:
        """Ranks on every tensor axis a layout may use."""
        return self.mesh.sizes if self.mesh is not None else {self.axis: self.size}

    def on_axis(self, axis: str) -> RuleContext:
        """The same op seen on one axis: layouts restricted to it, `size` its ranks."""
        size = self.sizes.get(axis, self.size)
        return replace(self, axis=axis, size=size, layouts=_Restricted(self.layouts, axis))

    def local_bytes(self, node: fx.Node, layout: Layout | None = None) -> sympy.Expr:
        """Bytes of the block of `node` one rank holds under `layout` (its own by default)."""
        info = node.meta["autopar"]
        layout = layout if layout is not None else self.layouts.get(node)
        n = sympy.Mul(*info.shape)
        if isinstance(layout, Layout):
            n = n / layout.parts(self.sizes)
        return n * _itemsize(info.dtype)

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
        return sympy.Mul(*info.shape) * _itemsize(info.dtype)

    def comm(self, op: str, node: fx.Node, phase: str = "forward") -> CommOp:
        return CommOp(op, self.axis, phase, self.bytes_of(node), self.node.name)

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
        return layout.restricted((axis,))
    if isinstance(layout, list):
        return [_restrict(v, axis) for v in layout]
    return layout


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size() if dtype is not None else 0


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The tensor-valued nodes among an op's arguments, in order, each once."""
    seen: dict[fx.Node, None] = {}
    for a in _flatten(node):
        if isinstance(a, fx.Node) and a.meta.get("autopar") and a.meta["autopar"].shape is not None:
            seen.setdefault(a, None)
    return list(seen)


def _flatten(node: fx.Node) -> list:
    out = []
    fx.node.map_arg((node.args, node.kwargs), out.append)
    return out


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


def _rep(node: fx.Node) -> Layout:
    return Layout.replicated(len(node.meta["autopar"].shape))


def _out_layouts(ctx: RuleContext, layout_fn: Callable[[tuple], Layout]):
    val = ctx.node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return [layout_fn(tuple(v.shape)) if isinstance(v, torch.Tensor) else None for v in val]
    if ctx.info.shape is None:
        return None
    return layout_fn(ctx.info.shape)


def replicate(ctx: RuleContext, note: str = "") -> Strategy:
    """Every input whole on every rank; the op runs unchanged."""
    needs = {n: Need(_rep(n)) for n in tensor_inputs(ctx.node)}
    out = _out_layouts(ctx, lambda shape: Layout.replicated(len(shape)))
    return Strategy("replicate", needs, out, note=note)


def follow(ctx: RuleContext, x: fx.Node, out: Layout, name: str = "follow",
           rewrite: str | None = None) -> Strategy:
    """One tensor input keeps its layout; the others (weights, masks) stay replicated."""
    needs = {n: Need(_rep(n)) for n in tensor_inputs(ctx.node) if n is not x}
    needs[x] = Need(ctx.layout(x))
    return Strategy(name, needs, out, rewrite=rewrite)


# ----------------------------------------------------------------------------- linear

def linear(ctx: RuleContext) -> Strategy:
    """Megatron 1D: a column split when the input is whole, a row split when it is split."""
    node = ctx.node
    if node.target is aten.addmm.default:  # transformers' Conv1D: addmm(bias, x, W[in, out])
        bias, x, w = node.args[0], node.args[1], node.args[2]
        in_dim, out_dim = 0, 1
    else:
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        in_dim, out_dim = 1, 0
    if ctx.mode != "1d" or ctx.hint() == ("replicate",):
        return replicate(ctx)
    w_shape = ctx.shape(w)
    x_layout = ctx.layout(x)
    x_shard = x_layout.shard_on(ctx.axis)
    last = len(ctx.shape(x)) - 1
    fixed_w = ctx.placed(w)
    if x_shard is not None and x_shard.dim == last and not x_layout.partial \
            and divisible(w_shape[in_dim], ctx.size * x_shard.groups):
        needs = {x: Need(x_layout), w: Need(_rep(w).with_shard(in_dim, ctx.axis, x_shard.groups))}
        if ctx.sp:  # sequence parallel: a partial sum, reduce-scattered where it is consumed
            if bias is not None:  # added once (on rank 0); its gradient summed over the axis
                needs[bias] = Need(_rep(bias), sum_grads=bool(ctx.requires_grad.get(bias)))
            out = Layout.replicated(len(ctx.info.shape)).with_partial(ctx.axis)
            return Strategy("row", needs, out, rewrite="partial_linear")
        if bias is not None:
            needs[bias] = Need(_rep(bias))
        out = Layout.replicated(len(ctx.info.shape))
        return Strategy("row", needs, out, comm=[ctx.comm("all_reduce", node)], rewrite="row_linear")
    hint = ctx.hint()
    groups = hint[1] if hint and hint[0] == "groups" else 1
    if fixed_w is not None and fixed_w.shard_on(ctx.axis) is not None and \
            fixed_w.shard_on(ctx.axis).dim == out_dim:
        groups = fixed_w.shard_on(ctx.axis).groups
    if divisible(w_shape[out_dim], ctx.size * groups):
        # a view before this linear that gathered a sequence split already sums the gradient
        needs = {x: Need(_rep(x), sum_grads=x not in ctx.grad_summed),
                 w: Need(_rep(w).with_shard(out_dim, ctx.axis, groups))}
        if bias is not None:
            needs[bias] = Need(_rep(bias).with_shard(0, ctx.axis, groups))
        out = Layout.replicated(len(ctx.info.shape)).with_shard(-1, ctx.axis, groups)
        return Strategy("column", needs, out)
    if x in ctx.grad_summed:  # the gradient is whole here: gather without summing it
        ctx.new_hints[x.name] = ("gather",)
    return replicate(ctx, note=f"output features {w_shape[out_dim]} do not split over "
                               f"{ctx.size} ranks")


# -------------------------------------------------------------------------- embedding

def embedding(ctx: RuleContext) -> Strategy:
    """Vocabulary-parallel lookup: each rank owns a slice of the rows, the sum is all-reduced."""
    w, idx = ctx.node.args[0], ctx.node.args[1]
    fixed = ctx.placed(w)
    split_rows = _rep(w).with_shard(0, ctx.axis)
    usable = fixed == split_rows or (fixed is None and divisible(ctx.shape(w)[0], ctx.size))
    if ctx.mode != "1d" or not usable:
        return replicate(ctx)
    needs = {w: Need(split_rows), idx: Need(_rep(idx))}
    if ctx.sp:  # the sum stays partial: its consumer reduce-scatters it into the sequence split
        return Strategy("vocab_parallel", needs,
                        Layout.replicated(len(ctx.info.shape)).with_partial(ctx.axis),
                        rewrite="vocab_parallel_embedding", args={"reduce": False})
    return Strategy("vocab_parallel", needs, Layout.replicated(len(ctx.info.shape)),
                    comm=[ctx.comm("all_reduce", ctx.node)], rewrite="vocab_parallel_embedding")


# ------------------------------------------------------------------------------- norm

def norm(ctx: RuleContext) -> Strategy:
    """Statistics over the last dims: fine while those dims are whole."""
    x = ctx.node.args[0]
    k = len(ctx.node.args[1])
    layout = ctx.layout(x)
    ndim = len(ctx.shape(x))
    if layout.partial and ctx.sp:
        layout = _sequence_split(ctx, x)
        if layout is None:
            return replicate(ctx)
    if layout.partial or any(s.dim >= ndim - k for s in layout.shards):
        return replicate(ctx)
    strategy = follow(ctx, x, layout)
    strategy.needs[x] = Need(layout)
    if layout.shards:  # rows split: each rank's weight and bias gradients are partial sums
        axes = tuple(s.axis for s in layout.shards)
        for p, need in strategy.needs.items():
            if p is not x and ctx.requires_grad.get(p):
                strategy.needs[p] = Need(need.layout, axes)
    return strategy


def _sequence_split(ctx: RuleContext, x: fx.Node) -> Layout | None:
    """x split on its sequence dim over the rule's axis (sequence parallelism), or None (and
    the reason recorded) when x has no sequence dim or it does not divide."""
    d = ctx.seq_dim(x)
    if d is None:
        ctx.sp_fail(f"reads a partial sum of shape {tuple(ctx.shape(x))} with no sequence dim "
                    f"of {ctx.seq} tokens")
        return None
    if not divisible(ctx.shape(x)[d], ctx.size):
        ctx.sp_fail(f"has a sequence of {ctx.shape(x)[d]} tokens, which does not split over "
                    f"{ctx.size} ranks")
        return None
    return Layout.replicated(len(ctx.shape(x))).with_shard(d, ctx.axis)


# -------------------------------------------------------------------------- attention

def attention(ctx: RuleContext) -> Strategy:
    """Split by heads (dim 1) or by batch (dim 0): each rank attends with whole heads of
    whole sequences, no communication."""
    q, k, v = ctx.node.args[:3]
    mask = ctx.node.args[3] if len(ctx.node.args) > 3 else ctx.node.kwargs.get("attn_mask")
    dims = [_shard_dim(ctx, n) for n in (q, k, v)]
    if ctx.axis == CP and any(d == 2 for d in dims):
        return sequence_attention(ctx, q, k, v, mask)
    d = next((d for d in dims if d in (0, 1)), None)
    if d is None or not all(_splits(ctx.shape(n)[d], ctx.size) for n in (q, k, v)):
        return replicate(ctx)
    needs = {n: Need(_rep(n).with_shard(d, ctx.axis)) for n in (q, k, v)}
    if isinstance(mask, fx.Node):
        mshape = ctx.shape(mask)
        split_mask = len(mshape) == 4 and mshape[d] != 1
        needs[mask] = Need(_rep(mask).with_shard(d, ctx.axis) if split_mask else _rep(mask))
    out = Layout.replicated(len(ctx.info.shape)).with_shard(d, ctx.axis)
    return Strategy("heads" if d == 1 else "batch", needs, out, rewrite="split_stream")


CP = "cp"  # the context-parallel (sequence) axis
_SDPA_ARGS = {  # target -> positions of (attn_mask, dropout_p, is_causal, scale, enable_gqa)
    aten.scaled_dot_product_attention.default: (3, 4, 5, 6, 7),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (None, 3, 4, None, None),
}


def _arg(node: fx.Node, pos, name: str, default):
    if pos is not None and len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def sequence_attention(ctx: RuleContext, q, k, v, mask) -> Strategy:
    """q, k, v split on the sequence dim (2) over `cp`: ring attention or Ulysses
    (`autopar.kernels.sequence`), with the collectives the kernel logs. Dropout and masks
    other than is_causal (or a mask equal to it, `autopar.graph.masks`) are not supported:
    the sequence is gathered instead."""
    node = ctx.node
    positions = _SDPA_ARGS.get(node.target)
    mode = ctx.sequence_mode or "ring"
    if positions is None:
        return replicate(ctx, note=f"{node.target} has no sequence-parallel kernel; ran with "
                                   "the sequence gathered")
    pm, pd, pc, ps, pg = positions
    if node.target is aten._scaled_dot_product_flash_attention_for_cpu.default:
        mask = node.kwargs.get("attn_mask")
        scale = node.kwargs.get("scale")
        gqa = False
    else:
        scale = _arg(node, ps, "scale", None)
        gqa = bool(_arg(node, pg, "enable_gqa", False))
    dropout_p = _arg(node, pd, "dropout_p", 0.0)
    causal = bool(_arg(node, pc, "is_causal", False))
    if isinstance(mask, fx.Node) and not causal and len(ctx.shape(q)) == 4 and \
            ctx.shape(q)[2] == ctx.shape(k)[2] and is_causal_mask(mask):
        causal, mask = True, None  # a causal mask built from positions (transformers' models)
    if isinstance(mask, fx.Node) and too_large(mask):
        return replicate(ctx, note=f"the attention mask of {node.name} is too large to check "
                                   "for causality; ran with the sequence gathered (pass "
                                   "is_causal=True instead of a causal mask)")
    if isinstance(mask, fx.Node) or dropout_p:
        return replicate(ctx, note="sequence-parallel attention takes no mask or dropout; "
                                   "ran with the sequence gathered")
    c = ctx.size
    shapes = [ctx.shape(n) for n in (q, k, v)]
    if not all(divisible(sh[2], c) for sh in shapes):
        return replicate(ctx)
    full = ctx.layouts._layouts if isinstance(ctx.layouts, _Restricted) else ctx.layouts
    sizes = ctx.sizes

    # the split the other axis's attention rule puts on batch or heads (all of q, k, v alike)
    other = None
    for n in (q, k, v):
        lay = full.get(n)
        for s in (lay.shards if isinstance(lay, Layout) else ()):
            if s.axis != CP and s.dim in (0, 1) and s.groups == 1 and other is None:
                other = s
    if other is not None and not all(_splits(sh[other.dim], sizes[other.axis]) for sh in shapes):
        other = None

    def per_rank(n: fx.Node) -> tuple[sympy.Expr, int]:
        """Bytes of this rank's block of n (every axis's split) and its heads per rank."""
        lay = _rep(n).with_shard(2, CP)
        heads = int(ctx.shape(n)[1])
        if other is not None:
            lay = lay.with_shard(other.dim, other.axis)
            heads //= sizes[other.axis] if other.dim == 1 else 1
        return ctx.local_bytes(n, lay), heads

    (qb, h), (kb, hkv), (vb, _) = (per_rank(n) for n in (q, k, v))
    ob = qb * sympy.sympify(ctx.shape(v)[3]) / sympy.sympify(ctx.shape(q)[3])
    grads = [bool(ctx.requires_grad.get(n)) for n in (q, k, v)]
    comm = []
    if mode == "ulysses":
        if h % c:
            from autopar.errors import PlanError
            raise PlanError(f"Ulysses splits the {h} attention heads{' per tensor rank' if h != int(shapes[0][1]) else ''} "
                            f"of {ctx.info.module or ctx.info.layer} over sequence size {c}, and "
                            f"{h} does not divide by {c}; use mode='ring', or a sequence size "
                            f"that divides {h}.")
        f = c // __import__("math").gcd(hkv, c)
        for b in (qb, f * kb, f * vb, ob):
            comm.append(CommOp("all_to_all", CP, "forward", b, node.name))
        if ctx.requires_grad.get(node, any(grads)):
            comm.append(CommOp("all_to_all", CP, "backward", ob, node.name))
            for b, g in zip((qb, f * kb, f * vb), grads):
                if g:
                    comm.append(CommOp("all_to_all", CP, "backward", b, node.name))
    elif c > 1:
        kv = kb + vb
        comm += [CommOp("p2p", CP, "forward", kv, node.name) for _ in range(c - 1)]
        if ctx.requires_grad.get(node, any(grads)):
            comm += [CommOp("p2p", CP, "backward", kv, node.name) for _ in range(c - 1)]
            if grads[1] or grads[2]:  # dk, dv accumulators: float32 for 16-bit inputs
                item = _itemsize(k.meta["autopar"].dtype)
                acc = kv * sympy.Rational(max(4, item), item)
                comm += [CommOp("p2p", CP, "backward", acc, node.name, accumulator=True)
                         for _ in range(c)]
    needs = {n: Need(_rep(n).with_shard(2, CP)) for n in (q, k, v)}
    out = _out_layouts(ctx, lambda shape: Layout.replicated(len(shape)).with_shard(2, CP)
                       if len(shape) == 4 else Layout.replicated(len(shape)))
    return Strategy("sequence", needs, out, comm=comm,
                    args={"sequence": {"mode": mode, "is_causal": causal, "scale": scale,
                                       "enable_gqa": gqa}})


def _splits(size, parts: int) -> bool:
    """A size splits into `parts` when it divides, or when it is a whole multiple of the batch
    (the engine refuses batches the batch split does not divide)."""
    return divisible(size, parts) or _batch_like(size)


def _batch_like(size) -> bool:
    size = sympy.sympify(size)
    ratio = sympy.simplify(size / BATCH)
    return size.free_symbols == {BATCH} and ratio.is_number and ratio.is_integer \
        and bool(ratio > 0)


def _shard_dim(ctx: RuleContext, node: fx.Node) -> int | None:
    layout = ctx.layout(node)
    shard = layout.shard_on(ctx.axis) if layout is not None else None
    return shard.dim if shard is not None and shard.groups == 1 else None


# ----------------------------------------------------------------------------- matmul

def matmul(ctx: RuleContext) -> Strategy:
    """Activation x activation: batch dims split alike, or rows of one operand, or columns."""
    node = ctx.node
    if node.target not in (aten.matmul.default, aten.bmm.default, aten.mm.default):
        return replicate(ctx)
    a, b = node.args[0], node.args[1]
    sa, sb = ctx.layout(a), ctx.layout(b)
    if sa.partial or sb.partial:
        return replicate(ctx)
    na, nb, nout = len(ctx.shape(a)), len(ctx.shape(b)), len(ctx.info.shape)
    if na < 2 or nb < 2:
        return replicate(ctx)
    da, db = _shard_dim(ctx, a), _shard_dim(ctx, b)
    out = Layout.replicated(nout)
    for d, n in ((da, na), (db, nb)):
        if d is not None and d < n - 2:  # a batch dim: split the other operand alike
            od = d + nout - n
            needs = {}
            for operand, m in ((a, na), (b, nb)):
                od_in = od - (nout - m)
                if od_in >= 0 and ctx.shape(operand)[od_in] != 1:
                    needs[operand] = Need(_rep(operand).with_shard(od_in, ctx.axis))
                else:
                    needs[operand] = Need(_rep(operand))
            return Strategy("batch", needs, out.with_shard(od, ctx.axis))
    if da == na - 2 and db is None:
        return Strategy("rows", {a: Need(sa), b: Need(sb, sum_grads=True)},
                        out.with_shard(nout - 2, ctx.axis))
    if db == nb - 1 and da is None:
        return Strategy("columns", {a: Need(sa, sum_grads=True), b: Need(sb)},
                        out.with_shard(nout - 1, ctx.axis))
    if da == na - 1 and db == nb - 2:
        return Strategy("contraction", {a: Need(sa), b: Need(sb)}, out.with_partial(ctx.axis))
    return replicate(ctx)


# ---------------------------------------------------------------------- softmax, loss

def softmax(ctx: RuleContext) -> Strategy:
    x, dim = ctx.node.args[0], ctx.node.args[1]
    layout = ctx.layout(x)
    ndim = len(ctx.shape(x))
    if layout.partial or layout.shard_of_dim(dim % ndim) is not None:
        return replicate(ctx)
    return follow(ctx, x, layout)


def cross_entropy_args(node: fx.Node) -> tuple:
    """(weight, reduction, ignore_index, label_smoothing) of an aten.cross_entropy_loss node,
    defaults filled in (reduction 1 is the mean)."""
    args = list(node.args) + [None] * (6 - len(node.args))
    weight = node.kwargs.get("weight", args[2])
    reduction = node.kwargs.get("reduction", args[3] if args[3] is not None else 1)
    ignore = node.kwargs.get("ignore_index", args[4] if args[4] is not None else -100)
    smoothing = node.kwargs.get("label_smoothing", args[5]) or 0.0
    return weight, reduction, ignore, smoothing


def loss(ctx: RuleContext) -> Strategy:
    """Vocabulary-parallel cross-entropy: max, sum of exponentials and target logit all-reduced."""
    node = ctx.node
    if node.target is not aten.cross_entropy_loss.default or ctx.mode != "1d":
        return replicate(ctx)
    logits, target = node.args[0], node.args[1]
    weight, _, _, smoothing = cross_entropy_args(node)
    if _shard_dim(ctx, logits) != 1 or len(ctx.shape(logits)) != 2 or weight is not None \
            or smoothing:
        return replicate(ctx)
    rows = ctx.shape(logits)[0] * _itemsize(logits.meta["autopar"].dtype)
    comm = [CommOp("all_reduce", ctx.axis, "forward", rows, node.name) for _ in range(3)]
    needs = {logits: Need(ctx.layout(logits)), target: Need(_rep(target))}
    return Strategy("vocab_parallel", needs, Layout.replicated(len(ctx.info.shape)), comm=comm,
                    rewrite="vocab_parallel_cross_entropy")


# ------------------------------------------------------------------- dropout, reduction

def dropout(ctx: RuleContext) -> Strategy:
    """Same random stream where the tensor is whole on the axis, a rank's own where split."""
    x = ctx.node.args[0]
    layout = ctx.layout(x)
    if layout.partial and ctx.sp:
        layout = _sequence_split(ctx, x) or layout
    if layout.partial:
        return replicate(ctx)
    strategy = follow(ctx, x, layout, rewrite="stream_dropout")
    strategy.needs[x] = Need(layout)
    return strategy


def reduction(ctx: RuleContext) -> Strategy:
    node = ctx.node
    x = node.args[0]
    layout = ctx.layout(x)
    ndim = len(ctx.shape(x))
    dims = node.args[1] if len(node.args) > 1 and node.target not in (aten.sum.default,
                                                                      aten.mean.default) \
        else list(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims or range(ndim))
    dims = sorted(d % ndim for d in dims)
    keepdim = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim"))
    if layout.partial:
        return replicate(ctx)
    shard = layout.shard_on(ctx.axis)
    if shard is None:
        return follow(ctx, x, Layout.replicated(len(ctx.info.shape)))
    if shard.dim in dims:
        if node.target in (aten.sum.dim_IntList, aten.sum.default):
            return Strategy("partial_sum", {x: Need(layout)},
                            Layout.replicated(len(ctx.info.shape)).with_partial(ctx.axis))
        if node.target in (aten.mean.dim, aten.mean.default) and shard.groups == 1:
            # each rank's mean over its slice, divided by the ranks: a partial sum of the mean
            return Strategy("partial_mean", {x: Need(layout)},
                            Layout.replicated(len(ctx.info.shape)).with_partial(ctx.axis),
                            rewrite="partial_mean")
        return replicate(ctx)
    new_dim = shard.dim if keepdim else shard.dim - sum(1 for d in dims if d < shard.dim)
    out = Layout.replicated(len(ctx.info.shape)).with_shard(new_dim, ctx.axis, shard.groups)
    return follow(ctx, x, out)


# -------------------------------------------------------------------------- elementwise

# one-input ops linear in their input: a partial sum stays one
_LINEAR_UNARY = (aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.clone.default,
                 aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.alias.default)

def elementwise(ctx: RuleContext) -> Strategy:
    """Broadcasting ops: inputs follow the first split input, partial sums only add up."""
    node = ctx.node
    inputs = tensor_inputs(node)
    out_nd = len(ctx.info.shape)
    layouts = [ctx.layout(n) for n in inputs]
    # a sum of partial sums is a partial sum; adding a number to one is not
    linear_in_partials = node.target in (aten.add.Tensor, aten.sub.Tensor) and \
        all(isinstance(a, fx.Node) for a in node.args[:2])
    if inputs and all(lay.partial for lay in layouts) and linear_in_partials \
            and len(set(layouts)) == 1:
        return Strategy("partial", {n: Need(lay) for n, lay in zip(inputs, layouts)}, layouts[0])
    target_shard = None
    keeps_partial = len(inputs) == 1 and layouts[0].partial and node.target in _LINEAR_UNARY
    if ctx.sp and any(lay.partial for lay in layouts):
        d = ctx.seq_dim()
        if d is not None and divisible(ctx.info.shape[d], ctx.size):
            target_shard = Shard(d, ctx.axis)  # sequence parallel: partial sums reduce-scattered
        elif not keeps_partial:
            ctx.sp_fail(f"reads a partial sum but its output {tuple(ctx.info.shape)} has no "
                        f"sequence dim of {ctx.seq} tokens that splits over {ctx.size} ranks")
    if target_shard is None and keeps_partial:
        return follow(ctx, inputs[0], layouts[0])
    for n, lay in zip(inputs, layouts):
        shard = lay.shard_on(ctx.axis)
        if target_shard is None and shard is not None and not lay.partial:
            target_shard = Shard(shard.dim + out_nd - len(ctx.shape(n)), ctx.axis, shard.groups)
            break
    out = Layout.replicated(out_nd)
    if target_shard is None:
        return Strategy("follow", {n: Need(_rep(n)) for n in inputs}, out)
    needs = {}
    for n in inputs:
        shape = ctx.shape(n)
        d = target_shard.dim - (out_nd - len(shape))
        if d >= 0 and shape[d] != 1:
            needs[n] = Need(_rep(n).with_shard(d, ctx.axis, target_shard.groups))
        else:  # broadcast along the split dim: each rank's gradient is a partial sum
            needs[n] = Need(_rep(n), sum_grads=bool(ctx.requires_grad.get(n)))
    return Strategy("follow", needs, out.with_shard(target_shard.dim, ctx.axis,
                                                    target_shard.groups))


# -------------------------------------------------------------------------------- views

_IDENTITY_VIEWS = {aten.contiguous.default, aten.clone.default, aten.alias.default,
                   aten.detach.default, aten.lift_fresh_copy.default}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.flatten.using_ints, aten.unflatten.int}
_SHAPE_ONLY = _IDENTITY_VIEWS | _RESHAPES | {aten.transpose.int, aten.permute.default,
                                             aten.t.default, aten.unsqueeze.default,
                                             aten.squeeze.dim, aten.squeeze.dims}


def view(ctx: RuleContext) -> Strategy:
    """Shape-only ops carry the split dimension along, or gather when they cannot."""
    node = ctx.node
    target = node.target
    if target is operator.getitem:
        source = ctx.layout(node.args[0])
        if isinstance(source, list):
            return Strategy("follow", {}, source[node.args[1]])
        return replicate(ctx)
    x = node.args[0]
    layout = ctx.layout(x)
    if ctx.sp and isinstance(layout, Layout) and layout.partial and not layout.shards and \
            target in _SHAPE_ONLY:  # a view of a partial sum is a partial sum
        return follow(ctx, x, Layout(len(ctx.info.shape), (), layout.partial))
    if layout is None or layout.partial:
        return replicate(ctx)
    shard = layout.shard_on(ctx.axis)
    in_shape = ctx.shape(x)
    if shard is None:
        return follow(ctx, x, _out_layouts(ctx, lambda s: Layout.replicated(len(s))))
    if target in _IDENTITY_VIEWS:
        return follow(ctx, x, layout)
    out_shape = ctx.info.shape
    if target in _RESHAPES:
        new, groups_needed = reshape_shard(in_shape, out_shape, shard, ctx.size)
        if new is not None:
            return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(
                new.dim, ctx.axis, new.groups), rewrite="local_sizes")
        if groups_needed and ctx.ask_producer(x, ("groups", groups_needed)):
            return replicate(ctx)
        if ctx.sp and shard.dim == ctx.seq_dim(x) and ctx.hint() != ("gather",) and \
                node.users and all(u.meta["autopar"].kind is OpKind.LINEAR for u in node.users):
            # [B, S, H] split on S flattened to tokens for linears (Conv1D): gathered here with
            # the gradient reduce-scattered, so the column linears after it sum nothing more
            ctx.grad_summed.add(node)
            return Strategy("gather", {x: Need(_rep(x), sum_grads=True)},
                            Layout.replicated(len(out_shape)))
        if ctx.axis != CP:  # the sequence split is gathered here; the producer keeps it
            ctx.ask_producer(x, ("replicate",))
        return replicate(ctx)
    if target in (aten.transpose.int, aten.permute.default, aten.t.default):
        nd = len(in_shape)
        if target is aten.permute.default:
            order = [d % nd for d in node.args[1]]
        else:
            d0, d1 = (node.args[1] % nd, node.args[2] % nd) if target is aten.transpose.int \
                else (0, 1)
            order = list(range(nd))
            order[d0], order[d1] = order[d1], order[d0]
        return follow(ctx, x, Layout.replicated(nd).with_shard(order.index(shard.dim), ctx.axis,
                                                                shard.groups))
    if target is aten.unsqueeze.default:
        d = node.args[1] % (len(in_shape) + 1)
        new_dim = shard.dim + (1 if d <= shard.dim else 0)
        return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(new_dim, ctx.axis,
                                                                            shard.groups))
    if target in (aten.squeeze.dim, aten.squeeze.dims):
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = {d % len(in_shape) for d in dims if in_shape[d % len(in_shape)] == 1}
        new_dim = shard.dim - sum(1 for d in dims if d < shard.dim)
        return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(new_dim, ctx.axis,
                                                                            shard.groups))
    if target is aten.expand.default:
        new_dim = shard.dim + len(out_shape) - len(in_shape)
        return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(
            new_dim, ctx.axis, shard.groups), rewrite="local_sizes")
    if target is aten.slice.Tensor:
        dim = node.args[1] % len(in_shape) if len(node.args) > 1 else 0
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        whole = start in (0, None) and step == 1 and (
            end is None or (isinstance(end, int) and sympy.sympify(in_shape[dim]).is_number
                            and end >= int(in_shape[dim])) or end >= 2 ** 62)
        if dim != shard.dim or whole:
            return follow(ctx, x, layout)
        return replicate(ctx)
    if target is aten.select.int:
        dim = node.args[1] % len(in_shape)
        if dim == shard.dim:
            return replicate(ctx)
        new_dim = shard.dim - (1 if dim < shard.dim else 0)
        return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(new_dim, ctx.axis,
                                                                            shard.groups))
    if target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return _split(ctx, x, layout, shard)
    return replicate(ctx)


def _split(ctx: RuleContext, x: fx.Node, layout: Layout, shard: Shard) -> Strategy:
    node = ctx.node
    nd = len(ctx.shape(x))
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    pieces = [tuple(v.shape) for v in node.meta["val"]]
    if dim != shard.dim:
        return follow(ctx, x, [layout for _ in pieces])
    equal = len({p[dim] for p in pieces}) == 1
    if equal and shard.groups == len(pieces):
        outs = [Layout.replicated(nd).with_shard(dim, ctx.axis) for _ in pieces]
        return follow(ctx, x, outs, rewrite="local_sizes")
    if equal and shard.groups == 1 and ctx.ask_producer(x, ("groups", len(pieces))):
        return replicate(ctx)
    return replicate(ctx)


def reshape_shard(in_shape, out_shape, shard: Shard, parts: int):
    """Where a split dimension lands after a reshape.

    Returns (Shard, None) when it lands on an output dimension, or (None, g) when it would
    land there if the input were split in `g` blocks, or (None, None) when it cannot.
    The split dimension (size n, in `groups` blocks, each block split in `parts`) sits in a
    run of input dims that maps to a run of output dims with the same product. Counting the
    blocks of that run, G = (product of the run before the split dim) x groups, the split
    lands on output dim t of the run if the product A of the output run before t divides G
    and (G / A) x parts divides the size of t.
    """
    run = _matching_runs(in_shape, out_shape)
    for ins, outs in run:
        if shard.dim not in ins:
            continue
        if shard.groups < 0:
            return _unflatten_samples(in_shape, out_shape, ins, outs, shard, parts), None
        prefix_in = sympy.Mul(*[in_shape[d] for d in ins if d < shard.dim])
        if not prefix_in.is_number:
            return _flatten_samples(in_shape, out_shape, ins, outs, shard, parts), None
        blocks = int(prefix_in) * shard.groups
        prefix_out = 1
        for t in outs:
            size = out_shape[t]
            if not sympy.sympify(size).is_number:
                # a batch dim leading its run: B -> B x T or back, the split stays leading
                if prefix_out == 1 and blocks == 1 and _batch_like(size) and \
                        _batch_like(in_shape[shard.dim]):
                    return Shard(t, shard.axis, 1), None
                return None, None
            size = int(size)
            if blocks % prefix_out == 0 and size % ((blocks // prefix_out) * parts) == 0:
                return Shard(t, shard.axis, blocks // prefix_out), None
            prefix_out *= size
        # not representable: the smallest block count that would be, off the innermost dim
        prefix_out = 1
        for t in outs[:-1]:
            size = int(out_shape[t])
            if prefix_out % blocks == 0 and prefix_out % int(prefix_in) == 0 \
                    and size % parts == 0 and prefix_out > blocks:
                return None, prefix_out // int(prefix_in)
            prefix_out *= size
        return None, None
    return None, None


def _flatten_samples(in_shape, out_shape, ins, outs, shard: Shard, parts: int):
    """[B, S, ...] split on S (right after the batch) over cp flattened into one dim
    [B*S*...]: a batch-major split with runs of S*... elements per sample (groups -r), or
    None. (Megatron-SP's sequence splits over tp are gathered at such views instead: the
    1D rules after them want whole tokens.)"""
    run = sympy.Mul(*[in_shape[d] for d in ins[1:]])
    if shard.axis != CP or shard.groups != 1 or len(outs) != 1 or len(ins) < 2 or \
            shard.dim != ins[1] or not _batch_like(in_shape[ins[0]]) or not run.is_number or \
            not divisible(in_shape[shard.dim], parts):
        return None
    return Shard(outs[0], shard.axis, -int(run))


def _unflatten_samples(in_shape, out_shape, ins, outs, shard: Shard, parts: int):
    """The inverse of `_flatten_samples`: [B*r] back to [B, S, ...] with S split, or None."""
    run = sympy.Mul(*[out_shape[d] for d in outs[1:]])
    if len(ins) != 1 or len(outs) < 2 or not _batch_like(out_shape[outs[0]]) or \
            not run.is_number or int(run) != -shard.groups or \
            not divisible(out_shape[outs[1]], parts):
        return None
    return Shard(outs[1], shard.axis, 1)


def _matching_runs(in_shape, out_shape):
    """Pair runs of input dims with runs of output dims of equal product (size-1 dims dropped)."""
    runs, i, j = [], 0, 0
    n, m = len(in_shape), len(out_shape)
    while i < n or j < m:
        ins, outs = [], []
        p_in, p_out = sympy.Integer(1), sympy.Integer(1)
        if i < n:
            ins.append(i)
            p_in = p_in * in_shape[i]
            i += 1
        if j < m:
            outs.append(j)
            p_out = p_out * out_shape[j]
            j += 1
        while sympy.simplify(p_in - p_out) != 0:
            if (i < n and _smaller(p_in, p_out)) or j >= m:
                if i >= n:
                    break
                ins.append(i)
                p_in = p_in * in_shape[i]
                i += 1
            else:
                outs.append(j)
                p_out = p_out * out_shape[j]
                j += 1
        runs.append((ins, outs))
    return runs


def _smaller(a, b) -> bool:
    ratio = sympy.simplify(b / a)
    if ratio.is_number:
        return bool(ratio > 1)
    return bool(sympy.degree(sympy.numer(sympy.together(ratio))) > 0) if ratio.free_symbols \
        else False


# ------------------------------------------------------------------- concatenate, narrow

def concat(ctx: RuleContext) -> Strategy:
    """Joining tensors along `dim`: a split elsewhere is kept as it is, with no communication.

    A split on the joined dimension itself is kept too when the inputs are equally long
    there: each rank joins its slices, which is the output split in one block per input
    (`S(tp)xN`). Inputs of unequal lengths are gathered.
    """
    node = ctx.node
    pieces = [p for p in node.args[0] if isinstance(p, fx.Node)]
    ndim = len(ctx.info.shape)
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % ndim
    if any(len(ctx.shape(p)) != ndim for p in pieces):
        return replicate(ctx, note="joins tensors with different numbers of dimensions; "
                                   "ran replicated")
    layouts = [ctx.layout(p) for p in pieces]
    if any(lay.partial for lay in layouts):
        return replicate(ctx)
    shard = next((lay.shard_on(ctx.axis) for lay in layouts if lay.shard_on(ctx.axis)), None)
    out = Layout.replicated(ndim)
    if shard is None:
        return Strategy("follow", {p: Need(_rep(p)) for p in pieces}, out)
    if shard.dim != dim:
        needs = {p: Need(_rep(p).with_shard(shard.dim, ctx.axis, shard.groups)) for p in pieces}
        return Strategy("follow", needs, out.with_shard(shard.dim, ctx.axis, shard.groups))
    if len({ctx.shape(p)[dim] for p in pieces}) == 1:
        needs = {p: Need(_rep(p).with_shard(dim, ctx.axis, shard.groups)) for p in pieces}
        return Strategy("blocks", needs,
                        out.with_shard(dim, ctx.axis, shard.groups * len(pieces)))
    return replicate(ctx, note=f"joins pieces of unequal sizes along dimension {dim}, which "
                               f"is split over '{ctx.axis}'; inputs gathered")


def narrow(ctx: RuleContext) -> Strategy:
    """A window of one dimension: a split elsewhere is kept; a split window is gathered."""
    x, dim = ctx.node.args[0], ctx.node.args[1]
    layout = ctx.layout(x)
    if layout.partial:
        return replicate(ctx)
    shard = layout.shard_on(ctx.axis)
    if shard is not None and shard.dim == dim % layout.ndim:
        return replicate(ctx, note=f"narrows dimension {shard.dim}, which is split over "
                                   f"'{ctx.axis}'; input gathered")
    return follow(ctx, x, layout)


# --------------------------------------------------------------- 2D, 2.5D and 3D modes
#
# The kernels of autopar.kernels.multid; each rule lists the collectives its kernel logs
# (bytes as one rank logs them: a broadcast or reduce on every member, an all-gather its
# output, a reduce-scatter its input), so predicted communication stays exact.

def role_layout(ctx: RuleContext, grid: tuple, role: str, ndim: int, groups: int = 1,
                transposed: bool = False) -> Layout:
    """The layout of a tensor in `role` on `grid` (see `autopar.sharding.axes.role_spec`).

    `groups` blocks go on the dim the fused output features lie on (weight and bias dim 0,
    y's last dim); `transposed` reads a weight as [in, out] (transformers' Conv1D).
    """
    layout = Layout.replicated(ndim)
    for dim, comps in role_spec(ctx.mode, grid, role).items():
        d = dim % ndim
        g = groups if (role in ("weight", "bias") and d == 0) or (role == "y" and dim == -1) \
            else 1
        if transposed and role == "weight":
            d = 1 - d
        layout = layout.with_shard(d, ctx.mesh.composite(comps), g)
    return layout


def _same_split(a: Layout, b: Layout) -> int:
    """How many shards two layouts share (axis and dim; blocks ignored)."""
    return len({(s.dim, s.axis) for s in a.shards} & {(s.dim, s.axis) for s in b.shards})


def _pick_grid(ctx: RuleContext, x: fx.Node, w: fx.Node | None = None,
               transposed: bool = False) -> tuple:
    """The grid whose x layout is closest to x's (3D alternates two); a weight already
    placed for one of them decides."""
    grids = GRIDS[ctx.mode]
    if w is not None and ctx.placed(w) is not None:
        for grid in grids:
            if _same_split(ctx.placed(w), role_layout(ctx, grid, "weight", 2,
                                                      transposed=transposed)) == 2:
                return grid
    layout = ctx.layout(x)
    ndim = len(ctx.shape(x))
    if not isinstance(layout, Layout):
        return grids[0]
    scores = [_same_split(layout, role_layout(ctx, g, "x", ndim)) for g in grids]
    return grids[scores.index(max(scores))]


def _comm(ctx: RuleContext, op: str, axis: str, nbytes, phase: str = "forward", times=1):
    return [CommOp(op, axis, phase, nbytes * times, ctx.node.name)]


def grid_linear(ctx: RuleContext) -> Strategy:
    """linear / Conv1D on the grid: SUMMA (2D, 2.5D) or gather-multiply-reduce-scatter (3D)."""
    node = ctx.node
    transposed = node.target is aten.addmm.default
    if transposed:
        bias, x, w = node.args[0], node.args[1], node.args[2]
    else:
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if ctx.hint() == ("replicate",):
        return replicate(ctx)
    grid = _pick_grid(ctx, x, w, transposed)
    hint = ctx.hint()
    groups = hint[1] if hint and hint[0] == "groups" else 1
    placed = ctx.placed(w)
    out_dim = 1 if transposed else 0
    if placed is not None and placed.shard_of_dim(out_dim) is not None:
        groups = placed.shard_of_dim(out_dim).groups
    nx = len(ctx.shape(x))
    needs_x = role_layout(ctx, grid, "x", nx)
    needs_w = role_layout(ctx, grid, "weight", 2, groups, transposed)
    w_shape = ctx.shape(w)
    for shard in needs_w.shards:
        g = shard.groups if shard.dim == out_dim else 1
        if not divisible(w_shape[shard.dim], ctx.sizes[shard.axis] * g):
            return replicate(ctx, note=f"weight dim {shard.dim} of {w_shape[shard.dim]} does "
                                       f"not split over the {ctx.mode} grid")
    needs = {x: Need(needs_x), w: Need(needs_w)}
    if bias is not None:
        needs[bias] = Need(role_layout(ctx, grid, "bias", 1, groups))
    out = role_layout(ctx, grid, "y", len(ctx.info.shape), groups)
    X, W = ctx.local_bytes(x, needs_x), ctx.local_bytes(w, needs_w)
    Y = ctx.local_bytes(node, out)
    rg = ctx.requires_grad
    x_grad, w_grad = bool(rg.get(x)), bool(rg.get(w))
    b_grad = bias is not None and bool(rg.get(bias))
    comm: list[CommOp] = []
    if ctx.mode == "3d":
        inp, wgt, outg = grid
        q = ctx.sizes[inp]
        comm += _comm(ctx, "all_gather", inp, X, times=q)
        comm += _comm(ctx, "all_gather", wgt, W, times=q)
        comm += _comm(ctx, "reduce_scatter", outg, Y, times=q)
        if x_grad or w_grad or b_grad:
            comm += _comm(ctx, "all_gather", outg, Y, "backward", q)
        if x_grad:
            comm += _comm(ctx, "reduce_scatter", inp, X, "backward", q)
        if w_grad:
            comm += _comm(ctx, "reduce_scatter", wgt, W, "backward", q)
        if b_grad:
            comm += _comm(ctx, "all_reduce", wgt, ctx.local_bytes(bias, needs[bias].layout),
                          "backward")
    else:
        row, col = grid[0], grid[1]
        dep = grid[2] if ctx.mode == "2.5d" else None
        q = ctx.sizes[row]
        comm += _comm(ctx, "broadcast", row, X, times=q)
        comm += _comm(ctx, "broadcast", col, W, times=q)
        if x_grad:
            comm += _comm(ctx, "broadcast", col, W, "backward", q)
            comm += _comm(ctx, "reduce", row, X, "backward", q)
        if w_grad:
            comm += _comm(ctx, "broadcast", row, X, "backward", q)
            comm += _comm(ctx, "reduce", col, W, "backward", q)
            if dep is not None:
                comm += _comm(ctx, "all_reduce", dep, W, "backward")
        if b_grad:
            B = ctx.local_bytes(bias, needs[bias].layout)
            comm += _comm(ctx, "all_reduce", col, B, "backward")
            if dep is not None:
                comm += _comm(ctx, "all_reduce", dep, B, "backward")
    return Strategy(f"{ctx.mode} linear", needs, out, comm=comm, rewrite="grid_linear",
                    args={"mode": ctx.mode, "grid": grid, "transposed": transposed})


def grid_norm(ctx: RuleContext) -> Strategy:
    """LayerNorm / RMSNorm over a hidden dim split on one axis: statistics all-reduced over
    it, weight and bias gradients over the axes that split the other dims."""
    node = ctx.node
    x, shape = node.args[0], node.args[1]
    if len(shape) != 1:
        return replicate(ctx)
    is_layer = node.target is aten.layer_norm.default
    args = list(node.args) + [None] * 5
    weight, bias = args[2], (args[3] if is_layer else None)
    eps = args[4] if is_layer else args[3]
    weight = node.kwargs.get("weight", weight)
    bias = node.kwargs.get("bias", bias) if is_layer else None
    eps = node.kwargs.get("eps", eps)
    nx = len(ctx.shape(x))
    layout = ctx.layout(x)
    hidden = layout.shard_of_dim(nx - 1) if isinstance(layout, Layout) else None
    if layout.partial or hidden is None or hidden.groups != 1 or \
            hidden.axis not in ctx.mesh.physical:
        layout = role_layout(ctx, _pick_grid(ctx, x), "x", nx)
        hidden = layout.shard_of_dim(nx - 1)
    h = hidden.axis
    if not divisible(ctx.shape(x)[-1], ctx.sizes[h]):
        return replicate(ctx, note=f"hidden size {ctx.shape(x)[-1]} does not split over "
                                   f"{ctx.sizes[h]}")
    replicas = tuple(s.axis for s in layout.shards if s.axis != h)
    needs = {x: Need(layout)}
    param_layout = Layout.replicated(1).with_shard(0, h)
    for p in (weight, bias):
        if isinstance(p, fx.Node):
            needs[p] = Need(param_layout)
    rows = ctx.local_bytes(x, layout) / (ctx.shape(x)[-1] / ctx.sizes[h])
    comm = _comm(ctx, "all_reduce", h, rows, times=2 if is_layer else 1)
    if ctx.requires_grad.get(x):
        comm += _comm(ctx, "all_reduce", h, rows, "backward", 2 if is_layer else 1)
    wants = sum(1 for p in (weight, bias) if isinstance(p, fx.Node) and ctx.requires_grad.get(p))
    if wants:
        for axis in replicas:
            comm += _comm(ctx, "all_reduce", axis, ctx.local_bytes(weight, param_layout),
                          "backward", wants)
    return Strategy(f"{ctx.mode} norm", needs, layout, comm=comm, rewrite="grid_norm",
                    args={"kind": "layer" if is_layer else "rms", "hidden": h,
                          "replicas": replicas, "eps": eps, "params": (weight, bias)})


def grid_embedding(ctx: RuleContext) -> Strategy:
    """The table split on hidden like activations: no forward communication; where the ids
    are split on batch, the table's gradient is summed over the batch-splitting axis."""
    w, ids = ctx.node.args[0], ctx.node.args[1]
    grid = GRIDS[ctx.mode][0]
    table = role_layout(ctx, grid, "embedding", 2)
    hidden = table.shard_of_dim(1)
    if not divisible(ctx.shape(w)[1], ctx.sizes[hidden.axis]):
        return replicate(ctx, note=f"embedding width {ctx.shape(w)[1]} does not split over "
                                   f"{ctx.sizes[hidden.axis]}")
    nids = len(ctx.shape(ids))
    ids_layout = Layout.replicated(nids)
    grads: tuple = ()
    if nids and _batch_like(ctx.shape(ids)[0]):
        ids_layout = role_layout(ctx, grid, "ids", nids)
        grads = tuple(s.axis for s in ids_layout.shards)
    out = Layout(nids + 1, tuple(sorted(ids_layout.shards + (Shard(nids, hidden.axis),))))
    needs = {w: Need(table, grads or False), ids: Need(ids_layout)}
    return Strategy(f"{ctx.mode} embedding", needs, out)


def grid_loss(ctx: RuleContext) -> Strategy:
    """Cross-entropy on logits split like a linear's output (batch and vocabulary): the
    vocabulary-parallel kernel, then the loss sum and count summed over the batch split."""
    node = ctx.node
    if node.target is not aten.cross_entropy_loss.default:
        return replicate(ctx)
    logits, target = node.args[0], node.args[1]
    weight, reduction, ignore, smoothing = cross_entropy_args(node)
    if len(ctx.shape(logits)) != 2 or weight is not None or smoothing or reduction != 1:
        return replicate(ctx)
    layout = ctx.layout(logits)
    vocab = layout.shard_of_dim(1) if isinstance(layout, Layout) else None
    batch = layout.shard_of_dim(0) if isinstance(layout, Layout) else None
    if layout.partial or vocab is None or vocab.groups != 1 or \
            (batch is not None and batch.groups != 1):
        layout = role_layout(ctx, GRIDS[ctx.mode][0], "y", 2)
        vocab, batch = layout.shard_of_dim(1), layout.shard_of_dim(0)
    if not divisible(ctx.shape(logits)[1], ctx.sizes[vocab.axis]):
        return replicate(ctx)
    target_layout = Layout.replicated(1)
    batch_axes: tuple = ()
    if batch is not None:
        target_layout = target_layout.with_shard(0, batch.axis)
        batch_axes = (batch.axis,)
    item = _itemsize(logits.meta["autopar"].dtype)
    rows = ctx.local_bytes(logits, layout) / (ctx.shape(logits)[1] / ctx.sizes[vocab.axis])
    comm = _comm(ctx, "all_reduce", vocab.axis, rows) + \
        _comm(ctx, "all_reduce", vocab.axis, rows, times=2)
    for axis in batch_axes:
        comm += _comm(ctx, "all_reduce", axis, 2 * item)
    needs = {logits: Need(layout), target: Need(target_layout)}
    return Strategy(f"{ctx.mode} vocab_parallel", needs, Layout.replicated(0), comm=comm,
                    rewrite="grid_cross_entropy",
                    args={"vocab": vocab.axis, "batch": batch_axes, "ignore_index": ignore})


MODE_RULES: dict[OpKind, Callable[[RuleContext], Strategy]] = {
    OpKind.LINEAR: grid_linear,
    OpKind.NORM: grid_norm,
    OpKind.EMBEDDING: grid_embedding,
    OpKind.LOSS: grid_loss,
}


# ------------------------------------------------------------------------------ dispatch

RULES: dict[OpKind, Callable[[RuleContext], Strategy]] = {
    OpKind.LINEAR: linear,
    OpKind.EMBEDDING: embedding,
    OpKind.NORM: norm,
    OpKind.ATTENTION: attention,
    OpKind.MATMUL: matmul,
    OpKind.SOFTMAX: softmax,
    OpKind.LOSS: loss,
    OpKind.DROPOUT: dropout,
    OpKind.REDUCTION: reduction,
    OpKind.ELEMENTWISE: elementwise,
    OpKind.VIEW: view,
}


# Ops the analysis does not classify (OpKind.OTHER), known to the catalog by their target.
TARGET_RULES: dict[object, Callable[[RuleContext], Strategy]] = {
    aten.cat.default: concat,
    aten.narrow.default: narrow,
}


def decide(ctx: RuleContext) -> Strategy:
    """The strategy of one op: its catalog rule, or replicated with the reason.

    In a 2D, 2.5D or 3D layer, linear layers, norms, embeddings and the loss take their mode
    rule. In a 1D layer, the 1D rules of those ops see their own axis only (other splits are
    gathered first). Every other rule runs once per axis the inputs are split over.
    """
    kind = ctx.info.kind
    cp = ctx.sizes.get(CP, 1)
    if ctx.mode == "replicate" or (ctx.size == 1 and cp == 1):
        return replicate(ctx)
    if ctx.mode in MULTI_D and kind in MODE_RULES:
        return MODE_RULES[kind](ctx)
    rule = TARGET_RULES.get(ctx.node.target) or RULES.get(kind)
    if rule is None and ctx.info.from_sizes:  # whole on every rank is what it is: no note
        return replicate(ctx)
    if rule is None:
        return replicate(ctx, note=f"no catalog entry for {ctx.node.target}; ran replicated")
    if kind in MODE_RULES:
        base = ctx.on_axis(ctx.axis)
        strategy = _normalized(rule(base), ctx.axis) if ctx.size > 1 else replicate(base)
        return with_tokens(ctx, strategy) if cp > 1 else strategy
    if ctx.node.target is operator.getitem:  # one output of a multi-output op, as it lies
        return view(ctx)
    return per_axis(ctx, rule)


def with_tokens(ctx: RuleContext, strategy: Strategy) -> Strategy:
    """A per-token op (linear, norm, embedding lookup) whose activation is split on a token
    dim over `cp` keeps that split: the activation and output carry it, and the gradients
    of the weights (whole on cp) are summed over cp. Other splits on cp are gathered by the
    strategy as it is (the loss: its logits and targets gathered)."""
    node, kind = ctx.node, ctx.info.kind
    if kind is OpKind.LINEAR:
        x = node.args[1] if node.target is aten.addmm.default else node.args[0]
        token_dims = len(ctx.shape(x)) - 1
    elif kind is OpKind.NORM:
        x = node.args[0]
        token_dims = len(ctx.shape(x)) - len(node.args[1])
    elif kind is OpKind.EMBEDDING:
        x = node.args[1]
        token_dims = len(ctx.shape(x))
    elif kind is OpKind.LOSS:
        return _token_loss(ctx, strategy)
    else:
        return strategy
    layout = ctx.layouts.get(x)
    shard = layout.shard_on(CP) if isinstance(layout, Layout) else None
    if shard is None or shard.dim >= token_dims or shard.groups > 1 or x not in strategy.needs:
        return strategy
    d, groups = shard.dim, shard.groups  # groups < 0: tokens flattened batch-major
    need_x = strategy.needs[x].layout
    if need_x.shard_of_dim(d) is not None or need_x.partial:
        return strategy
    x_len = ctx.shape(x)[d]

    def add(lay, shape):
        if not isinstance(lay, Layout) or len(shape) <= d or shape[d] != x_len or \
                lay.shard_of_dim(d) is not None:
            return lay
        return lay.with_shard(d, CP, groups)

    val = node.meta.get("val")
    if isinstance(strategy.out, list):
        out = [add(lay, tuple(v.shape)) if isinstance(v, torch.Tensor) else lay
               for lay, v in zip(strategy.out, val)]
    else:
        out = add(strategy.out, ctx.info.shape)
    comm = strategy.comm
    if out != strategy.out:  # the op's own collectives (a row linear's or vocabulary-parallel
        # embedding's all-reduce of its output) now move this rank's block of the tokens
        cp = ctx.sizes[CP]
        comm = [replace(c, bytes=c.bytes / cp) for c in comm]
    needs = {}
    for n, need in strategy.needs.items():
        if n is x:
            needs[n] = Need(need.layout.with_shard(d, CP, groups), need.sum_grads)
        elif ctx.requires_grad.get(n):
            needs[n] = Need(need.layout, tuple(dict.fromkeys(need.grad_axes(ctx.axis) + (CP,))))
        else:
            needs[n] = need
    return replace(strategy, needs=needs, out=out, comm=comm)


def _token_loss(ctx: RuleContext, strategy: Strategy) -> Strategy:
    """Mean cross-entropy of [tokens, vocab] logits whose rows are split over `cp` (a
    language model's [B, S, V] logits flattened with S split): each rank takes its rows
    (and, when the 1D rule split the vocabulary, its vocabulary slice), and the loss sum
    and row count are summed over cp, so no rank gathers the logits. Otherwise the 1D
    strategy as it is (its needs gather the rows)."""
    node = ctx.node
    if node.target is not aten.cross_entropy_loss.default or \
            strategy.name not in ("replicate", "vocab_parallel"):
        return strategy
    logits, target = node.args[0], node.args[1]
    weight, reduction, ignore, smoothing = cross_entropy_args(node)
    lay_x, lay_t = ctx.layouts.get(logits), ctx.layouts.get(target)
    if len(ctx.shape(logits)) != 2 or len(ctx.shape(target)) != 1 or weight is not None or \
            smoothing or reduction != 1 or not isinstance(lay_x, Layout) or \
            not isinstance(lay_t, Layout):
        return strategy
    rows, rows_t = lay_x.shard_on(CP), lay_t.shard_on(CP)
    if rows is None or rows_t is None or rows.dim != 0 or rows_t.dim != 0 or \
            rows.groups != rows_t.groups:
        return strategy
    cp = ctx.sizes[CP]
    vocab = strategy.name == "vocab_parallel"
    need_x = (strategy.needs[logits].layout if vocab else _rep(logits)).with_shard(
        0, CP, rows.groups)
    item = _itemsize(logits.meta["autopar"].dtype)
    comm = [replace(c, bytes=c.bytes / cp) for c in strategy.comm]
    comm += _comm(ctx, "all_reduce", CP, 2 * item)
    needs = {logits: Need(need_x), target: Need(_rep(target).with_shard(0, CP, rows.groups))}
    return Strategy("token_parallel" + (" vocab_parallel" if vocab else ""), needs,
                    Layout.replicated(0), comm=comm, rewrite="grid_cross_entropy",
                    args={"vocab": ctx.axis if vocab else None, "batch": (CP,),
                          "ignore_index": ignore})


def per_axis(ctx: RuleContext, rule: Callable[[RuleContext], Strategy]) -> Strategy:
    """Run a one-axis rule once per axis the inputs use and merge the strategies.

    Axes are taken in the order the inputs use them; an axis whose needs or output would put
    a second split on a dim, or reuse a physical mesh dim, is left out (its splits gathered,
    as if the rule had replicated on it).
    """
    axes: list[str] = []
    for n in tensor_inputs(ctx.node):
        for lay in _flat_layouts(ctx.layouts.get(n)):
            axes.extend(a for a in lay.axes if a not in axes)
    if len(axes) <= 1:
        axis = axes[0] if axes else ctx.axis
        return _normalized(rule(ctx.on_axis(axis)), axis)
    mesh = ctx.mesh or TensorMesh.one_d(ctx.axis, ctx.size)
    merged: Strategy | None = None
    for axis in axes:
        strategy = _normalized(rule(ctx.on_axis(axis)), axis)
        if strategy.name == "replicate":
            continue
        if merged is None:
            merged = strategy
            continue
        candidate = _merge(merged, strategy, mesh)
        if candidate is not None:
            merged = candidate
    return merged if merged is not None else replicate(ctx)


def _flat_layouts(layout) -> list[Layout]:
    if isinstance(layout, Layout):
        return [layout]
    if isinstance(layout, list):
        return [v for v in layout if isinstance(v, Layout)]
    return []


def _normalized(strategy: Strategy, axis: str) -> Strategy:
    """`sum_grads=True` spelled out as the axis the rule ran on."""
    for n, need in list(strategy.needs.items()):
        if need.sum_grads is True:
            strategy.needs[n] = Need(need.layout, (axis,))
    return strategy


def _merge(a: Strategy, b: Strategy, mesh: TensorMesh) -> Strategy | None:
    """Both strategies at once, or None when they clash on a dim or a physical mesh dim."""
    needs = {}
    for n in set(a.needs) | set(b.needs):
        na, nb = a.needs.get(n), b.needs.get(n)
        if na is None or nb is None:
            needs[n] = na or nb
            continue
        layout = _union(na.layout, nb.layout, mesh)
        if layout is None:
            return None
        grads = tuple(dict.fromkeys(na.grad_axes("") + nb.grad_axes("")))
        needs[n] = Need(layout, grads or False)
    out = _union(a.out, b.out, mesh)
    if out is None and a.out is not None:
        return None
    name = a.name if a.name == b.name else f"{a.name}+{b.name}"
    return Strategy(name, {n: needs[n] for n in list(a.needs) + [m for m in b.needs
                                                                  if m not in a.needs]},
                    out, a.comm + b.comm, a.rewrite or b.rewrite, a.note or b.note,
                    {**b.args, **a.args})


def _union(a, b, mesh: TensorMesh):
    if isinstance(a, list) and isinstance(b, list):
        out = [_union(x, y, mesh) for x, y in zip(a, b)]
        return None if any(o is None and x is not None for o, x in zip(out, a)) else out
    if not isinstance(a, Layout) or not isinstance(b, Layout):
        return a if a is not None else b
    shards = list(a.shards)
    partial = list(a.partial)
    for s in b.shards:
        if s in shards:
            continue
        used = [t.axis for t in shards] + partial
        if any(t.dim == s.dim for t in shards) or any(_overlap(mesh, s.axis, u) for u in used):
            return None
        shards.append(s)
    for p in b.partial:
        if p in partial:
            continue
        if any(_overlap(mesh, p, u) for u in [t.axis for t in shards] + partial):
            return None
        partial.append(p)
    return Layout(a.ndim, tuple(sorted(shards)), tuple(sorted(partial)))


def _overlap(mesh: TensorMesh, a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return mesh.overlap(a, b)
    except KeyError:
        return False
