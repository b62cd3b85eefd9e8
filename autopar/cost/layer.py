"""What each layer of a traced graph costs, read once from the graph and the catalog.

The planner prices a layer from numbers, not from the graph: FLOPs of every matrix
multiplication, attention cores, bytes moved by memory-bound ops, parameters, the
collectives the 1D catalog emits, the activation passed to the next layer, and the
activations saved for backward. Every quantity is linear in the micro-batch ``B``
(``Lin(a, b)`` = a + b·B). Structurally identical layers share one ``LayerType``, so a
96-block model is read from two traced blocks and priced once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import sympy
import torch

from autopar.cost.chunked_loss import held_while_running, remade
from autopar.cost.memory import activation_bytes
from autopar.cost.state import param_dtype
from autopar.graph.analysis import OpKind
from autopar.graph.opaque import MOE_KEY_ARG, described
from autopar.graph.trace import BATCH, TracedGraph
from autopar.modes import NO_RECOMPUTE, SELECTIVE, TP
from autopar.sharding.divisible import indivisible
from autopar.sharding.solve import Solution, replicated_regions, solve
from autopar.sharding.strategy import Rewrite

_FREE = {OpKind.INPUT, OpKind.PARAM, OpKind.OUTPUT, OpKind.VIEW, OpKind.SYMBOLIC}


@dataclass(frozen=True)
class Lin:
    """a + b * micro_batch."""

    a: float = 0.0
    b: float = 0.0

    def __call__(self, batch: float) -> float:
        return self.a + self.b * batch

    def __add__(self, other: Lin) -> Lin:
        return Lin(self.a + other.a, self.b + other.b)

    def scale(self, k: float) -> Lin:
        return Lin(self.a * k, self.b * k)

    @staticmethod
    def of(expr) -> Lin:
        expr = sympy.expand(sympy.sympify(expr))
        b = float(expr.coeff(BATCH, 1))
        a = float(expr.subs(BATCH, 0))
        return Lin(a, b)


ZERO = Lin()


@dataclass(frozen=True)
class Gemm:
    """One matrix multiplication: ``tokens`` x ``k`` times ``k`` x ``n`` (global sizes).

    ``flops`` counts multiply and add (2·M·K·N) of the forward. ``weight``: the right
    operand is a parameter (a linear layer), so multi-dimensional tensor modes can split it.
    """

    flops: Lin
    k: int
    n: int
    weight: bool
    # a grouped matmul over token-expert rows (MoE): `groups` experts' K x N weights, each
    # row multiplied by its own expert's, so FLOPs are those of the active (top-k) experts
    expert: bool = False
    groups: int = 1


@dataclass(frozen=True)
class Experts:
    """A layer's mixture-of-experts feed-forward: `count` experts, `top_k` per token."""

    count: int
    top_k: int
    hidden: int  # width of one dispatched row
    params: int  # elements of every expert's weights
    param_bytes: int
    rows: Lin  # bytes of the token-expert rows one micro-batch dispatches (whole batch)
    tokens: Lin  # tokens one micro-batch routes (whole batch)
    # (bytes, stacked) of each expert weight tensor in graph order; stacked: [E, ...], of
    # which an ep rank holds E/ep (else one expert's tensor, held whole)
    tensors: tuple = ()


@dataclass(frozen=True)
class Attention:
    """One attention core: scores and the weighted sum (4·B·H·S·S_k·D FLOPs forward)."""

    flops: Lin
    score_elements: Lin  # B·H·S·S_k: what an unfused kernel writes and reads
    heads: int
    kv_heads: int
    keys: int = 0  # S_k, keys per query: a fused kernel's rate depends on it
    causal: bool = False  # a causal mask: a fused kernel skips the masked half


@dataclass
class Sharded:
    """One layer under 1D tensor parallelism of size ``tp`` (from the catalog's solution)."""

    tp: int
    gemm_split: list[bool]  # per Gemm: its local FLOPs are 1/tp of the global
    attention_split: list[bool]
    traffic_split: Lin  # bytes of memory-bound ops whose values are split over tp
    traffic_replicated: Lin  # ... replicated over tp (Megatron-SP splits them on sequence)
    comm: list[tuple[str, str, Lin]]  # (op, phase, bytes of the whole tensor)
    param_bytes: int  # per device
    param_bytes_replicated: int  # of those, replicated over tp (norm weights, ...)
    act_split: Lin  # saved-for-backward bytes per device of split values
    act_replicated: Lin  # ... of replicated values (Megatron-SP splits them)
    act_attention: Lin  # ... inside attention (scores, probabilities): selective drops them
    replicated_ops: list[str] = field(default_factory=list)
    # why the runtime refuses this layer in 1d at this size (sharding.divisible), or None
    refused: str | None = None
    expert_split: int = 1  # the tp ranks each expert's FFN is split over (1: whole)
    # the experts' all-reduces over tp (as `comm`), which run only where they are split: the
    # engine keeps experts whole beside a cp axis (autopar.plans.Plan.splits_experts)
    expert_comm: list[tuple[str, str, Lin]] = field(default_factory=list)
    # bytes per device of each parameter tensor outside the experts, in the optimizer's order
    param_tensors: tuple = ()  # (the engine's: autopar.cost.state.StepTemps)
    # per tensor of `param_tensors`: whether the 2D, 2.5D and 3D grids split it q ways, not as
    # a matrix: one dim (a bias, a norm's weight), or an embedding's table (on its hidden dim)
    param_vectors: tuple = ()
    loss_workspace: Lin = ZERO  # bytes a loss holds running, beyond its saved (chunked_loss)
    loss_remade: tuple = ()  # (FLOPs Lin, chunk GEMM shape) of logits remade (chunked_loss)


