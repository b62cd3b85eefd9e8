"""Communication cost: how long a collective takes on one process group of a mesh axis.

The model is alpha-beta per link class: a message of ``m`` bytes over a link costs
``alpha + m * beta`` seconds, with one (alpha, beta) inside a node and one across nodes
(see :class:`~autopar.cost.hardware.Hardware`). Each collective has a few algorithms,
written once as formulas that work on floats and on sympy symbols alike, so the number
the planner uses and the formula ``explain`` prints are the same expression:

==============  ==================================  ==================================
op              ring                                tree
==============  ==================================  ==================================
all_reduce      reduce-scatter + all-gather ring    double binary tree
all_gather      ring                                recursive doubling
reduce_scatter  ring                                recursive halving
all_to_all      pairwise exchange                   Bruck's log-step exchange
broadcast       scatter + ring all-gather           binomial tree
p2p             one message ("direct")
==============  ==================================  ==================================

plus ``hierarchical`` for all_reduce, all_gather and reduce_scatter (the ring inside each
node, then the ring across nodes on the node's share of the data, then the ring inside
the node again).

Byte conventions (``n``): all_reduce and broadcast, the tensor; all_gather and
reduce_scatter, the full (gathered) tensor; all_to_all, one rank's whole buffer; p2p,
the message. The arithmetic of reductions is taken as free next to the link time (the
gamma term of Thakur et al. is zero here); a calibrated profile folds it into beta.

Sources. Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication
Operations in MPICH" (IJHPCA 2005) for the ring, recursive doubling/halving, pairwise
exchange, Bruck, binomial and scatter+all-gather costs; Patarasuk & Yuan, "Bandwidth
optimal all-reduce algorithms for clusters of workstations" (JPDC 2009) for the ring's
2(p-1)/p bandwidth term being the lower bound; Sanders, Speck & Traeff (2009) and NCCL
2.4's double binary trees for a tree all-reduce with log-depth latency and the ring's
bandwidth up to the 2(p-1)/p -> 2 factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import sympy

from autopar.cost.hardware import Hardware

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")


@dataclass(frozen=True)
class Symbols:
    """The sympy symbols of the formulas (bytes, group size, seconds, seconds per byte)."""

    n: sympy.Symbol
    p: sympy.Symbol
    q: sympy.Symbol  # ranks of the group inside one node (two-level formulas)
    alpha: sympy.Symbol
    beta: sympy.Symbol
    alpha_intra: sympy.Symbol
    beta_intra: sympy.Symbol
    alpha_inter: sympy.Symbol
    beta_inter: sympy.Symbol


SYMBOLS = Symbols(*sympy.symbols(
    "n p q alpha beta alpha_intra beta_intra alpha_inter beta_inter", positive=True))


# ----------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    """How the process groups of one mesh axis sit on the nodes.

    ``size`` ranks per group; ``per_node`` of them share a node (``size`` when a group
    fits in one node); ``sharing`` groups of the axis cross the boundary of the same node
    at the same time and so split its network links; ``node_size`` devices per node
    (``None``: the hardware profile's ``per_node``).

    Network links: every device of a node brings one link of ``inter_node_bandwidth``, so
    a node sends ``node_size * inter_node_bandwidth`` in all. The ``sharing`` groups split
    that evenly: one group's traffic across the boundary gets
    ``node_size * inter_node_bandwidth / sharing`` (a ring pushes it through one edge per
    node, spread over several NICs as NCCL's channels do), and each of its ``per_node``
    ranks, when they all send across at once, ``... / (sharing * per_node)``. Neither goes
    faster than ``intra_node_bandwidth``: traffic reaches another device's NIC over the
    node's own fabric. On a regular layout with full nodes ``sharing * per_node`` is
    ``node_size``, so a rank gets exactly its own link.

    When a node boundary cuts the groups unevenly, ``per_node`` is the fewest ranks of
    one group found together in a node and ``sharing`` the most crossing groups in one
    node: the slowest group sets the pace of a collective the whole axis runs at once.
    """

    size: int
    per_node: int
    sharing: int = 1
    node_size: int | None = None

    def __post_init__(self):
        if self.size < 1 or not 1 <= self.per_node <= self.size:
            raise ValueError(f"a placement needs size >= 1 and 1 <= per_node <= size, not "
                             f"size={self.size}, per_node={self.per_node}.")
        if self.sharing < 1 or (self.node_size is not None and self.node_size < 1):
            raise ValueError(f"sharing ({self.sharing}) and node_size ({self.node_size}) "
                             "must be at least 1.")
        # hashed once: placements key every collective's and layer's memo
        object.__setattr__(self, "_hash", hash((self.size, self.per_node, self.sharing,
                                                self.node_size)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def spans_nodes(self) -> bool:
        return self.per_node < self.size


def placements(mesh: dict[str, int], order: tuple[str, ...], per_node: int) -> dict[str, Placement]:
    """The placement of every axis of ``mesh`` when ranks are laid out axis by axis.

    The first axis of ``order`` is innermost: its groups are runs of consecutive ranks,
    so ``("tp", "cp", "dp", "pp")`` keeps tp inside a node first; it is the layout of
    ``init_device_mesh(..., mesh_dim_names=("pp", "dp", "cp", "tp"))``, whose last
    dimension is fastest. Nodes hold ``per_node`` consecutive ranks. Regular layouts take a
    few integer operations per axis; a node boundary that cuts an axis unevenly is counted
    over one period of the layout (``lcm(stride * size, per_node)`` ranks).
    """
    if sorted(mesh) != sorted(order) or len(set(order)) != len(order):
        raise ValueError(f"order {tuple(order)} must name each mesh axis {sorted(mesh)} once.")
    bad = {a: k for a, k in mesh.items() if not isinstance(k, int) or k < 1}
    if bad or not isinstance(per_node, int) or per_node < 1:
        raise ValueError(f"mesh sizes and per_node must be positive integers, not "
                         f"{bad or per_node}.")
    world = math.prod(mesh.values())
    out, stride = {}, 1
    for axis in order:
        out[axis] = _axis_placement(stride, mesh[axis], world, per_node)
        stride *= mesh[axis]
    return out


@lru_cache(maxsize=4096)
def _axis_placement(stride: int, size: int, world: int, node: int) -> Placement:
    block = stride * size  # ranks holding `stride` whole groups of this axis
    if size == 1 or world <= node or (stride < node and node % block == 0):
        return Placement(size, size, 1, node)  # every group inside one node
    if stride >= node:  # members at least a node apart: one per node, all crossing
        return Placement(size, 1, node, node)
    if node % stride == 0 and block % node == 0:  # node/stride ranks of each of stride groups
        return Placement(size, node // stride, stride, node)
    return _uneven_placement(stride, size, world, node)


_ENUMERATE = 1 << 16  # ranks counted one by one at most; past it, by the layout's structure


def _uneven_placement(stride: int, size: int, world: int, node: int) -> Placement:
    """The placement of an axis that a node boundary cuts unevenly (stride < node here).

    The layout repeats every lcm(block, node) ranks; a short period (or a short world) is
    counted rank by rank. A long one needs blocks of at least two nodes, and then only the
    nodes a block boundary cuts, and a partial last node, differ from the rest: every other
    node lies inside one block and holds each of the block's `stride` groups, all of which
    cross nodes, floor or ceil(node / stride) times. Those few nodes are counted rank by
    rank, so an axis of 10^9 ranks costs a few node's worth of work."""
    block = stride * size
    period = math.lcm(block, node)
    if world % node != 0 and world <= _ENUMERATE:
        period = world
    if period <= _ENUMERATE or block < 2 * node:
        counts = _pair_counts(range(min(period, world)), stride, block, node)
        if world % node != 0 and period < world:  # the partial last node
            counts.update(_pair_counts(range(world - world % node, world), stride, block, node))
        return _placement_of(counts, size, node)
    blocks = min(period, world) // block
    cut = {m * block // node for m in range(1, blocks) if m * block % node}
    counts = _pair_counts((r for j in sorted(cut) for r in range(j * node, j * node + node)
                           if r < world), stride, block, node)
    if world % node != 0:
        counts.update(_pair_counts(range(world - world % node, world), stride, block, node))
    per_node = min([*counts.values(), node // stride])  # an inside node: floor(node / stride)
    sharing = {}
    for _, where in counts:  # every group of a block of two nodes or more crosses
        sharing[where] = sharing.get(where, 0) + 1
    return Placement(size, per_node, max([stride, *sharing.values()]), node)


def _pair_counts(ranks, stride: int, block: int, node: int) -> dict[tuple[int, int], int]:
    """Members of each (group, node) pair among `ranks`."""
    counts: dict[tuple[int, int], int] = {}
    for rank in ranks:
        key = ((rank // block) * stride + rank % stride, rank // node)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _placement_of(counts: dict[tuple[int, int], int], size: int, node: int) -> Placement:
    nodes_of: dict[int, int] = {}
    for group, _ in counts:
        nodes_of[group] = nodes_of.get(group, 0) + 1
    crossing_per_node: dict[int, int] = {}
    for group, where in counts:
        if nodes_of[group] > 1:
            crossing_per_node[where] = crossing_per_node.get(where, 0) + 1
    return Placement(size, min(counts.values()), max(crossing_per_node.values()), node)


# ----------------------------------------------------------------------------- links


@dataclass(frozen=True)
class Links:
    """The alpha (seconds) and beta (seconds per byte) one placement sees on one machine.

    ``beta_inter_group``: one group's traffic across a node boundary (a ring's crossing
    edge); ``beta_inter_rank``: one rank's, when all of the group's ranks in the node send
    across at once. See :class:`Placement` for how ``sharing`` enters.
    """

    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter_group: float
    beta_inter_rank: float


def links(placement: Placement, hw: Hardware) -> Links:
    """The link parameters of ``placement`` on ``hw`` (both frozen: read once per pair)."""
    key = (placement, id(hw))
    hit = _LINKS.get(key)
    if hit is not None and hit[0] is hw:
        return hit[1]
    node = placement.node_size or hw.per_node
    node_links = hw.inter_node_bandwidth * node / placement.sharing
    cap = hw.intra_node_bandwidth
    made = Links(hw.intra_node_latency, 1.0 / cap, hw.inter_node_latency,
                 1.0 / min(cap, node_links), 1.0 / min(cap, node_links / placement.per_node))
    if len(_LINKS) >= 4096:
        _LINKS.clear()
    _LINKS[key] = (hw, made)  # (the profile held: its id is not reused while cached)
    return made


_LINKS: dict = {}  # `links` by (placement, id of the profile): (the profile, its Links)


# ----------------------------------------------------------------------------- formulas
# Each formula takes floats or sympy symbols. Flat ones see one link class:
# f(n, p, alpha, beta); two-level ones see both: f(n, p, q, a_intra, b_intra, a_inter, b_inter).


def _log2(p):
    if isinstance(p, sympy.Basic):
        return sympy.ceiling(sympy.log(p, 2))
    return math.ceil(math.log2(p))


def _ring_all_reduce(n, p, a, b):
    return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b


def _tree_all_reduce(n, p, a, b):
    return 2 * _log2(p) * a + 2 * n * b


def _ring_gather(n, p, a, b):  # all-gather and reduce-scatter alike
    return (p - 1) * a + (p - 1) / p * n * b


def _doubling_gather(n, p, a, b):
    return _log2(p) * a + (p - 1) / p * n * b


def _bruck_all_to_all(n, p, a, b):
    return _log2(p) * (a + n / 2 * b)


def _ring_broadcast(n, p, a, b):
    return (_log2(p) + p - 1) * a + 2 * (p - 1) / p * n * b


def _binomial_broadcast(n, p, a, b):
    return _log2(p) * (a + n * b)


def _direct(n, p, a, b):
    return a + n * b


def _hier_all_reduce(n, p, q, ai, bi, ae, be):
    return 2 * _ring_gather(n, q, ai, bi) + _ring_all_reduce(n / q, p / q, ae, be)


def _hier_gather(n, p, q, ai, bi, ae, be):
    return _ring_gather(n, q, ai, bi) + _ring_gather(n / q, p / q, ae, be)


def _pairwise_all_to_all(n, p, q, ai, bi, ae, be):
    # Pairing rank r with r xor k: the q-1 partners inside the node come first, then
    # the p-q outside it, when every rank of the node crosses at once.
    return (q - 1) * (ai + n / p * bi) + (p - q) * (ae + n / p * be)


@dataclass(frozen=True)
class _Algorithm:
    formula: Callable
    two_level: bool = False
    crossing: str = "group"  # which inter-node beta a flat formula sees across nodes


ALGORITHMS: dict[str, dict[str, _Algorithm]] = {
    "all_reduce": {"ring": _Algorithm(_ring_all_reduce),
                   "tree": _Algorithm(_tree_all_reduce),
                   "hierarchical": _Algorithm(_hier_all_reduce, two_level=True)},
    "all_gather": {"ring": _Algorithm(_ring_gather),
                   "tree": _Algorithm(_doubling_gather, crossing="rank"),
                   "hierarchical": _Algorithm(_hier_gather, two_level=True)},
    "reduce_scatter": {"ring": _Algorithm(_ring_gather),
                       "tree": _Algorithm(_doubling_gather, crossing="rank"),
                       "hierarchical": _Algorithm(_hier_gather, two_level=True)},
    "all_to_all": {"ring": _Algorithm(_pairwise_all_to_all, two_level=True),
                   "tree": _Algorithm(_bruck_all_to_all, crossing="rank")},
    "broadcast": {"ring": _Algorithm(_ring_broadcast),
                  "tree": _Algorithm(_binomial_broadcast, crossing="rank")},
    "p2p": {"direct": _Algorithm(_direct)},
}


def _algorithms(op: str) -> dict[str, _Algorithm]:
    if op not in ALGORITHMS:
        raise ValueError(f"unknown collective '{op}'; valid ops are {', '.join(OPS)}.")
    return ALGORITHMS[op]


def _lookup(op: str, algorithm: str) -> _Algorithm:
    algorithms = _algorithms(op)
    if algorithm not in algorithms:
        raise ValueError(f"{op} has no algorithm '{algorithm}'; choose one of "
                         f"{', '.join(algorithms)} or 'auto'.")
    return algorithms[algorithm]


def collective_expr(op: str, algorithm: str) -> sympy.Expr:
    """The cost formula of ``op`` under ``algorithm``, in the symbols of :data:`SYMBOLS`.

    Flat algorithms are in ``n, p, alpha, beta``; two-level ones (hierarchical, and the
    pairwise all-to-all) in ``n, p, q`` and the intra/inter alphas and betas.
    """
    alg, s = _lookup(op, algorithm), SYMBOLS
    if alg.two_level:
        return alg.formula(s.n, s.p, s.q, s.alpha_intra, s.beta_intra, s.alpha_inter, s.beta_inter)
    return alg.formula(s.n, s.p, s.alpha, s.beta)


def single_link(expr: sympy.Expr) -> sympy.Expr:
    """``expr`` when one link class serves the whole group (q = p, intra = inter)."""
    s = SYMBOLS
    return expr.subs({s.q: s.p, s.alpha_intra: s.alpha, s.alpha_inter: s.alpha,
                      s.beta_intra: s.beta, s.beta_inter: s.beta})


def _time(alg: _Algorithm, n: float, placement: Placement, link: Links) -> float:
    p, q = placement.size, placement.per_node
    if alg.two_level:
        return alg.formula(n, p, q, link.alpha_intra, link.beta_intra, link.alpha_inter,
                           link.beta_inter_rank)
    if not placement.spans_nodes:
        return alg.formula(n, p, link.alpha_intra, link.beta_intra)
    beta = link.beta_inter_group if alg.crossing == "group" else link.beta_inter_rank
    return alg.formula(n, p, link.alpha_inter, beta)


def collective_time(op: str, nbytes: float, placement: Placement, hw: Hardware,
                    algorithm: str = "auto") -> float:
    """Seconds for one ``op`` on ``nbytes`` over each group of ``placement``.

    ``algorithm="auto"`` takes the fastest of the op's algorithms, or, for a group inside
    one node on a profile that carries the op's own fitted figures (``hw.collectives``,
    written by ``autopar calibrate``), the formula it was fitted to with those figures
    (see :func:`fitted_time`). A group of one rank,
    or nothing to send, costs nothing. A group inside one node runs on intra-node links;
    a flat algorithm over a group that spans nodes pays the inter-node latency on every
    step and the node boundary's bandwidth (see :class:`Placement`).
    """
    candidates = (list(_algorithms(op).values()) if algorithm == "auto"
                  else [_lookup(op, algorithm)])
    if nbytes < 0:
        raise ValueError(f"{op} of {nbytes} bytes: a message size cannot be negative.")
    if placement.size == 1 or nbytes == 0:
        return 0.0
    fitted = _fitted(op, placement, hw) if algorithm == "auto" else None
    if fitted is not None:
        return fitted_time(op, fitted, nbytes, placement.size)
    link = links(placement, hw)
    return min(_time(alg, nbytes, placement, link) for alg in candidates)


def _fitted(op: str, placement: Placement, hw: Hardware) -> dict | None:
    """The profile's own figures for ``op`` (``Hardware.collectives``), which describe a
    group inside one node: calibration measures the ranks of one machine."""
    entry = hw.collectives.get(op) if hw.collectives else None
    return entry if entry is not None and not placement.spans_nodes else None


def fitted_time(op: str, fitted: dict, nbytes: float, p: int) -> float:
    """Seconds of ``op`` on ``nbytes`` over ``p`` ranks of one node by the formula it was
    fitted to (``fitted["algorithm"]``, one link class) with its own alpha and beta.

    ``autopar calibrate`` fits each collective separately, so the backend's algorithm
    choice and its overheads (gloo's all-gather and reduce-scatter move data about half as
    fast as its all-reduce; a point-to-point exchange costs more latency than a broadcast)
    are in the figures; the group size enters through the formula."""
    alg = _lookup(op, fitted["algorithm"])
    a, b = float(fitted["alpha"]), float(fitted["beta"])
    if alg.two_level:
        return alg.formula(nbytes, p, p, a, b, a, b)
    return alg.formula(nbytes, p, a, b)


def best_algorithm(op: str, nbytes: float, placement: Placement, hw: Hardware) -> str:
    """The algorithm ``collective_time(..., "auto")`` prices ``op`` with."""
    fitted = _fitted(op, placement, hw)
    if fitted is not None:
        return fitted["algorithm"]
    return min(_algorithms(op), key=lambda name: collective_time(op, nbytes, placement, hw, name))


def grid_gemm_bytes(lt, batch: float):
    """Each weight GEMM of layer `lt` a tensor grid splits (experts' aside), as the bytes of
    its activation (M x K), weight (K x N) and output (M x N) at `batch`."""
    e = lt.dtype_bytes
    for g in lt.gemms:
        if not g.weight or g.expert:
            continue
        m = g.flops(batch) / (2 * g.k * g.n)  # tokens
        yield m * g.k * e, g.k * g.n * e, m * g.n * e
