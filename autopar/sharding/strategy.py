"""The values the catalog produces: what an op needs of its inputs, and the collectives it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import sympy
import torch.fx as fx

from autopar.sharding.layout import Layout

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


@dataclass(frozen=True)
class CommOp:
    """One collective of one training step: its kind, mesh axis, phase and payload bytes.

    Bytes are what each rank of the axis logs (`autopar.kernels.collectives`), as a sympy
    expression in the batch symbol so one plan prices every micro-batch size.
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

    `sum_grads`: each rank's gradient of the input is a partial sum to all-reduce, over the
    rule's own axis (True) or over the axes named.
    """

    layout: Layout
    sum_grads: bool | tuple[str, ...] = False

    def grad_axes(self, axis: str) -> tuple[str, ...]:
        """The axes to sum the gradient over, `axis` standing for True."""
        if self.sum_grads is True:
            return (axis,)
        return tuple(self.sum_grads or ())


class Rewrite(str, Enum):
    """The sharded form the rewrite pass gives an op; `autopar.passes.tensor_parallel`
    holds one handler per member."""

    LOCAL_SIZES = "local_sizes"  # a view's, expand's or split's sizes divided by the ranks
    ROW_LINEAR = "row_linear"  # linear on the local input features, then all-reduced
    PARTIAL_LINEAR = "partial_linear"  # the same left a partial sum (sequence parallelism)
    VOCAB_EMBEDDING = "vocab_parallel_embedding"
    VOCAB_CROSS_ENTROPY = "vocab_parallel_cross_entropy"
    GRID_LINEAR = "grid_linear"  # the 2D, 2.5D and 3D kernels of autopar.kernels.multid
    GRID_NORM = "grid_norm"
    GRID_CROSS_ENTROPY = "grid_cross_entropy"  # also the token-split loss over cp
    PARTIAL_MEAN = "partial_mean"  # a mean over a split dim, divided by its ranks
    GLOBAL_SIZE = "global_size"  # a size read from a split batch dim, scaled back to global
    SEQUENCE_ATTENTION = "sequence_attention"  # ring or Ulysses attention over cp
    STREAM_DROPOUT = "stream_dropout"  # dropout on the random stream its layout calls for
    STREAM_ATTENTION = "stream_attention"  # attention dropout on that stream
    TENSOR_EXPERTS = "tensor_experts"  # an MoE layer whose experts' FFN is split over tp


@dataclass
class Strategy:
    """How one op runs on the mesh, as chosen by its catalog rule."""

    name: str  # "column", "row", "vocab_parallel", "follow", "replicate", ...
    needs: dict[fx.Node, Need]
    out: Layout | list | None
    comm: list[CommOp] = field(default_factory=list)  # collectives run inside the op
    rewrite: Rewrite | None = None  # the sharded form the rewrite pass gives the op
    note: str = ""  # why, for explain (e.g. an op with no catalog entry)
    args: dict = field(default_factory=dict)  # what the rewrite needs (grid axes, eps, ...)
