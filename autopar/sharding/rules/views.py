"""Shape-only ops (views, reshapes, transposes, slices, splits): where the split dim lands."""

from __future__ import annotations

import functools
import operator

import sympy
import torch
import torch.fx as fx

from autopar.graph.analysis import OpKind
from autopar.modes import CP
from autopar.sharding.layout import Layout, Shard, divisible
from autopar.sharding.rules.context import (
    RuleContext,
    batch_like,
    follow,
    out_layouts,
    rep,
    replicate,
)
from autopar.sharding.rules.registry import decides
from autopar.sharding.strategy import Need, Rewrite, Strategy

aten = torch.ops.aten


_IDENTITY_VIEWS = {aten.contiguous.default, aten.clone.default, aten.alias.default,
                   aten.detach.default, aten.lift_fresh_copy.default}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.flatten.using_ints, aten.unflatten.int}
_SHAPE_ONLY = _IDENTITY_VIEWS | _RESHAPES | {aten.transpose.int, aten.permute.default,
                                             aten.t.default, aten.unsqueeze.default,
                                             aten.squeeze.dim, aten.squeeze.dims}


@decides(OpKind.VIEW)
def view(ctx: RuleContext) -> Strategy:
    """Shape-only ops carry the split dimension along, or gather when they cannot."""
    node = ctx.node
    target = node.target
    if target is operator.getitem:
        source = ctx.layout(node.args[0])
        if isinstance(source, list):
            return Strategy("follow", {}, source[node.args[1]])
        return replicate(ctx)
    x = node.args[0]
    layout = ctx.layout(x)
    if ctx.sp and isinstance(layout, Layout) and layout.partial and not layout.shards and \
            target in _SHAPE_ONLY:  # a view of a partial sum is a partial sum
        return follow(ctx, x, Layout(len(ctx.info.shape), (), layout.partial))
    if layout is None or layout.partial:
        return replicate(ctx)
    shard = layout.shard_on(ctx.axis)
    in_shape = ctx.shape(x)
    if shard is None:
        return follow(ctx, x, out_layouts(ctx, lambda s: Layout.replicated(len(s))))
    if target in _IDENTITY_VIEWS:
        return follow(ctx, x, layout)
    out_shape = ctx.info.shape
    if target in _RESHAPES:
        return _reshape(ctx, x, shard)
    if target in (aten.transpose.int, aten.permute.default, aten.t.default):
        nd = len(in_shape)
        if target is aten.permute.default:
            order = [d % nd for d in node.args[1]]
        else:
            d0, d1 = (node.args[1] % nd, node.args[2] % nd) if target is aten.transpose.int \
                else (0, 1)
            order = list(range(nd))
            order[d0], order[d1] = order[d1], order[d0]
        return follow(ctx, x, Layout.replicated(nd).with_shard(order.index(shard.dim), ctx.axis,
                                                                shard.groups))
    if target is aten.unsqueeze.default:
        d = node.args[1] % (len(in_shape) + 1)
        new_dim = shard.dim + (1 if d <= shard.dim else 0)
        return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(new_dim, ctx.axis,
                                                                            shard.groups))
    if target in (aten.squeeze.dim, aten.squeeze.dims):
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = {d % len(in_shape) for d in dims if in_shape[d % len(in_shape)] == 1}
        new_dim = shard.dim - sum(1 for d in dims if d < shard.dim)
        return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(new_dim, ctx.axis,
                                                                            shard.groups))
    if target is aten.expand.default:
        new_dim = shard.dim + len(out_shape) - len(in_shape)
        return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(
            new_dim, ctx.axis, shard.groups), rewrite=Rewrite.LOCAL_SIZES)
    if target is aten.slice.Tensor:
        return _slice(ctx, x, layout, shard)
    if target is aten.select.int:
        dim = node.args[1] % len(in_shape)
        if dim == shard.dim:
            return replicate(ctx)
        new_dim = shard.dim - (1 if dim < shard.dim else 0)
        return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(new_dim, ctx.axis,
                                                                            shard.groups))
    if target in (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default):
        return _split(ctx, x, layout, shard)
    return replicate(ctx)


