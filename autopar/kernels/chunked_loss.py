"""Chunked cross-entropy: the classifier matmul, its optional fp32 upcast and the
cross-entropy as one op that never holds the whole [tokens, vocabulary] logits.

The forward walks the tokens in chunks: each chunk's logits are made, reduced to three
numbers per token (row max, sum of exponentials under that max, target logit) and freed.
The backward recomputes each chunk's logits from the saved hidden states and weight, turns
them into that chunk's gradient and folds it into the hidden-state and weight gradients
at once, so the peak holds one chunk's logits and gradient (the technique of Liger-Kernel's
fused linear cross-entropy and torchtitan's chunked loss). Where the logits are a single
chunk there is nothing to save by making them again: the forward keeps that chunk (as
exp(z - max)) and the backward turns it into the gradient in place, with no second
classifier matmul (a zero-bubble weight half still makes it again).

Under vocabulary parallelism (Megatron's 1D split of the classifier, Shoeybi et al. 2019)
each rank holds a vocabulary slice. The per-token triples of every chunk are gathered
first and combined across ranks after the loop, with the same three all-reduces of one
value per token as the unchunked kernel (`modules.VocabParallelCrossEntropy`): the local
sums are rescaled to the global max before they are summed (sum_r s_r exp(m_r - M)), so
the collectives' count and bytes, and with them the plan's prediction, do not change.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.graph.losses import chunk_rows
from autopar.kernels import multid
from autopar.kernels.collectives import AxisGroup, Bound


def _logits(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """One chunk's logits in fp32 (the loss's softmax runs in fp32 whatever x's dtype)."""
    z = x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())
    return z.float()


REMADE, SPLIT = "remade", "split"
"""What a timer's spans are tagged with: the backward's logits made again, in the one-node
backward or the input half (B), and once more in the weight half (W) of a split loss."""


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, g: AxisGroup | None, spec: tuple, timer=None):
        reduction, ignore_index, rows = spec
        vl = weight.shape[0]
        start = g.rank * vl if g is not None else 0
        t = target.reshape(-1)
        multid.check_index_range(t, vl * (g.size if g is not None else 1),
                                 "the cross-entropy target", ignore_index)
        xf = x.reshape(-1, x.shape[-1])
        n = xf.shape[0]
        row_max, sums, picked = (torch.empty(n, device=x.device) for _ in range(3))
        inside = (t >= start) & (t < start + vl)
        local_t = (t - start).masked_fill(~inside, 0)
        kept = (None, None)  # (exp(z - m), m) of the chunk, where the logits are a single one
        for a in range(0, n, rows):  # one chunk's logits alive at a time, reduced in place
            z = _logits(xf[a:a + rows], weight, bias)  # (rows, vocab slice)
            m = z.max(-1).values
            row_max[a:a + rows] = m
            picked[a:a + rows] = z.gather(1, local_t[a:a + rows, None]).squeeze(1)
            sums[a:a + rows] = z.sub_(m[:, None]).exp_().sum(-1)
            if n <= rows:  # nothing to save by making them again: kept for the backward
                kept = (z, m)
            del z
        picked = picked * inside
        if g is not None:  # the three per-token all-reduces of the unchunked kernel
            whole = g.all_reduce(row_max.clone(), "forward", op=dist.ReduceOp.MAX)
            sums = g.all_reduce(sums * (row_max - whole).exp(), "forward")
            picked = g.all_reduce(picked, "forward")
            row_max = whole
        lse = row_max + sums.log()
        valid = t != ignore_index
        losses = (lse - picked) * valid
        count = valid.sum().float()
        # (the kept chunk saved as autograd saves tensors: what measures activations sees it,
        # and a second backward through it, which found it consumed, is refused by autograd)
        ctx.save_for_backward(x, weight, bias, lse, local_t, inside, valid, count, *kept)
        ctx.spec, ctx.timer = spec, timer
        ctx.mark_non_differentiable(lse, local_t, inside, valid, count)
        loss = losses.sum() if reduction == 2 else losses.sum() / count
        return loss, lse, local_t, inside, valid, count

    @staticmethod
    def backward(ctx, grad, *_):
        x, weight, bias, lse, local_t, inside, valid, count, z, m = ctx.saved_tensors
        dx, dw, db = _gradients(x, weight, bias, (lse, local_t, inside, valid, count), grad,
                                ctx.spec, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                (ctx.timer, REMADE), None if z is None else (z, m))
        return dx, dw, db, None, None, None, None