@dataclass
class LayerType:
    """Everything the cost model needs of one kind of layer."""

    name: str  # the first layer of this kind
    names: list[str]  # every traced layer of this kind, in graph order
    gemms: list[Gemm]
    attention: list[Attention]
    traffic: Lin  # bytes read and written by memory-bound ops (global, forward)
    param_bytes: int
    params: int  # parameter elements
    boundary: Lin  # bytes of the activations this layer hands to the next one
    # bytes of the activations this layer receives (kept by full recompute), less those an
    # earlier layer reads too (`held_once`)
    input_bytes: Lin
    dtype_bytes: int
    sharded: dict[int, Sharded] = field(default_factory=dict)
    kernels: int = 0  # device kernels of its forward (one per op that is not a view)
    experts: Experts | None = None  # its MoE feed-forward, if it has one
    # compiled (inductor): each connected group of memory-bound ops is one kernel that
    # reads the group's inputs and writes its outputs once (`_fused`)
    fused_traffic: Lin = ZERO
    fused_kernels: int = 0
    held_bytes: int = 0  # of param_bytes, what a later layer reads too (ZeRO-3 holds it)

    def fused_share(self, batch: float) -> float:
        """The share of the memory-bound bytes a compiled layer still moves."""
        eager = self.traffic(batch)
        return self.fused_traffic(batch) / eager if eager > 0 else 1.0

    @property
    def is_block(self) -> bool:
        """A layer with linear algebra of its own: tensor modes, SP and recompute apply."""
        return any(g.weight for g in self.gemms)

    @property
    def forward_flops(self) -> Lin:
        out = ZERO
        for g in self.gemms:
            out = out + g.flops
        for a in self.attention:
            out = out + a.flops
        return out


@dataclass
class LayerChain:
    """The model as the planner sees it: layer kinds in order, with repeat counts."""

    types: list[LayerType]
    order: list[int]  # index into types, one per layer of the real model
    tokens_per_sample: int
    dtype_bytes: int  # the widest floating activation (never the parameters': param_dtype)
    names: list[str] = field(default_factory=list)  # one per layer of the real model
    sources: list[str] = field(default_factory=list)  # per entry of order: its traced layer
    refused: list[str] = field(default_factory=list)  # tensor sizes the model cannot take
    traced: TracedGraph | None = None
    # the dtype of most parameter elements: what autopar.cost.precision prices states from
    param_dtype: torch.dtype = torch.float32
    chunked_loss: bool = True  # a classifier's cross-entropy priced chunked (cost.chunked_loss)
    holding: dict = field(default_factory=dict)  # kind -> twin with `held_once`'s tensors

    def layers(self) -> list[LayerType]:
        return [self.types[i] for i in self.order]

    @property
    def params(self) -> int:
        return sum(self.types[i].params for i in self.order)


def _nbytes(shape, dtype) -> sympy.Expr:
    if shape is None or dtype is None:
        return sympy.Integer(0)
    n = sympy.Integer(1)
    for s in shape:
        n = n * s
    return n * torch.empty((), dtype=dtype).element_size()


def _numel(shape) -> sympy.Expr:
    n = sympy.Integer(1)
    for s in shape:
        n = n * s
    return n


def _tensor_args(node):
    return [a for a in node.all_input_nodes if a.meta.get("autopar") is not None
            and a.meta["autopar"].shape is not None]


