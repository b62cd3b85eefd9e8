"""Analyse a traced graph: the kind of every op, its global shape, its layer, repeated layers.

Shapes are tuples of sympy expressions in the batch symbol `BATCH`, so costs can be
evaluated for any micro-batch. Layers group nodes by module path up to the first numeric
component (`blocks.3.attn.c_attn` belongs to layer `blocks.3`); layers with the same
structure and shapes share a `group` and are priced once.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from autopar.graph.ir import BATCH, LOSS_MODULE, TracedGraph
from autopar.graph.opaque import MOE_OP_NAME

aten = torch.ops.aten


class OpKind(enum.Enum):
    INPUT = "input"
    PARAM = "param"
    OUTPUT = "output"
    LINEAR = "linear"  # matmul with a weight operand: linear, addmm on a parameter
    MATMUL = "matmul"  # activation x activation
    GROUPED_MM = "grouped_mm"  # experts' matmuls over rows grouped by expert (MoE)
    MOE = "moe"  # one whole MoE layer as the engine traces it: the opaque op autopar::moe
    ATTENTION = "attention"
    NORM = "norm"
    EMBEDDING = "embedding"
    LOSS = "loss"
    SOFTMAX = "softmax"
    ELEMENTWISE = "elementwise"
    VIEW = "view"
    REDUCTION = "reduction"
    DROPOUT = "dropout"
    SYMBOLIC = "symbolic"  # integer arithmetic on sizes
    OTHER = "other"


_ELEMENTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add_.Tensor,
    aten.mul_.Tensor, aten.gelu.default, aten.relu.default, aten.silu.default, aten.tanh.default,
    aten.sigmoid.default, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.sqrt.default,
    aten.neg.default, aten.exp.default, aten.add.Scalar, aten.mul.Scalar, aten.div.Scalar,
    aten.sub.Scalar, aten.rsub.Scalar, aten.masked_fill.Scalar, aten.where.self, aten.clone.default,
    aten.to.dtype, aten._to_copy.default, aten.type_as.default, aten.erf.default, aten.abs.default,
    aten.relu_.default, aten.gelu_.default, aten.silu_.default, aten.cos.default, aten.sin.default,
    aten.maximum.default, aten.minimum.default, aten.log.default, aten.alias.default,
    aten.to.dtype_layout, aten.to.device, aten.lift_fresh_copy.default, aten.detach.default,
}
_VIEW = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
    aten.permute.default, aten.t.default, aten.contiguous.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.chunk.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.flatten.using_ints, aten.expand.default,
    aten.slice.Tensor, aten.select.int, aten.unbind.int, aten.unflatten.int,
    operator.getitem,
}
_REDUCTION = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.sum.default,
              aten.mean.default, aten.var.correction}
_NORM = {aten.layer_norm.default, aten.rms_norm.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default, aten.log_softmax.int,
            aten._log_softmax.default}
_LOSS = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.mse_loss.default}
_MATMUL = {aten.matmul.default, aten.bmm.default, aten.mm.default, aten.baddbmm.default}
_SYMBOLIC = {aten.sym_size.int, operator.mul, operator.floordiv, operator.add, operator.sub,
             aten.sym_numel.default}


@dataclass(frozen=True)
class NodeInfo:
    """What autopar knows about one node."""

    kind: OpKind
    module: str  # module path in the original model ("" for the root, the loss)
    layer: str
    shape: tuple | None  # global shape as sympy expressions in BATCH; None for non-tensors
    dtype: torch.dtype | None
    # made from sizes, constants and buffers alone (transformers' position aranges and the
    # masks built from them): the same whole value on every rank, never an input's value
    from_sizes: bool = False


@dataclass
class Layer:
    """Consecutive nodes of one module subtree (a transformer block, an embedding, the loss)."""

    name: str
    nodes: list[fx.Node] = field(default_factory=list)
    group: int = 0  # layers with the same group are structurally identical

    @property
    def params(self) -> list[str]:
        return [n.target for n in self.nodes if n.op == "get_attr"]


def analyse(traced: TracedGraph) -> TracedGraph:
    """Attach a NodeInfo to every node (node.meta["autopar"]) and fill traced.layers."""
    batch_symbol = traced.gm.meta["autopar_batch_symbol"]
    layer_of_param = _param_layers(traced.gm)
    layers: dict[str, Layer] = {}
    for node in traced.gm.graph.nodes:
        module = node.meta.get("autopar_module", "")
        if node.op == "get_attr":
            module = layer_of_param.get(node.name, "")
        layer = _layer_name(module, node)
        info = NodeInfo(kind=_kind(node, traced), module=module, layer=layer,
                        shape=_shape(node, batch_symbol), dtype=_dtype(node),
                        from_sizes=_from_sizes(node, traced))
        node.meta["autopar"] = info
        if (node.op == "call_function" and info.kind is not OpKind.SYMBOLIC) or \
                (node.op == "get_attr" and node.users):
            layers.setdefault(layer, Layer(layer)).nodes.append(node)
    traced.layers = _order(list(layers.values()), _position(traced.gm))
    _group_repeated(traced.layers)
    return traced


def _param_layers(gm: fx.GraphModule) -> dict[str, str]:
    """A parameter belongs to the layer of its first user (tied weights: the first use)."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.users:
            first = min(node.users, key=_position(gm))
            out[node.name] = first.meta.get("autopar_module", "")
        elif node.op == "get_attr":
            out[node.name] = ""
    return out


