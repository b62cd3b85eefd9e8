"""Vocabulary-parallel embedding and cross-entropy (Megatron 1D): each rank owns a slice
of the vocabulary; the partial results are all-reduced."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.graph.analysis import OpKind
from autopar.modes import TP_1D
from autopar.sharding.layout import Layout, divisible
from autopar.sharding.rules.context import RuleContext, rep, replicate, shard_dim
from autopar.sharding.rules.registry import decides
from autopar.sharding.strategy import CommOp, Need, Rewrite, Strategy

aten = torch.ops.aten
FP32_BYTES = 4  # the dtype of the cross-entropy's statistics


@decides(OpKind.EMBEDDING)
def embedding(ctx: RuleContext) -> Strategy:
    """Vocabulary-parallel lookup: each rank owns a slice of the rows, the sum is all-reduced."""
    w, idx = ctx.node.args[0], ctx.node.args[1]
    fixed = ctx.placed(w)
    split_rows = rep(w).with_shard(0, ctx.axis)
    usable = fixed == split_rows or (fixed is None and divisible(ctx.shape(w)[0], ctx.size))
    if ctx.mode != TP_1D or not usable:
        return replicate(ctx)
    needs = {w: Need(split_rows), idx: Need(rep(idx))}
    if ctx.sp:  # the sum stays partial: its consumer reduce-scatters it into the sequence split
        return Strategy("vocab_parallel", needs,
                        Layout.replicated(len(ctx.info.shape)).with_partial(ctx.axis),
                        rewrite=Rewrite.VOCAB_EMBEDDING, args={"reduce": False})
    return Strategy("vocab_parallel", needs, Layout.replicated(len(ctx.info.shape)),
                    comm=[ctx.comm("all_reduce", ctx.node)], rewrite=Rewrite.VOCAB_EMBEDDING)

def cross_entropy_args(node: fx.Node) -> tuple:
    """(weight, reduction, ignore_index, label_smoothing) of an aten.cross_entropy_loss node,
    defaults filled in (reduction 1 is the mean)."""
    args = list(node.args) + [None] * (6 - len(node.args))
    weight = node.kwargs.get("weight", args[2])
    reduction = node.kwargs.get("reduction", args[3] if args[3] is not None else 1)
    ignore = node.kwargs.get("ignore_index", args[4] if args[4] is not None else -100)
    smoothing = node.kwargs.get("label_smoothing", args[5]) or 0.0
    return weight, reduction, ignore, smoothing


@decides(OpKind.LOSS)
def loss(ctx: RuleContext) -> Strategy:
    """Vocabulary-parallel cross-entropy: max, sum of exponentials and target logit all-reduced."""
    node = ctx.node
    if node.target is not aten.cross_entropy_loss.default or ctx.mode != TP_1D:
        return replicate(ctx)
    logits, target = node.args[0], node.args[1]
    weight, _, _, smoothing = cross_entropy_args(node)
    if shard_dim(ctx, logits) != 1 or len(ctx.shape(logits)) != 2 or weight is not None \
            or smoothing:
        return replicate(ctx)
    # one fp32 value per row whatever the logits' dtype: the kernels take the softmax's
    # statistics in fp32 (kernels.modules.VocabParallelCE, kernels.chunked_loss)
    rows = ctx.shape(logits)[0] * FP32_BYTES
    comm = [CommOp("all_reduce", ctx.axis, "forward", rows, node.name) for _ in range(3)]
    needs = {logits: Need(ctx.layout(logits)), target: Need(rep(target))}
    return Strategy("vocab_parallel", needs, Layout.replicated(len(ctx.info.shape)), comm=comm,
                    rewrite=Rewrite.VOCAB_CROSS_ENTROPY)
