"""The 2D (SUMMA, Xu et al. 2021), 2.5D (Wang et al. 2021) and 3D (Bian et al. 2021) rules:
linears, norms, embeddings and the loss in the block layouts of `autopar.kernels.multid`.

Each rule lists the collectives its kernel logs (bytes as one rank logs them), so predicted
communication stays exact."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.graph.analysis import OpKind
from autopar.modes import CP, TP_3D, TP_25D
from autopar.sharding.axes import GRIDS, cp_batch, role_spec
from autopar.sharding.layout import Layout, Shard, divisible
from autopar.sharding.rules.context import RuleContext, batch_like, itemsize, replicate
from autopar.sharding.rules.registry import decides
from autopar.sharding.rules.vocab import cross_entropy_args
from autopar.sharding.strategy import CommOp, Need, Rewrite, Strategy

aten = torch.ops.aten


def role_layout(ctx: RuleContext, grid: tuple, role: str, ndim: int, groups: int = 1,
                transposed: bool = False) -> Layout:
    """The layout of a tensor in `role` on `grid` (see `autopar.sharding.axes.role_spec`).

    `groups` blocks go on the dim the fused output features lie on (weight and bias dim 0,
    y's last dim); `transposed` reads a weight as [in, out] (transformers' Conv1D).
    """
    layout = Layout.replicated(ndim)
    for dim, comps in role_spec(ctx.mode, grid, role).items():
        d = dim % ndim
        g = groups if (role in ("weight", "bias") and d == 0) or (role == "y" and dim == -1) \
            else 1
        if transposed and role == "weight":
            d = 1 - d
        layout = layout.with_shard(d, ctx.mesh.composite(comps), g)
    return layout


def keep_tokens(ctx: RuleContext, x: fx.Node, layout: Layout) -> Layout:
    """`layout` with x's split of its tokens over cp kept (beside cp, a grid rule is per
    token: the grid splits batch and hidden, cp the sequence); as it is where x has none, or
    where the grid already splits that dim (a flattened batch x sequence dim: cp gathered)."""
    held = ctx.layout(x)
    rows, batch = _rows(ctx, held), layout.shard_of_dim(0)
    if rows is not None and batch is not None and batch.groups == 1 and \
            rows.axis == cp_batch(batch.axis):  # [batch x tokens, ...] over cp and the batch
        return layout.with_shard(0, rows.axis, rows.groups)
    shard = held.shard_on(CP) if isinstance(held, Layout) else None
    if shard is None or shard.dim >= len(ctx.shape(x)) - 1 or \
            layout.shard_of_dim(shard.dim) is not None:
        return layout
    return layout.with_shard(shard.dim, CP, shard.groups)


def _rows(ctx: RuleContext, layout) -> Shard | None:
    """The split of dim 0 over cp and a grid's batch axis (`cp_batch`), or None."""
    rows = layout.shard_of_dim(0) if isinstance(layout, Layout) else None
    return rows if rows is not None and _cp_rows(ctx, rows.axis) else None


def _tokens_out(ctx: RuleContext, x: fx.Node, needs_x: Layout, out: Layout) -> Layout:
    """The output keeps the token split x's need carries (the same leading dims)."""
    rows, batch = _rows(ctx, needs_x), out.shard_of_dim(0)
    if rows is not None and batch is not None and cp_batch(batch.axis) in ctx.mesh.composites:
        return out.with_shard(0, cp_batch(batch.axis), rows.groups)
    shard = needs_x.shard_on(CP)
    if shard is None or len(ctx.info.shape) <= shard.dim or \
            ctx.info.shape[shard.dim] != ctx.shape(x)[shard.dim]:
        return out
    return out.with_shard(shard.dim, CP, shard.groups)


def _over_cp(ctx: RuleContext, needs_x: Layout) -> tuple:
    """The axes a weight whole on cp sums its gradient over, where x's tokens split over cp."""
    return (CP,) if needs_x.shard_on(CP) is not None or _rows(ctx, needs_x) else ()


def _cp_rows(ctx: RuleContext, axis: str) -> bool:
    """Whether `axis` is a grid's batch axis and cp over a flattened batch x tokens dim."""
    return axis in ctx.mesh.composites and ctx.mesh.components(axis)[0] == CP and \
        not ctx.mesh.has_group(axis)


