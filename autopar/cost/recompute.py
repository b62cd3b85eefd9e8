"""What each recompute mode runs again (Korthikanti et al. 2022): `full`, a whole layer;
`selective`, attention's core, the nodes that make and read its s x s tensors."""

from __future__ import annotations

import torch.fx as fx

from autopar.cost.memory import attention_nodes, saved_activations
from autopar.graph.analysis import OpKind
from autopar.graph.trace import TracedGraph


def attention_core(gm: fx.GraphModule, fused: frozenset = frozenset()) -> set[fx.Node]:
    """The nodes selective recomputation runs again: attention's inside on the math path
    (`attention_nodes`) with the matmuls that read it (probabilities x V: what they save,
    the probabilities, is inside), and the fused attention ops in `fused`."""
    inside = attention_nodes(gm)
    readers = {u for n in inside for u in n.users
               if u not in inside and _kind(u) is OpKind.MATMUL}
    return inside | readers | set(fused)


def fused_with_inside(traced: TracedGraph) -> set[fx.Node]:
    """The fused attention ops of a traced graph that save an s x s tensor (a math-path
    kernel, as the CPU's under dropout). One that saves none (flash) leaves selective
    recomputation nothing to drop, so it runs once, as the memory model counts it."""
    return {s.node for s in saved_activations(traced) if s.internal and s.attention_inside
            and _kind(s.node) is OpKind.ATTENTION}


def selective_core(traced: TracedGraph) -> set[fx.Node]:
    """`attention_core` of a traced graph."""
    return attention_core(traced.gm, frozenset(fused_with_inside(traced)))


def _kind(node: fx.Node) -> OpKind | None:
    info = node.meta.get("autopar")
    return getattr(info, "kind", None)
