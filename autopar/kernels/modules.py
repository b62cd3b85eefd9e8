"""Sharded forms of ops that need more than a redistribution: the graph modules the rewrite emits.

Vocabulary-parallel embedding and cross-entropy (Megatron-LM's vocab-parallel layers, by
Shoeybi et al. 2019), dropout drawn from the random stream that matches the layout, and the
2D / 2.5D / 3D kernels of `autopar.kernels.multid` bound to the mesh axes the solver named
(`GridLinear`, `GridNorm`, `GridCrossEntropy`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar.kernels import multid
from autopar.kernels.collectives import FUNCTIONS, AxisGroup, Bound
from autopar.modes import TP, TP_2D, TP_3D, TP_25D


class VocabParallelEmbedding(Bound):
    """Lookup in this rank's rows of the table; rows owned elsewhere give zeros; then all-reduce."""

    def __init__(self, axis: str, padding_idx: int = -1, reduce: bool = True):
        super().__init__(axis)
        self.padding_idx = padding_idx
        self.reduce = reduce  # False: the output stays a partial sum (sequence parallelism)

    def forward(self, weight: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        g = self._g()
        rows = weight.shape[0]
        start = g.rank * rows
        multid.check_index_range(idx, rows * g.size, "a token id of a vocabulary-parallel "
                                 "embedding")
        outside = (idx < start) | (idx >= start + rows)
        local = (idx - start).masked_fill(outside, 0)
        pad = self.padding_idx - start if 0 <= self.padding_idx - start < rows else -1
        out = F.embedding(local, weight, padding_idx=pad if pad >= 0 else None)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if not self.reduce:
            return out
        return FUNCTIONS["reduce"].apply(out, g, None, 1, False)


class PartialBias(Bound):
    """y + b on rank 0 of the axis only: the bias of a row-split linear whose output stays a
    partial sum (sequence parallelism), so the sum over the axis adds it once. The bias's
    gradient (nonzero on rank 0 only) is then summed over the axis by the solver."""

    def forward(self, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return y + bias if self._g().rank == 0 else y + bias * 0.0


class VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, g: AxisGroup, reduction: int, ignore_index: int):
        cols = logits.shape[1]
        start = g.rank * cols
        multid.check_index_range(target, cols * g.size, "the cross-entropy target",
                                 ignore_index)
        logits = logits.float()
        row_max = g.all_reduce(logits.max(dim=1).values, "forward", op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(1)
        exp = shifted.exp()
        sum_exp = g.all_reduce(exp.sum(dim=1), "forward")
        inside = (target >= start) & (target < start + cols)
        local_t = (target - start).masked_fill(~inside, 0)
        picked = shifted.gather(1, local_t.unsqueeze(1)).squeeze(1) * inside
        picked = g.all_reduce(picked, "forward")
        valid = (target != ignore_index).to(logits.dtype)
        losses = (sum_exp.log() - picked) * valid
        count = valid.sum()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(1), local_t, inside, valid, count)
        ctx.reduction = reduction
        if reduction == 0:
            return losses
        if reduction == 2:
            return losses.sum()
        return losses.sum() / count

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, inside, valid, count = ctx.saved_tensors
        scale = grad * valid if ctx.reduction in (0, 2) else grad * valid / count  # none, sum
        return multid.ce_logit_grad(softmax, local_t, inside, scale), None, None, None, None


class VocabParallelCrossEntropy(Bound):
    """Cross-entropy over logits split by class: three all-reduces of one value per row."""

    def __init__(self, axis: str, reduction: int = 1, ignore_index: int = -100):
        super().__init__(axis)
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = VocabParallelCE.apply(logits, target, self._g(), self.reduction, self.ignore_index)
        return out.to(logits.dtype)


class GridBound(Bound):
    """A graph module that needs several mesh axes (the groups of a 2D, 2.5D or 3D grid)."""

    def __init__(self, axes: tuple[str, ...]):
        super().__init__(axes[0] if axes else TP)
        self.axes = tuple(axes)
        self.groups: dict[str, AxisGroup] | None = None

    def bind(self, groups: dict[str, AxisGroup]) -> None:
        self.groups = {a: groups[a] for a in self.axes}

    def _gs(self, axes) -> tuple[AxisGroup, ...]:
        if self.groups is None:
            raise RuntimeError(f"{type(self).__name__} on axes {self.axes} runs before the graph "
                               "was bound to a mesh; call autopar.runtime.bind(gm, groups).")
        return tuple(self.groups[a] for a in axes)


class GridLinear(GridBound):
    """`multid.linear` on the grid whose roles the axes name: (row, col) in 2D, (row, col,
    dep) in 2.5D, (input, weight, output) in 3D. `transposed`: the weight is [in, out]."""

    _GRIDS = {TP_2D: multid.Grid2D, TP_25D: multid.Grid2p5D, TP_3D: multid.Grid3D}

    def __init__(self, mode: str, grid: tuple[str, ...], transposed: bool = False):
        super().__init__(grid)
        self.mode, self.transposed = mode, transposed

    def extra_repr(self) -> str:
        return f"{self.mode}, grid={self.axes}" + (", transposed" if self.transposed else "")

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        grid = self._GRIDS[self.mode](*self._gs(self.axes))
        return multid.linear(x, weight.t() if self.transposed else weight, bias, grid)


class GridNorm(GridBound):
    """LayerNorm ("layer") or RMSNorm ("rms") over a hidden dim split on `hidden`; weight and
    bias gradients summed over `replicas`, the axes splitting the other dims."""

    def __init__(self, kind: str, hidden: str, replicas: tuple[str, ...], eps):
        super().__init__((hidden,) + tuple(replicas))
        self.kind, self.eps = kind, eps

    def extra_repr(self) -> str:
        return f"{self.kind}, hidden={self.axes[0]}, replicas={self.axes[1:]}, eps={self.eps}"

    def forward(self, x: torch.Tensor, weight=None, bias=None) -> torch.Tensor:
        hidden, *replicas = self._gs(self.axes)
        if self.kind == "layer":
            eps = 1e-5 if self.eps is None else self.eps
            return multid.SplitLayerNorm.apply(x, weight, bias, hidden, tuple(replicas), eps)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return multid.SplitRMSNorm.apply(x, weight, hidden, tuple(replicas), eps)


class GridCrossEntropy(GridBound):
    """Mean cross-entropy of logits split on vocabulary (`vocab`, or None when each rank
    holds whole rows) and rows (`batch` axes): `multid.vocab_parallel_cross_entropy`, the
    same scalar on every rank."""

    def __init__(self, vocab: str | None, batch: tuple[str, ...], ignore_index: int = -100):
        super().__init__(((vocab,) if vocab else ()) + tuple(batch))
        self.vocab, self.batch, self.ignore_index = vocab, tuple(batch), ignore_index

    def extra_repr(self) -> str:
        return f"vocab={self.vocab}, batch={self.batch}"

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        vocab = self._gs((self.vocab,))[0] if self.vocab else None
        return multid.VocabParallelCE.apply(logits, target, vocab, self._gs(self.batch),
                                             self.ignore_index)


class RandomStreams:
    """A generator per set of axes that split an activation, shared by the ranks that hold
    the same slice of it.

    Where an activation is whole on every rank of a data-parallel replica, its dropout mask
    must be the same on all of them ("replicated"); where tensor axes split it, each tensor
    rank's slice needs its own mask, the same across cp ranks when cp does not split it
    ("split"); where cp splits it (this rank's tokens), the tensor ranks holding those
    tokens draw the same mask and each cp rank its own ("tokens"); both ("split+tokens").
    """

    def __init__(self, seed: int, data_rank: int, tensor_rank: int, cp_rank: int = 0):
        base = seed + 1_000_003 * data_rank
        tensor, tokens = 7919 * (tensor_rank + 1), 104_729 * (cp_rank + 1)
        self._generators = {
            "replicated": torch.Generator().manual_seed(base),
            "split": torch.Generator().manual_seed(base + tensor),
            "tokens": torch.Generator().manual_seed(base + tokens),
            "split+tokens": torch.Generator().manual_seed(base + tensor + tokens),
        }

    def get(self, stream: str) -> torch.Generator:
        return self._generators[stream]


class StreamDropout(nn.Module):
    """Dropout whose mask comes from the stream its input's layout calls for."""

    def __init__(self, p: float, train: bool, stream: str):
        super().__init__()
        self.p, self.train_mode, self.stream = p, train, stream
        self.streams: RandomStreams | None = None

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.train_mode or self.p == 0.0:
            return x
        if self.p >= 1.0:
            return x * 0.0
        mask = torch.empty_like(x).bernoulli_(1.0 - self.p, generator=self.streams.get(self.stream))
        return x * mask / (1.0 - self.p)


class StreamCall(nn.Module):
    """Runs an op that draws from torch's default generator (attention dropout) on a given stream."""

    def __init__(self, op, stream: str):
        super().__init__()
        self.op, self.stream = op, stream
        self.streams: RandomStreams | None = None

    def extra_repr(self) -> str:
        return f"{self.op}, stream={self.stream}"

    def forward(self, *args, **kwargs):
        generator = self.streams.get(self.stream)
        saved = torch.get_rng_state()
        torch.set_rng_state(generator.get_state())
        try:
            return self.op(*args, **kwargs)
        finally:
            generator.set_state(torch.get_rng_state())
            torch.set_rng_state(saved)


def bind_streams(gm: nn.Module, streams: RandomStreams) -> None:
    for module in gm.modules():
        if isinstance(module, (StreamDropout, StreamCall)):
            module.streams = streams