def _gemm(node) -> Gemm:
    info = node.meta["autopar"]
    args = node.args
    target = str(node.target)
    if "addmm" in target or "baddbmm" in target:
        a, w = args[1], args[2]
    else:
        a, w = args[0], args[1]
    a_shape = a.meta["autopar"].shape
    w_info = w.meta["autopar"]
    k = a_shape[-1]
    flops = 2 * _numel(info.shape) * k
    if "linear" in target:
        n = w_info.shape[0]
    else:
        n = w_info.shape[-1]
    weight = w_info.kind is OpKind.PARAM or (w.op == "call_function" and any(
        x.meta["autopar"].kind is OpKind.PARAM for x in w.all_input_nodes
        if x.meta.get("autopar") and w.meta["autopar"].kind is OpKind.VIEW))
    return Gemm(Lin.of(flops), int(k), int(n), weight)


def _grouped_gemm(node) -> Gemm:
    """`aten._grouped_mm(rows [R, K], weights [E, K, N], offs)`: each of the R token-expert
    rows times its expert's K x N weight, 2·R·K·N FLOPs in all."""
    rows, w = node.args[0], node.args[1]
    k = rows.meta["autopar"].shape[-1]
    groups, _, n = w.meta["autopar"].shape
    return Gemm(Lin.of(2 * _numel(node.meta["autopar"].shape) * k), int(k), int(n), True,
                expert=True, groups=int(groups))


def _expert_weights(node) -> list:
    """The parameters (get_attr nodes) a grouped matmul's weight operand is a view of."""
    out, todo = [], [node.args[1]]
    while todo:
        a = todo.pop()
        if a.op == "get_attr":
            out.append(a)
        elif a.meta["autopar"].kind is OpKind.VIEW:
            todo.extend(a.all_input_nodes)
    return out


def _experts(traced: TracedGraph, grouped: list) -> Experts | None:
    """The MoE of a layer from its grouped matmuls and its router's top-k, if any."""
    if not grouped:
        return None
    weights = {a.target: traced.params[a.target] for g in grouped for a in _expert_weights(g)
               if a.target in traced.params}
    params = sum(int(_numel(p.shape)) for p in weights.values())
    param_bytes = sum(int(_numel(p.shape)) * torch.empty((), dtype=p.dtype).element_size()
                      for p in weights.values())
    first = grouped[0]
    rows = first.args[0].meta["autopar"]
    count = int(first.args[1].meta["autopar"].shape[0])
    topk = next((n for n in first.graph.nodes if n.target is torch.ops.aten.topk.default and
                 n.meta["autopar"].layer == first.meta["autopar"].layer), None)
    top_k = int(topk.args[1]) if topk is not None else 1
    return Experts(count, top_k, int(rows.shape[-1]), params, param_bytes,
                   Lin.of(_nbytes(rows.shape, rows.dtype)), Lin.of(_numel(rows.shape[:-1]))
                   .scale(1 / top_k), _expert_tensors(weights.values(), count))


def _expert_tensors(weights, count: int) -> tuple:
    """(bytes, stacked) of each expert weight (`Experts.tensors`)."""
    return tuple((int(_numel(p.shape)) * torch.empty((), dtype=p.dtype).element_size(),
                  len(p.shape) > 2 and int(p.shape[0]) == count) for p in weights)


def _expert_targets(traced: TracedGraph, nodes) -> set:
    """The targets of the expert weights among `nodes` (grouped matmuls' and MoE ops')."""
    out = set()
    for node in nodes:
        kind = node.meta["autopar"].kind if "autopar" in node.meta else None
        if kind is OpKind.GROUPED_MM:
            out.update(a.target for a in _expert_weights(node) if a.target in traced.params)
        elif kind is OpKind.MOE:
            out.update(_weight_of(w).target for w in node.args[2])
    return out


def _weight_of(node):
    """The get_attr node a weight argument reads (through the casts a precision pass adds)."""
    while node.op != "get_attr":
        node = node.args[0]
    return node


def _moe_split(node) -> list[bool]:
    """Per GEMM of `_moe(node)`: whether tensor parallelism's expert split cuts it (the
    experts' three, the shared expert's three; not the router nor the shared gate)."""
    spec = described(node.args[MOE_KEY_ARG])
    return [False, True, True, True] + ([True, True, True] if spec.shared_ffn else []) + \
        ([False] if spec.shared_gate else [])


def _moe_ffn_traffic(node) -> sympy.Expr:
    """The memory-bound bytes of `_moe(node)` on the experts' FFN width (SwiGLU's silu and
    product), which tensor parallelism's expert split cuts."""
    spec = described(node.args[MOE_KEY_ARG])
    x = node.args[0].meta["autopar"]
    t, size = _numel(x.shape[:-1]), torch.empty((), dtype=x.dtype).element_size()
    return 5 * t * spec.top_k * spec.ffn * size + 5 * t * spec.shared_ffn * size


