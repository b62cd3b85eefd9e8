"""Passes that apply a sharding solution to a graph; `apply_solution` runs them in order.

    localize_ops        each op to the sharded form its strategy's `Rewrite` names, by the
                        handler `REWRITES` holds for it
    insert_collectives  one Redistribute node per transition of the solution
    shard_parameters    every parameter replaced by this rank's slice (`local_parameters`)

The emitted collectives are exactly those the solution lists, so predicted and measured
communication are equal.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Callable

import torch
import torch.fx as fx
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule

from autopar.graph.ir import copy_nodes
from autopar.kernels.collectives import Redistribute
from autopar.kernels.modules import (
    GridCrossEntropy,
    GridLinear,
    GridNorm,
    PartialBias,
    StreamCall,
    StreamDropout,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
)
from autopar.kernels.sequence import SequenceAttention
from autopar.modes import CP, ZIGZAG
from autopar.sharding.axes import TensorMesh
from autopar.sharding.layout import Layout
from autopar.sharding.rules.attention import repeated_kv
from autopar.sharding.rules.vocab import cross_entropy_args
from autopar.sharding.solve import Solution
from autopar.sharding.strategy import Rewrite, Strategy

aten = torch.ops.aten


def clone_graph_module(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A GraphModule with a copy of gm's graph (node meta kept) sharing gm's tensors.

    Its Python code is generated when it first runs (or its code is read), not at every
    `recompile()`: each pass after this one edits the graph and recompiles, and only the
    last edit's code runs (the inference graph a start solves for layouts never runs)."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen  # keeps export's pytree calling convention
    mapping = copy_nodes(gm.graph, graph)
    new_gm = _LazyGraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    return new_gm, mapping


def apply_solution(gm: fx.GraphModule, solution: Solution) -> fx.GraphModule:
    """Sharded ops and explicit collectives, as a new GraphModule (this rank's parameter
    slices are installed apart: `shard_parameters(gm, local_parameters(...))`)."""
    out, mapping = clone_graph_module(gm)
    readers: dict = {}
    for old, new in mapping.items():  # before the rewrite: redistributions copy this meta
        new.meta[PARTS] = dim_parts(solution.layouts.get(old), solution.sizes)
    localize_ops(out, solution, mapping, readers)
    insert_collectives(out, solution, mapping, readers)
    drop_dead_code(out.graph)
    out.graph.lint()
    out.recompile()
    return out


PARTS = "autopar_parts"  # node.meta key: into how many pieces each dim is split on this rank


def dim_parts(layout, sizes: dict[str, int]) -> tuple[int, ...] | None:
    """Per dim of a value, into how many pieces the tensor axes split it (1: whole); None
    for a value without a layout. A rank holds size // parts elements of each dim."""
    if not isinstance(layout, Layout):
        return None
    out = [1] * layout.ndim
    for shard in layout.shards:
        out[shard.dim] *= sizes.get(shard.axis, 1)
    return tuple(out)


def drop_dead_code(graph: fx.Graph) -> None:
    """Remove function calls nothing reads any more (a causal mask's subgraph once the
    sequence kernels take is_causal instead), with the metadata asserts export left on them."""
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        if node.target is aten._assert_tensor_metadata.default:
            if all(len(a.users) == 1 for a in node.all_input_nodes):  # guards a dead value
                graph.erase_node(node)
            continue
        if not node.is_impure():
            graph.erase_node(node)


def _add_module(gm: fx.GraphModule, stem: str, module: nn.Module) -> str:
    name, i = stem, 0
    while hasattr(gm, name):
        i += 1
        name = f"{stem}_{i}"
    gm.add_submodule(name, module)
    return name


