"""Mixed precision as a graph pass: the model computes in bf16 or fp16, the parameters
(the optimizer's masters) and the loss stay fp32.

`cast_precision` casts each floating parameter and graph input to the compute dtype where a
layer first reads it (the cast's backward returns fp32 gradients), runs what is computed from
them in that dtype, casts size-, constant- and buffer-made values (positions, masks, rotary
tables) where that stream reads them, and runs the loss part (`autopar.graph.ir.LOSS_MODULE`)
and returned values in the traced dtype. `comm_factors` scales each collective's bytes to match, so the
prediction stays equal to what the runtime logs. Run it after `apply_solution`, before the
collectives are bound.
"""

from __future__ import annotations

import dataclasses
import operator
from fractions import Fraction

import torch
import torch.fx as fx
from torch import nn

from autopar.errors import PlanError
from autopar.graph.analysis import OpKind
from autopar.modes import BF16, FP8, FP16, FP32
from autopar.passes.tensor_parallel import clone_graph_module
from autopar.sharding.strategy import Rewrite

aten = torch.ops.aten

# FP8 (autopar.modes): linears' GEMMs in float8 (autopar.passes.float8), the rest as bf16
PRECISIONS = {FP32: None, BF16: torch.bfloat16, FP16: torch.float16, FP8: torch.bfloat16}
"""`parallelize(precision=...)` names -> compute dtype (None: no cast, today's fp32)."""

LOSS_LAYER = "loss"  # the layer analyse gives the nodes the loss function added
CAST = "autopar_precision"  # node.meta key on the casts this pass inserts: "compute" | "loss"

_SIZE_OPS = {aten.sym_size.int, aten.sym_numel.default, aten.sym_stride.int}
_DTYPE_ARGS = {aten.to.dtype: 1, aten._to_copy.default: None, aten.to.dtype_layout: None}