def _same_split(a: Layout, b: Layout) -> int:
    """How many shards two layouts share (axis and dim; blocks ignored)."""
    return len({(s.dim, s.axis) for s in a.shards} & {(s.dim, s.axis) for s in b.shards})


def _pick_grid(ctx: RuleContext, x: fx.Node, w: fx.Node | None = None,
               transposed: bool = False) -> tuple:
    """The grid whose x layout is closest to x's (3D alternates two); a weight already
    placed for one of them decides."""
    grids = GRIDS[ctx.mode]
    if w is not None and ctx.placed(w) is not None:
        for grid in grids:
            if _same_split(ctx.placed(w), role_layout(ctx, grid, "weight", 2,
                                                      transposed=transposed)) == 2:
                return grid
    layout = ctx.layout(x)
    ndim = len(ctx.shape(x))
    if not isinstance(layout, Layout):
        return grids[0]
    scores = [_same_split(layout, role_layout(ctx, g, "x", ndim)) for g in grids]
    return grids[scores.index(max(scores))]


@decides(OpKind.LINEAR, grid=True)
def grid_linear(ctx: RuleContext) -> Strategy:
    """linear / Conv1D on the grid: SUMMA (2D, 2.5D) or gather-multiply-reduce-scatter (3D)."""
    node = ctx.node
    transposed = node.target is aten.addmm.default
    if transposed:
        bias, x, w = node.args[0], node.args[1], node.args[2]
    else:
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if ctx.hint() == ("replicate",):
        return replicate(ctx)
    grid = _pick_grid(ctx, x, w, transposed)
    hint = ctx.hint()
    groups = hint[1] if hint and hint[0] == "groups" else 1
    placed = ctx.placed(w)
    out_dim = 1 if transposed else 0
    if placed is not None and placed.shard_of_dim(out_dim) is not None:
        groups = placed.shard_of_dim(out_dim).groups
    nx = len(ctx.shape(x))
    needs_x = keep_tokens(ctx, x, role_layout(ctx, grid, "x", nx))
    needs_w = role_layout(ctx, grid, "weight", 2, groups, transposed)
    w_shape = ctx.shape(w)
    for shard in needs_w.shards:
        g = shard.groups if shard.dim == out_dim else 1
        if not divisible(w_shape[shard.dim], ctx.sizes[shard.axis] * g):
            return replicate(ctx, note=f"weight dim {shard.dim} of {w_shape[shard.dim]} does "
                                       f"not split over the {ctx.mode} grid")
    cp = _over_cp(ctx, needs_x)
    needs = {x: Need(needs_x), w: Need(needs_w, cp if ctx.requires_grad.get(w) else False)}
    if bias is not None:
        needs[bias] = Need(role_layout(ctx, grid, "bias", 1, groups),
                           cp if ctx.requires_grad.get(bias) else False)
    out = _tokens_out(ctx, x, needs_x, role_layout(ctx, grid, "y", len(ctx.info.shape), groups))
    X, W = ctx.local_bytes(x, needs_x), ctx.local_bytes(w, needs_w)
    Y = ctx.local_bytes(node, out)
    rg = ctx.requires_grad
    x_grad, w_grad = bool(rg.get(x)), bool(rg.get(w))
    b_grad = bias is not None and bool(rg.get(bias))
    comm: list[CommOp] = []
    if ctx.mode == TP_3D:
        inp, wgt, outg = grid
        q = ctx.sizes[inp]
        comm += ctx.comm_on("all_gather", inp, X, times=q)
        comm += ctx.comm_on("all_gather", wgt, W, times=q)
        comm += ctx.comm_on("reduce_scatter", outg, Y, times=q)
        if x_grad or w_grad or b_grad:
            comm += ctx.comm_on("all_gather", outg, Y, "backward", q)
        if x_grad:
            comm += ctx.comm_on("reduce_scatter", inp, X, "backward", q)
        if w_grad:
            comm += ctx.comm_on("reduce_scatter", wgt, W, "backward", q)
        if b_grad:
            comm += ctx.comm_on("all_reduce", wgt, ctx.local_bytes(bias, needs[bias].layout),
                                "backward")
    else:
        row, col = grid[0], grid[1]
        dep = grid[2] if ctx.mode == TP_25D else None
        q = ctx.sizes[row]
        comm += ctx.comm_on("broadcast", row, X, times=q)
        comm += ctx.comm_on("broadcast", col, W, times=q)
        if x_grad:
            comm += ctx.comm_on("broadcast", col, W, "backward", q)
            comm += ctx.comm_on("reduce", row, X, "backward", q)
        if w_grad:
            comm += ctx.comm_on("broadcast", row, X, "backward", q)
            comm += ctx.comm_on("reduce", col, W, "backward", q)
            if dep is not None:
                comm += ctx.comm_on("all_reduce", dep, W, "backward")
        if b_grad:
            B = ctx.local_bytes(bias, needs[bias].layout)
            comm += ctx.comm_on("all_reduce", col, B, "backward")
            if dep is not None:
                comm += ctx.comm_on("all_reduce", dep, B, "backward")
    return Strategy(f"{ctx.mode} linear", needs, out, comm=comm, rewrite=Rewrite.GRID_LINEAR,
                    args={"mode": ctx.mode, "grid": grid, "transposed": transposed})


