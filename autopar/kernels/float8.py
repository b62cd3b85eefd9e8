"""Float8 linear layers: the three GEMMs of a linear (forward, grad-input, grad-weight) on
`torch._scaled_mm` with dynamic scaling, rowwise or tensorwise (docs/fp8-training.md).

Rowwise (the default): every operand in e4m3 with one power-of-two scale per row of a GEMM's
left operand and per column of its right one (the dims the GEMM keeps), from this rank's
piece of the row; no collective. Tensorwise: each step every operand gets one scale from
its current amax, rounded down to a power of two (so a scale only shifts exponents and
rounding is the same whatever the amax, subnormals aside); activations and weights in e4m3,
output gradients in e5m2; the backward reuses the forward's float8 input and weight. Both:
products accumulate in fp32 and come out in the input's dtype (bf16). Under tensorwise, where
a tensor is split over the tensor axis its amax is taken over the whole tensor: one
all-reduce (max) of 4 bytes through the axis group, logged like every collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.kernels.collectives import AxisGroup, Bound

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MULTIPLE = 16  # the fp8 GEMM kernels take dims (in, out features) divisible by this
INPUT, WEIGHT, GRAD = "input", "weight", "grad"  # the operands a layer's split may name
FORWARD_AMAX, BACKWARD_AMAX = (INPUT, WEIGHT), (GRAD,)  # whose amax each phase reduces
TENSORWISE, ROWWISE = "tensorwise", "rowwise"  # the scaling recipes (docs/fp8-training.md)
RECIPES = (TENSORWISE, ROWWISE)
RECIPE_TEXT = {  # what each recipe does, as explain prints it
    TENSORWISE: "e4m3 activations and weights, e5m2 gradients, tensorwise power-of-two scales",
    ROWWISE: "e4m3 activations, weights and gradients, rowwise power-of-two scales"}


def check_recipe(recipe: str) -> str:
    """`recipe` when it names a scaling recipe, else a ValueError saying which do."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8_recipe={recipe!r} is not a float8 scaling recipe; pass one of "
                         f"{', '.join(map(repr, RECIPES))}")
    return recipe