def _moe(traced: TracedGraph, node) -> tuple[list[Gemm], Experts, sympy.Expr]:
    """One MoE layer traced as the opaque op `autopar::moe(x, gate, experts, shared, key,
    with_aux)` (its MoESpec registered under `key`): the GEMMs, experts and memory-bound
    bytes of what the grouped-matmul trace of the same layer holds. T tokens of width H,
    top-k of E experts of FFN width F: the router [T, H] x [H, E]; three grouped GEMMs (w1,
    w3: H -> F; w2: F -> H) over the T·k dispatched rows, each row times its own expert's
    weight (active FLOPs); a shared expert of width F_s (and its [H, 1] gate) on every token.
    Memory-bound bytes, op by op as the zoo's SparseMoE runs them: the router's fp32
    scores, softmax and top-k (normalised: their sum and division); sorting the rows by
    expert, counting them and gathering them; SwiGLU's silu and product on [T·k, F]; the
    inverse permutation, the fp32 combine weighting and summing the rows, and the cast back;
    a shared expert's SwiGLU and its sigmoid-gated sum."""
    spec = described(node.args[MOE_KEY_ARG])
    x = node.args[0].meta["autopar"]
    e, k, h, f, fs = spec.experts, spec.top_k, spec.hidden, spec.ffn, spec.shared_ffn
    t = _numel(x.shape[:-1])
    rows = t * k
    gemms = [Gemm(Lin.of(2 * t * h * e), h, e, True)]
    for kk, n in ((h, f), (h, f), (f, h)):
        gemms.append(Gemm(Lin.of(2 * rows * kk * n), kk, n, True, expert=True, groups=e))
    if fs:
        for kk, n in ((h, fs), (h, fs), (fs, h)) + (((h, 1),) if spec.shared_gate else ()):
            gemms.append(Gemm(Lin.of(2 * t * kk * n), kk, n, True))
    size = torch.empty((), dtype=x.dtype).element_size()
    weights = [traced.params[_weight_of(w).target] for w in node.args[2]]
    params = sum(int(_numel(p.shape)) for p in weights)
    param_bytes = sum(int(_numel(p.shape)) * torch.empty((), dtype=p.dtype).element_size()
                      for p in weights)
    experts = Experts(e, k, h, params, param_bytes, Lin.of(rows * h * size), Lin.of(t),
                      _expert_tensors(weights, e))
    routing = t * e * (size + 4) + 3 * t * e * 4 + \
        (3 * rows * 4 + 2 * t * 4 if spec.router.normalize else 0)
    dispatch = 8 * rows * 8 + 52 * e + t * h * size + rows * 8 + rows * h * size
    swiglu = 5 * rows * f * size + (5 * t * fs * size + 2 * t * size + 6 * t * h * size
                                    if fs else 0)
    combine = 2 * rows * 8 + 2 * rows * h * size + rows * 8 + rows * h * (size + 4) + \
        2 * rows * h * 4 + rows * 4 + rows * h * 4 + t * h * 4 + t * h * (4 + size)
    return gemms, experts, routing + dispatch + swiglu + combine


def _attention(node) -> Attention:
    q, k, v = node.args[:3]
    qs, ks, vs = (x.meta["autopar"].shape for x in (q, k, v))
    b, h, s, d = qs
    sk = ks[-2]
    flops = 2 * b * h * s * sk * d + 2 * b * h * s * sk * vs[-1]
    causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
    return Attention(Lin.of(flops), Lin.of(b * h * s * sk), int(h), int(ks[1]), int(sk),
                     bool(causal))


def _split(layout) -> bool:
    if isinstance(layout, (list, tuple)):
        layout = layout[0] if layout else None
    return layout is not None and not layout.is_replicated


_MEMORY_BOUND_NOT = _FREE | {OpKind.LINEAR, OpKind.MATMUL, OpKind.GROUPED_MM, OpKind.MOE,
                              OpKind.ATTENTION}