def localize_ops(gm: fx.GraphModule, solution: Solution, mapping: dict,
                 readers: dict | None = None) -> None:
    """Rewrite each op into the sharded form its strategy names (in place on gm's graph).

    `mapping[old]` becomes the node later passes read in place of `old` (a row linear's bias
    add, a partial mean's scaled result); `readers[old]` lists the new nodes that read
    `old`'s inputs, where `insert_collectives` rewires their redistributions."""
    readers = readers if readers is not None else {}
    late = []
    for old, strategy in solution.strategies.items():
        node = mapping.get(old)
        if node is None or node.op != "call_function":
            continue
        readers[old] = [node]
        if strategy.rewrite in LATE:
            late.append(old)
        elif strategy.rewrite is not None:
            REWRITES[strategy.rewrite](Site(gm, node, old, strategy, solution, mapping, readers))
    for old in late:  # after the views that read them
        strategy = solution.strategies[old]
        REWRITES[strategy.rewrite](Site(gm, mapping[old], old, strategy, solution, mapping,
                                        readers))


@dataclasses.dataclass
class Site:
    """One op being rewritten: its node in the new graph, the solved node it copies, and
    what `localize_ops` shares with later passes."""

    gm: fx.GraphModule
    node: fx.Node  # in the new graph
    old: fx.Node  # in the solved graph
    strategy: Strategy
    solution: Solution
    mapping: dict
    readers: dict

    @property
    def layout(self):
        return self.solution.layouts.get(self.old)


def _local_sizes_site(site: Site) -> None:
    _local_sizes(site.gm, site.node, site.layout, site.solution.layouts.get(site.old.args[0]),
                 site.solution.sizes)


def _row_linear_site(site: Site) -> None:
    site.mapping[site.old], site.readers[site.old] = _row_linear(site.gm, site.node,
                                                                 site.solution.axis)


def _partial_linear_site(site: Site) -> None:
    """Later passes read (and feed) the partial sum."""
    site.mapping[site.old], site.readers[site.old] = _row_linear(site.gm, site.node,
                                                                 site.solution.axis, reduce=False)


def _vocab_embedding(site: Site) -> None:
    node = site.node
    padding = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
    module = VocabParallelEmbedding(site.solution.axis, padding,
                                    site.strategy.args.get("reduce", True))
    _replace_with_module(site.gm, node, "vocab_embedding", module, (node.args[0], node.args[1]))


def _vocab_cross_entropy(site: Site) -> None:
    _, reduction, ignore, _ = cross_entropy_args(site.old)
    module = VocabParallelCrossEntropy(site.solution.axis, reduction, ignore)
    _replace_with_module(site.gm, site.node, "vocab_cross_entropy", module,
                         (site.node.args[0], site.node.args[1]))


def _grid_linear(site: Site) -> None:
    node, args = site.node, site.strategy.args
    if args["transposed"]:
        bias, x, w = node.args[0], node.args[1], node.args[2]
    else:
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    _replace_with_module(site.gm, node, f"{args['mode']}_linear".replace(".", "p"),
                         GridLinear(args["mode"], args["grid"], args["transposed"]),
                         (x, w, bias))


def _grid_norm(site: Site) -> None:
    args = site.strategy.args
    weight, bias = (site.mapping.get(p) if isinstance(p, fx.Node) else None
                    for p in args["params"])
    _replace_with_module(site.gm, site.node, f"{args['kind']}_norm",
                         GridNorm(args["kind"], args["hidden"], args["replicas"], args["eps"]),
                         (site.node.args[0], weight, bias))


def _grid_cross_entropy(site: Site) -> None:
    args = site.strategy.args
    _replace_with_module(site.gm, site.node, "grid_cross_entropy",
                         GridCrossEntropy(args["vocab"], args["batch"], args["ignore_index"]),
                         (site.node.args[0], site.node.args[1]))


def _partial_mean(site: Site) -> None:
    """Later passes read the mean divided by the ranks that split its dims."""
    site.mapping[site.old] = _scale_after(site.gm, site.node, operator.truediv,
                                          _parts_on(site.solution, site.old,
                                                    site.solution.sizes))


def _global_size(site: Site) -> None:
    _scale_after(site.gm, site.node, operator.mul, site.strategy.args["parts"])


def _sequence_attention(site: Site) -> None:
    gm, node, seq = site.gm, site.node, site.strategy.args["sequence"]
    args = tuple(node.args[:3])
    if seq.get("repeated_kv"):  # the kernel reads k, v before repeat_kv (enable_gqa)
        args = (args[0],) + tuple(site.mapping[repeated_kv(a)] for a in site.old.args[1:3])
    _replace_with_module(gm, node, "sequence_attention",
                         SequenceAttention(CP, seq["mode"], seq["is_causal"], seq["scale"],
                                           seq["enable_gqa"],
                                           layout=site.solution.sequence_layout),
                         args)
    for user in list(node.users):  # tuple-output variants: output [0] is the kernel's
        if user.target is operator.getitem and user.args[1] == 0:
            user.replace_all_uses_with(node)
            gm.graph.erase_node(user)


