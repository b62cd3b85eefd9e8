"""Moving a tensor from the layout its producer gives to the layout its consumer needs.

Each step is one of six conjugate pairs (forward / backward), named by what it does to the
tensor on the axis; `autopar.runtime.collectives` implements the same six:

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

from autopar.sharding.layout import Layout
from autopar.sharding.strategy import CommOp, Need

FORWARD = {"split": None, "gather": "all_gather", "gather_sum_grads": "all_gather",
           "reduce": "all_reduce", "reduce_scatter": "reduce_scatter", "sum_grads": None}
BACKWARD = {"split": "all_gather", "gather": None, "gather_sum_grads": "reduce_scatter",
            "reduce": None, "reduce_scatter": "all_gather", "sum_grads": "all_reduce"}


@dataclass(frozen=True)
class Step:
    """One redistribution on one axis; `dim`/`groups` say which dimension is split or gathered."""

    kind: str
    axis: str
    dim: int | None = None
    groups: int = 1

    def comm(self, nbytes: sympy.Expr, requires_grad: bool, where: str) -> list[CommOp]:
        out = []
        if FORWARD[self.kind]:
            out.append(CommOp(FORWARD[self.kind], self.axis, "forward", nbytes, where))
        if BACKWARD[self.kind] and requires_grad:
            out.append(CommOp(BACKWARD[self.kind], self.axis, "backward", nbytes, where))
        return out


def steps_between(src: Layout, need: Need, axis: str) -> list[Step]:
    """The steps that turn `src` into `need.layout` on `axis` (gradients summed if asked)."""
    dst = need.layout
    steps: list[Step] = []
    current = src
    dst_shard = dst.shard_on(axis)
    if axis in current.partial:
        if dst_shard is not None and not need.sum_grads:
            return [Step("reduce_scatter", axis, dst_shard.dim, dst_shard.groups)]
        steps.append(Step("reduce", axis))
        current = current.without(axis)
    shard = current.shard_on(axis)
    if shard is not None and shard != dst_shard:
        kind = "gather_sum_grads" if need.sum_grads and dst_shard is None else "gather"
        steps.append(Step(kind, axis, shard.dim, shard.groups))
        shard = None
        if kind == "gather_sum_grads":
            return steps
    if shard is None and dst_shard is not None:
        steps.append(Step("split", axis, dst_shard.dim, dst_shard.groups))
    elif dst_shard is None and need.sum_grads:
        steps.append(Step("sum_grads", axis))
    return steps