def _fused(nodes) -> tuple[sympy.Expr, int]:
    """Bytes and kernels of a layer's memory-bound ops as inductor runs them: producer and
    consumer ops (views between them are indexing) fuse into one kernel per connected
    group, which reads what enters the group and writes what leaves it once (inductor's
    scheduler fuses pointwise and reduction nodes that share loops: torch._inductor.scheduler,
    Ansel et al. 2024, "PyTorch 2", ASPLOS). GEMMs and attention stay library kernels."""
    members = [n for n in nodes if "autopar" in n.meta and n.op != "get_attr"
               and n.meta["autopar"].kind not in _MEMORY_BOUND_NOT]
    group = {n: i for i, n in enumerate(members)}

    def source(a):  # what holds a view's values
        while a.meta["autopar"].kind is OpKind.VIEW and _tensor_args(a):
            a = _tensor_args(a)[0]
        return a

    for n in members:  # union by relabelling: the groups are small
        for a in _tensor_args(n):
            s = source(a)
            if s in group and group[s] != group[n]:
                old, new = group[s], group[n]
                for m in members:
                    if group[m] == old:
                        group[m] = new

    def escapes(n, inside) -> bool:
        return any(u not in inside and ("autopar" not in u.meta or u.meta["autopar"].kind
                                        is not OpKind.VIEW or escapes(u, inside))
                   for u in n.users)

    traffic = sympy.Integer(0)
    for label in set(group.values()):
        inside = {n for n in members if group[n] == label}
        ins = {source(a) for n in inside for a in _tensor_args(n)} - inside
        outs = [n for n in inside if escapes(n, inside)]
        traffic = traffic + sum((_nbytes(a.meta["autopar"].shape, a.meta["autopar"].dtype)
                                 for a in ins if a.meta["autopar"].kind is not OpKind.PARAM),
                                sympy.Integer(0))
        traffic = traffic + sum((_nbytes(n.meta["autopar"].shape, n.meta["autopar"].dtype)
                                 for n in outs), sympy.Integer(0))
    return traffic, len(set(group.values()))


def _traffic(node) -> sympy.Expr:
    info = node.meta["autopar"]
    out = _nbytes(info.shape, info.dtype)
    for a in _tensor_args(node):
        ai = a.meta["autopar"]
        if ai.kind is not OpKind.PARAM:
            out = out + _nbytes(ai.shape, ai.dtype)
    return out


def layer_chain(traced: TracedGraph, *, repeat: dict[str, int] | None = None,
                tokens_per_sample: int = 1) -> LayerChain:
    """Read the layer kinds of `traced`. ``repeat``: a layer name -> how many identical
    copies the real model has where the trace has one (the zoo traces two blocks of 96)."""
    repeat = repeat or {}
    types: dict[tuple, LayerType] = {}
    order, sources, read = [], [], set()
    owner = {node: layer.name for layer in traced.layers for node in layer.nodes}
    for layer in traced.layers:
        held = held_once(layer, owner, read)
        # the first block to read a shared tensor keeps it: a kind of its own
        kind = (layer.group, bool(held))
        if kind not in types:
            types[kind] = _read_layer(traced, layer, owner, held)
        else:
            types[kind].names.append(layer.name)
        order.extend([kind] * repeat.get(layer.name, 1))
        sources.extend([layer.name] * repeat.get(layer.name, 1))
    group_index = {g: i for i, g in enumerate(types)}
    type_list = list(types.values())
    dtype_bytes = max(t.dtype_bytes for t in type_list)
    return LayerChain(type_list, [group_index[g] for g in order], tokens_per_sample,
                      dtype_bytes, sources=sources, param_dtype=param_dtype(traced),
                      holding={lt.name: types[(g, False)].name for (g, held), lt in types.items()
                               if held and (g, False) in types})  # (a pipeline's stages)


def _outside_inputs(layer, owner) -> list:
    """The activations `layer` reads from other layers, in graph order."""
    out: dict = {}
    for node in layer.nodes:
        if node.op == "get_attr":
            continue
        for a in _tensor_args(node):
            if owner.get(a, layer.name) != layer.name and \
                    a.meta["autopar"].kind not in (OpKind.PARAM,) and a.op != "get_attr":
                out[a] = None
    return list(out)


def held_once(layer, owner, read: set) -> set:
    """The inputs of `layer` an earlier layer reads too (adding this layer's to `read`): a
    tensor several layers read (transformers' rotary tables, an additive mask) is held once,
    by the first reader; full recomputation keeps it there, later layers leave it out."""
    inputs = _outside_inputs(layer, owner)
    held = {a for a in inputs if a in read}
    read.update(inputs)
    return held