def _stream_dropout(site: Site) -> None:
    node = site.node
    module = StreamDropout(node.args[1], node.args[2], _stream(site.layout))
    _replace_with_module(site.gm, node, "dropout", module, (node.args[0],))


def _stream_attention(site: Site) -> None:
    name = _add_module(site.gm, "attention", StreamCall(site.node.target, _stream(site.layout)))
    site.node.op, site.node.target = "call_module", name


SPLIT_EXPERTS = "autopar_split_experts"  # node.meta key: the axis an MoE op's experts split over


def _tensor_experts(site: Site) -> None:
    """The op runs on its weights' slices as they are; the expert pass reads the axis its
    kernel sums the experts' partial rows over (autopar.passes.experts)."""
    site.node.meta[SPLIT_EXPERTS] = site.solution.axis


REWRITES: dict[Rewrite, Callable[[Site], None]] = {
    Rewrite.LOCAL_SIZES: _local_sizes_site,
    Rewrite.ROW_LINEAR: _row_linear_site,
    Rewrite.PARTIAL_LINEAR: _partial_linear_site,
    Rewrite.VOCAB_EMBEDDING: _vocab_embedding,
    Rewrite.VOCAB_CROSS_ENTROPY: _vocab_cross_entropy,
    Rewrite.GRID_LINEAR: _grid_linear,
    Rewrite.GRID_NORM: _grid_norm,
    Rewrite.GRID_CROSS_ENTROPY: _grid_cross_entropy,
    Rewrite.PARTIAL_MEAN: _partial_mean,
    Rewrite.GLOBAL_SIZE: _global_size,
    Rewrite.SEQUENCE_ATTENTION: _sequence_attention,
    Rewrite.STREAM_DROPOUT: _stream_dropout,
    Rewrite.STREAM_ATTENTION: _stream_attention,
    Rewrite.TENSOR_EXPERTS: _tensor_experts,
}
LATE = frozenset({Rewrite.GLOBAL_SIZE})  # run once every other op is rewritten


def _parts_on(solution: Solution, node: fx.Node, sizes: dict[str, int]) -> int:
    """Ranks that split the dims a mean reduces (each rank averaged its share only)."""
    layout = solution.layouts.get(node.args[0])
    ndim = layout.ndim
    dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else range(ndim)
    dims = {d % ndim for d in ([dims] if isinstance(dims, int) else dims)}
    parts = 1
    for shard in layout.shards:
        if shard.dim in dims:
            parts *= sizes[shard.axis]
    return parts


def _scale_after(gm: fx.GraphModule, node: fx.Node, op, factor: int) -> fx.Node:
    """Every user of `node` reads op(node, factor) instead; returns that node."""
    if factor == 1:
        return node
    with gm.graph.inserting_after(node):
        scaled = gm.graph.call_function(op, (node, factor))
    scaled.meta = dict(node.meta)
    node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    return scaled


def _stream(layout) -> str:
    """The random stream of a tensor, named by what splits it (`RandomStreams`): "split"
    where tensor axes do (2D, 2.5D and 3D activations are split over every tensor rank),
    "tokens" where cp does, "split+tokens" where both do, "replicated" where it is whole."""
    axes = set(layout.axes) if isinstance(layout, Layout) else set()
    names = (["split"] if axes - {CP} else []) + (["tokens"] if CP in axes else [])
    return "+".join(names) or "replicated"


def _replace_with_module(gm, node: fx.Node, stem: str, module: nn.Module, args: tuple) -> None:
    name = _add_module(gm, stem, module)
    node.op, node.target, node.args, node.kwargs = "call_module", name, args, {}


