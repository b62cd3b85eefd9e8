"""Cross-entropy over a classifier's logits, as a chunked loss fuses it: which traced
chains qualify (`classifier_behind`) and how many tokens one chunk holds (`chunk_rows`).

The pass (`autopar.passes.chunked_loss`), its kernel (`autopar.kernels.chunked_loss`) and
the memory model (`autopar.cost.chunked_loss`) read these, so what is fused, run and
priced is the same chain and the same chunk.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

CHUNK_BYTES = 16 * 2**20
"""Bytes of one chunk's fp32 logits (tokens = CHUNK_BYTES // (4 x the rank's vocabulary))."""

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CASTS = {aten._to_copy.default, aten.to.dtype}


def chunk_rows(vocab: int, chunk_bytes: int | None = None) -> int:
    """Tokens per chunk for a rank holding `vocab` classes (chunk_bytes None: CHUNK_BYTES,
    read when called, so a test can make chunks small)."""
    chunk_bytes = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    return max(1, chunk_bytes // (4 * max(1, vocab)))


def classifier_behind(logits) -> fx.Node | None:
    """The aten.linear whose output reaches `logits` ([tokens, vocabulary]) through views
    that keep the last dim and casts to fp32 alone, each read once; else None."""
    if not isinstance(logits, fx.Node) or len(_shape(logits) or ()) != 2:
        return None
    vocab, node = _shape(logits)[-1], logits
    while node.op == "call_function" and node.target in _VIEWS | _CASTS:
        if len(readers(node)) != 1 or not _passes_through(node, vocab):
            return None
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return None
    if node.op != "call_function" or node.target is not aten.linear.default or \
            len(readers(node)) != 1 or (_shape(node) or (None,))[-1] != vocab:
        return None
    return node


def readers(node: fx.Node) -> list[fx.Node]:
    """The users of node but export's metadata asserts (which go with it)."""
    return [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]


def _passes_through(node: fx.Node, vocab) -> bool:
    if node.target in _VIEWS:
        return (_shape(node.args[0]) or (None,))[-1] == vocab
    dtype = node.args[1] if node.target is aten.to.dtype else node.kwargs.get("dtype")
    extra = set(node.kwargs) - {"dtype", "layout", "device"}
    return dtype == torch.float32 and not extra


def _shape(node) -> tuple | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None
