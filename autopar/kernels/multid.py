"""Kernels for 2D, 2.5D and 3D tensor parallelism, as autograd Functions with explicit backward.

2D is SUMMA on a q x q grid (Xu et al. 2021, arXiv 2104.05343), 2.5D runs SUMMA in each of d
depth layers (Tesseract, Wang et al. 2021, arXiv 2105.14500), 3D gathers, multiplies and
reduce-scatters on a q x q x q cube (Bian et al. 2021, arXiv 2105.14450). The grid (`Grid2D`,
`Grid2p5D`, `Grid3D`) names the mode. Every rank of a grid must run the same kernels with the
same `requires_grad` flags. The layout of every tensor and the collectives of each kernel are
tabled in README.md beside this file.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from autopar.errors import TokenIdError
from autopar.kernels.collectives import AxisGroup
from autopar.modes import TP_2D, TP_3D, TP_25D

__all__ = [
    "Grid", "Grid2D", "Grid2p5D", "Grid3D", "ROLES",
    "linear", "layer_norm", "rms_norm", "embedding",
    "vocab_parallel_cross_entropy", "classifier_cross_entropy",
    "Linear", "LayerNorm", "RMSNorm", "Embedding", "ClassifierCrossEntropy",
]

ROLES = ("x", "ids", "y", "target", "weight", "bias", "norm", "embedding")

# A block spec: tensor dim -> the groups that split it, major first.
Spec = dict[int, tuple[AxisGroup, ...]]


# --------------------------------------------------------------------------------------
# Grids: which groups split which dims of each tensor role
# --------------------------------------------------------------------------------------


class Grid(abc.ABC):
    """Common part of the three grids: block specs per tensor role, cut and assemble."""

    mode: str = ""

    @property
    @abc.abstractmethod
    def hidden(self) -> AxisGroup:
        """The group that splits the hidden (last) dim of activations."""

    @property
    @abc.abstractmethod
    def batch(self) -> tuple[AxisGroup, ...]:
        """The groups that split the batch (first) dim of activations, major first."""

    @property
    def out_grid(self) -> "Grid":
        """The grid whose x layout the output of `linear(x, W, b, self)` has."""
        return self

    @abc.abstractmethod
    def _weight_spec(self) -> Spec:
        """Which groups split a linear weight [out, in]."""

    @abc.abstractmethod
    def _bias_spec(self) -> Spec:
        """Which groups split a linear bias [out]."""

    def spec(self, role: str) -> Spec:
        """Which groups split which dims of a tensor in `role` (see ROLES), major first.

        x: activation; ids: token ids lying like x; y: linear output (x of `out_grid`);
        target: labels lying like y; weight / bias: linear or classifier parameters;
        norm: LayerNorm / RMSNorm parameters; embedding: the [vocab, hidden] table.
        """
        if role == "x":
            return {0: self.batch, -1: (self.hidden,)}
        if role == "ids":
            return {0: self.batch}
        if role == "y":
            return self.out_grid.spec("x")
        if role == "target":
            return self.out_grid.spec("ids")
        if role == "weight":
            return self._weight_spec()
        if role == "bias":
            return self._bias_spec()
        if role == "norm":
            return {0: (self.hidden,)}
        if role == "embedding":
            return {1: (self.hidden,)}
        raise ValueError(f"unknown tensor role {role!r}; expected one of {ROLES}")

    def slices(self, role: str, shape) -> tuple[slice, ...]:
        """This rank's block of a whole tensor of `shape` in `role`, as one slice per dim."""
        return _block_slices(tuple(shape), self.spec(role), role)

    def cut(self, full: torch.Tensor, role: str) -> torch.Tensor:
        """This rank's block of the whole tensor `full` in `role` (a contiguous copy)."""
        return full[self.slices(role, full.shape)].clone()

    def assemble(self, block: torch.Tensor, role: str, phase: str = "state") -> torch.Tensor:
        """The whole tensor from every rank's `block` in `role` (a collective: all ranks call).

        All-gathers over the splitting groups, minor first; replicated axes are not touched,
        so each replica assembles from its own copies.
        """
        out = block.detach()
        for dim, groups in self.spec(role).items():
            for g in reversed(groups):
                out = g.all_gather(out, dim, 1, phase)
        return out


