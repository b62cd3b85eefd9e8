"""Regional compilation of a rank's rewritten graph (`parallelize(..., compile=True)`).

Each run of compute nodes of one layer between two of autopar's own modules (collectives,
sharded kernels, ZeRO-3 gathers, dropout streams, measurement marks) becomes one region,
compiled by inductor. Regions are keyed by their canonical code: the repeated blocks of a
model share one compiled function (one dynamo code object, one inductor graph), so compile
time does not grow with depth. Every collective stays outside the regions, run and logged by
`autopar.kernels.collectives` as in eager mode, so `comm_log` still equals the plan's.

The seam for what other passes add (recomputation, float8): a region holds only nodes that
`compilable` accepts, and a pass that wraps nodes in a module of its own keeps them out of
the regions; a pass that emits plain aten ops gets them compiled with their neighbours. A
recomputed layer's inner graph is cut into regions of its own, which its replay calls again.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import nn

from autopar.kernels.modules import StreamDropout
from autopar.kernels.recompute import Recomputed

PREFIX = "autopar_region"


class CompiledRegions:
    """The compiled functions of one engine, one per distinct region code (shared by the
    blocks that repeat it), and what compiling cost."""

    def __init__(self, backend: str = "inductor"):
        self.backend = backend
        self.functions: dict[str, nn.Module] = {}
        self.regions = 0  # regions replaced in the graphs, over all of them

    def function_for(self, sub: fx.GraphModule) -> nn.Module:
        key = sub.code
        if key not in self.functions:
            options = cpu_options() if self.backend == "inductor" else None
            self.functions[key] = torch.compile(sub, backend=self.backend, fullgraph=True,
                                                dynamic=False, options=options)
        return self.functions[key]

    def compile_graph(self, gm: fx.GraphModule) -> int:
        """Replace every region of `gm` (in place) by a call to its compiled function;
        returns the number of regions."""
        _drop_identity_dropout(gm)
        count = 0
        for run in _runs(gm):
            sub, inputs, outputs = _extract(run)
            name = f"{PREFIX}_{self.regions}"
            gm.add_submodule(name, Region(self.function_for(sub), len(outputs)))
            with gm.graph.inserting_after(run[-1]):  # after the weight reads among the run
                call = gm.graph.call_module(name, tuple(inputs))
            call.meta.update({k: v for k, v in run[0].meta.items() if k != "val"})
            for i, out in enumerate(outputs):
                with gm.graph.inserting_after(call):
                    got = gm.graph.call_function(operator.getitem, (call, i))
                got.meta.update(out.meta)
                out.replace_all_uses_with(got)
            for node in reversed(run):
                gm.graph.erase_node(node)
            self.regions += 1
            count += 1
        gm.graph.lint()
        gm.recompile()
        return count

    @property
    def compiled(self) -> int:
        """Distinct compiled functions (regions with the same code share one)."""
        return len(self.functions)


class Region(nn.Module):
    """One region of a graph: calls the compiled function its code shares with the other
    regions of that code (held outside the module tree: it has no parameters)."""

    def __init__(self, function: nn.Module, outputs: int):
        super().__init__()
        object.__setattr__(self, "function", function)
        self.outputs = outputs

    def extra_repr(self) -> str:
        return f"outputs={self.outputs}"

    def forward(self, *args):
        return self.function(*args)


def cpu_options() -> dict:
    """Inductor's options for the regions: the vector width its C++ kernels are generated for,
    named, so that it enters inductor's graph cache key. Inductor picks the width by building
    and loading a probe library in a child interpreter; where that probe fails (a module in
    the working directory shadowing one of the standard library's, for instance) it writes
    scalar loops, and the cache, whose key does not hold the width, then hands those scalar
    kernels to every later process compiling the same graph (GELU 7x slower than
    vectorized, docs/compile.md). Naming the width keeps the two apart."""
    from torch._inductor import cpu_vec_isa

    return {"cpp.simdlen": cpu_vec_isa.pick_vec_isa().bit_width()}


def compile_graphs(regions: CompiledRegions | None, graphs) -> None:
    """Compile the regions of each graph (a pipeline rank: its stages and the loss) and of
    each recomputed layer's inner graph (its replay calls the same compiled functions) with
    `regions`; nothing when the engine runs eagerly (None)."""
    for gm in graphs if regions is not None else ():
        regions.compile_graph(gm)
        for module in list(gm.modules()):
            if isinstance(module, Recomputed):
                regions.compile_graph(module.inner)


def compilable(node: fx.Node) -> bool:
    """An op inductor may take into a region: a functional, unseeded aten op (autopar's
    modules, collectives and random draws stay outside, in eager mode)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and compilable(src)
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target._schema.is_mutable or (torch.Tag.nondeterministic_seeded in target.tags
                                      and _dropout_p(node) != 0.0):
        return False
    return not any(isinstance(r.type, torch.SymIntType) or str(r.type) == "SymInt"
                   for r in target._schema.returns)


def _dropout_p(node: fx.Node):
    """The dropout probability a seeded op (attention) is called with; None when it has
    none (a random draw of its own): such an op draws nothing at p = 0."""
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            given = node.args[i] if i < len(node.args) else node.kwargs.get(
                "dropout_p", arg.default_value)
            return float(given) if isinstance(given, (int, float)) else None
    return None


def _layer(node: fx.Node):
    meta = node.meta.get("autopar")
    return getattr(meta, "layer", None)


def _runs(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Maximal runs of compilable nodes of one layer, consecutive in graph order (a
    consecutive run of a topological order is convex: it can become one call). The weight
    reads a pipeline stage's graph holds between its ops (get_attr nodes, which read
    nothing of the graph) do not cut a run: they become the region's inputs, defined
    before the call, which takes the run's last place. A run with
    fewer than two ops that compute (views and getitems aside) stays eager: there is
    nothing to fuse, and a compile would cost seconds for no launch saved."""
    runs, current, layer = [], [], None
    for node in gm.graph.nodes:
        if node.op == "get_attr":  # a weight read (a pipeline stage's): an input, no cut
            continue
        if compilable(node) and (not current or _layer(node) == layer):
            current.append(node)
            layer = _layer(node)
            continue
        runs.append(current)
        current, layer = ([node], _layer(node)) if compilable(node) else ([], None)
    runs.append(current)
    return [r for r in runs if sum(not _is_view(n) for n in r) >= 2]


def _is_view(node: fx.Node) -> bool:
    return node.target is operator.getitem or getattr(node.target, "is_view", False)


def _extract(run: list[fx.Node]):
    """A standalone graph of `run` with canonical names (so equal regions have equal code):
    its inputs (values from outside, in order of first use) and outputs (values used
    outside)."""
    members = set(run)
    inputs: list[fx.Node] = []
    for node in run:
        for a in node.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    outputs = [n for n in run if any(u not in members for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(inputs):
        env[a] = graph.placeholder(f"in_{i}")
    for i, node in enumerate(run):
        env[node] = graph.create_node(node.op, node.target, fx.map_arg(node.args, env.get),
                                      fx.map_arg(node.kwargs, env.get), name=f"v_{i}")
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule(nn.Module(), graph, "Region"), inputs, outputs


def _drop_identity_dropout(gm: fx.GraphModule) -> None:
    """Dropout with p = 0 (or in eval) is the identity: take it out so it does not split a
    region; dropout that draws stays outside, on autopar's random streams."""
    for node in list(gm.graph.nodes):
        if node.op != "call_module":
            continue
        module = gm.get_submodule(node.target)
        if isinstance(module, StreamDropout) and (module.p == 0.0 or not module.train_mode):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
