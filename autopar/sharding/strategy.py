"""The values the catalog produces: what an op needs of its inputs, and the collectives it runs."""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch.fx as fx

from autopar.sharding.layout import Layout

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


@dataclass(frozen=True)
class CommOp:
    """One collective of one training step: its kind, mesh axis, phase and payload bytes.

    Payload bytes are those each rank of the axis logs (`autopar.kernels.collectives`): the
    all-reduced, broadcast or reduced tensor, the all-gathered output, the reduce-scattered
    input, each as one rank holds it. With a single tensor axis that is the whole tensor on
    the axis; when other axes split it too, it is the share left after their splits. They
    are sympy expressions in the batch symbol, so one plan prices every micro-batch size.
    """

    op: str
    axis: str
    phase: str  # "forward" or "backward"
    bytes: sympy.Expr
    where: str  # the graph node that runs it
    # it moves a kernel's accumulators (ring attention's dk, dv), which stay float32 for
    # 16-bit inputs, not the value's own dtype (autopar.passes.precision prices it so)
    accumulator: bool = False


@dataclass(frozen=True)
class Need:
    """The layout an op needs of one input.

    `sum_grads`: the op uses the whole input on every rank to compute a split result, so the
    gradient each rank computes for that input is a partial sum that must be all-reduced:
    True for the rule's own axis, or the tuple of axes whose ranks hold partial gradients.
    """

    layout: Layout
    sum_grads: bool | tuple[str, ...] = False

    def grad_axes(self, axis: str) -> tuple[str, ...]:
        """The axes to sum the gradient over, `axis` standing for True."""
        if self.sum_grads is True:
            return (axis,)
        return tuple(self.sum_grads or ())


@dataclass
class Strategy:
    """How one op runs on the mesh, as chosen by its catalog rule."""

    name: str  # "column", "row", "vocab_parallel", "follow", "replicate", ...
    needs: dict[fx.Node, Need]
    out: Layout | list | None
    comm: list[CommOp] = field(default_factory=list)  # collectives run inside the op
    rewrite: str | None = None  # the sharded form the rewrite pass gives the op
    note: str = ""  # why, for explain (e.g. an op with no catalog entry)
    args: dict = field(default_factory=dict)  # what the rewrite needs (grid axes, eps, ...)
