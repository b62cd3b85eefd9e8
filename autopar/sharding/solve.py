"""Propagate layouts through a traced graph under a plan: the sharding solution.

Walks the graph once in order. Inputs arrive replicated over the tensor axis; each op's
catalog rule picks a strategy from its inputs' layouts; where an input's layout differs
from the one the strategy needs, a transition (a list of redistribution steps) is
recorded on that edge. A parameter takes the layout its first user asks for. When a rule
finds that a producer should have laid its output out differently (a fused QKV weight
that must be split in three blocks, a key projection with fewer heads than ranks), it
leaves a hint and the walk is repeated with the hint applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.errors import PlanError
from autopar.graph.analysis import OpKind
from autopar.graph.trace import TracedGraph
from autopar.sharding.catalog import RuleContext, decide, tensor_inputs
from autopar.sharding.layout import Layout, divisible
from autopar.sharding.redistribute import Step, steps_between
from autopar.sharding.strategy import CommOp, Need, Strategy

_MAX_PASSES = 6


@dataclass
class Transition:
    """Redistribution of one value to the layout some of its consumers need (done once)."""

    producer: fx.Node
    consumers: list[fx.Node]
    src: Layout
    need: Need
    steps: list[Step]
    comm: list[CommOp]


@dataclass
class Solution:
    """Layouts of every value, the strategy of every op, and every collective of one step."""

    axis: str
    size: int
    layouts: dict[fx.Node, object]
    strategies: dict[fx.Node, Strategy]
    transitions: list[Transition]
    params: dict[str, Layout]  # get_attr target -> layout
    requires_grad: dict[fx.Node, bool]
    modes: dict[str, str]  # layer -> mode used
    hints: dict = field(default_factory=dict)

    @property
    def comm(self) -> list[CommOp]:
        """Every collective of one forward and backward pass, in graph order."""
        out = []
        for node, strategy in self.strategies.items():
            for t in self.transitions:
                if t.consumers[0] is node:
                    out.extend(t.comm)
            out.extend(strategy.comm)
        out.extend(c for t in self.transitions if t.consumers[0].op == "output" for c in t.comm)
        return out

    def notes(self) -> list[str]:
        return [f"{n.name}: {s.note}" for n, s in self.strategies.items() if s.note]


def solve(traced: TracedGraph, *, axis: str = "tp", size: int = 1,
          modes: dict[str, str] | None = None, default_mode: str = "1d",
          fixed_params: dict[str, Layout] | None = None) -> Solution:
    """Layouts for `traced` with `size` ranks on `axis`, each layer in its plan mode."""
    modes = dict(modes or {})
    layer_modes = {layer.name: modes.get(layer.name, default_mode) for layer in traced.layers}
    hints: dict = {}
    for _ in range(_MAX_PASSES):
        new_hints: dict = {}
        solution = _walk(traced, axis, size, layer_modes, hints, new_hints, fixed_params or {})
        if not new_hints:
            solution.hints = hints
            return solution
        hints.update(new_hints)
    solution.hints = hints
    return solution


def _walk(traced, axis, size, layer_modes, hints, new_hints, fixed_params) -> Solution:
    layouts: dict[fx.Node, object] = {}
    strategies: dict[fx.Node, Strategy] = {}
    transitions: list[Transition] = []
    shared: dict[tuple, Transition] = {}
    params: dict[str, Layout] = dict(fixed_params)
    requires_grad: dict[fx.Node, bool] = {}
    for node in traced.graph.nodes:
        info = node.meta["autopar"]
        if node.op == "placeholder":
            layouts[node] = Layout.replicated(len(info.shape)) if info.shape is not None else None
            requires_grad[node] = False
            continue
        if node.op == "get_attr":
            if node.target in params:
                layouts[node] = params[node.target]
            pinfo = traced.params.get(node.target)
            requires_grad[node] = bool(pinfo and pinfo.is_parameter and pinfo.dtype.is_floating_point)
            continue
        inputs = tensor_inputs(node)
        requires_grad[node] = _requires_grad(node, inputs, requires_grad)
        if node.op == "output":
            strategy = Strategy("gather outputs", {n: Need(Layout.replicated(len(n.meta["autopar"].shape)))
                                                   for n in inputs}, None)
        elif info.kind is OpKind.SYMBOLIC:
            _check_symbolic(node, layouts, axis)
            strategies[node] = Strategy("symbolic", {}, None)
            continue
        else:
            ctx = RuleContext(node, axis, size, layer_modes.get(info.layer, "1d"), layouts, hints,
                              new_hints)
            strategy = decide(ctx)
        for producer, need in strategy.needs.items():
            if producer.op == "get_attr" and producer not in layouts:
                layouts[producer] = _place_param(traced, producer, need.layout, size, axis)
                params[producer.target] = layouts[producer]
            src = layouts[producer]
            if (producer, need) in shared:
                shared[(producer, need)].consumers.append(node)
                continue
            steps = steps_between(src, need, axis)
            if steps:
                nbytes = _bytes(producer)
                comm = [c for s in steps for c in s.comm(nbytes, requires_grad[producer], node.name)]
                shared[(producer, need)] = Transition(producer, [node], src, need, steps, comm)
                transitions.append(shared[(producer, need)])
        strategies[node] = strategy
        if node.op != "output":
            layouts[node] = strategy.out
    for node in traced.graph.nodes:
        if node.op == "get_attr" and node.target not in params and node.target in traced.params:
            params[node.target] = Layout.replicated(len(traced.params[node.target].shape))
    return Solution(axis, size, layouts, strategies, transitions, params, requires_grad,
                    dict(layer_modes))


def _place_param(traced: TracedGraph, node: fx.Node, wanted: Layout, size: int, axis: str) -> Layout:
    """A parameter takes the layout its first user wants if its dims split evenly."""
    shape = node.meta["autopar"].shape
    for shard in wanted.shards:
        if not divisible(shape[shard.dim], size * shard.groups):
            return Layout.replicated(len(shape))
    return wanted


def _requires_grad(node: fx.Node, inputs, requires_grad) -> bool:
    info = node.meta["autopar"]
    if info.dtype is None or not info.dtype.is_floating_point:
        val = node.meta.get("val")
        if not (isinstance(val, (list, tuple)) and any(
                isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in val)):
            return False
    if node.target is torch.ops.aten.detach.default:
        return False
    return any(requires_grad.get(n, False) for n in inputs)


def _bytes(node: fx.Node):
    import sympy

    info = node.meta["autopar"]
    item = torch.empty((), dtype=info.dtype).element_size()
    return sympy.Mul(*info.shape) * item


def _check_symbolic(node: fx.Node, layouts, axis: str) -> None:
    if node.target is torch.ops.aten.sym_size.int:
        src, dim = node.args[0], node.args[1]
        layout = layouts.get(src)
        if isinstance(layout, Layout) and layout.shard_of_dim(dim % max(layout.ndim, 1)):
            raise PlanError(f"{node.name} reads the size of dimension {dim} of {src.name}, which "
                            f"is split over '{axis}'; use a fixed size in the model or keep that "
                            "layer replicated.")