def _local_sizes(gm: fx.GraphModule, node: fx.Node, layout, in_layout,
                 sizes: dict[str, int]) -> None:
    """Divide the size arguments of a view, expand or split by the ranks on each split dim.

    A size given as a symbol (the batch, read from an input) is divided by a node inserted
    before the view; -1 is left to the view.
    """
    target = node.target

    def local(value, axis: str):
        if isinstance(value, fx.Node):
            with gm.graph.inserting_before(node):
                out = gm.graph.call_function(operator.floordiv, (value, sizes[axis]))
            out.meta = dict(value.meta)
            return out
        return value if value == -1 else value // sizes[axis]

    if target in (aten.split.Tensor, aten.split_with_sizes.default):
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % in_layout.ndim
        shard = in_layout.shard_of_dim(dim)
        sizes_arg = node.args[1]
        if isinstance(sizes_arg, (list, tuple)):
            new = [local(v, shard.axis) for v in sizes_arg]
        else:
            new = local(sizes_arg, shard.axis)
        node.args = (node.args[0], new) + tuple(node.args[2:])
        return
    if target is aten.chunk.default:
        return
    if target in (aten.flatten.using_ints,):
        return
    if target is aten.unflatten.int:
        new = list(node.args[2])
        for shard in layout.shards:
            rel = shard.dim - node.args[1]
            if 0 <= rel < len(new) and (isinstance(new[rel], fx.Node) or new[rel] > 0):
                new[rel] = local(new[rel], shard.axis)
        node.args = (node.args[0], node.args[1], new)
        return
    new = list(node.args[1])
    for shard in layout.shards:
        new[shard.dim] = local(new[shard.dim], shard.axis)
    node.args = (node.args[0], new) + tuple(node.args[2:])


def _row_linear(gm: fx.GraphModule, node: fx.Node, axis: str, reduce: bool = True) -> \
        tuple[fx.Node, list[fx.Node]]:
    """linear(x, W, b) -> all_reduce(linear(x, W_local)) + b, so the bias is added once.

    `reduce=False` (sequence parallelism): the partial sum linear(x, W_local) + b with the
    bias added on rank 0 only; the solver's transition reduce-scatters it where consumed.
    Returns the result and the new nodes that read the linear's inputs (product, bias add)."""
    graph = gm.graph
    if node.target is aten.addmm.default:
        bias, x, w = node.args[0], node.args[1], node.args[2]
        product_args, product_target = (x, w), aten.mm.default
    else:
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        product_args, product_target = (x, w), aten.linear.default
    with graph.inserting_before(node):
        product = graph.call_function(product_target, product_args)
        product.meta = dict(node.meta)
        if reduce:
            name = _add_module(gm, f"tp_all_reduce_{node.name}", Redistribute("reduce", axis))
            reduced = graph.call_module(name, (product,))
            reduced.meta = dict(node.meta)
        else:
            reduced = product
        result = reduced
        if bias is not None and reduce:
            result = graph.call_function(aten.add.Tensor, (reduced, bias))
            result.meta = dict(node.meta)
        elif bias is not None:
            name = _add_module(gm, f"{axis}_partial_bias_{node.name}", PartialBias(axis))
            result = graph.call_module(name, (reduced, bias))
            result.meta = dict(node.meta)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    return result, [product] + ([result] if result is not reduced else [])