@decides(OpKind.NORM, grid=True)
def grid_norm(ctx: RuleContext) -> Strategy:
    """LayerNorm / RMSNorm over a hidden dim split on one axis: statistics all-reduced over
    it, weight and bias gradients over the axes that split the other dims."""
    node = ctx.node
    x, shape = node.args[0], node.args[1]
    if len(shape) != 1:
        return replicate(ctx)
    is_layer = node.target is aten.layer_norm.default
    args = list(node.args) + [None] * 5
    weight, bias = args[2], (args[3] if is_layer else None)
    eps = args[4] if is_layer else args[3]
    weight = node.kwargs.get("weight", weight)
    bias = node.kwargs.get("bias", bias) if is_layer else None
    eps = node.kwargs.get("eps", eps)
    nx = len(ctx.shape(x))
    layout = ctx.layout(x)
    hidden = layout.shard_of_dim(nx - 1) if isinstance(layout, Layout) else None
    if layout.partial or hidden is None or hidden.groups != 1 or \
            hidden.axis not in ctx.mesh.physical:
        layout = keep_tokens(ctx, x, role_layout(ctx, _pick_grid(ctx, x), "x", nx))
        hidden = layout.shard_of_dim(nx - 1)
    h = hidden.axis
    if not divisible(ctx.shape(x)[-1], ctx.sizes[h]):
        return replicate(ctx, note=f"hidden size {ctx.shape(x)[-1]} does not split over "
                                   f"{ctx.sizes[h]}")
    replicas = tuple(s.axis for s in layout.shards if s.axis != h)
    over_cp = not ctx.cp_grads and ctx.mesh.without_cp(replicas) != replicas
    if over_cp:  # the step's sync sums the parameters' gradients over cp
        replicas = ctx.mesh.without_cp(replicas)
    needs = {x: Need(layout)}
    param_layout = Layout.replicated(1).with_shard(0, h)
    for p in (weight, bias):
        if isinstance(p, fx.Node):
            needs[p] = Need(param_layout)
    rows = ctx.local_bytes(x, layout) / (ctx.shape(x)[-1] / ctx.sizes[h])
    comm = ctx.comm_on("all_reduce", h, rows, times=2 if is_layer else 1)
    if ctx.requires_grad.get(x):
        comm += ctx.comm_on("all_reduce", h, rows, "backward", 2 if is_layer else 1)
    wants = sum(1 for p in (weight, bias) if isinstance(p, fx.Node) and ctx.requires_grad.get(p))
    if wants:
        for axis in replicas:
            comm += ctx.comm_on("all_reduce", axis, ctx.local_bytes(weight, param_layout),
                                "backward", wants)
    return Strategy(f"{ctx.mode} norm", needs, layout, comm=comm, rewrite=Rewrite.GRID_NORM,
                    args={"kind": "layer" if is_layer else "rms", "hidden": h,
                          "replicas": replicas, "eps": eps, "params": (weight, bias),
                          "params_over_cp": over_cp})


