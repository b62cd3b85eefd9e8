"""Propagate layouts through a traced graph under a plan: the sharding solution.

Walks the graph once in order. Inputs arrive replicated over the tensor axis; each op's
catalog rule picks a strategy from its inputs' layouts; where an input's layout differs
from the one the strategy needs, a transition (a list of redistribution steps) is
recorded on that edge. A parameter takes the layout its first user asks for. When a rule
finds that a producer should have laid its output out differently (a fused QKV weight
that must be split in three blocks, a key projection with fewer heads than ranks), it
leaves a hint and the walk is repeated with the hint applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from autopar.errors import PlanError
from autopar.graph.analysis import OpKind, node_label
from autopar.graph.ir import LOSS_MODULE, TracedGraph
from autopar.modes import CONTIGUOUS, CP, TP, TP_1D
from autopar.sharding.axes import TensorMesh
from autopar.sharding.catalog import decide
from autopar.sharding.layout import Layout, divisible
from autopar.sharding.redistribute import Step, steps_between
from autopar.sharding.rules.context import RuleContext, batch_like, tensor_inputs
from autopar.sharding.strategy import CommOp, Need, Rewrite, Strategy

_MAX_PASSES = 6


@dataclass
class Transition:
    """Redistribution of one value to the layout some of its consumers need (done once)."""

    producer: fx.Node
    consumers: list[fx.Node]
    src: Layout
    need: Need
    steps: list[Step]
    comm: list[CommOp]


@dataclass
class Solution:
    """Layouts of every value, the strategy of every op, and every collective of one step."""

    axis: str
    size: int
    layouts: dict[fx.Node, object]
    strategies: dict[fx.Node, Strategy]
    transitions: list[Transition]
    params: dict[str, Layout]  # get_attr target -> layout
    requires_grad: dict[fx.Node, bool]
    modes: dict[str, str]  # layer -> mode used
    hints: dict = field(default_factory=dict)
    mesh: TensorMesh | None = None  # every tensor axis (1D: `axis` alone, of `size` ranks)
    sp_layers: frozenset = frozenset()  # layers run with Megatron sequence parallelism
    seq: int | None = None  # tokens per sample, the size of the sequence dim they split
    sp_failures: dict = field(default_factory=dict)  # layer -> why it is not sequence-split
    sequence_layout: str = CONTIGUOUS  # how tokens split over cp lie ("zigzag" or not)
    # parameters (get_attr targets) whose gradients the graph leaves partial over cp, for the
    # step's sync over dp x cp to sum (solve's cp_grads=False); the others are whole on cp
    cp_partial: frozenset = frozenset()

    @property
    def sizes(self) -> dict[str, int]:
        """Ranks on every tensor axis a layout of this solution may use."""
        return self.mesh.sizes if self.mesh is not None else {self.axis: self.size}

    @property
    def comm(self) -> list[CommOp]:
        """Every collective of one forward and backward pass, in graph order."""
        out = []
        for node, strategy in self.strategies.items():
            for t in self.transitions:
                if t.consumers[0] is node:
                    out.extend(t.comm)
            out.extend(strategy.comm)
        out.extend(c for t in self.transitions if t.consumers[0].op == "output" for c in t.comm)
        return out

    def notes(self) -> list[str]:
        return [f"{node_label(n)}: {s.note}" for n, s in self.strategies.items() if s.note]

    def replicated_regions(self) -> list[str]:
        """Why ops ran replicated, one line per reason, naming the model's modules they ran
        in (not graph nodes): `blocks.0.attn, blocks.1.attn: no catalog entry for ...`."""
        return replicated_regions((n, s.note) for n, s in self.strategies.items() if s.note)


def replicated_regions(noted) -> list[str]:
    """(node, note) pairs as one line per note with the modules of its nodes, in order."""
    modules: dict[str, list[str]] = {}
    for node, note in noted:
        where = module_label(node)
        held = modules.setdefault(note, [])
        if where not in held:
            held.append(where)
    return [f"{_modules_text(names)}: {note}" for note, names in modules.items()]


def module_label(node: fx.Node) -> str:
    """The module path of the model a node runs in, as a user reads it."""
    info = node.meta["autopar"]
    if info.module == LOSS_MODULE:
        return "the loss"
    return info.module or "the model's own forward"


def _modules_text(names: list[str]) -> str:
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]}, {names[1]} ... {names[-1]} ({len(names)} modules)"


def solve(traced: TracedGraph, *, axis: str = TP, size: int = 1,
          modes: dict[str, str] | None = None, default_mode: str = TP_1D,
          fixed_params: dict[str, Layout] | None = None,
          mesh: TensorMesh | None = None,
          sequence_parallel: bool | set | frozenset = False,
          sequence_mode: str | None = None,
          sequence_layout: str = CONTIGUOUS, cp_grads: bool = True) -> Solution:
    """Layouts for `traced` with `size` ranks on `axis`, each layer in its plan mode.

    `mesh`: the tensor axes of a plan with 2D, 2.5D or 3D layers (`axis` is then the whole
    tensor group, which 1D layers of the same plan use); None for 1D only.
    `sequence_parallel`: Megatron sequence parallelism (Korthikanti et al. 2022) in every 1D
    layer (True) or in the 1D layers named: between tensor-parallel regions activations
    are split on the sequence dim over `axis`; a row-split linear (and the vocabulary-
    parallel embedding) leaves a partial sum that its consumer reduce-scatters, a
    column-split linear all-gathers its input (the gradient reduce-scattered). Raises
    PlanError naming the layers that cannot be sequence-split.
    `sequence_mode`: with a "cp" axis in `mesh` (context parallelism), "ring" or "ulysses":
    token inputs [batch, tokens, ...] (and targets) arrive split on dim 1 over cp in the
    contiguous layout, per-token ops keep the split, attention runs the sequence kernels.
    `sequence_layout`: how the tokens lie over cp ("contiguous", or "zigzag": rank r holds
    chunks r and 2c-1-r of 2c). Layouts say S(cp) either way: a split on cp is always a
    token split, so the layout is one property of the solution, which the run-time
    redistributions over cp and the sequence kernels follow.
    `cp_grads`: whether the graph sums parameters' gradients over cp; False leaves those
    sums to the step's sync over dp x cp (Megatron's data-and-context group) and lists the
    parameters left partial in `Solution.cp_partial`. A parameter read both where tokens
    split over cp and where they do not keeps its sums in the graph.
    """
    mesh = mesh if mesh is not None else TensorMesh.one_d(axis, size)
    modes = dict(modes or {})
    layer_modes = {layer.name: modes.get(layer.name, default_mode) for layer in traced.layers}
    sp_layers = _sp_layers(sequence_parallel, layer_modes, size)
    seq = tokens_per_sample(traced) if sp_layers else None
    if sp_layers and seq is None:
        raise PlanError("Megatron sequence parallelism needs token sequences, but the model's "
                        "first input has no sequence dim (it should be [batch, tokens, ...]); "
                        "drop sequence_parallel for this model.")
    hints: dict = {}
    cp = _CpGrads(cp_grads or mesh.sizes.get(CP, 1) == 1)
    for _ in range(_MAX_PASSES):
        new_hints: dict = {}
        solution = _walk(traced, axis, size, layer_modes, hints, new_hints, fixed_params or {},
                         mesh, sp_layers, seq, sequence_mode, cp)
        if not new_hints and not cp.partial & cp.whole:
            break
        hints.update(new_hints)
        cp.kept |= cp.partial & cp.whole  # read both ways: summed over cp in the graph
    solution.cp_partial = frozenset(cp.partial - cp.kept)
    solution.hints = hints
    solution.sequence_layout = sequence_layout if mesh.sizes.get(CP, 1) > 1 else CONTIGUOUS
    if solution.sp_failures:
        why = "; ".join(f"{layer}: {reason}" for layer, reason in
                        sorted(solution.sp_failures.items()))
        raise PlanError(f"Megatron sequence parallelism cannot split these layers on the "
                        f"sequence ({why}); turn sequence_parallel off for them (per layer, "
                        "sp='none') or for the plan.")
    return solution


def _sp_layers(sequence_parallel, layer_modes: dict[str, str], size: int) -> frozenset:
    if size == 1 or not sequence_parallel:
        return frozenset()
    if sequence_parallel is True:
        return frozenset(n for n, m in layer_modes.items() if m == TP_1D)
    return frozenset(n for n in sequence_parallel if layer_modes.get(n, TP_1D) == TP_1D)


def tokens_per_sample(traced: TracedGraph) -> int | None:
    """The sequence length: dim 1 of the model's first input when it is [batch, tokens, ...]
    (token ids [B, S] or embeddings [B, S, H]); None when there is no such input."""
    for node in traced.graph.nodes:
        if node.op != "placeholder":
            continue
        shape = node.meta["autopar"].shape
        if shape is None or len(shape) < 2 or len(shape) > 3 or not batch_like(shape[0]):
            return None
        size = sympy.sympify(shape[1])
        return int(size) if size.is_number else None
    return None


def cp_sequence_input(shape, seq: int) -> bool:
    """Whether a graph input is split on dim 1 over cp: [batch, seq, ...] inputs and targets."""
    return shape is not None and len(shape) >= 2 and batch_like(shape[0]) and \
        sympy.sympify(shape[1]) == seq


@dataclass
class _CpGrads:
    """Which parameters' gradients the graph sums over cp (`in_graph`: all of them), and,
    when not, which it left partial and which it read whole on cp; `kept`: parameters read
    both ways, whose sums stay in the graph."""

    in_graph: bool
    partial: set = field(default_factory=set)
    whole: set = field(default_factory=set)
    kept: set = field(default_factory=set)

    def need(self, producer: fx.Node, need: Need, axis: str, mesh: TensorMesh,
             requires_grad: bool) -> Need:
        """A parameter's need, its sum over cp left out unless the graph keeps it."""
        if self.in_graph or producer.target in self.kept or not requires_grad:
            return need
        axes = need.grad_axes(axis)
        kept = mesh.without_cp(axes)
        if kept == axes:
            self.whole.add(producer.target)
            return need
        self.partial.add(producer.target)
        return Need(need.layout, kept or False)


