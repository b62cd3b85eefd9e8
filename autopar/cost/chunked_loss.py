"""What a chunked cross-entropy (`autopar.passes.chunked_loss`) takes off a device's memory.

Effect: the loss over a classifier's logits holds whole [tokens, vocabulary] fp32 tensors
at its peak, unchunked: aten's cross-entropy keeps the log-probabilities for backward, then
makes their gradient (nll_loss's backward) and the logits' gradient (log_softmax's
backward), three at once; the vocabulary-parallel kernel holds the logits, their shifted
copy, the exponentials and the saved softmax, four at once. Chunked, it holds one chunk's
logits, turned into that chunk's gradient in place, and keeps 4 bytes per token (the
log-sum-exp) for backward. Source: the fused linear cross-entropy of Liger-Kernel (Hsu et
al. 2024, arXiv 2410.10989) and torchtitan's chunked loss; the buffer counts are those of
the ops named above, checked by tests/test_chunked_loss.py against the live tensor bytes.

`loss_logits` finds the fused losses of a traced graph under a solution, as the pass will
fuse them; `activation_bytes` (autopar.cost.memory) takes `chunked_activations` off its
per-layer figures; `held_while_running` is the rest of the loss's peak (one chunk's logits,
or the unchunked buffers beyond the saved one), a layer workspace in the plan's memory;
`effect` is what a plan's `predicted["chunked_loss"]` and explain show; `remade` and
`remade_work` price the logits its backward makes again (REMADE_NAME, and SPLIT_NAME once more
under zero-bubble).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from autopar.graph.ir import BATCH
from autopar.graph.losses import chunk_rows, classifier_behind
from autopar.sharding.rules.vocab import cross_entropy_args
from autopar.sharding.strategy import Rewrite

aten = torch.ops.aten

NAME = "chunked cross-entropy"
SOURCE = ("the loss holds one chunk's fp32 logits instead of whole [tokens, vocabulary] "
          "ones (Liger-Kernel's fused linear cross-entropy, arXiv 2410.10989; torchtitan)")
REMADE_NAME = "chunked loss logits remade"
REMADE_SOURCE = ("the chunked loss keeps no logits for its backward, which makes each chunk's "
                 "again: one more [tokens x hidden] @ [hidden x vocabulary] GEMM per "
                 "micro-batch, chunk by chunk (the weight read per chunk), upcast to fp32 "
                 "where 16-bit, less the log-sum-exp before the softmax's exponential (one "
                 "more fp32 read and write than the unchunked backward; "
                 "autopar.kernels.chunked_loss); none where the logits are a single chunk, "
                 "which the forward keeps")
SPLIT_NAME = "zero-bubble classifier matmul"
SPLIT_SOURCE = ("a zero-bubble schedule splits the loss's backward into its input and weight "
                "halves (B and W), and each makes the chunks' logits again: one more "
                "[tokens x hidden] @ [hidden x vocabulary] GEMM per micro-batch on the last "
                "stage than the one-node backward (autopar.kernels.chunked_loss)")
EFFECTS = {REMADE_NAME: REMADE_SOURCE, SPLIT_NAME: SPLIT_SOURCE}  # (cost.model.EFFECTS)
WHOLE_BUFFERS = {"aten": 3, "vocab_parallel": 4}
"""Whole fp32 [tokens, vocabulary] tensors the unchunked loss holds at its peak (docstring)."""
FP32 = 4


@dataclass(frozen=True)
class LossLogits:
    """One fused loss on one device: its tokens and vocabulary slice."""

    layer: str  # where activation_bytes counts the saved log-probabilities
    tokens: int
    vocab: int  # this device's classes
    kernel: str  # "aten" or "vocab_parallel": what runs unchunked
    itemsize: int = FP32  # of the logits the traced loss reads (what activation_bytes counts)
    hidden: int = 0  # the classifier's input width

    @property
    def logits_flops(self) -> int:
        """FLOPs of one pass over the classifier's matmul (the chunks' logits made again)."""
        return 2 * self.tokens * self.hidden * self.vocab

    @property
    def rows(self) -> int:
        """Tokens per chunk."""
        return min(self.tokens, chunk_rows(self.vocab))

    @property
    def one_chunk(self) -> bool:
        """Whether the logits are a single chunk, which the forward keeps for the backward
        (exp(z - max) and the max: 4 bytes per logit and per token) instead of making
        them again."""
        return self.tokens <= chunk_rows(self.vocab)

    @property
    def kept_bytes(self) -> int:
        """Bytes kept for the backward: the log-sum-exp, and the one chunk where it is kept."""
        return self.tokens * FP32 + (self.chunk_bytes + self.tokens * FP32
                                     if self.one_chunk else 0)

    @property
    def whole_bytes(self) -> int:
        return self.tokens * self.vocab * FP32

    @property
    def chunk_bytes(self) -> int:
        return self.rows * self.vocab * FP32

    @property
    def unchunked_peak(self) -> int:
        return WHOLE_BUFFERS[self.kernel] * self.whole_bytes

    @property
    def saving(self) -> int:
        """The fall of the device's peak: the unchunked loss's buffers less one chunk."""
        return self.unchunked_peak - self.chunk_bytes


def loss_logits(traced, solution=None, micro_batch: int = 1) -> list[LossLogits]:
    """The cross-entropies of `traced` the pass fuses under `solution` (None: one device),
    at `micro_batch` samples per device."""
    out = []
    for node in traced.gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default:
            continue
        weight, reduction, _, smoothing = cross_entropy_args(node)
        logits = node.args[0]
        linear = classifier_behind(logits)
        if linear is None or weight is not None or smoothing or reduction not in (1, 2):
            continue
        kernel = _kernel(solution, node, linear)
        if kernel is None:
            continue
        tokens, vocab = (int(sympy.sympify(d).subs(BATCH, micro_batch))
                         for d in logits.meta["autopar"].shape)
        if kernel == "vocab_parallel":
            vocab //= solution.size
        size = torch.empty((), dtype=logits.meta["autopar"].dtype, device="meta").element_size()
        hidden = int(sympy.sympify(linear.args[0].meta["autopar"].shape[-1]))
        out.append(LossLogits(node.meta["autopar"].layer, tokens, vocab, kernel, size, hidden))
    return out


def _kernel(solution, loss: fx.Node, linear: fx.Node) -> str | None:
    """What the rewritten graph runs for `loss`, where the pass can fuse it: the aten op on
    whole logits, or the 1D vocabulary-parallel kernel; None for any other form."""
    if solution is None:
        return "aten"
    strategy = solution.strategies.get(loss)
    if strategy is None:
        return None
    if strategy.rewrite is Rewrite.VOCAB_CROSS_ENTROPY:
        return "vocab_parallel"
    layout = solution.layouts.get(linear)
    whole = layout is not None and not getattr(layout, "shards", ()) and \
        not getattr(layout, "partial", ())
    return "aten" if strategy.rewrite is None and whole and not strategy.comm else None


def chunked_activations(traced, solution, micro_batch: int, per_layer: dict) -> dict:
    """`per_layer` (activation_bytes' result) with each fused loss's saved whole logits
    replaced by its per-token log-sum-exp (and, where the logits are a single chunk, that
    chunk: `LossLogits.kept_bytes`)."""
    out = dict(per_layer)
    for loss in loss_logits(traced, solution, micro_batch):
        if loss.layer in out:
            saved = loss.tokens * loss.vocab * loss.itemsize
            out[loss.layer] = max(0, out[loss.layer] - saved + loss.kept_bytes)
    return out


def held_while_running(traced, solution, micro_batch: int, chunked: bool) -> dict[str, int]:
    """Per loss layer, the bytes its loss holds while it runs beyond what `activation_bytes`
    keeps for the backward: one chunk's fp32 logits chunked (none more where that chunk is
    all the logits, kept for the backward); unchunked, the whole buffers of its peak less
    the saved logits."""
    out: dict[str, int] = {}
    for loss in loss_logits(traced, solution, micro_batch):
        held = (0 if loss.one_chunk else loss.chunk_bytes) if chunked else \
            loss.unchunked_peak - loss.tokens * loss.vocab * loss.itemsize
        out[loss.layer] = out.get(loss.layer, 0) + held
    return out


def remade(traced, solution, micro_batch: int, chunked: bool) -> dict[str, tuple]:
    """Per loss layer, the FLOPs of the logits its backward makes again (REMADE_SOURCE; as
    many again when zero-bubble splits it, SPLIT_SOURCE) and its chunk's GEMM shape (most
    rows, hidden, vocabulary); nothing unchunked, where the backward reads the saved logits."""
    out: dict[str, tuple] = {}
    for loss in loss_logits(traced, solution, micro_batch) if chunked else ():
        flops = out.get(loss.layer, (0, None))[0] + loss.logits_flops
        out[loss.layer] = (flops, (chunk_rows(loss.vocab), loss.hidden, loss.vocab))
    return out


def remade_work(flops: float, chunk: tuple, itemsize: int,
                kept: bool = True) -> tuple[float, tuple, float]:
    """What making `flops` of logits again takes (REMADE_SOURCE): (how many GEMMs, each's
    (M, K, N), the bytes its upcast to fp32 from `itemsize` and the subtraction of the
    log-sum-exp move); `chunk` is `remade`'s shape. `kept`: nothing where the logits are a
    single chunk, which the forward keeps for the one-node backward (and a split loss's input
    half); a zero-bubble weight half makes them again all the same (kept=False)."""
    if flops <= 0 or not chunk:
        return 0.0, (0, 0, 0), 0.0
    most, hidden, vocab = chunk
    logits = flops / (2 * hidden)  # tokens x vocabulary
    if kept and logits / vocab <= most:
        return 0.0, (0, 0, 0), 0.0
    rows = min(most, logits / vocab)
    upcast = itemsize + FP32 if itemsize < FP32 else 0
    return flops / (2 * rows * hidden * vocab), (rows, hidden, vocab), \
        logits * (2 * FP32 + upcast)


def remade_both(flops: float, chunk: tuple, itemsize: int) -> list[tuple]:
    """`remade_work` of the one-node backward (a single chunk kept) and of a zero-bubble
    weight half (which makes even a single chunk again)."""
    return [remade_work(flops, chunk, itemsize, kept) for kept in (True, False)]


def effect(traced, solution, micro_batch: int) -> dict | None:
    """The named effect for a plan's prediction and explain: None where nothing fuses."""
    losses = loss_logits(traced, solution, micro_batch)
    if not losses:
        return None
    return {"effect": NAME, "source": SOURCE,
            "unchunked_peak_bytes": sum(c.unchunked_peak for c in losses),
            "chunk_bytes": sum(c.chunk_bytes for c in losses),
            "saving_bytes": sum(c.saving for c in losses),
            "remade_flops": sum(c.logits_flops for c in losses if not c.one_chunk),
            "losses": [{"layer": c.layer, "tokens": c.tokens, "vocab": c.vocab,
                        "kernel": c.kernel, "whole_buffers": WHOLE_BUFFERS[c.kernel]}
                       for c in losses]}