class _WeightHalf(torch.autograd.Function):
    """The weight gradient of a split chunked loss: forward a zero added to the loss, its
    backward the classifier's weight (and bias) gradient, from the statistics the input half
    saved; a zero-bubble stage runs it in its W pass, apart from the input gradient (B)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lse, local_t, inside, valid, count, spec, timer=None):
        ctx.save_for_backward(x, weight, bias, lse, local_t, inside, valid, count)
        ctx.spec, ctx.timer = spec, timer
        return lse.new_zeros(())

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, *stats = ctx.saved_tensors
        _, dw, db = _gradients(x, weight, bias, stats, grad, ctx.spec, False, True,
                               (ctx.timer, SPLIT))
        return None, dw, db, None, None, None, None, None, None, None


def _gradients(x, weight, bias, stats, grad, spec, want_x: bool, want_w: bool,
               timed: tuple = (None, REMADE), kept: tuple | None = None):
    """dx, dW, db of the chunked loss (None where not wanted), chunk by chunk: each
    chunk's logits are made again, turned into their gradient in place and folded in.
    `timed`: (a timer, or None; the tag its spans of the logits made again take); `kept`:
    the forward's (exp(z - m), m) where the logits were a single chunk, turned into the
    softmax in place instead of made again."""
    timer, tag = timed
    lse, local_t, inside, valid, count = stats
    reduction, _, rows = spec
    scale = grad * valid if reduction == 2 else grad * valid / count
    xf = x.reshape(-1, x.shape[-1])
    dx = torch.empty_like(xf) if want_x else None
    # the first chunk writes dW (and db) by its GEMM, the others add to it: no zero-filled
    # table of the classifier's size first (at vocabulary 32768 and width 768, 100 MB)
    dw = db = None
    for a in range(0, xf.shape[0], rows):  # the chunk's softmax and gradient in place
        if kept is not None:  # exp(z - m) exp(m - lse): (this rank's m, the global lse)
            dz = kept[0].mul_((kept[1] - lse).exp()[:, None])
        else:
            start = timer.now() if timer is not None else None
            dz = _logits(xf[a:a + rows], weight, bias)
            if timer is not None:
                timer.span(tag, start)
            dz = dz.sub_(lse[a:a + rows, None]).exp_()
        hit = torch.arange(dz.shape[0], device=dz.device)
        dz[hit, local_t[a:a + rows]] -= inside[a:a + rows].to(dz.dtype)
        dz = dz.mul_(scale[a:a + rows, None]).to(x.dtype)
        if dx is not None:
            torch.mm(dz, weight, out=dx[a:a + rows])
        if want_w:
            dw = torch.mm(dz.t(), xf[a:a + rows]) if dw is None else \
                dw.addmm_(dz.t(), xf[a:a + rows])
            if bias is not None:
                db = dz.sum(0).to(bias.dtype) if db is None else db.add_(dz.sum(0))
        del dz
    if want_w and dw is None:  # (no rows)
        dw = torch.zeros_like(weight)
        db = torch.zeros_like(bias) if bias is not None else None
    return None if dx is None else dx.reshape(x.shape), dw, db


class ChunkedCrossEntropy(Bound):
    """Cross-entropy of x @ W.T (+ b), in chunks of `chunk_rows(this rank's vocabulary,
    chunk_bytes)` tokens; W's rows split over `axis` (vocabulary-parallel) or whole (axis
    None). `reduction`: 1 the mean over the tokens
    whose target is not `ignore_index`, 2 their sum. The logits are fp32 (upcast when x is
    16-bit), as the unchunked kernels compute them. `split`: the input and weight gradients
    in two autograd nodes (zero-bubble's B and W passes), each making the chunks' logits
    again; otherwise one backward makes them once for both."""

    def __init__(self, axis: str | None, reduction: int = 1, ignore_index: int = -100,
                 chunk_bytes: int | None = None, split: bool = False):
        super().__init__(axis)
        self.reduction, self.ignore_index = reduction, ignore_index
        self.chunk_bytes, self.split = chunk_bytes, split
        # what times the logits the backward makes again (`now()`, `span(tag, start)`: the
        # engine's recorder, for explain), or None
        self.timer = None

    def extra_repr(self) -> str:
        return f"axis={self.axis}, chunk_bytes={self.chunk_bytes}, split={self.split}"

    def bind(self, groups: dict[str, AxisGroup]) -> None:
        if self.axis is not None:
            super().bind(groups)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        g = self._g() if self.axis is not None else None
        spec = (self.reduction, self.ignore_index, chunk_rows(weight.shape[0], self.chunk_bytes))
        if not self.split:
            return _ChunkedCE.apply(x, weight, bias, target, g, spec, self.timer)[0]
        detached = None if bias is None else bias.detach()
        loss, *stats = _ChunkedCE.apply(x, weight.detach(), detached, target, g, spec,
                                        self.timer)
        return loss + _WeightHalf.apply(x.detach(), weight, bias, *stats, spec, self.timer)
