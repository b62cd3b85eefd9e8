"""Layer and RMS norms under 1D: statistics over the last dims, fine while those are whole."""

from __future__ import annotations

import torch

from autopar.graph.analysis import OpKind
from autopar.sharding.rules.context import RuleContext, follow, replicate
from autopar.sharding.rules.registry import decides
from autopar.sharding.strategy import Need, Strategy

aten = torch.ops.aten


@decides(OpKind.NORM)
def norm(ctx: RuleContext) -> Strategy:
    """Statistics over the last dims: fine while those dims are whole."""
    x = ctx.node.args[0]
    k = len(ctx.node.args[1])
    layout = ctx.layout(x)
    ndim = len(ctx.shape(x))
    if layout.partial and ctx.sp:
        layout = ctx.sequence_split(x)
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