@decides(OpKind.EMBEDDING, grid=True)
def grid_embedding(ctx: RuleContext) -> Strategy:
    """The table split on hidden like activations: no forward communication; where the ids
    are split on batch, the table's gradient is summed over the batch-splitting axis."""
    w, ids = ctx.node.args[0], ctx.node.args[1]
    grid = GRIDS[ctx.mode][0]
    table = role_layout(ctx, grid, "embedding", 2)
    hidden = table.shard_of_dim(1)
    if not divisible(ctx.shape(w)[1], ctx.sizes[hidden.axis]):
        return replicate(ctx, note=f"embedding width {ctx.shape(w)[1]} does not split over "
                                   f"{ctx.sizes[hidden.axis]}")
    nids = len(ctx.shape(ids))
    ids_layout = Layout.replicated(nids)
    grads: tuple = ()
    if nids and batch_like(ctx.shape(ids)[0]):
        ids_layout = role_layout(ctx, grid, "ids", nids)
        held = ctx.layout(ids)
        tokens = held.shard_on(CP) if isinstance(held, Layout) else None
        if tokens is not None and tokens.dim > 0:  # [batch, tokens] ids: cp's split kept
            ids_layout = ids_layout.with_shard(tokens.dim, CP, tokens.groups)
        grads = tuple(s.axis for s in ids_layout.shards)
    out = Layout(nids + 1, tuple(sorted(ids_layout.shards + (Shard(nids, hidden.axis),))))
    needs = {w: Need(table, grads or False), ids: Need(ids_layout)}
    return Strategy(f"{ctx.mode} embedding", needs, out)


@decides(OpKind.LOSS, grid=True)
def grid_loss(ctx: RuleContext) -> Strategy:
    """Cross-entropy on logits split like a linear's output (batch and vocabulary): the
    vocabulary-parallel kernel, then the loss sum and count summed over the batch split."""
    node = ctx.node
    if node.target is not aten.cross_entropy_loss.default:
        return replicate(ctx)
    logits, target = node.args[0], node.args[1]
    weight, reduction, ignore, smoothing = cross_entropy_args(node)
    if len(ctx.shape(logits)) != 2 or weight is not None or smoothing or reduction != 1:
        return replicate(ctx)
    layout = ctx.layout(logits)
    vocab = layout.shard_of_dim(1) if isinstance(layout, Layout) else None
    batch = layout.shard_of_dim(0) if isinstance(layout, Layout) else None
    rows = batch is not None and _cp_rows(ctx, batch.axis)  # batch x tokens beside cp
    if layout.partial or vocab is None or vocab.groups != 1 or \
            (batch is not None and batch.groups != 1 and not rows):
        layout = role_layout(ctx, GRIDS[ctx.mode][0], "y", 2)
        vocab, batch = layout.shard_of_dim(1), layout.shard_of_dim(0)
    if not divisible(ctx.shape(logits)[1], ctx.sizes[vocab.axis]):
        return replicate(ctx)
    target_layout = Layout.replicated(1)
    batch_axes: tuple = ()
    if batch is not None:
        target_layout = target_layout.with_shard(0, batch.axis, batch.groups)
        # the loss sum and count summed over each group that splits the rows
        batch_axes = ctx.mesh.components(batch.axis) if rows else (batch.axis,)
    item = itemsize(logits.meta["autopar"].dtype)
    rows = ctx.local_bytes(logits, layout) / (ctx.shape(logits)[1] / ctx.sizes[vocab.axis])
    comm = ctx.comm_on("all_reduce", vocab.axis, rows) + \
        ctx.comm_on("all_reduce", vocab.axis, rows, times=2)
    for axis in batch_axes:
        comm += ctx.comm_on("all_reduce", axis, 2 * item)
    needs = {logits: Need(layout), target: Need(target_layout)}
    return Strategy(f"{ctx.mode} vocab_parallel", needs, Layout.replicated(0), comm=comm,
                    rewrite=Rewrite.GRID_CROSS_ENTROPY,
                    args={"vocab": vocab.axis, "batch": batch_axes, "ignore_index": ignore})