def compute_dtype(precision: str) -> torch.dtype | None:
    """The compute dtype of a precision name, or PlanError naming the valid ones."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise PlanError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, not "
                        f"{precision!r}.")
    return PRECISIONS[precision]


def cast_precision(gm: fx.GraphModule, dtype: torch.dtype) -> fx.GraphModule:
    """A new GraphModule (sharing gm's tensors and submodules) whose model computes in
    `dtype` and whose loss part runs in the traced dtype (see the module docstring)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise PlanError(f"cast_precision needs torch.bfloat16 or torch.float16, not {dtype}.")
    out, _ = clone_graph_module(gm)
    graph = out.graph
    nodes = list(graph.nodes)
    traced = {node: _traced_dtype(node) for node in nodes}  # before any is retargeted
    stream = compute_stream(out)
    order = {node: i for i, node in enumerate(nodes)}
    for node in nodes:
        if node.op in ("get_attr", "placeholder") and node in stream:
            _cast_reads(graph, node, dtype, order, [
                u for u in node.users if _model_part(u) and u.target not in _SIZE_OPS])
        elif node in stream and node.op == "call_function":
            _retarget_dtypes(node, dtype)
        elif node.target is aten._assert_tensor_metadata.default and \
                node.args and node.args[0] in stream and _model_part(node):
            # asserts a stream value's (now 16-bit) dtype; the loss part's asserts (a loss
            # that calls .float() on the logits) read values cast back to the traced dtype
            _retarget_dtypes(node, dtype)
        elif _model_part(node) and _holds_floating(node, traced):  # made from no stream
            _cast_reads(graph, node, dtype, order, [u for u in node.users if u in stream])
    made: dict = {}
    for node in nodes:  # stream values the loss part reads, or the graph returns
        if node.op == "output" or (node.op != "placeholder" and _in_loss(node)):
            _cast_back(graph, node, traced, stream, made)
    graph.lint()
    out.recompile()
    return out


def compute_stream(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes that run in the compute dtype under `cast_precision`: floating parameters
    and graph inputs, and every floating value of the model part computed from one."""
    stream: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                value = operator.attrgetter(node.target)(gm)
            except AttributeError:
                continue
            if isinstance(value, nn.Parameter) and value.dtype.is_floating_point:
                stream.add(node)
        elif node.op == "placeholder":
            if _floating(node):
                stream.add(node)
        elif node.op != "output" and _model_part(node) and _holds_floating(node, {}) and \
                any(a in stream for a in node.all_input_nodes):
            stream.add(node)
    return stream


def _in_loss(node: fx.Node) -> bool:
    info = node.meta.get("autopar")
    return getattr(info, "layer", None) == LOSS_LAYER


def _model_part(node: fx.Node) -> bool:
    """An op of the model: not the loss function's, not the output."""
    return node.op != "output" and not _in_loss(node)


def _traced_dtype(node: fx.Node) -> torch.dtype | None:
    info = node.meta.get("autopar")
    dtype = getattr(info, "dtype", None)
    if dtype is None:
        val = node.meta.get("val")
        dtype = val.dtype if isinstance(val, torch.Tensor) else None
    return dtype


def _floating(node: fx.Node) -> bool:
    dtype = _traced_dtype(node)
    return dtype is not None and dtype.is_floating_point


def _holds_floating(node: fx.Node, traced: dict) -> bool:
    """A floating tensor, or a tuple holding one (a multi-output op read by getitem)."""
    dtype = traced.get(node) or _traced_dtype(node)
    if dtype is not None:
        return dtype.is_floating_point
    val = node.meta.get("val")
    return isinstance(val, (list, tuple)) and any(
        isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in val)


def _cast_reads(graph: fx.Graph, source: fx.Node, dtype: torch.dtype, order: dict,
                readers: list[fx.Node]) -> None:
    """`readers` read a cast of `source` instead: one cast per reading layer, placed just
    before that layer's first reader (not at the top where export hoists the get_attr
    nodes: a pass that gathers a layer's parameters in front of their first use, as
    ZeRO-3 does, then still gathers each layer when it runs), so a pipeline stage casts
    what it reads itself (a tied embedding read by the first and the last stage is cast on
    both, each gradient flowing to the one parameter)."""
    by_layer: dict[str | None, list[fx.Node]] = {}
    for user in readers:
        layer = getattr(user.meta.get("autopar"), "layer", None)
        by_layer.setdefault(layer, []).append(user)
    for layer, users in by_layer.items():
        with graph.inserting_before(min(users, key=order.__getitem__)):
            cast = graph.call_function(aten._to_copy.default, (source,), {"dtype": dtype})
        _describe(cast, source, dtype, layer, "compute")
        for user in users:
            user.replace_input_with(source, cast)


def _cast_back(graph: fx.Graph, node: fx.Node, traced: dict, stream: set,
               made: dict) -> None:
    """Each stream value `node` (a loss-part op, or the output) reads is read through a
    cast to its traced dtype, made once per value and reading part."""
    for arg in list(node.all_input_nodes):
        dtype = traced.get(arg)
        if arg not in stream or arg.op in ("get_attr", "placeholder") or dtype is None or \
                not dtype.is_floating_point:
            continue
        layer = LOSS_LAYER if node.op != "output" else getattr(
            arg.meta.get("autopar"), "layer", None)
        cast = made.get((arg, layer))
        if cast is None:
            with graph.inserting_after(arg):
                cast = graph.call_function(aten._to_copy.default, (arg,), {"dtype": dtype})
            _describe(cast, arg, dtype, layer, "loss")
            made[(arg, layer)] = cast
        node.replace_input_with(arg, cast)


def _describe(cast: fx.Node, source: fx.Node, dtype: torch.dtype, layer, role: str) -> None:
    """The cast's meta: the source's, in the reading layer, with the dtype it produces."""
    cast.meta = {k: v for k, v in source.meta.items() if k != CAST}
    info = source.meta.get("autopar")
    if info is not None:
        cast.meta["autopar"] = dataclasses.replace(
            info, kind=OpKind.ELEMENTWISE, dtype=dtype,
            layer=layer if layer is not None else info.layer)
    val = source.meta.get("val")
    if isinstance(val, torch.Tensor):
        cast.meta["val"] = val.to(dtype)
    cast.meta[CAST] = role


def _retarget_dtypes(node: fx.Node, dtype: torch.dtype) -> None:
    """A floating dtype named by a stream op (a conversion, an assert on a value's
    metadata) becomes the compute dtype, and so does the dtype its meta records."""
    kwargs = dict(node.kwargs)
    if isinstance(kwargs.get("dtype"), torch.dtype) and kwargs["dtype"].is_floating_point:
        kwargs["dtype"] = dtype
        node.kwargs = kwargs
    position = _DTYPE_ARGS.get(node.target)
    if position is not None and len(node.args) > position and \
            isinstance(node.args[position], torch.dtype) and \
            node.args[position].is_floating_point:
        args = list(node.args)
        args[position] = dtype
        node.args = tuple(args)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype.is_floating_point and val.dtype != dtype:
        node.meta["val"] = val.to(dtype)
    info = node.meta.get("autopar")
    if info is not None and info.dtype is not None and info.dtype.is_floating_point:
        node.meta["autopar"] = dataclasses.replace(info, dtype=dtype)


def comm_factors(solution, dtype: torch.dtype | None) -> list[tuple[object, Fraction]]:
    """Every collective of `solution` (in `Solution.comm`'s order) with the factor its bytes
    take when the graph runs under `cast_precision(dtype)` (1 everywhere for None).

    The catalog prices each collective at the traced dtype of the value it moves. A stream
    value (`compute_stream` on the traced graph) moves in `dtype`: factor itemsize(dtype)
    / itemsize(traced dtype); the loss part's values, values made from no stream (a mask,
    a rotary table) and integers move as traced: factor 1. A redistribution runs where its
    first consumer is (the rewrite puts it in that layer), so one feeding the loss moves
    the value cast back. Ring attention's dk, dv accumulators (`CommOp.accumulator`)
    travel in fp32 for 16-bit inputs: factor 1 from an fp32 trace."""
    one = Fraction(1)
    if dtype is None or not solution.strategies:
        return [(c, one) for c in solution.comm]
    stream = compute_stream(next(iter(solution.strategies)).graph.owning_module)

    def of(c, value: fx.Node, reader: fx.Node) -> Fraction:
        traced = _traced_dtype(value)
        if traced is None:
            return one
        if c.accumulator:  # float32, or the inputs' wider dtype, either way
            return Fraction(max(4, _itemsize(dtype)), max(4, _itemsize(traced)))
        if value not in stream or not _model_part(reader):
            return one
        return Fraction(_itemsize(dtype), _itemsize(traced))

    out = []
    for node, strategy in solution.strategies.items():
        for t in solution.transitions:
            if t.consumers[0] is node:
                out.extend((c, of(c, t.producer, node)) for c in t.comm)
        # an MoE layer's expert all-reduces move rows of its tokens' dtype (its output is a
        # tuple, which has none)
        moved = node.args[0] if strategy.rewrite is Rewrite.TENSOR_EXPERTS else node
        out.extend((c, of(c, moved, node)) for c in strategy.comm)
    out.extend((c, of(c, t.producer, t.producer)) for t in solution.transitions
               if t.consumers[0].op == "output" for c in t.comm)
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()