def _walk(traced, axis, size, layer_modes, hints, new_hints, fixed_params, mesh,
          sp_layers=frozenset(), seq=None, sequence_mode=None,
          cp: _CpGrads | None = None) -> Solution:
    cp = cp if cp is not None else _CpGrads(True)
    cp.partial, cp.whole = set(), set()
    layouts: dict[fx.Node, object] = {}
    strategies: dict[fx.Node, Strategy] = {}
    transitions: list[Transition] = []
    shared: dict[tuple, Transition] = {}
    params: dict[str, Layout] = dict(fixed_params)
    requires_grad: dict[fx.Node, bool] = {}
    grad_summed: set = set()
    sp_failures: dict = {}
    cp_seq = tokens_per_sample(traced) if mesh.sizes.get(CP, 1) > 1 else None
    for node in traced.graph.nodes:
        info = node.meta["autopar"]
        if node.op == "placeholder":
            layouts[node] = Layout.replicated(len(info.shape)) if info.shape is not None else None
            if cp_seq is not None and cp_sequence_input(info.shape, cp_seq):
                layouts[node] = layouts[node].with_shard(1, CP)
            requires_grad[node] = False
            continue
        if node.op == "get_attr":
            if node.target in params:
                layouts[node] = params[node.target]
            pinfo = traced.params.get(node.target)
            requires_grad[node] = bool(pinfo and pinfo.is_parameter and pinfo.dtype.is_floating_point)
            continue
        inputs = tensor_inputs(node)
        requires_grad[node] = _requires_grad(node, _node_args(node), requires_grad)
        if node.op == "output":
            strategy = Strategy("gather outputs", {n: Need(Layout.replicated(len(n.meta["autopar"].shape)))
                                                   for n in inputs}, None)
        elif info.kind is OpKind.SYMBOLIC:
            strategies[node] = _check_symbolic(node, layouts, mesh)
            continue
        else:
            ctx = RuleContext(node, axis, size, layer_modes.get(info.layer, TP_1D), layouts, hints,
                              new_hints, mesh=mesh, requires_grad=requires_grad,
                              sp=info.layer in sp_layers, seq=seq, grad_summed=grad_summed,
                              sp_failures=sp_failures, sequence_mode=sequence_mode,
                              cp_grads=cp.in_graph)
            strategy = decide(ctx)
        # a grid norm's kernel sums its parameters' gradients itself (not over cp here)
        by_kernel = {p.target for p in strategy.args.get("params", ()) if isinstance(p, fx.Node)
                     and requires_grad.get(p)} if strategy.args.get("params_over_cp") else set()
        cp.partial |= by_kernel
        for producer, need in list(strategy.needs.items()):
            if producer.op == "get_attr" and producer.target not in by_kernel:
                need = strategy.needs[producer] = cp.need(producer, need, axis, mesh,
                                                          requires_grad[producer])
            if producer.op == "get_attr" and producer not in layouts:
                layouts[producer] = _place_param(producer, need.layout, mesh.sizes)
                params[producer.target] = layouts[producer]
            src = layouts[producer]
            if (producer, need) in shared:
                shared[(producer, need)].consumers.append(node)
                continue
            steps = steps_between(src, need, axis, mesh)
            if steps:
                nbytes = _bytes(producer)
                comm = [c for s in steps for c in s.comm(nbytes, requires_grad[producer], node.name)]
                shared[(producer, need)] = Transition(producer, [node], src, need, steps, comm)
                transitions.append(shared[(producer, need)])
        strategies[node] = strategy
        if node.op != "output":
            layouts[node] = strategy.out
    for node in traced.graph.nodes:
        if node.op == "get_attr" and node.target not in params and node.target in traced.params:
            params[node.target] = Layout.replicated(len(traced.params[node.target].shape))
    return Solution(axis, size, layouts, strategies, transitions, params, requires_grad,
                    dict(layer_modes), mesh=mesh, sp_layers=sp_layers, seq=seq,
                    sp_failures=sp_failures)


