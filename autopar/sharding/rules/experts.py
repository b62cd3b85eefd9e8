"""Mixture-of-experts layers under tensor parallelism: each expert's FFN split over 1D tp.

The engine's opaque MoE op (`autopar::moe`, one whole MoE layer; its MoESpec read from the
node's key) under 1D tensor parallelism splits every expert's FFN width F over tp, as
Megatron-Core's expert tensor parallelism: w1 and w3 (gate and up, [E, F, H]) by rows of F,
transformers' fused gate_up_proj [E, 2F, H] as its gate block and its up block separately
(S(tp)x2), w2 ([E, H, F]) by columns of F, and the shared expert's gate and up projections
by rows and its down projection by columns; the router and the shared expert's sigmoid gate
(and the router's biases) stay whole, so every tp rank routes the same tokens the same way (the ep groups lie inside
one tp index). The kernel (autopar.kernels.moe.MoE) sums the experts' partial output rows
over tp before the combine (an all-reduce of the T·k dispatched rows, and of the shared
expert's T rows) and, in the backward, the input's gradient from the routed experts and
from the shared expert (two all-reduces of T rows): the collectives this rule emits, which
the cost model prices (cost.layer) and the engine counts (runtime.accounting). A width that
does not split, or another tensor mode, keeps the layer whole on every tensor rank.

Under context parallelism the op is per token: an input split on its tokens over cp keeps
that split (its output likewise, no collective), as Megatron-Core routes a sequence's shards
as more tokens. The router's and shared expert's gradients (whole on cp) are summed over
cp; the routed experts' are not: they lie over ep groups inside dp x cp, whose all-to-all
already brought every token's gradient rows home, and are averaged over edp after the
backward (runtime.gradients).

The grouped matmuls of experts in a planner's trace of the model's own code run whole on
each tp rank (the runtime never runs them split); the cost model prices their layer as the
engine runs it, from the layer's expert record (cost.layer.expert_tensor_split).
"""

from __future__ import annotations

import sympy

from autopar.graph.analysis import OpKind
from autopar.graph.opaque import MOE_KEY_ARG, described
from autopar.modes import CP, TP_1D
from autopar.sharding.layout import Layout
from autopar.sharding.rules.context import RuleContext, itemsize, out_layouts, rep, replicate
from autopar.sharding.rules.registry import decides
from autopar.sharding.strategy import CommOp, Need, Rewrite, Strategy


@decides(OpKind.GROUPED_MM)
def grouped_experts(ctx: RuleContext) -> Strategy:
    """Every input whole, the experts' matmul runs unchanged."""
    return replicate(ctx)


@decides(OpKind.MOE)
def experts(ctx: RuleContext) -> Strategy:
    """1D: each expert's FFN split over tp (router and shared gate whole, tokens whole), the
    expert rows all-reduced before the combine; on cp: the tokens' split kept (`_tokens`);
    else every input whole."""
    spec = described(ctx.node.args[MOE_KEY_ARG])
    if ctx.axis == CP:
        return _tokens(ctx)
    if ctx.mode != TP_1D or ctx.size == 1:
        return replicate(ctx)
    if not spec.splits_over(ctx.size):
        return replicate(ctx, note=f"expert FFN width {spec.ffn} (shared {spec.shared_ffn}) "
                                   f"does not split over {ctx.size} ranks")
    x, gate, weights, shared = ctx.node.args[:4]
    needs = {n: Need(rep(n)) for n in (x, gate)}
    fused = spec.fused
    dims = ((1, 2), (2, 1)) if fused else ((1, 1), (1, 1), (2, 1))  # (dim, blocks) per weight
    for w, (dim, blocks) in zip(weights, dims, strict=True):
        needs[w] = Need(rep(w).with_shard(dim, ctx.axis, blocks))
    split = 3 if spec.shared_ffn else 0  # the shared expert's three, then the whole ones
    for w, dim in zip(shared[:split], (0, 0, 1)[:split], strict=True):
        needs[w] = Need(rep(w).with_shard(dim, ctx.axis))
    for w in shared[split:]:  # its sigmoid gate, the router's biases
        needs[w] = Need(rep(w))
    out = out_layouts(ctx, lambda shape: Layout.replicated(len(shape)))
    return Strategy("tensor_experts", needs, out, comm=_comm(ctx, spec),
                    rewrite=Rewrite.TENSOR_EXPERTS)


def _tokens(ctx: RuleContext) -> Strategy:
    """x split on a token dim over cp keeps it: each rank routes and runs its own tokens
    (output split alike, the balance loss whole); the gate's and shared expert's gradients
    summed over cp, the routed experts' not (see the module's docstring). Any other split on
    cp is gathered."""
    x, gate, weights, shared = ctx.node.args[:4]
    layout = ctx.layouts.get(x)
    shard = layout.shard_on(CP) if isinstance(layout, Layout) else None
    rank = len(ctx.shape(x))
    if shard is None or shard.groups != 1 or shard.dim >= rank - 1 or len(layout.axes) > 1:
        return replicate(ctx)
    d = shard.dim
    needs = {x: Need(rep(x).with_shard(d, CP))}
    for w in (gate, *shared):
        needs[w] = Need(rep(w), (CP,) if ctx.requires_grad.get(w) else False)
    for w in weights:
        needs[w] = Need(rep(w))
    out = out_layouts(ctx, lambda shape: Layout.replicated(len(shape)).with_shard(d, CP)
                      if len(shape) == rank else Layout.replicated(len(shape)))
    return Strategy("token_experts", needs, out)


def _comm(ctx: RuleContext, spec) -> list[CommOp]:
    """Forward: the T·k expert rows (and the shared expert's T rows) all-reduced; backward:
    the input's gradient from the routed experts and from the shared expert."""
    info = ctx.node.args[0].meta["autopar"]
    token_bytes = sympy.Mul(*info.shape) * itemsize(info.dtype)  # T rows of H
    forward = [token_bytes * spec.top_k] + ([token_bytes] if spec.shared_ffn else [])
    backward = [token_bytes] * (2 if spec.shared_ffn else 1)
    return [CommOp("all_reduce", ctx.axis, phase, nbytes, ctx.node.name)
            for phase, sizes in (("forward", forward), ("backward", backward))
            for nbytes in sizes]