def scale_for(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The power of two that brings `amax` to at most the largest finite value of `dtype`;
    at most 2**126, so that a zero amax (an all-zero tensor, or row under rowwise scaling)
    gets a finite scale whose reciprocal is a normal float32."""
    top = torch.finfo(dtype).max
    amax = amax.float().clamp(min=torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.floor(torch.log2(top / amax)).clamp(max=126))


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale in `dtype`, saturated at its largest finite value."""
    top = torch.finfo(dtype).max
    return (x.float() * scale).clamp(-top, top).to(dtype)


def _amax(x: torch.Tensor, group: AxisGroup | None, phase: str) -> torch.Tensor:
    """The largest |x| of the whole tensor: over `group` when x is split there."""
    amax = x.abs().max().float().reshape(1)
    if group is not None:
        amax = group.all_reduce(amax, phase, op=dist.ReduceOp.MAX)
    return amax


def _mm(a: torch.Tensor, b: torch.Tensor, scale_a, scale_b, out_dtype) -> torch.Tensor:
    """a [m, k] @ b [k, n] in float8, a row-major, b column-major as the kernel wants; the
    rows padded with zeros to a multiple of 16 (exact: the padding's products are dropped)."""
    m = a.shape[0]
    pad = -m % MULTIPLE
    if pad:
        a = torch.cat([a, torch.zeros((pad, a.shape[1]), dtype=a.dtype, device=a.device)])
        if scale_a.dim() == 2:  # one scale per row [m, 1]: the padding's rows scaled by one
            scale_a = torch.cat([scale_a, scale_a.new_ones((pad, 1))])
    b = b.t().contiguous().t()
    out = torch._scaled_mm(a.contiguous(), b, scale_a.reciprocal(), scale_b.reciprocal(),
                           out_dtype=out_dtype)
    return out[:m] if pad else out


class _Float8Matmul(torch.autograd.Function):
    """y = x @ W.T (W [out, in], or [in, out] when `transposed`) with all three GEMMs in
    float8 at one scale per tensor; `split` names the operands split over `group` (their
    amax is reduced there)."""

    @staticmethod
    def forward(ctx, x, w, group, split, transposed):
        w_out_in = w.t() if transposed else w
        x2 = x.reshape(-1, x.shape[-1])
        sx = scale_for(_amax(x2, group if INPUT in split else None, "forward"), E4M3)
        sw = scale_for(_amax(w, group if WEIGHT in split else None, "forward"), E4M3)
        xq, wq = quantize(x2, sx, E4M3), quantize(w_out_in, sw, E4M3)
        y = _mm(xq, wq.t(), sx, sw, x.dtype)
        ctx.save_for_backward(xq, wq, sx, sw)
        ctx.group, ctx.split, ctx.transposed = group, split, transposed
        ctx.shape, ctx.dtypes = x.shape, (x.dtype, w.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        xq, wq, sx, sw = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        sg = scale_for(_amax(dy2, ctx.group if GRAD in ctx.split else None, "backward"), E5M2)
        gq = quantize(dy2, sg, E5M2)
        dx = _mm(gq, wq, sg, sw, ctx.dtypes[0]).reshape(ctx.shape)  # [m, out] @ [out, in]
        dw = _mm(gq.t(), xq, sg, sx, ctx.dtypes[1])  # [out, m] @ [m, in]
        return dx, (dw.t() if ctx.transposed else dw), None, None, None


def _rowwise(t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` in e4m3 at one power-of-two scale per slice along `dim` (dim=1: a scale per row,
    from the row's amax; dim=0: a scale per column), and the scales (kept dims)."""
    scale = scale_for(t.abs().amax(dim=dim, keepdim=True), E4M3)
    return quantize(t, scale, E4M3), scale


class _RowwiseMatmul(torch.autograd.Function):
    """y = x @ W.T as `_Float8Matmul`, every operand in e4m3 with one power-of-two scale per
    row of the GEMM's left operand and per column of its right one (along the dim each
    GEMM does not sum over), taken from this rank's piece of the row: x per token and W per
    output feature in the forward, dy per token and W per input feature for the input
    gradient, dy per output feature and x per input feature for the weight gradient."""

    @staticmethod
    def forward(ctx, x, w, transposed):
        w_out_in = w.t() if transposed else w
        x2 = x.reshape(-1, x.shape[-1])
        xq, sx = _rowwise(x2, 1)
        wq, sw = _rowwise(w_out_in, 1)
        y = _mm(xq, wq.t(), sx, sw.t(), x.dtype)
        ctx.save_for_backward(x2, w_out_in)
        ctx.transposed, ctx.shape, ctx.dtypes = transposed, x.shape, (x.dtype, w.dtype)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        gq, sg = _rowwise(dy2, 1)
        wq, sw = _rowwise(w, 0)
        dx = _mm(gq, wq, sg, sw, ctx.dtypes[0]).reshape(ctx.shape)  # [m, out] @ [out, in]
        gq, sg = _rowwise(dy2, 0)
        xq, sx = _rowwise(x2, 0)
        dw = _mm(gq.t(), xq, sg.t(), sx, ctx.dtypes[1])  # [out, m] @ [m, in]
        return dx, (dw.t() if ctx.transposed else dw), None


class Float8Linear(Bound):
    """A linear of the rewritten graph in float8: forward(x, weight, bias=None). `split`:
    which of input, weight and grad (the output's gradient) are split over the axis."""

    def __init__(self, axis: str, split: tuple[str, ...] = (), transposed: bool = False,
                 recipe: str = TENSORWISE):
        super().__init__(axis)
        self.split, self.transposed = tuple(split), transposed
        self.recipe = check_recipe(recipe)

    def extra_repr(self) -> str:
        return f"axis={self.axis}, split={list(self.split)}, transposed={self.transposed}, " \
               f"recipe={self.recipe}"

    def forward(self, x, weight, bias=None):
        if self.recipe == ROWWISE:
            y = _RowwiseMatmul.apply(x, weight, self.transposed)
        else:
            group = self._g() if self.split else None
            y = _Float8Matmul.apply(x, weight, group, self.split, self.transposed)
        return y if bias is None else y + bias

    def amax_bytes(self) -> dict[str, int]:
        """Bytes this layer all-reduces per run, by phase (one float32 per split operand;
        none under rowwise scaling, whose scales come from each rank's piece of a row)."""
        per = 0 if self.recipe == ROWWISE else 4
        return {phase: per * sum(s in self.split for s in names) for phase, names in
                (("forward", FORWARD_AMAX), ("backward", BACKWARD_AMAX))}