@dataclass(frozen=True)
class _SummaGrid(Grid):
    """What 2D and 2.5D share: a q x q SUMMA grid of `row` (ranks sharing row index i,
    rank = j) and `col` (ranks sharing column j, rank = i) groups."""

    row: AxisGroup
    col: AxisGroup

    def __post_init__(self):
        if self.row.size != self.col.size:
            where = " in each layer" if self.mode == TP_25D else ""
            raise ValueError(f"a {self.mode.upper()} grid is square{where}; row has "
                             f"{self.row.size} ranks, col {self.col.size}")

    @property
    def q(self) -> int:
        return self.row.size

    @property
    def hidden(self) -> AxisGroup:
        return self.row

    def _weight_spec(self) -> Spec:
        return {0: (self.row,), 1: (self.col,)}

    def _bias_spec(self) -> Spec:
        return {0: (self.row,)}


@dataclass(frozen=True)
class Grid2D(_SummaGrid):
    """q x q grid: `row` = ranks sharing row index i (rank = j), `col` = sharing column j
    (rank = i)."""

    mode = TP_2D

    @property
    def coords(self) -> tuple[int, int]:
        return (self.col.rank, self.row.rank)

    @property
    def batch(self) -> tuple[AxisGroup, ...]:
        return (self.col,)


@dataclass(frozen=True)
class Grid2p5D(_SummaGrid):
    """q x q x d grid: `row`, `col` as in 2D within a depth layer, `dep` across layers
    (rank = k)."""

    dep: AxisGroup
    mode = TP_25D

    @property
    def d(self) -> int:
        return self.dep.size

    @property
    def coords(self) -> tuple[int, int, int]:
        return (self.col.rank, self.row.rank, self.dep.rank)

    @property
    def batch(self) -> tuple[AxisGroup, ...]:
        return (self.dep, self.col)


@dataclass(frozen=True)
class Grid3D(Grid):
    """q x q x q grid with groups in the roles input (index a), weight (b) and output (c)."""

    input: AxisGroup
    weight: AxisGroup
    output: AxisGroup
    mode = TP_3D

    def __post_init__(self):
        sizes = {self.input.size, self.weight.size, self.output.size}
        if len(sizes) != 1:
            raise ValueError(f"a 3D grid is a cube; input, weight and output groups have "
                             f"{self.input.size}, {self.weight.size}, {self.output.size} ranks")

    @property
    def q(self) -> int:
        return self.input.size

    @property
    def coords(self) -> tuple[int, int, int]:
        return (self.input.rank, self.weight.rank, self.output.rank)

    def swapped(self) -> "Grid3D":
        """The grid of the next layer: input and output roles exchanged, weight kept."""
        return Grid3D(self.output, self.weight, self.input)

    @property
    def out_grid(self) -> "Grid3D":
        return self.swapped()

    @property
    def hidden(self) -> AxisGroup:
        return self.output

    @property
    def batch(self) -> tuple[AxisGroup, ...]:
        return (self.weight, self.input)

    def _weight_spec(self) -> Spec:
        return {0: (self.input, self.weight), 1: (self.output,)}

    def _bias_spec(self) -> Spec:
        return {0: (self.input,)}


def _block_slices(shape: tuple, spec: Spec, role: str) -> tuple[slice, ...]:
    out = [slice(None)] * len(shape)
    for dim, groups in spec.items():
        d = dim % len(shape)
        parts, index = 1, 0
        for g in groups:  # major first: index = ((i0 * s1) + i1) * s2 + i2 ...
            parts *= g.size
            index = index * g.size + g.rank
        if shape[d] % parts:
            axes = " x ".join(g.axis for g in groups)
            raise ValueError(f"dim {d} of a {role} tensor of shape {list(shape)} has "
                             f"{shape[d]} entries, which do not split into {parts} equal "
                             f"slices over {axes}")
        n = shape[d] // parts
        out[d] = slice(index * n, (index + 1) * n)
    return tuple(out)


# --------------------------------------------------------------------------------------
# Linear
# --------------------------------------------------------------------------------------