def _position(gm: fx.GraphModule):
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    return index.__getitem__


def _layer_name(module: str, node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    if module == LOSS_MODULE:
        return "loss"
    if not module:
        return "root"
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return module


def _order(layers: list[Layer], position) -> list[Layer]:
    """Layers in the order their first computation runs (parameters are all hoisted to the top)."""
    def first(layer: Layer) -> int:
        calls = [position(n) for n in layer.nodes if n.op == "call_function"]
        return min(calls) if calls else min(position(n) for n in layer.nodes)
    return sorted(layers, key=first)


def _group_repeated(layers: list[Layer]) -> None:
    signatures: dict[tuple, int] = {}
    for layer in layers:
        sig = _signature(layer)
        layer.group = signatures.setdefault(sig, len(signatures))


def _signature(layer: Layer) -> tuple:
    local = {n: i for i, n in enumerate(layer.nodes)}

    def arg(a):
        if isinstance(a, fx.Node):
            if a in local:
                return ("local", local[a])
            return ("outside", a.meta["autopar"].shape)
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        return a if isinstance(a, (int, float, bool, str, type(None))) else str(a)

    items = []
    for node in layer.nodes:
        info = node.meta["autopar"]
        target = node.target if node.op == "call_function" else "param"
        items.append((str(target), info.shape, str(info.dtype), arg(node.args),
                      tuple(sorted((k, arg(v)) for k, v in node.kwargs.items()))))
    return tuple(items)


def _kind(node: fx.Node, traced: TracedGraph) -> OpKind:
    if node.op == "placeholder":
        return OpKind.INPUT
    if node.op == "output":
        return OpKind.OUTPUT
    if node.op == "get_attr":
        return OpKind.PARAM
    target = node.target
    if target in (aten.linear.default,):
        return OpKind.LINEAR
    if target is aten.addmm.default and _is_param(node.args[2]):
        return OpKind.LINEAR
    if target in _MATMUL or target is aten.addmm.default:
        return OpKind.MATMUL
    if target is aten._grouped_mm.default:
        return OpKind.GROUPED_MM
    if isinstance(target, torch._ops.OpOverload) and target.name() == MOE_OP_NAME:
        return OpKind.MOE  # its MoESpec: graph.opaque.described(node.args[MOE_KEY_ARG])
    if target is aten.scaled_dot_product_attention.default:
        return OpKind.ATTENTION
    if target in _NORM:
        return OpKind.NORM
    if target is aten.embedding.default:
        return OpKind.EMBEDDING
    if target in _LOSS:
        return OpKind.LOSS
    if target in _SOFTMAX:
        return OpKind.SOFTMAX
    if target in (aten.dropout.default, aten.native_dropout.default):
        return OpKind.DROPOUT
    if target in _VIEW:
        return OpKind.VIEW
    if target in _REDUCTION:
        return OpKind.REDUCTION
    if target in _ELEMENTWISE:
        return OpKind.ELEMENTWISE
    if target in _SYMBOLIC or not isinstance(node.meta.get("val"), torch.Tensor) and \
            not isinstance(node.meta.get("val"), (list, tuple)):
        return OpKind.SYMBOLIC
    return OpKind.OTHER


def node_label(node: fx.Node) -> str:
    """How a report names a node: the module that runs it and its op (`blocks.1.moe.gate
    (linear)`), which a reader finds in the model, rather than the trace's `linear_17`."""
    info = node.meta.get("autopar")
    module = info.module if info is not None else node.meta.get("autopar_module", "")
    if not module:
        return node.name
    op = getattr(node.target, "_opname", None) or getattr(node.target, "__name__", node.name)
    return f"{module} ({op})"


def _from_sizes(node: fx.Node, traced: TracedGraph) -> bool:
    """Whether `node` is computed from sizes, constants and buffers only (its inputs already
    analysed): no input value, parameter or random number reaches it."""
    if node.op != "call_function":
        return False
    if node.target in (aten.sym_size.int, aten.sym_numel.default):
        return True
    if not isinstance(node.meta.get("val"), (torch.Tensor, torch.SymInt, int)) or \
            torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
        return False
    for a in node.all_input_nodes:
        if a.meta["autopar"].from_sizes:
            continue
        buffer = traced.params.get(a.target) if a.op == "get_attr" else None
        if buffer is None or buffer.is_parameter:
            return False
    return True


def _is_param(a) -> bool:
    return isinstance(a, fx.Node) and a.op == "get_attr"


def _shape(node: fx.Node, batch_symbol) -> tuple | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(to_expr(d, batch_symbol) for d in val.shape)


def to_expr(dim, batch_symbol) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression in BATCH."""
    if isinstance(dim, torch.SymInt):
        return sympy.sympify(dim.node.expr).subs(batch_symbol, BATCH)
    return sympy.Integer(int(dim))


def _dtype(node: fx.Node):
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None