def insert_collectives(gm: fx.GraphModule, solution: Solution, mapping: dict,
                       readers: dict | None = None) -> None:
    """Insert each transition's steps as call_module nodes between producer and consumers.

    A consumer that `localize_ops` rewrote into several nodes has its input rewired in each
    of them that reads it (`readers`), not in the node that stands for its result."""
    graph = gm.graph
    readers = readers or {}
    for t in solution.transitions:
        producer = mapping[t.producer]
        consumers = [n for c in t.consumers for n in readers.get(c, [mapping[c]])
                     if producer in n.all_input_nodes]
        if not consumers:
            raise RuntimeError(f"no rewritten node reads {producer.name} for the transition "
                               f"to {[c.name for c in t.consumers]}")
        current = producer
        anchor = min(consumers, key=_index(graph))
        parts = dim_parts(solution.layouts.get(t.producer), solution.sizes)
        # the steps belong to the first consumer's layer (the plan counts their bytes there,
        # and a pipeline runs them on that layer's stage)
        info = _layer_of(producer.meta.get("autopar"), t.consumers[0].meta.get("autopar"))
        for step in t.steps:
            stem = f"{step.axis}_{step.kind}_{producer.name}"
            zigzag = step.axis == CP and solution.sequence_layout == ZIGZAG
            name = _add_module(gm, stem, Redistribute(step.kind, step.axis, step.dim, step.groups,
                                                      zigzag))
            with graph.inserting_before(anchor):
                nxt = graph.call_module(name, (current,))
            nxt.meta = dict(producer.meta)
            if info is not None:
                nxt.meta["autopar"] = info
            if parts is not None and step.dim is not None:
                size = solution.sizes.get(step.axis, 1)
                parts = list(parts)
                parts[step.dim] = parts[step.dim] // size if step.kind.startswith("gather") \
                    else parts[step.dim] * size
                parts = tuple(parts)
            nxt.meta[PARTS] = parts
            current = nxt
        for consumer in consumers:
            consumer.replace_input_with(producer, current)


def _layer_of(info, consumer):
    if info is None or consumer is None or info.layer == consumer.layer:
        return info
    return dataclasses.replace(info, layer=consumer.layer)


def _index(graph: fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__


def shard_parameters(gm: fx.GraphModule, local: dict[str, torch.Tensor]) -> None:
    """Swap each parameter and buffer the graph reads for the tensor `local` gives its target.

    `local` maps get_attr targets to this rank's tensors (see `local_parameters`); targets
    it leaves out keep their tensor.
    """
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in local:
            module, _, attr = node.target.rpartition(".")
            setattr(gm.get_submodule(module), attr, local[node.target])


def local_parameters(gm: fx.GraphModule, solution: Solution, coords: dict[str, int]) -> \
        dict[str, torch.Tensor]:
    """This rank's slice of every tensor the graph reads, by target; a tensor read under two
    targets (tied weights) is sliced once and shared. `coords`: this rank's index on every
    physical tensor axis."""
    done: dict[int, torch.Tensor] = {}
    out = {}
    mesh = solution.mesh if solution.mesh is not None else solution.size
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        full = operator.attrgetter(node.target)(gm)
        if not isinstance(full, torch.Tensor):
            continue
        if id(full) not in done:
            done[id(full)] = local_slice(full, solution.params.get(node.target), coords, mesh)
        out[node.target] = done[id(full)]
    return out


def shard_steps(shard, mesh: TensorMesh | int) -> list[tuple[str, int]]:
    """(axis, blocks) per cut of one shard, major first: a composite axis without a process
    group of its own is cut component by component, its blocks on the major one
    (`autopar.sharding.axes`); any other axis in one cut."""
    if isinstance(mesh, int) or shard.axis not in mesh.axes or mesh.has_group(shard.axis):
        return [(shard.axis, shard.groups)]
    comps = mesh.components(shard.axis)
    return [(c, shard.groups if i == 0 else 1) for i, c in enumerate(comps)]


def local_slice(full: torch.Tensor, layout: Layout | None, coords: dict[str, int],
                mesh: TensorMesh | int):
    """This rank's slice of a full tensor under `layout` (a new Parameter for parameters).

    `coords`: this rank's index on every physical axis; `mesh`: the tensor axes (an int: one
    axis of that many ranks, as in 1D).
    """
    data = full.detach()
    if layout is not None:
        for shard in layout.shards:
            for axis, groups in shard_steps(shard, mesh):
                parts = mesh if isinstance(mesh, int) else mesh.size(axis)
                index = coords[axis] if isinstance(mesh, int) else mesh.index(axis, coords)
                shape = list(data.shape)
                m = shape[shard.dim] // (groups * parts)
                blocks = data.reshape(shape[:shard.dim] + [groups, parts, m]
                                      + shape[shard.dim + 1:])
                data = blocks.select(shard.dim + 1, index)
                data = data.reshape(shape[:shard.dim] + [groups * m] + shape[shard.dim + 1:])
    data = data.clone() if data.device.type != "meta" else data
    if isinstance(full, nn.Parameter):
        return nn.Parameter(data, requires_grad=full.requires_grad)
    return data