def _bcast(g: AxisGroup, t: torch.Tensor, src: int, phase: str) -> torch.Tensor:
    """Member `src`'s `t` on every member of `g` (the others pass a same-shaped buffer)."""
    buf = t if g.rank == src else torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return g.broadcast(buf, src, phase)


class _SummaLinear(torch.autograd.Function):
    """y = x @ W.T + b on a q x q grid by SUMMA; `dep` (2.5D) sums the parameter gradients."""

    @staticmethod
    def forward(ctx, x, w, b, row: AxisGroup, col: AxisGroup, dep: AxisGroup | None):
        q = row.size
        x2 = x.reshape(-1, x.shape[-1])
        y = x2.new_zeros(x2.shape[0], w.shape[0])
        for k in range(q):
            xk = _bcast(row, x2, k, "forward")  # x(i, k)
            wk = _bcast(col, w, k, "forward")   # W-block(k, j) = W[out j, in k]
            y.addmm_(xk, wk.T)
        if b is not None:
            y += b
        ctx.save_for_backward(x, w)
        ctx.groups = (row, col, dep)
        ctx.has_bias = b is not None
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        row, col, dep = ctx.groups
        q = row.size
        dy2 = dy.reshape(-1, w.shape[0])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            for l in range(q):
                wl = _bcast(col, w, l, "backward")  # W-block(l, j)
                part = row.reduce(dy2 @ wl, l, "backward")  # sum_j -> dx(i, l)
                if row.rank == l:
                    dx = part
            dx = dx.reshape(x.shape)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            for l in range(q):
                xl = _bcast(row, x2, l, "backward")  # x(i, l)
                part = col.reduce(dy2.T @ xl, l, "backward")  # sum_i -> dW-block(l, j)
                if col.rank == l:
                    dw = part
            if dep is not None:
                dw = dep.all_reduce(dw, "backward")
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = col.all_reduce(dy2.sum(0), "backward")
            if dep is not None:
                db = dep.all_reduce(db, "backward")
        return dx, dw, db, None, None, None


class _Linear3D(torch.autograd.Function):
    """y = x @ W.T + b on a q x q x q grid: gather x and W, multiply, reduce-scatter y."""

    @staticmethod
    def forward(ctx, x, w, b, inp: AxisGroup, wgt: AxisGroup, out: AxisGroup):
        xg = inp.all_gather(x, 0, 1, "forward")  # B: b of q, H: c of q
        wg = wgt.all_gather(w, 0, 1, "forward")  # out: a of q, in: c of q
        partial = torch.matmul(xg, wg.T)  # B: b, out: a; a partial sum over c
        y = out.reduce_scatter(partial, 0, 1, "forward")  # B: b*q + c
        if b is not None:
            y = y + b
        ctx.save_for_backward(xg, wg)
        ctx.groups = (inp, wgt, out)
        ctx.has_bias = b is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        xg, wg = ctx.saved_tensors
        inp, wgt, out = ctx.groups
        dyg = out.all_gather(dy, 0, 1, "backward")  # B: b of q, out: a of q
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = inp.reduce_scatter(torch.matmul(dyg, wg), 0, 1, "backward")
        dy2 = dyg.reshape(-1, dyg.shape[-1])
        if ctx.needs_input_grad[1]:
            dw = wgt.reduce_scatter(dy2.T @ xg.reshape(-1, xg.shape[-1]), 0, 1, "backward")
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = wgt.all_reduce(dy2.sum(0), "backward")
        return dx, dw, db, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           grid: Grid) -> torch.Tensor:
    """x @ W.T + b with x, W, b and the result in the blocks of the layout table (README.md).

    The result lies like x of `grid.out_grid` (of `grid` itself in 2D and 2.5D).
    """
    if isinstance(grid, Grid3D):
        return _Linear3D.apply(x, weight, bias, grid.input, grid.weight, grid.output)
    if isinstance(grid, Grid2p5D):
        return _SummaLinear.apply(x, weight, bias, grid.row, grid.col, grid.dep)
    if isinstance(grid, Grid2D):
        return _SummaLinear.apply(x, weight, bias, grid.row, grid.col, None)
    raise TypeError(f"expected a Grid2D, Grid2p5D or Grid3D, got {type(grid).__name__}")


# --------------------------------------------------------------------------------------
# Norms over a split hidden dim
# --------------------------------------------------------------------------------------


