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
          sequence_layout: str = CONTIGUOUS, cp_grads: bool = True,
          resume: bool = True) -> Solution:
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
    `resume`: a walk repeated for a hint starts from a copy of the last walk's state before
    the hinted op (`_layer_starts`), not from the top (False: from the top; the solution is
    the same).
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
    walk = _Walk(traced, axis, size, layer_modes, hints, fixed_params or {}, mesh, sp_layers,
                 seq, sequence_mode, cp, resume)
    for _ in range(_MAX_PASSES):
        solution = walk.run()
        new_hints = walk.state.new_hints
        read_both = cp.partial & cp.whole
        if not new_hints and not read_both:
            break
        changed = {name for name, hint in new_hints.items() if hints.get(name) != hint}
        hints.update(new_hints)
        walk.resume_before(changed if not read_both else None)  # (cp's sums: from the top)
        cp.kept |= read_both  # read both ways: summed over cp in the graph
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


@dataclass
class _State:
    """What a walk has decided up to some node (and the hints it has asked for so far)."""

    layouts: dict
    strategies: dict
    transitions: list
    params: dict
    requires_grad: dict
    grad_summed: set
    sp_failures: dict
    new_hints: dict
    cp_partial: set
    cp_whole: set

    def copy(self) -> _State:
        return _State(dict(self.layouts), dict(self.strategies),
                      [Transition(t.producer, list(t.consumers), t.src, t.need, t.steps, t.comm)
                       for t in self.transitions],
                      dict(self.params), dict(self.requires_grad), set(self.grad_summed),
                      dict(self.sp_failures), dict(self.new_hints), set(self.cp_partial),
                      set(self.cp_whole))


