"""Ops that keep an input's split: elementwise, softmax, dropout, reductions, concatenation
and narrow."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.graph.analysis import OpKind
from autopar.sharding.layout import Layout, Shard, divisible
from autopar.sharding.rules.context import RuleContext, follow, rep, replicate
from autopar.sharding.rules.registry import decides
from autopar.sharding.strategy import Need, Rewrite, Strategy

aten = torch.ops.aten


@decides(OpKind.SOFTMAX)
def softmax(ctx: RuleContext) -> Strategy:
    """Along a whole dim: the input's split kept; a split softmax dim is gathered."""
    x, dim = ctx.node.args[0], ctx.node.args[1]
    layout = ctx.layout(x)
    ndim = len(ctx.shape(x))
    if layout.partial or layout.shard_of_dim(dim % ndim) is not None:
        return replicate(ctx)
    return follow(ctx, x, layout)


@decides(OpKind.DROPOUT)
def dropout(ctx: RuleContext) -> Strategy:
    """Same random stream where the tensor is whole on the axis, a rank's own where split."""
    x = ctx.node.args[0]
    layout = ctx.layout(x)
    if layout.partial and ctx.sp:
        layout = ctx.sequence_split(x) or layout
    if layout.partial:
        return replicate(ctx)
    strategy = follow(ctx, x, layout, rewrite=Rewrite.STREAM_DROPOUT)
    strategy.needs[x] = Need(layout)
    return strategy


@decides(OpKind.REDUCTION)
def reduction(ctx: RuleContext) -> Strategy:
    """Sum or mean: a split on a kept dim stays, a sum over the split dim is a partial sum."""
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
                            rewrite=Rewrite.PARTIAL_MEAN)
        return replicate(ctx)
    new_dim = shard.dim if keepdim else shard.dim - sum(1 for d in dims if d < shard.dim)
    out = Layout.replicated(len(ctx.info.shape)).with_shard(new_dim, ctx.axis, shard.groups)
    return follow(ctx, x, out)


# one-input ops linear in their input: a partial sum stays one
_LINEAR_UNARY = (aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.clone.default,
                 aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.alias.default)


@decides(OpKind.ELEMENTWISE)
def elementwise(ctx: RuleContext) -> Strategy:
    """Broadcasting ops: inputs follow the first split input, partial sums only add up."""
    node = ctx.node
    inputs = ctx.inputs
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
        token = ctx.token_shard()
        if token is not None and divisible(ctx.seq, ctx.size):
            target_shard = token  # sequence parallel: partial sums reduce-scattered
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
        return Strategy("follow", {n: Need(rep(n)) for n in inputs}, out)
    needs = {}
    for n in inputs:
        shape = ctx.shape(n)
        d = target_shard.dim - (out_nd - len(shape))
        if d >= 0 and shape[d] != 1:
            needs[n] = Need(rep(n).with_shard(d, ctx.axis, target_shard.groups))
        else:  # broadcast along the split dim: each rank's gradient is a partial sum
            needs[n] = Need(rep(n), sum_grads=bool(ctx.requires_grad.get(n)))
    return Strategy("follow", needs, out.with_shard(target_shard.dim, ctx.axis,
                                                    target_shard.groups))

@decides(aten.cat.default)
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
                                   "runs replicated")
    layouts = [ctx.layout(p) for p in pieces]
    if any(lay.partial for lay in layouts):
        return replicate(ctx)
    shard = next((lay.shard_on(ctx.axis) for lay in layouts if lay.shard_on(ctx.axis)), None)
    out = Layout.replicated(ndim)
    if shard is None:
        return Strategy("follow", {p: Need(rep(p)) for p in pieces}, out)
    if shard.dim != dim:
        needs = {p: Need(rep(p).with_shard(shard.dim, ctx.axis, shard.groups)) for p in pieces}
        return Strategy("follow", needs, out.with_shard(shard.dim, ctx.axis, shard.groups))
    if len({ctx.shape(p)[dim] for p in pieces}) == 1:
        needs = {p: Need(rep(p).with_shard(dim, ctx.axis, shard.groups)) for p in pieces}
        return Strategy("blocks", needs,
                        out.with_shard(dim, ctx.axis, shard.groups * len(pieces)))
    return replicate(ctx, note=f"joins pieces of unequal sizes along dimension {dim}, which "
                               f"is split over '{ctx.axis}'; inputs gathered")


@decides(aten.narrow.default)
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
