"""Megatron 1D linear layers (Shoeybi et al. 2019: column then row split) and
activation x activation matmuls."""

from __future__ import annotations

import torch

from autopar.graph.analysis import OpKind
from autopar.modes import TP_1D
from autopar.sharding.layout import Layout, divisible
from autopar.sharding.rules.context import RuleContext, rep, replicate, shard_dim
from autopar.sharding.rules.registry import decides
from autopar.sharding.strategy import Need, Rewrite, Strategy

aten = torch.ops.aten


@decides(OpKind.LINEAR)
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
    if ctx.mode != TP_1D or ctx.hint() == ("replicate",):
        return replicate(ctx)
    w_shape = ctx.shape(w)
    x_layout = ctx.layout(x)
    x_shard = x_layout.shard_on(ctx.axis)
    last = len(ctx.shape(x)) - 1
    fixed_w = ctx.placed(w)
    if x_shard is not None and x_shard.dim == last and not x_layout.partial \
            and divisible(w_shape[in_dim], ctx.size * x_shard.groups):
        needs = {x: Need(x_layout), w: Need(rep(w).with_shard(in_dim, ctx.axis, x_shard.groups))}
        if ctx.sp:  # sequence parallel: a partial sum, reduce-scattered where it is consumed
            if bias is not None:  # added once (on rank 0); its gradient summed over the axis
                needs[bias] = Need(rep(bias), sum_grads=bool(ctx.requires_grad.get(bias)))
            out = Layout.replicated(len(ctx.info.shape)).with_partial(ctx.axis)
            return Strategy("row", needs, out, rewrite=Rewrite.PARTIAL_LINEAR)
        if bias is not None:
            needs[bias] = Need(rep(bias))
        out = Layout.replicated(len(ctx.info.shape))
        return Strategy("row", needs, out, comm=[ctx.comm("all_reduce", node)],
                        rewrite=Rewrite.ROW_LINEAR)
    hint = ctx.hint()
    groups = hint[1] if hint and hint[0] == "groups" else 1
    if fixed_w is not None and fixed_w.shard_on(ctx.axis) is not None and \
            fixed_w.shard_on(ctx.axis).dim == out_dim:
        groups = fixed_w.shard_on(ctx.axis).groups
    if divisible(w_shape[out_dim], ctx.size * groups):
        # a view before this linear that gathered a sequence split already sums the gradient
        needs = {x: Need(rep(x), sum_grads=x not in ctx.grad_summed),
                 w: Need(rep(w).with_shard(out_dim, ctx.axis, groups))}
        if bias is not None:
            needs[bias] = Need(rep(bias).with_shard(0, ctx.axis, groups))
        out = Layout.replicated(len(ctx.info.shape)).with_shard(-1, ctx.axis, groups)
        return Strategy("column", needs, out)
    if x in ctx.grad_summed:  # the gradient is whole here: gather without summing it
        ctx.new_hints[x.name] = ("gather",)
    return replicate(ctx, note=f"output features {w_shape[out_dim]} do not split over "
                               f"{ctx.size} ranks")

@decides(OpKind.MATMUL)
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
    da, db = shard_dim(ctx, a), shard_dim(ctx, b)
    out = Layout.replicated(nout)
    for d, n in ((da, na), (db, nb)):
        if d is not None and d < n - 2:  # a batch dim: split the other operand alike
            od = d + nout - n
            needs = {}
            for operand, m in ((a, na), (b, nb)):
                od_in = od - (nout - m)
                if od_in >= 0 and ctx.shape(operand)[od_in] != 1:
                    needs[operand] = Need(rep(operand).with_shard(od_in, ctx.axis))
                else:
                    needs[operand] = Need(rep(operand))
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
