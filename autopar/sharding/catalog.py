"""The strategy catalog: which rule decides each op, and how one-axis rules combine.

A rule (`autopar.sharding.rules`) looks at the layouts of an op's inputs and returns a
`Strategy`: the layout each input must have, the output layout, the collectives the op runs
and the sharded form (`Rewrite`) the rewrite pass gives it. The cost model prices that
entry, the rewrite emits it and explain prints it. Rules are found by op kind, or by target
for ops the analysis leaves unclassified, in the tables each family fills as it registers
(`rules.registry.decides`); an op with no entry runs replicated, with a note.

Modes: "1d" (Megatron), "2d", "2.5d" and "3d" (`rules.grid`), and "replicate". Generic
rules are written for one axis: on a layout split over several, `decide` runs the rule once
per axis and merges the results, gathering an axis that would clash with an earlier one.
"""

from __future__ import annotations

import operator
from dataclasses import replace

import torch
import torch.fx as fx

from autopar.graph.analysis import OpKind
from autopar.modes import CP, CP_TP, TP
from autopar.sharding import rules  # noqa: F401  (importing it registers every family's rules)
from autopar.sharding.axes import MULTI_D, TensorMesh, cp_batch
from autopar.sharding.layout import Layout, Shard, joined_tokens
from autopar.sharding.rules.context import RuleContext, replicate, tensor_inputs
from autopar.sharding.rules.registry import MODE_RULES, RULES, TARGET_RULES, Rule
from autopar.sharding.rules.tokens import with_tokens
from autopar.sharding.rules.views import view
from autopar.sharding.strategy import Need, Rewrite, Strategy

__all__ = ["MODE_RULES", "RULES", "TARGET_RULES", "RuleContext", "decide", "tensor_inputs"]

aten = torch.ops.aten


def decide(ctx: RuleContext) -> Strategy:
    """The strategy of one op: its catalog rule, or replicated with the reason.

    In a 2D, 2.5D or 3D layer, linears, norms, embeddings and the loss take their grid rule.
    In a 1D layer the 1D rules of those ops see their own axis only (other splits gathered
    first). Every other rule runs once per axis the inputs are split over.
    """
    strategy = _summed_where_split(ctx, _rule_strategy(ctx))
    stream = _random_stream(ctx.node)
    if strategy.rewrite is None and stream is not None:
        return replace(strategy, rewrite=stream)
    return strategy


# rewrites that run the op itself on each rank's blocks; the others are kernels that run
# their own gradient collectives
_RUNS_AS_IS = (None, Rewrite.LOCAL_SIZES, Rewrite.STREAM_DROPOUT, Rewrite.STREAM_ATTENTION)


def _summed_where_split(ctx: RuleContext, strategy: Strategy) -> Strategy:
    """An input whole on an axis the output is split on feeds every rank's slice of the
    output, so each rank's gradient of it is a partial sum: it is summed over that axis.

    The rules state this for the splits they make themselves; this covers the splits they
    only carry along, such as a 2D grid's batch split through an op with no grid rule (a
    matmul by a weight, which then gets a slice of the batch's gradient on each rank).
    Kernels with their own gradient collectives, MoE layers (routed experts average over
    their expert-data group) and values whose gradient a gather before the op already sums
    (`RuleContext.grad_summed`) are left as they are."""
    if strategy.rewrite not in _RUNS_AS_IS or \
            ctx.info.kind in (OpKind.MOE, OpKind.GROUPED_MM):
        return strategy
    mesh = ctx.mesh or TensorMesh.one_d(ctx.axis, ctx.size)
    split = [c for lay in _flat_layouts(strategy.out) for s in lay.shards
             for c in _components(mesh, s.axis)]
    if not split:
        return strategy
    for n, need in list(strategy.needs.items()):
        if not ctx.requires_grad.get(n) or n in ctx.grad_summed:
            continue
        axes = need.grad_axes(ctx.axis)
        held = {c for a in [s.axis for s in need.layout.shards] + list(need.layout.partial)
                + list(axes) for c in _components(mesh, a)}
        missing = tuple(dict.fromkeys(c for c in split if c not in held))
        if missing:
            strategy.needs[n] = Need(need.layout, axes + missing)
    return strategy


def _components(mesh: TensorMesh, axis: str) -> tuple[str, ...]:
    try:
        return mesh.components(axis)
    except KeyError:  # an axis outside the tensor mesh (cp in a 1D solution): itself
        return (axis,)


def _random_stream(node: fx.Node) -> Rewrite | None:
    """Dropout, alone or inside attention, draws from the stream its layout calls for
    (`autopar.kernels.modules.RandomStreams`), however the op is split or replicated."""
    if node.target is aten.dropout.default:
        return Rewrite.STREAM_DROPOUT
    if node.target is aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return Rewrite.STREAM_ATTENTION if p else None
    return None


def _rule_strategy(ctx: RuleContext) -> Strategy:
    kind = ctx.info.kind
    cp = ctx.sizes.get(CP, 1)
    if ctx.mode == "replicate" or (ctx.size == 1 and cp == 1):
        return replicate(ctx)
    if ctx.mode in MULTI_D and kind in MODE_RULES:
        return MODE_RULES[kind](ctx)
    rule = TARGET_RULES.get(ctx.node.target) or RULES.get(kind)
    if rule is None and ctx.info.from_sizes:  # whole on every rank is what it is: no note
        return replicate(ctx)
    if rule is None:
        return replicate(ctx, note=f"no catalog entry for {ctx.node.target}; runs replicated")
    if kind in MODE_RULES:
        base = ctx.on_axis(ctx.axis)
        strategy = _normalized(rule(base), ctx.axis) if ctx.size > 1 else replicate(base)
        return with_tokens(ctx, strategy) if cp > 1 else strategy
    if ctx.node.target is operator.getitem:  # one output of a multi-output op, as it lies
        return view(ctx)
    return per_axis(ctx, rule)


