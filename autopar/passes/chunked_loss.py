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

from autopar.graph.losses import classifier_behind
from autopar.kernels.chunked_loss import ChunkedCrossEntropy
from autopar.kernels.modules import VocabParallelCrossEntropy
from autopar.sharding.rules.vocab import cross_entropy_args

aten = torch.ops.aten

CHUNKED = "autopar_chunked_loss"  # node.meta key on a fused loss


def chunk_loss(gm: fx.GraphModule, chunk_bytes: int | None = None, split: bool = False) -> int:
    """Fuse every classifier + cross-entropy chain of gm (in place); returns how many.
    `chunk_bytes`: one chunk's fp32 logits (None: `graph.losses.CHUNK_BYTES`); `split`: the
    input and weight gradients in two autograd nodes (a zero-bubble schedule's B and W)."""
    fused = 0
    for node in list(gm.graph.nodes):
        loss = _loss_of(gm, node)
        if loss is None:
            continue
        axis, reduction, ignore = loss
        linear = classifier_behind(node.args[0])
        if linear is None:
            continue
        x, weight = linear.args[0], linear.args[1]
        bias = linear.args[2] if len(linear.args) > 2 else None
        module = ChunkedCrossEntropy(axis, reduction, ignore, chunk_bytes, split)
        name = _free_name(gm, "chunked_cross_entropy")
        gm.add_submodule(name, module)
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(name, (x, weight, node.args[1], bias))
        # the loss's layer: its collectives are the loss's, logged where the plan puts them
        new.meta = dict(node.meta)
        new.meta[CHUNKED] = True
        _targets_with_the_classifier(node.args[1], node, linear)
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


def _targets_with_the_classifier(target, loss: fx.Node, linear: fx.Node) -> None:
    """The loss's ops that prepare the target (reshapes, transformers' label shift) join
    the classifier's layer, so the fused op starts the loss's layer with a floating input:
    the per-layer recorder (runtime.measure) then ends the loss's backward where the
    classifier's input gradient leaves it, as the unfused graph's logits did."""
    layer = getattr(loss.meta.get("autopar"), "layer", None)
    into = getattr(linear.meta.get("autopar"), "layer", None)
    todo, seen = [target] if isinstance(target, fx.Node) else [], set()
    while todo:
        node = todo.pop()
        info = node.meta.get("autopar")
        if node in seen or node.op != "call_function" or getattr(info, "layer", None) != layer:
            continue
        seen.add(node)
        node.meta["autopar"] = dataclasses.replace(info, layer=into)
        todo.extend(node.all_input_nodes)


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