def _sum_over(groups, t: torch.Tensor, phase: str) -> torch.Tensor:
    for g in groups:
        t = g.all_reduce(t, phase)
    return t


def _param_grads(dy, xhat, wants, replicas):
    """Sum over the batch of dy * xhat (norm weight) and dy (norm bias), then over replicas."""
    hl = dy.shape[-1]
    dy2, xh2 = dy.reshape(-1, hl), xhat.reshape(-1, hl)
    parts = []
    if wants[0]:
        parts.append((dy2 * xh2).sum(0))
    if wants[1]:
        parts.append(dy2.sum(0))
    if not parts:
        return None, None
    packed = _sum_over(replicas, torch.cat(parts), "backward")  # one message per group
    got = list(packed.split(hl))
    dw = got.pop(0) if wants[0] else None
    db = got.pop(0) if wants[1] else None
    return dw, db


class SplitLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, hidden: AxisGroup, replicas: tuple, eps: float):
        n = x.shape[-1] * hidden.size
        mean = hidden.all_reduce(x.sum(-1, keepdim=True), "forward") / n
        xc = x - mean
        var = hidden.all_reduce((xc * xc).sum(-1, keepdim=True), "forward") / n
        rstd = torch.rsqrt(var + eps)
        xhat = xc * rstd
        y = xhat
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
        ctx.save_for_backward(xhat, rstd, w)
        ctx.hidden, ctx.replicas, ctx.n = hidden, replicas, n
        ctx.has = (w is not None, b is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        xhat, rstd, w = ctx.saved_tensors
        g = dy * w if w is not None else dy
        dx = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([g.sum(-1, keepdim=True), (g * xhat).sum(-1, keepdim=True)], -1)
            sums = ctx.hidden.all_reduce(sums, "backward") / ctx.n
            dx = rstd * (g - sums[..., :1] - xhat * sums[..., 1:])
        wants = (ctx.has[0] and ctx.needs_input_grad[1], ctx.has[1] and ctx.needs_input_grad[2])
        dw, db = _param_grads(dy, xhat, wants, ctx.replicas)
        return dx, dw, db, None, None, None


class SplitRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, hidden: AxisGroup, replicas: tuple, eps: float):
        n = x.shape[-1] * hidden.size
        ms = hidden.all_reduce((x * x).sum(-1, keepdim=True), "forward") / n
        rstd = torch.rsqrt(ms + eps)
        xhat = x * rstd
        y = xhat * w if w is not None else xhat
        ctx.save_for_backward(xhat, rstd, w)
        ctx.hidden, ctx.replicas, ctx.n = hidden, replicas, n
        ctx.has_weight = w is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        xhat, rstd, w = ctx.saved_tensors
        g = dy * w if w is not None else dy
        dx = None
        if ctx.needs_input_grad[0]:
            s = ctx.hidden.all_reduce((g * xhat).sum(-1, keepdim=True), "backward") / ctx.n
            dx = rstd * (g - xhat * s)
        dw, _ = _param_grads(dy, xhat, (ctx.has_weight and ctx.needs_input_grad[1], False),
                             ctx.replicas)
        return dx, dw, None, None, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               grid: Grid, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the whole hidden dim of x (split over `grid.hidden`); output lies like x.

    Mean and variance: two all-reduces of one value per row over `grid.hidden` (the variance
    is taken around the global mean). Backward: one all-reduce of two values per row, and
    one of the packed weight and bias gradients per batch-splitting group.
    """
    return SplitLayerNorm.apply(x, weight, bias, grid.hidden, grid.batch, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, grid: Grid,
             eps: float | None = None) -> torch.Tensor:
    """RMSNorm over the whole hidden dim (eps None: the dtype's machine epsilon, as torch)."""
    if eps is None:
        eps = torch.finfo(x.dtype).eps
    return SplitRMSNorm.apply(x, weight, grid.hidden, grid.batch, eps)


# --------------------------------------------------------------------------------------
# Embedding
# --------------------------------------------------------------------------------------


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, w, replicas: tuple, padding_idx: int | None):
        ctx.save_for_backward(ids)
        ctx.shape, ctx.replicas, ctx.padding_idx = w.shape, replicas, padding_idx
        return F.embedding(ids, w)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        dw = dy.new_zeros(ctx.shape)
        dw.index_add_(0, ids.reshape(-1), dy.reshape(-1, ctx.shape[1]))
        if ctx.padding_idx is not None:
            dw[ctx.padding_idx] = 0
        return None, _sum_over(ctx.replicas, dw, "backward"), None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, grid: Grid,
              padding_idx: int | None = None) -> torch.Tensor:
    """Rows of the [vocab, hidden] table for `ids` (lying like x's batch); output lies like x.

    The table is split on hidden like activations, so the forward needs no communication;
    its gradient is all-reduced over the groups that split the batch. `padding_idx` rows get
    no gradient, as in torch.
    """
    if padding_idx is not None and padding_idx < 0:
        padding_idx += weight.shape[0]
    return _Embedding.apply(ids, weight, grid.batch, padding_idx)


