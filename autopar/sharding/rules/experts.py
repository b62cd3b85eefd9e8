"""Mixture-of-experts layers under tensor parallelism: whole on every tensor rank.

The engine's opaque MoE op (`autopar::moe`, one whole MoE layer) and the grouped matmuls of
experts in a planner's trace run on the whole hidden size on each tp rank: experts are split
over the ep axis inside the data ranks (autopar.passes.experts), never over tp, so their
weights and rows are replicated over tp, as the cost model prices them (cost.layer._moe).
"""

from __future__ import annotations

from autopar.graph.analysis import OpKind
from autopar.sharding.rules.context import RuleContext, replicate
from autopar.sharding.rules.registry import decides
from autopar.sharding.strategy import Strategy


@decides(OpKind.MOE, OpKind.GROUPED_MM)
def experts(ctx: RuleContext) -> Strategy:
    """Every input whole, the layer (or the experts' matmul) runs unchanged."""
    return replicate(ctx)
