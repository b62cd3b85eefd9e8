"""Activation recomputation as a graph pass: each recomputed layer's region of a rewritten
graph (under `full` the whole layer, under `selective` its attention core) moved into a
`Recomputed` submodule, which keeps only the region's inputs for the backward and runs it
again there (autopar.kernels.recompute). The plan's modes per layer come from
`Plan.recompute_modes`; the collectives a region holds run again in the backward, which
`autopar.runtime.accounting` counts."""

from __future__ import annotations

import operator
from typing import Callable

import torch.fx as fx

from autopar.cost.recompute import attention_core
from autopar.graph.analysis import OpKind
from autopar.kernels.recompute import Recomputed
from autopar.modes import FULL, SELECTIVE

_COMPUTE = ("call_function", "call_method", "call_module")


def _layer(node: fx.Node) -> str | None:
    return getattr(node.meta.get("autopar"), "layer", None)


def fused_keys(gm: fx.GraphModule, fused: set[fx.Node]) -> set[tuple[str, int]]:
    """(layer, ordinal among the layer's attention ops) of each node of `fused`: how the
    traced graph's fused attention ops are found again in the rewritten graph."""
    out, seen = set(), {}
    for node in gm.graph.nodes:
        info = node.meta.get("autopar")
        if info is not None and info.kind is OpKind.ATTENTION and node.op in _COMPUTE:
            k = seen[info.layer] = seen.get(info.layer, -1) + 1
            if node in fused:
                out.add((info.layer, k))
    return out


def recompute_regions(gm: fx.GraphModule, modes: dict[str, str],
                      outside: Callable[[fx.Node], bool] = lambda n: False,
                      fused: set[tuple[str, int]] = frozenset()) -> list[tuple[str, list]]:
    """(layer, nodes) of each region to recompute, in graph order. `outside`: nodes that
    stay out (the recorder's marks, ZeRO-3's gathers); `fused`: `fused_keys` of the fused
    attention ops selective recomputation runs again. A region is a run of its layer's
    nodes; a node between them that reads one of them ends the run."""
    keys = {}
    for node in gm.graph.nodes:
        info = node.meta.get("autopar")
        if info is not None and info.kind is OpKind.ATTENTION and node.op in _COMPUTE:
            keys[node] = (info.layer, sum(1 for k in keys.values() if k[0] == info.layer))
    core = attention_core(gm, frozenset(n for n, k in keys.items() if k in fused)) \
        if SELECTIVE in modes.values() else set()

    def member(node: fx.Node) -> bool:
        mode = modes.get(_layer(node))
        return node.op in _COMPUTE and not outside(node) and (
            mode == FULL or (mode == SELECTIVE and node in core))

    def check(node: fx.Node, run: list) -> bool:  # a shape check on the run's values
        info = node.meta.get("autopar")
        return bool(run) and info is not None and info.kind is OpKind.SYMBOLIC and \
            info.layer == _layer(run[0]) and not set(node.all_input_nodes).isdisjoint(run)

    regions: list[tuple[str, list]] = []
    run: list[fx.Node] = []
    for node in gm.graph.nodes:
        joins = (member(node) and (not run or _layer(node) == _layer(run[0]))) or \
            (node.op in _COMPUTE and check(node, run))
        if joins:
            run.append(node)
            continue
        if run and (not member(node) and set(node.all_input_nodes).isdisjoint(run)
                    and node.op != "output"):
            continue  # a node that does not read the run: the run goes on past it
        if run:
            regions.append((_layer(run[0]), run))
        run = [node] if member(node) else []
    return regions


def wrap_recompute(gm: fx.GraphModule, modes: dict[str, str],
                   outside: Callable[[fx.Node], bool] = lambda n: False,
                   fused: set[tuple[str, int]] = frozenset()) -> list[str]:
    """Move each region of `recompute_regions` into a Recomputed submodule (in place);
    returns the submodules' names."""
    names = []
    for k, (layer, nodes) in enumerate(recompute_regions(gm, modes, outside, fused)):
        name = f"autopar_recompute_{k}"
        _outline(gm, nodes, name, layer, modes[layer])
        names.append(name)
    if names:
        gm.graph.lint()
        gm.recompile()
    return names


def _outline(gm: fx.GraphModule, nodes: list[fx.Node], name: str, layer: str,
             mode: str) -> None:
    """Replace `nodes` by one call of a submodule that runs them."""
    members = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                if a not in members))
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs))
    gm.add_submodule(name, Recomputed(fx.GraphModule(gm, graph), layer, mode))
    with gm.graph.inserting_after(nodes[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta = dict(nodes[0].meta)
    last = call
    for i, out in enumerate(outputs):
        with gm.graph.inserting_after(last):
            last = gm.graph.call_function(operator.getitem, (call, i))
        last.meta = dict(out.meta)
        out.replace_all_uses_with(last, delete_user_cb=lambda user: user not in members)
    for n in reversed(nodes):
        gm.graph.erase_node(n)