def _reshape(ctx: RuleContext, x: fx.Node, shard: Shard) -> Strategy:
    """A reshape of `x` split by `shard`: the split carried to the dim it lands in, else the
    sequence split gathered or flattened per sample, else replicated."""
    node = ctx.node
    in_shape, out_shape = ctx.shape(x), ctx.info.shape
    if _cp_rows(ctx, shard.axis):  # [B*S, ...] over cp's runs and a grid's batch axis
        back, _ = reshape_shard(in_shape, out_shape, shard, ctx.sizes[CP])
        if back is not None and back.dim >= 1 and back.groups == 1:  # to [B, S, ...]
            batch = ctx.mesh.composite(ctx.mesh.components(shard.axis)[1:])
            return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(
                back.dim - 1, batch).with_shard(back.dim, CP), rewrite=Rewrite.LOCAL_SIZES)
        return replicate(ctx)
    new, groups_needed = reshape_shard(in_shape, out_shape, shard, ctx.size)
    if new is not None:
        return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(
            new.dim, ctx.axis, new.groups), rewrite=Rewrite.LOCAL_SIZES)
    if groups_needed and ctx.ask_producer(x, ("groups", groups_needed)):
        return replicate(ctx)
    if ctx.sp and shard.dim == ctx.seq_dim(x) and ctx.hint() != ("gather",) and \
            node.users and all(u.meta["autopar"].kind is OpKind.LINEAR for u in node.users):
        # [B, S, H] split on S flattened to tokens for linears (Conv1D): gathered here with
        # the gradient reduce-scattered, so the column linears after it sum nothing more
        ctx.grad_summed.add(node)
        return Strategy("gather", {x: Need(rep(x), sum_grads=True)},
                        Layout.replicated(len(out_shape)))
    if ctx.sp and shard.dim == ctx.seq_dim(x):
        # [B, S, H] split on S flattened to [B*S, H] for ops other than linears (OPT's MLP
        # block: a norm and a residual): each sample's run of S tokens split alike
        flat, _ = reshape_shard(in_shape, out_shape, shard, ctx.size, flatten=(ctx.axis,))
        if flat is not None:
            return follow(ctx, x, Layout.replicated(len(out_shape)).with_shard(
                flat.dim, ctx.axis, flat.groups), rewrite=Rewrite.LOCAL_SIZES)
    if ctx.axis != CP:  # the sequence split is gathered here; the producer keeps it
        ctx.ask_producer(x, ("replicate",))
    return replicate(ctx)


def _cp_rows(ctx: RuleContext, axis: str) -> bool:
    """Whether `axis` is cp and a grid's batch axis over one flattened dim (`cp_batch`)."""
    mesh = ctx.mesh
    return mesh is not None and axis in mesh.composites and \
        mesh.components(axis)[0] == CP and not mesh.has_group(axis)


def _slice(ctx: RuleContext, x: fx.Node, layout: Layout, shard: Shard) -> Strategy:
    """A slice keeps the layout unless it cuts the split dim."""
    node = ctx.node
    in_shape = ctx.shape(x)
    dim = node.args[1] % len(in_shape) if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    whole = start in (0, None) and step == 1 and (
        end is None or (isinstance(end, int) and sympy.sympify(in_shape[dim]).is_number
                        and end >= int(in_shape[dim])) or end >= 2 ** 62)
    if dim != shard.dim or whole:
        return follow(ctx, x, layout)
    return replicate(ctx)


def _split(ctx: RuleContext, x: fx.Node, layout: Layout, shard: Shard) -> Strategy:
    node = ctx.node
    nd = len(ctx.shape(x))
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    pieces = [tuple(v.shape) for v in node.meta["val"]]
    if dim != shard.dim:
        return follow(ctx, x, [layout for _ in pieces])
    equal = len({p[dim] for p in pieces}) == 1
    if equal and shard.groups == len(pieces):
        outs = [Layout.replicated(nd).with_shard(dim, ctx.axis) for _ in pieces]
        return follow(ctx, x, outs, rewrite=Rewrite.LOCAL_SIZES)
    if equal and shard.groups == 1 and ctx.ask_producer(x, ("groups", len(pieces))):
        return replicate(ctx)
    return replicate(ctx)


