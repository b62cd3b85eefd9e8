"""Per-token ops under context parallelism: a linear, norm, embedding or loss whose input
is split on tokens over cp keeps that split."""

from __future__ import annotations

from dataclasses import replace

import torch

from autopar.graph.analysis import OpKind
from autopar.modes import CP, CP_TP
from autopar.sharding.layout import Layout, Shard, joined_tokens
from autopar.sharding.rules.context import RuleContext, itemsize, rep
from autopar.sharding.rules.vocab import cross_entropy_args
from autopar.sharding.strategy import Need, Rewrite, Strategy

aten = torch.ops.aten


def with_tokens(ctx: RuleContext, strategy: Strategy) -> Strategy:
    """A per-token op (linear, norm, embedding lookup) whose activation is split on a token
    dim over `cp` keeps that split: the activation and output carry it, and the gradients
    of the weights (whole on cp) are summed over cp. Other splits on cp are gathered by the
    strategy as it is (the loss: its logits and targets gathered)."""
    node, kind = ctx.node, ctx.info.kind
    if kind is OpKind.LINEAR:
        x = node.args[1] if node.target is aten.addmm.default else node.args[0]
        token_dims = len(ctx.shape(x)) - 1
    elif kind is OpKind.NORM:
        x = node.args[0]
        token_dims = len(ctx.shape(x)) - len(node.args[1])
    elif kind is OpKind.EMBEDDING:
        x = node.args[1]
        token_dims = len(ctx.shape(x))
    elif kind is OpKind.LOSS:
        return _token_loss(ctx, strategy)
    else:
        return strategy
    layout = ctx.layouts.get(x)
    shard = cp_shard(layout)
    if shard is None or shard.dim >= token_dims or shard.groups > 1 or x not in strategy.needs:
        return strategy
    d, groups = shard.dim, shard.groups  # groups < 0: tokens flattened batch-major
    need_x = strategy.needs[x].layout
    if _tokens_on(need_x, d, groups) is None or need_x.partial:
        return strategy
    x_len = ctx.shape(x)[d]

    def add(lay, shape):
        if not isinstance(lay, Layout) or len(shape) <= d or shape[d] != x_len:
            return lay
        return _tokens_on(lay, d, groups) or lay

    val = node.meta.get("val")
    if isinstance(strategy.out, list):
        out = [add(lay, tuple(v.shape)) if isinstance(v, torch.Tensor) else lay
               for lay, v in zip(strategy.out, val)]
    else:
        out = add(strategy.out, ctx.info.shape)
    comm = strategy.comm
    if out != strategy.out:  # the op's own collectives (a row linear's or vocabulary-parallel
        # embedding's all-reduce of its output) now move this rank's block of the tokens
        cp = ctx.sizes[CP]
        comm = [replace(c, bytes=c.bytes / cp) for c in comm]
    needs = {}
    for n, need in strategy.needs.items():
        if n is x:
            needs[n] = Need(_tokens_on(need.layout, d, groups), need.sum_grads)
        elif ctx.requires_grad.get(n):
            needs[n] = Need(need.layout, tuple(dict.fromkeys(need.grad_axes(ctx.axis) + (CP,))))
        else:
            needs[n] = need
    return replace(strategy, needs=needs, out=out, comm=comm)


def cp_shard(layout) -> Shard | None:
    """The split of a value's tokens over cp: on cp alone, or on `CP_TP` (Megatron-SP's tp
    split of each cp block)."""
    if not isinstance(layout, Layout):
        return None
    return layout.shard_on(CP) or layout.shard_on(CP_TP)


def _tokens_on(lay: Layout, d: int, groups: int) -> Layout | None:
    """`lay` with dim d split over cp as well: whole there, over cp; split over tp (a
    sequence-parallel rule's tokens), over `CP_TP`; None when d is split otherwise."""
    held = lay.shard_of_dim(d)
    if held is None:
        return lay.with_shard(d, CP, groups)
    joined = joined_tokens(held, Shard(d, CP, groups))
    return lay.with_shard(d, joined.axis) if joined is not None else None


def _token_loss(ctx: RuleContext, strategy: Strategy) -> Strategy:
    """Mean cross-entropy of [tokens, vocab] logits whose rows are split over `cp` (a
    language model's [B, S, V] logits flattened with S split): each rank takes its rows
    (and, when the 1D rule split the vocabulary, its vocabulary slice), and the loss sum
    and row count are summed over cp, so no rank gathers the logits. Otherwise the 1D
    strategy as it is (its needs gather the rows)."""
    node = ctx.node
    if node.target is not aten.cross_entropy_loss.default or \
            strategy.name not in ("replicate", "vocab_parallel"):
        return strategy
    logits, target = node.args[0], node.args[1]
    weight, reduction, ignore, smoothing = cross_entropy_args(node)
    lay_x, lay_t = ctx.layouts.get(logits), ctx.layouts.get(target)
    if len(ctx.shape(logits)) != 2 or len(ctx.shape(target)) != 1 or weight is not None or \
            smoothing or reduction != 1 or not isinstance(lay_x, Layout) or \
            not isinstance(lay_t, Layout):
        return strategy
    rows, rows_t = lay_x.shard_on(CP), lay_t.shard_on(CP)
    if rows is None or rows_t is None or rows.dim != 0 or rows_t.dim != 0 or \
            rows.groups != rows_t.groups:
        return strategy
    cp = ctx.sizes[CP]
    vocab = strategy.name == "vocab_parallel"
    need_x = (strategy.needs[logits].layout if vocab else rep(logits)).with_shard(
        0, CP, rows.groups)
    item = itemsize(logits.meta["autopar"].dtype)
    comm = [replace(c, bytes=c.bytes / cp) for c in strategy.comm]
    comm += ctx.comm_on("all_reduce", CP, 2 * item)
    needs = {logits: Need(need_x), target: Need(rep(target).with_shard(0, CP, rows.groups))}
    return Strategy("token_parallel" + (" vocab_parallel" if vocab else ""), needs,
                    Layout.replicated(0), comm=comm, rewrite=Rewrite.GRID_CROSS_ENTROPY,
                    args={"vocab": ctx.axis if vocab else None, "batch": (CP,),
                          "ignore_index": ignore})