# --------------------------------------------------------------------------------------
# Vocabulary-parallel cross-entropy
# --------------------------------------------------------------------------------------


def check_index_range(ids: torch.Tensor, rows: int, what: str,
                      ignore_index: int | None = None) -> None:
    """Refuse indices outside [0, rows) (but `ignore_index`) as one device would: a
    TokenIdError (an IndexError) on the CPU, an asynchronous device-side assertion on a GPU
    (no host sync). A split table or masked lookup would otherwise read zeros silently."""
    if ids.dtype.is_floating_point or ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= rows)
    if ignore_index is not None:
        bad &= ids != ignore_index
    if ids.is_cuda:
        torch._assert_async(~bad.any(), f"{what}: an index outside [0, {rows})")
        return
    if bad.any():
        first = int(ids[bad].reshape(-1)[0])
        skip = f" (nor ignore_index {ignore_index})" if ignore_index is not None else ""
        raise TokenIdError(f"{what} holds {first}, outside [0, {rows}){skip}; use indices below "
                           f"{rows}, e.g. a tokenizer with the model's vocabulary size.")


class VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab: AxisGroup, batch: tuple, ignore_index: int):
        vl = logits.shape[-1]
        start = vocab.rank * vl if vocab is not None else 0
        check_index_range(target, vl * (vocab.size if vocab is not None else 1),
                          "the cross-entropy target", ignore_index)
        z = logits.reshape(-1, vl)
        t = target.reshape(-1)
        row_max = z.max(-1).values
        if vocab is not None:
            row_max = vocab.all_reduce(row_max, "forward", op=dist.ReduceOp.MAX)
        shifted = z - row_max[:, None]
        exp = shifted.exp()
        valid = t != ignore_index
        inside = valid & (t >= start) & (t < start + vl)
        local_t = (t - start).masked_fill(~inside, 0)
        picked = shifted.gather(1, local_t[:, None]).squeeze(1) * inside
        sums = torch.stack([exp.sum(-1), picked])
        if vocab is not None:
            sums = vocab.all_reduce(sums, "forward")
        losses = (sums[0].log() - sums[1]) * valid
        total = _sum_over(batch, torch.stack([losses.sum(), valid.sum().to(z.dtype)]), "forward")
        ctx.save_for_backward(exp / sums[0][:, None], local_t, inside, valid, total[1])
        ctx.shape = logits.shape
        return total[0] / total[1]

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, inside, valid, count = ctx.saved_tensors
        dz = ce_logit_grad(softmax, local_t, inside, valid.to(softmax.dtype) * (grad / count))
        return dz.reshape(ctx.shape), None, None, None, None


