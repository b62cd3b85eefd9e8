"""Fuse a classifier and its cross-entropy into one chunked op (`kernels.chunked_loss`).

`chunk_loss` finds, in a rewritten training graph, a cross-entropy (the aten op, or the
vocabulary-parallel module the tensor-parallel pass put in its place) whose logits come
from a linear through nothing but flattening views and an fp32 upcast, read by nothing
else, and replaces the chain by a `ChunkedCrossEntropy` of the linear's input and weight:
the whole [tokens, vocabulary] logits and their gradient are never held. Run it after
`apply_solution` (and `cast_precision`), before the graph is bound to the mesh.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autopar.kernels.chunked_loss import ChunkedCrossEntropy
from autopar.kernels.modules import VocabParallelCrossEntropy
from autopar.sharding.rules.vocab import cross_entropy_args

aten = torch.ops.aten

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_CASTS = {aten._to_copy.default, aten.to.dtype}
CHUNKED = "autopar_chunked_loss"  # node.meta key on a fused loss: its ChunkedCrossEntropy


def chunk_loss(gm: fx.GraphModule, chunk_bytes: int | None = None) -> int:
    """Fuse every classifier + cross-entropy chain of gm (in place); returns how many.
    `chunk_bytes`: one chunk's fp32 logits (None: `kernels.chunked_loss.CHUNK_BYTES`)."""
    fused = 0
    for node in list(gm.graph.nodes):
        loss = _loss_of(gm, node)
        if loss is None:
            continue
        axis, reduction, ignore = loss
        linear = _linear_behind(node.args[0])
        if linear is None:
            continue
        x, weight = linear.args[0], linear.args[1]
        bias = linear.args[2] if len(linear.args) > 2 else None
        module = ChunkedCrossEntropy(axis, reduction, ignore, chunk_bytes)
        name = _free_name(gm, "chunked_cross_entropy")
        gm.add_submodule(name, module)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, (x, weight, node.args[1], bias))
        new.meta = dict(linear.meta)  # the classifier's layer: its stage, its ZeRO-3 gather
        info = node.meta.get("autopar")
        if info is not None and "autopar" in new.meta:
            new.meta["autopar"] = dataclasses.replace(
                new.meta["autopar"], kind=info.kind, shape=info.shape, dtype=info.dtype)
        new.meta[CHUNKED] = module
        node.replace_all_uses_with(new)
        _erase_chain(gm.graph, node, linear)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def _loss_of(gm: fx.GraphModule, node: fx.Node):
    """(axis or None, reduction, ignore_index) of a cross-entropy node the kernel computes
    exactly (a mean or a sum, no class weights, no label smoothing); else None."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, VocabParallelCrossEntropy) and module.reduction in (1, 2):
            return module.axis, module.reduction, module.ignore_index
        return None
    if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default:
        return None
    weight, reduction, ignore, smoothing = cross_entropy_args(node)
    if weight is not None or smoothing or reduction not in (1, 2):
        return None
    return None, reduction, ignore


def _linear_behind(logits) -> fx.Node | None:
    """The aten.linear whose output reaches `logits` ([tokens, vocabulary]) through views
    that keep the last dim and casts to fp32 alone, each read once; else None."""
    if not isinstance(logits, fx.Node) or len(_shape(logits) or ()) != 2:
        return None
    vocab, node = _shape(logits)[-1], logits
    while node.op == "call_function" and node.target in _VIEWS | _CASTS:
        if len(_readers(node)) != 1 or not _passes_through(node, vocab):
            return None
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return None
    if node.op != "call_function" or node.target is not aten.linear.default or \
            len(_readers(node)) != 1 or (_shape(node) or (None,))[-1] != vocab:
        return None
    return node


def _readers(node: fx.Node) -> list[fx.Node]:
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


def _erase_chain(graph: fx.Graph, loss: fx.Node, linear: fx.Node) -> None:
    node = loss
    while True:
        source = node.args[0]
        for user in list(node.users):  # export's metadata asserts on the erased values
            graph.erase_node(user)
        graph.erase_node(node)
        if node is linear:
            return
        node = source


def _free_name(gm: fx.GraphModule, stem: str) -> str:
    name, i = stem, 0
    while hasattr(gm, name):
        i += 1
        name = f"{stem}_{i}"
    return name