def per_axis(ctx: RuleContext, rule: Rule) -> Strategy:
    """Run a one-axis rule once per axis the inputs use and merge the strategies.

    Axes are taken in the order the inputs use them; an axis whose needs or output would put
    a second split on a dim, or reuse a physical mesh dim, is left out (its splits gathered,
    as if the rule had replicated on it).
    """
    axes: list[str] = []
    for n in ctx.inputs:
        for lay in _flat_layouts(ctx.layouts.get(n)):
            # the tokens of a cp block split over tp: each axis's rule sees its own split
            seen = [c for a in lay.axes for c in ((CP, TP) if a == CP_TP else (a,))]
            axes.extend(a for a in seen if a not in axes)
    if len(axes) <= 1:
        axis = axes[0] if axes else ctx.axis
        return _normalized(rule(ctx.on_axis(axis)), axis)
    mesh = ctx.mesh or TensorMesh.one_d(ctx.axis, ctx.size)
    merged: Strategy | None = None
    for axis in axes:
        strategy = _normalized(rule(ctx.on_axis(axis)), axis)
        if strategy.name == "replicate":
            continue
        if merged is None:
            merged = strategy
            continue
        candidate = _merge(merged, strategy, mesh)
        if candidate is not None:
            merged = candidate
    return merged if merged is not None else replicate(ctx)


def _flat_layouts(layout) -> list[Layout]:
    if isinstance(layout, Layout):
        return [layout]
    if isinstance(layout, list):
        return [v for v in layout if isinstance(v, Layout)]
    return []


def _normalized(strategy: Strategy, axis: str) -> Strategy:
    """`sum_grads=True` spelled out as the axis the rule ran on."""
    for n, need in list(strategy.needs.items()):
        if need.sum_grads is True:
            strategy.needs[n] = Need(need.layout, (axis,))
    return strategy


def _merge(a: Strategy, b: Strategy, mesh: TensorMesh) -> Strategy | None:
    """Both strategies at once, or None when they clash on a dim or a physical mesh dim."""
    needs = {}
    for n in set(a.needs) | set(b.needs):
        na, nb = a.needs.get(n), b.needs.get(n)
        if na is None or nb is None:
            needs[n] = na or nb
            continue
        layout = _union(na.layout, nb.layout, mesh)
        if layout is None:
            return None
        grads = tuple(dict.fromkeys(na.grad_axes("") + nb.grad_axes("")))
        needs[n] = Need(layout, grads or False)
    out = _union(a.out, b.out, mesh)
    if out is None and a.out is not None:
        return None
    kernel = next((s for s in (a, b) if s.rewrite is Rewrite.SEQUENCE_ATTENTION), None)
    if kernel is not None:  # it reads q, k, v alone: a causal mask another axis split is gone
        needs = {n: need for n, need in needs.items() if n in kernel.needs}
    name = a.name if a.name == b.name else f"{a.name}+{b.name}"
    return Strategy(name, {n: needs[n] for n in list(a.needs) + [m for m in b.needs
                                                                  if m not in a.needs]
                           if n in needs},
                    out, a.comm + b.comm, a.rewrite or b.rewrite, a.note or b.note,
                    {**b.args, **a.args})


def _union(a, b, mesh: TensorMesh):
    if isinstance(a, list) and isinstance(b, list):
        out = [_union(x, y, mesh) for x, y in zip(a, b)]
        return None if any(o is None and x is not None for o, x in zip(out, a)) else out
    if not isinstance(a, Layout) or not isinstance(b, Layout):
        return a if a is not None else b
    shards = list(a.shards)
    partial = list(a.partial)
    for s in b.shards:
        if s in shards:
            continue
        same = next((t for t in shards if t.dim == s.dim), None)
        joined = joined_tokens(same, s) if same is not None and CP_TP in mesh.axes else None
        joined = joined or (_cp_rows(same, s, mesh) if same is not None else None)
        if joined is not None:  # Megatron-SP's tp split of a rank's cp block of the tokens,
            # or a grid's batch split and cp's tokens flattened into one dim
            shards[shards.index(same)] = joined
            continue
        used = [t.axis for t in shards] + partial
        if same is not None or any(_overlap(mesh, s.axis, u) for u in used):
            return None
        shards.append(s)
    for p in b.partial:
        if p in partial:
            continue
        if any(_overlap(mesh, p, u) for u in [t.axis for t in shards] + partial):
            return None
        partial.append(p)
    return Layout(a.ndim, tuple(sorted(shards)), tuple(sorted(partial)))


def _cp_rows(a: Shard, b: Shard, mesh: TensorMesh) -> Shard | None:
    """One dim split over a grid's batch axis (one block) and over cp in per-sample runs (a
    [B, S, ...] value flattened, `Shard.groups` < 0): the split over `cp_batch`; else None."""
    tokens, batch = (a, b) if a.axis == CP else (b, a)
    if tokens.axis != CP or tokens.groups >= 0 or batch.groups != 1:
        return None
    axis = cp_batch(batch.axis)
    return Shard(a.dim, axis, tokens.groups) if axis in mesh.composites else None


def _overlap(mesh: TensorMesh, a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return mesh.overlap(a, b)
    except KeyError:
        return False