def ce_logit_grad(softmax: torch.Tensor, local_t: torch.Tensor, inside: torch.Tensor,
                  row_scale: torch.Tensor) -> torch.Tensor:
    """Gradient of cross-entropy for this rank's [rows, vocabulary slice] logits: softmax
    minus the one-hot of targets inside the slice, each row times `row_scale`."""
    dz = softmax.clone()
    rows = torch.arange(dz.shape[0], device=dz.device)
    dz[rows, local_t] -= inside.to(dz.dtype)
    return dz * row_scale[:, None]


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, grid: Grid,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over the whole global batch, the same scalar on every rank.

    `logits` [batch, ..., vocab] lie like x of `grid` (vocab split over `grid.hidden`);
    `target` [batch, ...] like ids of `grid`. Rows whose target is `ignore_index` count
    neither in the sum nor in the mean. Forward: a max and a packed (sum of exp, target
    logit) all-reduce per row over `grid.hidden`, then (loss sum, row count) all-reduced
    over each batch-splitting group. Backward needs no communication.
    """
    return VocabParallelCE.apply(logits, target, grid.hidden, grid.batch, ignore_index)


def classifier_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                             grid: Grid, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of logits = x @ E.T over the global batch (every rank gets it).

    `weight` E [vocab, hidden] is cut like a linear weight (vocab as out-features) and
    `target` lies like the logits' batch (role "target": in 3D that is y's batch, not x's).
    """
    logits = linear(x, weight, None, grid)
    return vocab_parallel_cross_entropy(logits, target, grid.out_grid, ignore_index)


# --------------------------------------------------------------------------------------
# Modules holding this rank's blocks
# --------------------------------------------------------------------------------------


class Linear(nn.Module):
    """A linear layer holding this rank's blocks of W and b (see `linear`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, grid: Grid):
        super().__init__()
        self.grid = grid
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_dense(cls, module: nn.Linear, grid: Grid) -> "Linear":
        bias = grid.cut(module.bias.data, "bias") if module.bias is not None else None
        return cls(grid.cut(module.weight.data, "weight"), bias, grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.grid)


class LayerNorm(nn.Module):
    """LayerNorm over the split hidden dim, holding this rank's slice of weight and bias."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, grid: Grid,
                 eps: float = 1e-5):
        super().__init__()
        self.grid, self.eps = grid, eps
        self.weight = nn.Parameter(weight) if weight is not None else None
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_dense(cls, module: nn.LayerNorm, grid: Grid) -> "LayerNorm":
        if len(module.normalized_shape) != 1:
            raise ValueError("a split LayerNorm normalizes over the hidden dim only; got "
                             f"normalized_shape={tuple(module.normalized_shape)}")
        w = grid.cut(module.weight.data, "norm") if module.weight is not None else None
        b = grid.cut(module.bias.data, "norm") if module.bias is not None else None
        return cls(w, b, grid, module.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.grid, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm over the split hidden dim, holding this rank's slice of the weight."""

    def __init__(self, weight: torch.Tensor | None, grid: Grid, eps: float | None = None):
        super().__init__()
        self.grid, self.eps = grid, eps
        self.weight = nn.Parameter(weight) if weight is not None else None

    @classmethod
    def from_dense(cls, module: nn.RMSNorm, grid: Grid) -> "RMSNorm":
        if len(module.normalized_shape) != 1:
            raise ValueError("a split RMSNorm normalizes over the hidden dim only; got "
                             f"normalized_shape={tuple(module.normalized_shape)}")
        w = grid.cut(module.weight.data, "norm") if module.weight is not None else None
        return cls(w, grid, module.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.grid, self.eps)


class Embedding(nn.Module):
    """An embedding holding this rank's hidden slice of the whole [vocab, hidden] table."""

    def __init__(self, weight: torch.Tensor, grid: Grid, padding_idx: int | None = None):
        super().__init__()
        self.grid, self.padding_idx = grid, padding_idx
        self.weight = nn.Parameter(weight)

    @classmethod
    def from_dense(cls, module: nn.Embedding, grid: Grid) -> "Embedding":
        return cls(grid.cut(module.weight.data, "embedding"), grid, module.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight, self.grid, self.padding_idx)


class ClassifierCrossEntropy(nn.Module):
    """logits = x @ E.T, then the mean vocabulary-parallel cross-entropy over the global batch."""

    def __init__(self, weight: torch.Tensor, grid: Grid, ignore_index: int = -100):
        super().__init__()
        self.grid, self.ignore_index = grid, ignore_index
        self.weight = nn.Parameter(weight)

    @classmethod
    def from_dense(cls, weight: torch.Tensor, grid: Grid,
                   ignore_index: int = -100) -> "ClassifierCrossEntropy":
        return cls(grid.cut(weight.detach(), "weight"), grid, ignore_index)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return classifier_cross_entropy(x, self.weight, target, self.grid, self.ignore_index)