def reshape_shard(in_shape, out_shape, shard: Shard, parts: int, flatten=(CP,)):
    """Where a split dimension lands after a reshape.

    Returns (Shard, None) when it lands on an output dimension, or (None, g) when it would
    land there if the input were split in `g` blocks, or (None, None) when it cannot.
    The split dimension (size n, in `groups` blocks, each block split in `parts`) sits in a
    run of input dims that maps to a run of output dims with the same product. Counting the
    blocks of that run, G = (product of the run before the split dim) x groups, the split
    lands on output dim t of the run if the product A of the output run before t divides G
    and (G / A) x parts divides the size of t. A split right after the batch flattened with
    it (`_flatten_samples`) lands only for the axes in `flatten`.
    """
    run = _matching_runs(in_shape, out_shape)
    for ins, outs in run:
        if shard.dim not in ins:
            continue
        if shard.groups < 0:
            return _unflatten_samples(in_shape, out_shape, ins, outs, shard, parts), None
        prefix_in = sympy.Mul(*[in_shape[d] for d in ins if d < shard.dim])
        if not prefix_in.is_number:
            if shard.axis not in flatten:
                return None, None
            return _flatten_samples(in_shape, out_shape, ins, outs, shard, parts), None
        blocks = int(prefix_in) * shard.groups
        prefix_out = 1
        for t in outs:
            size = out_shape[t]
            if not sympy.sympify(size).is_number:
                # a batch dim leading its run: B -> B x T or back, the split stays leading
                if prefix_out == 1 and blocks == 1 and batch_like(size) and \
                        batch_like(in_shape[shard.dim]):
                    return Shard(t, shard.axis, 1), None
                return None, None
            size = int(size)
            if blocks % prefix_out == 0 and size % ((blocks // prefix_out) * parts) == 0:
                return Shard(t, shard.axis, blocks // prefix_out), None
            prefix_out *= size
        # not representable: the smallest block count that would be, off the innermost dim
        prefix_out = 1
        for t in outs[:-1]:
            size = int(out_shape[t])
            if prefix_out % blocks == 0 and prefix_out % int(prefix_in) == 0 \
                    and size % parts == 0 and prefix_out > blocks:
                return None, prefix_out // int(prefix_in)
            prefix_out *= size
        return None, None
    return None, None


def _flatten_samples(in_shape, out_shape, ins, outs, shard: Shard, parts: int):
    """[B, S, ...] split on S (right after the batch) over cp flattened into one dim
    [B*S*...]: a batch-major split with runs of S*... elements per sample (groups -r), or
    None. (Megatron-SP's sequence splits over tp reach it only from the view rule: those
    feeding linears alone are gathered at the view instead.)"""
    run = sympy.Mul(*[in_shape[d] for d in ins[1:]])
    if shard.groups != 1 or len(outs) != 1 or len(ins) < 2 or \
            shard.dim != ins[1] or not batch_like(in_shape[ins[0]]) or not run.is_number or \
            not divisible(in_shape[shard.dim], parts):
        return None
    return Shard(outs[0], shard.axis, -int(run))


def _unflatten_samples(in_shape, out_shape, ins, outs, shard: Shard, parts: int):
    """The inverse of `_flatten_samples`: [B*r] back to [B, S, ...] with S split, or None."""
    run = sympy.Mul(*[out_shape[d] for d in outs[1:]])
    if len(ins) != 1 or len(outs) < 2 or not batch_like(out_shape[outs[0]]) or \
            not run.is_number or int(run) != -shard.groups or \
            not divisible(out_shape[outs[1]], parts):
        return None
    return Shard(outs[1], shard.axis, 1)


def _matching_runs(in_shape, out_shape):
    """Pair runs of input dims with runs of output dims of equal product (size-1 dims dropped)."""
    return _runs(tuple(in_shape), tuple(out_shape))


@functools.lru_cache(maxsize=4096)
def _runs(in_shape: tuple, out_shape: tuple) -> tuple:
    """`_matching_runs` of two shapes: the same reshape recurs in every layer and every solve
    of a start (and sympy's simplify is most of its cost), so each pair is worked out once."""
    runs, i, j = [], 0, 0
    n, m = len(in_shape), len(out_shape)
    while i < n or j < m:
        ins, outs = [], []
        p_in, p_out = sympy.Integer(1), sympy.Integer(1)
        if i < n:
            ins.append(i)
            p_in = p_in * in_shape[i]
            i += 1
        if j < m:
            outs.append(j)
            p_out = p_out * out_shape[j]
            j += 1
        while _differ(p_in, p_out):
            if (i < n and _smaller(p_in, p_out)) or j >= m:
                if i >= n:
                    break
                ins.append(i)
                p_in = p_in * in_shape[i]
                i += 1
            else:
                outs.append(j)
                p_out = p_out * out_shape[j]
                j += 1
        runs.append((tuple(ins), tuple(outs)))
    return tuple(runs)


def _differ(a, b) -> bool:
    """Whether two sizes differ; simplified only when sympy's assumptions cannot tell whether
    their difference is zero (B - 8 * B is not: the batch symbol is positive)."""
    zero = (a - b).is_zero
    return not zero if zero is not None else sympy.simplify(a - b) != 0


def _smaller(a, b) -> bool:
    ratio = b / a  # sympy cancels a monomial's factors itself: simplify only what is left
    if not ratio.is_number:
        ratio = sympy.simplify(ratio)
    if ratio.is_number:
        return bool(ratio > 1)
    return bool(sympy.degree(sympy.numer(sympy.together(ratio))) > 0) if ratio.free_symbols \
        else False
