"""Moving a tensor from the layout its producer gives to the layout its consumer needs.

Each step is one of six conjugate pairs (forward / backward), named by what it does to the
tensor on the axis; `autopar.kernels.collectives` implements the same six:

    split             keep my slice         / all-gather the gradient
    gather            all-gather            / keep my slice of the gradient
    gather_sum_grads  all-gather            / reduce-scatter the gradient
    reduce            all-reduce            / pass the gradient through
    reduce_scatter    reduce-scatter        / all-gather the gradient
    sum_grads         pass through          / all-reduce the gradient
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from autopar.modes import CP, CP_TP, TP
from autopar.sharding.axes import TensorMesh
from autopar.sharding.layout import Layout, Shard
from autopar.sharding.strategy import CommOp, Need

FORWARD = {"split": None, "gather": "all_gather", "gather_sum_grads": "all_gather",
           "reduce": "all_reduce", "reduce_scatter": "reduce_scatter", "sum_grads": None}
BACKWARD = {"split": "all_gather", "gather": None, "gather_sum_grads": "reduce_scatter",
            "reduce": None, "reduce_scatter": "all_gather", "sum_grads": "all_reduce"}


@dataclass(frozen=True)
class Step:
    """One redistribution on one axis; `dim`/`groups` say which dimension is split or gathered.

    `parts`: into how many pieces the other shards cut the tensor on the larger side of the
    step (before a split or reduce-scatter, after a gather), so a collective moves the whole
    tensor's bytes divided by `parts` (1 with a single tensor axis).
    """

    kind: str
    axis: str
    dim: int | None = None
    groups: int = 1
    parts: int = 1

    def comm(self, nbytes: sympy.Expr, requires_grad: bool, where: str) -> list[CommOp]:
        """The collectives of this step for a tensor of `nbytes` whole."""
        nbytes = nbytes / self.parts if self.parts != 1 else nbytes
        out = []
        if FORWARD[self.kind]:
            out.append(CommOp(FORWARD[self.kind], self.axis, "forward", nbytes, where))
        if BACKWARD[self.kind] and requires_grad:
            out.append(CommOp(BACKWARD[self.kind], self.axis, "backward", nbytes, where))
        return out


def steps_between(src: Layout, need: Need, axis: str = TP, mesh: TensorMesh | None = None) \
        -> list[Step]:
    """The steps that turn `src` into `need.layout` (gradients summed where `need` asks).

    Gathers come first (shards the target does not keep), then reductions of partial sums
    (a reduce-scatter where the target splits that axis on a free dim), then splits, then
    the gradient sums; so axes that share a physical mesh dim are released before they are
    reused. `axis` is what `need.sum_grads=True` stands for. Steps on a composite axis
    without a process group of its own run over its components (see
    `autopar.sharding.axes`); between a split over cp and one over `CP_TP` on the same dim
    (Megatron-SP's tp parts of each cp block) they run over tp alone, on a rank's block.
    """
    dst, grad_axes = need.layout, need.grad_axes(axis)
    if src == dst and not grad_axes and len({s.axis for s in src.shards}) == len(src.shards):
        return []  # (most edges: the value already lies as its consumer needs)
    mesh = mesh if mesh is not None else TensorMesh.one_d(axis, 1)
    current = {s.axis: s for s in src.shards}
    steps: list[Step] = []

    def parts() -> int:
        out = 1
        for s in current.values():
            out *= mesh.size(s.axis) if s.axis in mesh.axes else 1
        return out

    summed = set()
    for shard in sorted(src.shards, key=lambda s: s.dim):
        if dst.shard_on(shard.axis) == shard or _within(shard, dst.shard_on(CP_TP)) or \
                _leads(shard, dst, mesh):
            continue
        del current[shard.axis]
        if shard.axis == CP_TP and _within(dst.shard_on(CP), shard):  # tp's part gathered
            current[CP] = dst.shard_on(CP)
            kind = "gather_sum_grads" if TP in grad_axes else "gather"
            summed.update((TP,) if TP in grad_axes else ())
            steps.append(Step(kind, TP, shard.dim, _in_block(shard, mesh), parts()))
            continue
        kind = "gather"
        if shard.axis in grad_axes and dst.shard_on(shard.axis) is None:
            kind = "gather_sum_grads"
            summed.add(shard.axis)
        steps += _expand(kind, shard, parts(), mesh)
    for a in src.partial:
        if a in dst.partial:  # the consumer takes the partial sum as it is
            continue
        target = dst.shard_on(a)
        free = target is not None and all(s.dim != target.dim for s in current.values())
        nested = dst.shard_on(CP_TP)
        if a == TP and a not in grad_axes and _within(current.get(CP), nested):
            steps.append(Step("reduce_scatter", TP, nested.dim, _in_block(nested, mesh),
                              parts()))
            del current[CP]
            current[CP_TP] = nested
        elif free and a not in grad_axes and _one_step(a, target.groups, mesh):
            steps.append(Step("reduce_scatter", a, target.dim, target.groups, parts()))
            current[a] = target
        else:
            steps += _expand("reduce", Shard(0, a), parts(), mesh)
    for shard in dst.shards:
        if current.get(shard.axis) == shard:
            continue
        if _within(current.get(CP), shard):  # a rank's cp block split again over tp
            steps.append(Step("split", TP, shard.dim, _in_block(shard, mesh), parts()))
            del current[CP]
            current[CP_TP] = shard
            continue
        if _leads(current.get(CP), dst, mesh) and current[CP].dim == shard.dim:
            p = parts()  # cp's runs kept: a rank's part split over the rest, one block each
            for c in mesh.components(shard.axis)[1:]:
                steps.append(Step("split", c, shard.dim, 1, p))
                p *= mesh.size(c)
            del current[CP]
            current[shard.axis] = shard
            continue
        steps += _expand("split", shard, parts(), mesh)
        current[shard.axis] = shard
    for a in grad_axes:
        if a not in summed and dst.shard_on(a) is None:
            steps += _expand("sum_grads", Shard(0, a), parts(), mesh)
    return steps


def _within(outer: Shard | None, inner: Shard | None) -> bool:
    """`inner` (over `CP_TP`) splits each block of `outer` (over cp, the same dim) over tp."""
    return outer is not None and inner is not None and outer.axis == CP and \
        inner.axis == CP_TP and (outer.dim, outer.groups) == (inner.dim, inner.groups)


def _leads(shard: Shard | None, dst: Layout, mesh: TensorMesh) -> bool:
    """`shard` (over cp) is the major part of `dst`'s split of the same dim over a `cp_batch`
    axis with the same blocks: that split keeps cp's runs and cuts a rank's part further."""
    if shard is None or shard.axis != CP:
        return False
    target = dst.shard_of_dim(shard.dim)
    return target is not None and target.axis not in (CP, CP_TP) and \
        target.axis in mesh.composites and mesh.components(target.axis)[0] == CP and \
        target.groups == shard.groups


def _in_block(shard: Shard, mesh: TensorMesh) -> int:
    """The blocks of a `CP_TP` split as tp's step sees a rank's cp block: a batch-major
    flattening's runs of r tokens per sample are r / cp long there."""
    return shard.groups // mesh.size(CP) if shard.groups < 0 else shard.groups


def _one_step(axis: str, groups: int, mesh: TensorMesh) -> bool:
    if axis not in mesh.axes:
        return True
    return mesh.has_group(axis)


def _expand(kind: str, shard: Shard, parts: int, mesh: TensorMesh) -> list[Step]:
    """One step, or one per component of a composite axis (splits major first, gathers minor
    first, the blocks on the major component); `parts` counts the other shards' pieces."""
    dim = shard.dim if kind not in ("reduce", "sum_grads") else None
    if _one_step(shard.axis, shard.groups, mesh):
        return [Step(kind, shard.axis, dim, shard.groups, parts)]
    comps = mesh.components(shard.axis)
    if kind in ("reduce", "sum_grads"):
        return [Step(kind, c, None, 1, parts) for c in comps]
    blocks = [shard.groups] + [1] * (len(comps) - 1)
    if kind == "split":  # the larger side is before each split
        out, p = [], parts
        for c, g in zip(comps, blocks):
            out.append(Step(kind, c, dim, g, p))
            p *= mesh.size(c)
        return out
    out = []  # gathers: minor first; the larger side is after each gather
    for i in range(len(comps) - 1, -1, -1):
        p = parts
        for c in comps[:i]:
            p *= mesh.size(c)
        out.append(Step(kind, comps[i], dim, blocks[i], p))
    return out