def _place_param(node: fx.Node, wanted: Layout, sizes: dict[str, int]) -> Layout:
    """A parameter takes the layout its first user wants if its dims split evenly."""
    shape = node.meta["autopar"].shape
    for shard in wanted.shards:
        if not divisible(shape[shard.dim], sizes[shard.axis] * shard.groups):
            return Layout.replicated(len(shape))
    return wanted


def _node_args(node: fx.Node) -> list[fx.Node]:
    """Every node among an op's arguments (multi-output producers included)."""
    out: list = []
    fx.node.map_arg((node.args, node.kwargs), out.append)
    return out


def _requires_grad(node: fx.Node, inputs, requires_grad) -> bool:
    info = node.meta["autopar"]
    if info.dtype is None or not info.dtype.is_floating_point:
        val = node.meta.get("val")
        if not (isinstance(val, (list, tuple)) and any(
                isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in val)):
            return False
    if node.target is torch.ops.aten.detach.default:
        return False
    return any(requires_grad.get(n, False) for n in inputs)


def _bytes(node: fx.Node):
    info = node.meta["autopar"]
    item = torch.empty((), dtype=info.dtype).element_size()
    return sympy.Mul(*info.shape) * item


def _check_symbolic(node: fx.Node, layouts, mesh: TensorMesh) -> Strategy:
    """Integer arithmetic on sizes. Sizes in the graph are global (per data-parallel replica):
    reading the size of a split batch dim multiplies the local size back by the ranks that
    split it; any other split dim's size is refused."""
    if node.target is torch.ops.aten.sym_size.int:
        src, dim = node.args[0], node.args[1]
        layout = layouts.get(src)
        shard = layout.shard_of_dim(dim % max(layout.ndim, 1)) \
            if isinstance(layout, Layout) else None
        if shard is not None:
            size = src.meta["autopar"].shape[dim]
            if shard.groups == 1 and batch_like(size):
                return Strategy("symbolic", {}, None, rewrite=Rewrite.GLOBAL_SIZE,
                                args={"parts": mesh.size(shard.axis)})
            raise PlanError(f"{node.name} reads the size of dimension {dim} of {src.name}, which "
                            f"is split over '{shard.axis}'; use a fixed size in the model or "
                            "keep that layer replicated.")
    return Strategy("symbolic", {}, None)