class _Walk:
    """The graph walked in order, each op's rule deciding from what came before it.

    A rule reads the hints of its own op and of the ops that produced its inputs only, so a
    walk repeated with hints changed from some op on decides every op before that one as
    the last walk did. With `resume`, the walk keeps copies of its state at a few layer
    starts (`_layer_starts`), and a repeated walk starts from the last copy before the first
    op whose hint changed instead of the top (`solve(resume=False)` walks from the top)."""

    def __init__(self, traced, axis, size, layer_modes, hints, fixed_params, mesh, sp_layers,
                 seq, sequence_mode, cp: _CpGrads, resume: bool = True):
        self.traced, self.axis, self.size, self.mesh = traced, axis, size, mesh
        self.layer_modes, self.hints, self.fixed_params = layer_modes, hints, fixed_params
        self.sp_layers, self.seq, self.sequence_mode, self.cp = sp_layers, seq, sequence_mode, cp
        self.nodes = list(traced.graph.nodes)
        self.cp_seq = tokens_per_sample(traced) if mesh.sizes.get(CP, 1) > 1 else None
        self.marks: dict[int, _State] | None = {} if resume else None
        self.points = _layer_starts(self.nodes) if resume else frozenset()
        self.start, self.state = 0, None

    def resume_before(self, changed: set | None) -> None:
        """The next walk starts from the last copy before every op named in `changed` (the
        ops whose hints changed), or from the top (None, or no such copy)."""
        index = {n.name: i for i, n in enumerate(self.nodes)}
        first = min((index.get(name, -1) for name in changed), default=-1) \
            if changed is not None and self.marks else -1
        self.start = max((i for i in self.marks or () if i <= first), default=0)
        if self.marks is not None:
            self.marks = {i: m for i, m in self.marks.items() if i <= self.start}

    def run(self) -> Solution:
        """One walk (from the top, or from `start` after `resume_before`)."""
        cp = self.cp
        if self.start:
            st = self.state = self.marks[self.start].copy()
        else:
            st = self.state = _State({}, {}, [], dict(self.fixed_params), {}, set(), {}, {},
                                     set(), set())
        cp.partial, cp.whole = st.cp_partial, st.cp_whole
        shared = {(t.producer, t.need): t for t in st.transitions}
        for i in range(self.start, len(self.nodes)):
            if i in self.points:
                self.marks[i] = st.copy()
            self._step(self.nodes[i], st, shared)
        for node in self.nodes:
            if node.op == "get_attr" and node.target not in st.params and \
                    node.target in self.traced.params:
                st.params[node.target] = Layout.replicated(
                    len(self.traced.params[node.target].shape))
        return Solution(self.axis, self.size, st.layouts, st.strategies, st.transitions,
                        st.params, st.requires_grad, dict(self.layer_modes), mesh=self.mesh,
                        sp_layers=self.sp_layers, seq=self.seq, sp_failures=st.sp_failures)

    def _step(self, node: fx.Node, st: _State, shared: dict) -> None:
        """Decide one node: its layout, its strategy and the transitions its inputs need."""
        info, layouts, requires_grad, cp = node.meta["autopar"], st.layouts, st.requires_grad, \
            self.cp
        axis, mesh = self.axis, self.mesh
        if node.op == "placeholder":
            layouts[node] = Layout.replicated(len(info.shape)) if info.shape is not None else None
            if self.cp_seq is not None and cp_sequence_input(info.shape, self.cp_seq):
                layouts[node] = layouts[node].with_shard(1, CP)
            requires_grad[node] = False
            return
        if node.op == "get_attr":
            if node.target in st.params:
                layouts[node] = st.params[node.target]
            pinfo = self.traced.params.get(node.target)
            requires_grad[node] = bool(pinfo and pinfo.is_parameter and pinfo.dtype.is_floating_point)
            return
        inputs = tensor_inputs(node)
        requires_grad[node] = _requires_grad(node, _node_args(node), requires_grad)
        if node.op == "output":
            strategy = Strategy("gather outputs", {n: Need(Layout.replicated(len(n.meta["autopar"].shape)))
                                                   for n in inputs}, None)
        elif info.kind is OpKind.SYMBOLIC:
            st.strategies[node] = _check_symbolic(node, layouts, mesh)
            return
        else:
            ctx = RuleContext(node, axis, self.size, self.layer_modes.get(info.layer, TP_1D),
                              layouts, self.hints, st.new_hints, mesh=mesh,
                              requires_grad=requires_grad, sp=info.layer in self.sp_layers,
                              seq=self.seq, grad_summed=st.grad_summed,
                              sp_failures=st.sp_failures, sequence_mode=self.sequence_mode,
                              cp_grads=cp.in_graph, node_inputs=tuple(inputs))
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
                st.params[producer.target] = layouts[producer]
            src = layouts[producer]
            if (producer, need) in shared:
                shared[(producer, need)].consumers.append(node)
                continue
            steps = steps_between(src, need, axis, mesh)
            if steps:
                nbytes = _bytes(producer)
                comm = [c for s in steps for c in s.comm(nbytes, requires_grad[producer], node.name)]
                shared[(producer, need)] = Transition(producer, [node], src, need, steps, comm)
                st.transitions.append(shared[(producer, need)])
        st.strategies[node] = strategy
        if node.op != "output":
            layouts[node] = strategy.out


def _layer_starts(nodes: list[fx.Node]) -> frozenset:
    """Where a walk keeps a copy of its state: before the first linear of a layer (the ops
    rules hint: a fused QKV projection, a key projection), each at least twice as far into
    the graph as the one before, so the copies cost at most two copies of the whole state
    and a walk resumed for a hint at op p starts at p/2 or later."""
    out, layer = [], object()
    for i, node in enumerate(nodes):
        info = node.meta.get("autopar")
        if info is not None and info.kind is OpKind.LINEAR and info.layer != layer:
            layer = info.layer
            if not out or i >= 2 * out[-1]:
                out.append(i)
    return frozenset(out)


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
    item = (info.dtype or torch.get_default_dtype()).itemsize
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