def _read_layer(traced: TracedGraph, layer, owner, held: set = frozenset()) -> LayerType:
    gemms, attention = [], []
    traffic = sympy.Integer(0)
    boundary = sympy.Integer(0)
    param_bytes = params = kernels = held_bytes = 0
    dtype_bytes = 0
    grouped = []
    moe = None
    for node in layer.nodes:
        info = node.meta["autopar"]
        if node.op == "get_attr":
            p = traced.params.get(node.target)
            if p is not None and p.is_parameter:
                n = int(_numel(p.shape))
                params += n
                param_bytes += n * torch.empty((), dtype=p.dtype).element_size()
                if any(owner.get(u, layer.name) != layer.name for u in node.users):  # (tied)
                    held_bytes += n * torch.empty((), dtype=p.dtype).element_size()
            continue
        if info.dtype is not None and info.dtype.is_floating_point:
            dtype_bytes = max(dtype_bytes, torch.empty((), dtype=info.dtype).element_size())
        kernels += info.kind not in _FREE
        if info.kind in (OpKind.LINEAR, OpKind.MATMUL):
            gemms.append(_gemm(node))
        elif info.kind is OpKind.GROUPED_MM:
            gemms.append(_grouped_gemm(node))
            grouped.append(node)
        elif info.kind is OpKind.MOE:
            moe_gemms, moe, moe_traffic = _moe(traced, node)
            gemms.extend(moe_gemms)
            traffic = traffic + moe_traffic
        elif info.kind is OpKind.ATTENTION:
            attention.append(_attention(node))
        elif info.kind not in _FREE:
            traffic = traffic + _traffic(node)
        if any(owner.get(u, layer.name) != layer.name for u in node.users) and info.shape:
            boundary = boundary + _nbytes(info.shape, info.dtype)
    inputs = sum((_nbytes(a.meta["autopar"].shape, a.meta["autopar"].dtype)
                  for a in _outside_inputs(layer, owner) if a not in held), sympy.Integer(0))
    fused, groups = _fused(layer.nodes)
    return LayerType(layer.name, [layer.name], gemms, attention, Lin.of(traffic), param_bytes,
                     params, Lin.of(boundary), Lin.of(inputs), dtype_bytes or 4, kernels=kernels,
                     experts=moe or _experts(traced, grouped), fused_traffic=Lin.of(fused),
                     fused_kernels=groups, held_bytes=held_bytes)


def add_tensor_parallel(traced: TracedGraph, chain: LayerChain, sizes,
                        chunked_loss: bool = True) -> list[str]:
    """Fill ``chain.types[*].sharded[t]`` for each tensor size t from the 1D catalog.

    Returns the sizes the model cannot take, each with the reason.
    """
    layer_of = {layer.name: layer for layer in traced.layers}
    refused = []
    solutions = {}
    for size in sizes:
        try:
            solution = solve(traced, axis=TP, size=size)
        except Exception as e:  # a size the model's shapes do not divide
            refused.append(f"tp={size}: {e}")
            continue
        # heads or widths the runtime refuses to split: the layers holding them cannot take
        # this size in 1d (Sharded.refused), the others can (beside a 2D/2.5D/3D grid)
        problem = indivisible(traced, solution)
        if problem:
            refused.append(f"tp={size}: {problem}")
        solutions[size] = solution
    _split_kinds(traced, chain, solutions, layer_of)
    by_name = {t.names[0]: t for t in chain.types}
    for size, solution in solutions.items():
        for name, lt in by_name.items():
            lt.sharded[size] = _read_sharded(traced, layer_of[name], solution, size)
            lt.sharded[size].refused = indivisible(traced, solution, set(layer_of[name].nodes))
        _add_activations(traced, by_name, solution, size, chunked_loss)
    return refused


def _split_kinds(traced: TracedGraph, chain: LayerChain, solutions, layer_of) -> None:
    """Structurally identical layers that 1D splits differently are different kinds.

    A stack of identical Linear blocks alternates column and row splits under 1D, so the
    blocks share a structure but not a cost; each kind is split by how its members read
    under every tensor size, and the chain's order follows.
    """
    if not solutions or not chain.sources:
        return
    new_types: list[LayerType] = []
    kind_of: dict[str, int] = {}
    for lt in chain.types:
        signatures: list[tuple[tuple, list[str]]] = []  # Sharded is unhashable: compare
        for name in lt.names:
            sig = tuple(dataclasses.replace(_read_sharded(traced, layer_of[name], sol, size),
                                            replicated_ops=[])
                        for size, sol in solutions.items())
            same = next((members for known, members in signatures if known == sig), None)
            if same is None:
                signatures.append((sig, [name]))
            else:
                same.append(name)
        for _, members in signatures:
            kind = lt if len(signatures) == 1 else dataclasses.replace(
                lt, name=members[0], names=list(members), sharded={})
            kind_of.update({n: len(new_types) for n in members})
            new_types.append(kind)
    if len(new_types) != len(chain.types):
        chain.types = new_types
        chain.order = [kind_of[src] for src in chain.sources]


