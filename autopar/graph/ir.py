"""What tracing produces and analysis reads: the traced graph, its parameter table, the batch
symbol and the module path of the loss."""

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
