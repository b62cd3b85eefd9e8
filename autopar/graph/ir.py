"""What tracing produces and analysis reads: the traced graph, its parameter table, the batch
symbol and the module path of the loss; and the copy of a graph's nodes its copies share."""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

BATCH = sympy.Symbol("B", integer=True, positive=True)
"""The symbol of the (micro-)batch size in every traced shape."""

LOSS_MODULE = "<loss>"
"""Module path of the nodes the loss function adds after the model."""


@dataclass(frozen=True)
class ParamInfo:
    """A parameter or buffer the graph reads with get_attr."""

    target: str  # attribute path inside the traced GraphModule
    names: tuple[str, ...]  # every key of the original model's state_dict that holds it
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_parameter: bool


@dataclass
class TracedGraph:
    """An aten-level graph of a model, with analysis attached by `autopar.graph.analyse`."""

    gm: fx.GraphModule
    tracer: str  # "export" or "fx"
    example_batch: int
    params: dict[str, ParamInfo]
    with_loss: bool
    fallback_reason: str | None = None
    layers: list = field(default_factory=list)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def info(self, node: fx.Node):
        return node.meta["autopar"]


def copy_nodes(src: fx.Graph, dst: fx.Graph, meta_value=None) -> dict[fx.Node, fx.Node]:
    """Every node of `src` appended to `dst` with the same name, op, target, type, arguments
    and meta (each meta value through `meta_value` when given); old node -> new node.

    The same nodes as `Graph.graph_copy` makes, made faster: graph_copy has `create_node`
    walk every argument for symbolic values, where each argument is set on its node here; and
    as each attribute set on a node costs a lookup-table update, the meta dict is filled in
    place."""
    nodes: dict[fx.Node, fx.Node] = {}
    copied = nodes.__getitem__
    for old in src.nodes:
        if old.op == "output":
            new = dst.output(fx.map_arg(old.args[0], copied), type_expr=old.type)
        else:
            new = dst.create_node(old.op, old.target, name=old.name, type_expr=old.type)
            if old.args:
                new.args = fx.map_arg(old.args, copied)
            if old.kwargs:
                new.kwargs = fx.map_arg(old.kwargs, copied)
        if meta_value is None:
            new.meta.update(old.meta)
        else:
            new.meta.update((k, meta_value(v)) for k, v in old.meta.items())
        nodes[old] = new
    return nodes