def _add_activations(traced: TracedGraph, by_name, solution: Solution, size: int,
                     chunked_loss: bool = True) -> None:
    """Saved-for-backward bytes per layer kind, split into what tensor parallelism splits,
    what it leaves replicated (and Megatron-SP splits) and what lies inside attention.

    The memory analysis gives each layer's local bytes A_t at size t and the global A_1;
    with S split 1/t and R replicated, A_t = S/t + R, so R = (t A_t - A_1) / (t - 1).
    """
    def at(batch, recompute, sol):
        return activation_bytes(traced, sol, micro_batch=batch, recompute=recompute,
                                chunked_loss=chunked_loss)

    one = {b: at(b, NO_RECOMPUTE, None) for b in (1, 2)}
    local = {(b, r): at(b, r, solution) for b in (1, 2) for r in (NO_RECOMPUTE, SELECTIVE)}
    held = {b: held_while_running(traced, solution, b, chunked_loss) for b in (1, 2)}
    again = {b: remade(traced, solution, b, chunked_loss) for b in (1, 2)}
    for name, lt in by_name.items():
        def lin(table, name=name):
            return Lin(2 * table[1].get(name, 0) - table[2].get(name, 0),
                       table[2].get(name, 0) - table[1].get(name, 0))

        whole = lin(one)
        kept = lin({b: local[(b, NO_RECOMPUTE)] for b in (1, 2)})
        no_attn = lin({b: local[(b, SELECTIVE)] for b in (1, 2)})
        attention = kept + no_attn.scale(-1)
        rest = no_attn
        if size > 1:
            whole_rest = whole + attention.scale(-size)
            replicated = (rest.scale(size) + whole_rest.scale(-1)).scale(1 / (size - 1))
        else:
            replicated = rest
        sharded = lt.sharded[size]
        sharded.loss_workspace = lin(held)
        if name in again[1]:  # the backward's logits made again (per pass)
            sharded.loss_remade = (lin({b: {name: again[b][name][0]} for b in (1, 2)}),
                                   again[1][name][1])
        sharded.act_attention = attention
        sharded.act_replicated = replicated
        sharded.act_split = rest + replicated.scale(-1)


