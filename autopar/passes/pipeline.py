"""Cut a training graph into pipeline stages at layer boundaries.

`split_stages(gm, stage_of_layer, n)` returns one GraphModule per stage. Stage 0 takes the
graph's inputs (the batch and the target); stage k > 0 takes the values earlier stages
produced that stage k or a later one reads, in a fixed order, and returns those that
stage k+1 or a later one reads (a value crossing several stages, a skip connection, is
passed along by every stage in between); the last stage returns the graph's output (the
loss). Every value that crosses a boundary is a tensor, so each boundary is one
point-to-point send of a tuple of tensors.

Values derived only from sizes and constants (the sizes of the inputs, aranges, position
tables cut from buffers, causal masks built from positions) are never sent: each stage
that reads one recomputes it from its own inputs' sizes (`Stages.recomputed` names them).
Reading the batch size of a graph input in a later stage becomes reading it from a carried
tensor with the same batch dim (times the pieces a 2D/2.5D/3D layout splits that dim into
on this rank, `node.meta["autopar_parts"]`).

With `targets`, the loss (what reads the targets) is cut off as its own module, which a
pipeline schedule calls on the last stage with each micro-batch's targets: the targets
(integer class ids) never travel between stages.

Parameters stay attributes of the original module: a stage reads those its nodes use.
A parameter read by more than one stage (a tied input and output embedding) is listed in
`Stages.shared`; on different ranks its gradients must be summed over those stages.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from autopar.errors import PlanError

aten = torch.ops.aten


@dataclass
class Stages:
    modules: list[fx.GraphModule]
    inputs: list[list[str]]  # stage k: the names of the values it receives, in order
    outputs: list[list[str]]  # stage k: the names of the values it sends on, in order
    params: list[set[str]]  # stage k: the parameter attributes it reads (its loss included)
    shared: dict[str, list[int]] = field(default_factory=dict)  # parameter -> its stages
    recomputed: set[str] = field(default_factory=set)  # size-derived nodes rebuilt per stage
    # with targets: loss(*last stage's outputs, *targets) -> the graph's output
    loss: fx.GraphModule | None = None


def _reads_before(graph: fx.Graph, stage: dict, free: set,
                  loss_stage: int) -> list[set[fx.Node]]:
    """What each stage reads from earlier ones (the graph's inputs are stage 0's values)."""
    reads_before: list[set[fx.Node]] = [set() for _ in range(loss_stage + 1)]
    for nd in graph.nodes:
        if nd.op == "output":
            k = loss_stage
        elif nd in stage and nd.op != "placeholder":
            k = stage[nd]
        else:
            continue
        for a in _sources(nd.all_input_nodes, free):
            if a.op != "get_attr" and stage[a] < k:
                reads_before[k].add(a)
    return reads_before


def split_stages(gm: fx.GraphModule, stage_of_layer: dict[str, int], n: int,
                 targets: int = 0) -> Stages:
    """Cut `gm` into `n` stages. `stage_of_layer` maps layer names (node.meta["autopar"]
    .layer, the loss's layer included: map it to the last stage) to stage indices. A node
    runs on its layer's stage, or later when it reads a later stage's value: a model's
    root layer has ops both before its blocks and after them (transformers' final view).
    A node of no listed layer joins the latest stage among its inputs (stage 0 when it has
    none). Raises PlanError when a node that reads parameters would run on a later stage
    than its layer's (layers placed out of order), or a layer beyond the last stage.

    `targets`: the graph's last `targets` inputs are the targets. They never cross a stage
    boundary: what reads them (the loss) becomes `Stages.loss`, called on the last stage's
    outputs and the targets (a pipeline schedule's loss function), and stage 0 takes the
    other inputs. Without targets the target travels with the activations and the last
    stage returns the loss itself.
    """
    bad = sorted((k, layer) for layer, k in stage_of_layer.items() if not 0 <= k < n)
    if bad:
        raise PlanError(f"layer {bad[0][1]} is placed on stage {bad[0][0]}; a {n}-stage "
                        f"pipeline has stages 0 to {n - 1}.")
    graph = gm.graph
    placeholders = [nd for nd in graph.nodes if nd.op == "placeholder"]
    inputs, target_nodes = placeholders[:len(placeholders) - targets], \
        placeholders[len(placeholders) - targets:]
    output = next(nd for nd in graph.nodes if nd.op == "output")
    free = _size_derived(graph)
    loss_stage = n if targets else n - 1  # a virtual stage after the last holds the loss
    stage: dict[fx.Node, int] = {nd: 0 for nd in inputs}
    stage.update({nd: loss_stage for nd in target_nodes})
    for nd in graph.nodes:
        if nd.op in ("placeholder", "get_attr", "output") or nd in free:
            continue
        info = nd.meta.get("autopar")
        layer = getattr(info, "layer", None)
        earliest = max((stage[a] for a in nd.all_input_nodes if a in stage), default=0)
        if targets and earliest == loss_stage:
            stage[nd] = loss_stage  # reads a target
            continue
        k = max(stage_of_layer.get(layer, 0), earliest)
        if layer in stage_of_layer and k != stage_of_layer[layer] and \
                any(a.op == "get_attr" and _is_parameter(a) for a in nd.all_input_nodes):
            raise PlanError(f"layer {layer} is placed on stage {stage_of_layer[layer]} but its "
                            f"node {nd.name} reads a value of stage {earliest}; stages must "
                            "follow the order in which the model runs its layers.")
        stage[nd] = k
    reads_before = _reads_before(graph, stage, free, loss_stage)
    order = {nd: i for i, nd in enumerate(graph.nodes)}
    # carried into stage k: what stage k or a later one reads that an earlier stage made
    carried: list[list[fx.Node]] = [inputs]
    for k in range(1, loss_stage + 1):
        vals = {a for j in range(k, loss_stage + 1) for a in reads_before[j] if stage[a] < k}
        carried.append(sorted(vals, key=order.__getitem__))
    modules, ins, outs, params = [], [], [], []
    for k in range(n):
        sends = carried[k + 1] if k + 1 <= loss_stage else None
        mod, used = _build_stage(gm, k, stage, free, carried[k], sends, output)
        modules.append(mod)
        ins.append([v.name for v in carried[k]])
        outs.append([v.name for v in sends] if sends is not None else ["output"])
        params.append(used)
    loss = None
    if targets:
        loss, used = _build_stage(gm, n, stage, free, carried[n] + target_nodes, None, output)
        params[-1] |= used
    shared: dict[str, list[int]] = {}
    for k, used in enumerate(params):
        for p in used:
            shared.setdefault(p, []).append(k)
    shared = {p: ks for p, ks in shared.items() if len(ks) > 1}
    return Stages(modules, ins, outs, params, shared, {nd.name for nd in free}, loss)


def check_stage_count(layers: list[str], n: int) -> list[str]:
    """The repeated blocks of `layers` (names ending in an index); one sentence when there
    are fewer than the n stages, each of which must hold at least one."""
    blocks = [name for name in layers if name.rsplit(".", 1)[-1].isdigit()]
    if len(blocks) < n:
        raise PlanError(f"a {n}-stage pipeline needs at least {n} blocks; the model has "
                        f"{len(blocks)}: use {max(1, len(blocks))} stages or fewer.")
    return blocks


def contiguous_stages(layers: list[str], n: int) -> dict[str, int]:
    """A stage per layer for `split_stages`: the repeated blocks (layers whose name ends in
    a number) in n runs of equal length, what comes before the first block on stage 0,
    what comes after the last (final norm, classifier, loss) on stage n - 1."""
    blocks = check_stage_count(layers, n)
    first, last = layers.index(blocks[0]), layers.index(blocks[-1])
    out = {b: i * n // len(blocks) for i, b in enumerate(blocks)}
    for i, name in enumerate(layers):
        if name not in out:
            out[name] = 0 if i < first else n - 1 if i > last else out[layers[i - 1]]
    out["loss"] = n - 1
    return out


def _sources(reads, free: set) -> list[fx.Node]:
    """The non-free values `reads` depend on: free nodes are looked through (they are
    rebuilt where they are read), down to the inputs whose sizes they read."""
    out, todo, seen = [], list(reads), set()
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        if a in free:
            if a.op == "call_function" and a.target is aten.sym_size.int:
                continue  # rebuilt from a carried tensor's size
            todo.extend(a.all_input_nodes)
        else:
            out.append(a)
    return out


def _size_derived(graph: fx.Graph) -> set[fx.Node]:
    """Nodes computed from sizes and constants only: sizes of any value, aranges, buffers
    and everything pure built from them, but no parameter (its gradient must come from
    one place) and no input or activation value."""
    free: set[fx.Node] = set()
    for nd in graph.nodes:
        if nd.op == "call_function" and nd.target is aten.sym_size.int:
            free.add(nd)
            continue
        if nd.op == "get_attr":
            continue
        if nd.op != "call_function" or nd.is_impure() or \
                getattr(nd.target, "_nondeterministic_seeded", False):
            continue
        inputs = nd.all_input_nodes
        if all(a in free or (a.op == "get_attr" and not _is_parameter(a)) for a in inputs):
            free.add(nd)
    return free


def _is_parameter(nd: fx.Node) -> bool:
    owner = nd.graph.owning_module
    try:
        value = owner.get_parameter(nd.target)
    except AttributeError:
        return False
    return isinstance(value, torch.nn.Parameter)


def _build_stage(gm, k, stage, free, receives, sends, output):
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    used: set[str] = set()
    for v in receives:
        p = graph.placeholder(v.name)
        p.meta = dict(v.meta)
        env[v] = p

    def value(a: fx.Node) -> fx.Node:
        if a in env:
            return env[a]
        if a.op == "get_attr":
            new = graph.get_attr(a.target)
            new.meta = dict(a.meta)
            if _is_parameter(a):
                used.add(a.target)
        elif a.op == "call_function" and a.target is aten.sym_size.int and \
                a.args[0] not in env:
            new = _size_from_carried(graph, a, env)
        elif a in free:
            new = graph.node_copy(a, value)
        else:
            raise PlanError(f"stage {k} reads {a.name}, which it neither computes nor "
                            "receives")
        env[a] = new
        return new

    own = [nd for nd in gm.graph.nodes
           if stage.get(nd) == k and nd.op != "placeholder" and nd not in free]
    _hoist_free(gm, k, stage, free, own, value)
    for nd in own:
        env[nd] = graph.node_copy(nd, value)
    if sends is None:
        graph.output(fx.map_arg(output.args[0], value))
    else:
        graph.output(tuple(value(v) for v in sends))
    graph.lint()
    module = fx.GraphModule(gm, graph)
    return module, used


def _hoist_free(gm, k, stage, free, own, value) -> None:
    """Build the free nodes stage k's own nodes read before them, in the graph's order (as
    the whole graph computes a model's mask and rotary tables before its first block): built
    at their first reader they would cut that block's recomputed region in pieces, whose
    boundaries the backward keeps. A free node that reads a size of one of the stage's own
    values stays where it is read."""
    needed, todo = set(), [a for nd in own for a in nd.all_input_nodes if a in free]
    while todo:
        a = todo.pop()
        if a not in needed:
            needed.add(a)
            todo.extend(b for b in a.all_input_nodes if b in free)
    late: set = set()
    for nd in gm.graph.nodes:
        if nd not in needed:
            continue
        if any(b in late or (stage.get(b) == k and b.op != "placeholder" and b not in free)
               for b in nd.all_input_nodes):
            late.add(nd)
        else:
            value(nd)


def _size_from_carried(graph: fx.Graph, size_node: fx.Node, env: dict) -> fx.Node:
    """A size of an input this stage does not receive, read from a received tensor whose dim
    has the same (symbolic) global size: the batch of the input ids, from an activation."""
    source, dim = size_node.args[0], size_node.args[1]
    want = sympy.sympify(source.meta["autopar"].shape[dim])
    for old, new in env.items():
        info = old.meta.get("autopar")
        shape = getattr(info, "shape", None)
        if new.op != "placeholder" or not shape:
            continue
        parts = old.meta.get("autopar_parts") or (1,) * len(shape)
        for d, size in enumerate(shape):
            if sympy.simplify(sympy.sympify(size) - want) == 0 and want.free_symbols:
                out = graph.call_function(aten.sym_size.int, (new, d))
                out.meta = dict(size_node.meta)
                if parts[d] > 1:  # this rank holds 1/parts of the dim (2D splits the batch)
                    out = graph.call_function(operator.mul, (out, parts[d]))
                    out.meta = dict(size_node.meta)
                return out
    raise PlanError(f"a later pipeline stage reads size {dim} of input {source.name} "
                    f"({want}) but receives no tensor with that size")