def _read_sharded(traced: TracedGraph, layer, solution: Solution, size: int) -> Sharded:
    gemm_split, attention_split = [], []
    t_split = t_repl = sympy.Integer(0)
    param_bytes = param_repl = 0
    comm = []
    grouped, gemm_at = [], {}  # a planner trace's expert GEMMs; each GEMM's place
    expert_split = 1
    names = {n.name for n in layer.nodes}
    tensors = {}  # target -> bytes per device
    vectors = {}  # target -> whether it has one dim
    for node in layer.nodes:
        info = node.meta["autopar"]
        if node.op == "get_attr":
            p = traced.params.get(node.target)
            if p is None or not p.is_parameter:
                continue
            nbytes = int(_numel(p.shape)) * torch.empty((), dtype=p.dtype).element_size()
            layout = solution.params.get(node.target)
            split = layout is not None and layout.shards
            param_bytes += nbytes // size if split else nbytes
            param_repl += 0 if split else nbytes
            tensors.setdefault(node.target, nbytes // size if split else nbytes)
            table = any(u.meta["autopar"].kind is OpKind.EMBEDDING for u in node.users)
            vectors.setdefault(node.target, len(p.shape) == 1 or table)
            continue
        layout = solution.layouts.get(node)
        split = _split(layout) or (solution.strategies.get(node) is not None and any(
            _split(solution.layouts.get(a)) for a in _tensor_args(node)))
        if info.kind in (OpKind.LINEAR, OpKind.MATMUL, OpKind.GROUPED_MM):
            if info.kind is OpKind.GROUPED_MM:
                grouped.append(node)
            gemm_at[node] = len(gemm_split)
            gemm_split.append(split)
        elif info.kind is OpKind.MOE:  # the experts split over tp (1D), or whole
            moe_gemms, _, moe_traffic = _moe(traced, node)
            strategy = solution.strategies.get(node)
            if strategy is not None and strategy.rewrite is Rewrite.TENSOR_EXPERTS:
                expert_split = size
                gemm_split.extend(_moe_split(node))
                t_split = t_split + _moe_ffn_traffic(node)
                t_repl = t_repl + moe_traffic - _moe_ffn_traffic(node)
            else:
                gemm_split.extend([False] * len(moe_gemms))
                t_repl = t_repl + moe_traffic
        elif info.kind is OpKind.ATTENTION:
            attention_split.append(split)
        elif info.kind not in _FREE:
            if split:
                t_split = t_split + _traffic(node)
            else:
                t_repl = t_repl + _traffic(node)
    router = _router(grouped) if grouped and _experts_split(traced, grouped, size) else []
    if router:  # the engine runs the router whole
        gate = _weight_of(router[0].args[1]).target
        tensors[gate] = int(_numel(traced.params[gate].shape)) * torch.empty(
            (), dtype=traced.params[gate].dtype).element_size()
    experts = _expert_targets(traced, layer.nodes)
    kept = {n.name for n in router}  # the engine runs the router whole: no collective there
    split_moe = {n.name for n, s in solution.strategies.items()
                 if s.rewrite is Rewrite.TENSOR_EXPERTS}
    expert_comm = []
    for c in solution.comm:
        if c.where in names and c.where not in kept:
            (expert_comm if c.where in split_moe else comm).append(
                (c.op, c.phase, Lin.of(c.bytes)))
    notes = replicated_regions((n, s.note) for n, s in solution.strategies.items()
                               if s.note and n.name in names)
    out = Sharded(size, gemm_split, attention_split, Lin.of(t_split).scale(1 / size),
                  Lin.of(t_repl), comm, param_bytes, param_repl, ZERO, ZERO, ZERO, notes,
                  expert_split=expert_split, expert_comm=expert_comm,
                  param_tensors=tuple(b for t, b in tensors.items() if t not in experts),
                  param_vectors=tuple(vectors.get(t, False) for t in tensors
                                      if t not in experts))
    if router:
        expert_tensor_split(traced, solution, grouped, router, gemm_at, out)
    return out


def _experts_split(traced: TracedGraph, grouped: list, size: int) -> bool:
    """Whether the engine splits this layer's experts over `size` tensor ranks (1D): every
    FFN width of its grouped GEMMs divides."""
    if size == 1:
        return False
    hidden = _experts(traced, grouped).hidden
    widths = {int(g.args[1].meta["autopar"].shape[2]) for g in grouped} | \
        {int(g.args[0].meta["autopar"].shape[-1]) for g in grouped}
    return all(w % size == 0 for w in widths - {hidden})


def _router(grouped: list) -> list:
    """The ops from the router's linear layer to its top-k (the linear first)."""
    layer = grouped[0].meta["autopar"].layer
    topk = next(n for n in grouped[0].graph.nodes if n.target is torch.ops.aten.topk.default
                and n.meta["autopar"].layer == layer)
    path, node = [topk], topk.args[0]
    while node.meta["autopar"].kind is not OpKind.LINEAR:
        path.append(node)
        node = node.args[0]
    return [node] + path[::-1]


def expert_tensor_split(traced: TracedGraph, solution: Solution, grouped: list, router: list,
                        gemm_at: dict, sharded: Sharded) -> None:
    """A planner's trace of a model's own MoE code (its experts as grouped matmuls, which the
    catalog keeps whole) priced as the engine runs the layer under 1D tensor parallelism
    (autopar.sharding.rules.experts): each expert's FFN width split over tp, so the grouped
    GEMMs' FLOPs and the experts' weights are 1/tp per rank, SwiGLU's [T·k, F] values split,
    the router whole (`router`: its linear layer to its top-k, whose collectives the caller
    left out), and the T·k expert rows all-reduced forward, the input's gradient (T rows)
    backward. `gemm_at`: each GEMM's place in `sharded.gemm_split`."""
    size = sharded.tp
    moe = _experts(traced, grouped)
    sharded.expert_split = size
    for g in grouped:
        sharded.gemm_split[gemm_at[g]] = True
    sharded.gemm_split[gemm_at[router[0]]] = False
    gate = _weight_of(router[0].args[1])
    layout = solution.params.get(gate.target)
    if layout is not None and layout.shards:  # the catalog split it: whole again
        p = traced.params[gate.target]
        nbytes = int(_numel(p.shape)) * torch.empty((), dtype=p.dtype).element_size()
        sharded.param_bytes += nbytes - nbytes // size
        sharded.param_bytes_replicated += nbytes
    split = sum(int(_numel(p.shape)) * torch.empty((), dtype=p.dtype).element_size()
                for p in {a.target: traced.params[a.target] for g in grouped
                          for a in _expert_weights(g) if a.target in traced.params}.values())
    sharded.param_bytes -= split - split // size
    sharded.param_bytes_replicated -= split
    ffn = _ffn_values(grouped, moe.hidden)
    sharded.traffic_split = sharded.traffic_split + ffn.scale(1 / size)
    sharded.traffic_replicated = sharded.traffic_replicated + ffn.scale(-1)
    sharded.expert_comm.append(("all_reduce", "forward", moe.rows))
    sharded.expert_comm.append(("all_reduce", "backward", moe.rows.scale(1 / moe.top_k)))


def _ffn_values(grouped: list, hidden: int) -> Lin:
    """Memory-bound bytes of the ops between the experts' first grouped GEMMs and the last
    (SwiGLU's silu and product on [T·k, F]), which the expert split cuts."""
    inner = {g for g in grouped if int(g.args[1].meta["autopar"].shape[2]) != hidden}
    out = sympy.Integer(0)
    for node in grouped[0].graph.nodes:
        info = node.meta.get("autopar")
        if info is None or node in inner or info.kind is OpKind.GROUPED_MM:
            continue
        args = _tensor_args(node)
        if args and all(a in inner for a in args):  # (views of them too: no bytes)
            inner.add(node)
            out = out + (0 if info.kind in _FREE else _traffic(node))
    return Lin.of(out)
