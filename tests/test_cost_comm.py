"""Tests of the communication cost model (autopar/cost/comm.py)."""

import itertools
import math

import pytest

from autopar.cost import comm
from autopar.cost.comm import (
    ALGORITHMS,
    OPS,
    SYMBOLS,
    Placement,
    best_algorithm,
    collective_expr,
    collective_time,
    links,
    placements,
    single_link,
)
from autopar.cost.hardware import Hardware


def machine(intra_bw=100e9, intra_lat=1e-6, inter_bw=1e9, inter_lat=1e-4, per_node=8):
    return Hardware(name="test", memory_bytes=1, peak_flops={"fp32": 1.0}, memory_bandwidth=1.0,
                    intra_node_bandwidth=intra_bw, intra_node_latency=intra_lat,
                    inter_node_bandwidth=inter_bw, inter_node_latency=inter_lat,
                    per_node=per_node)


def evaluate(expr, **values):
    return float(expr.subs({getattr(SYMBOLS, k): v for k, v in values.items()}))


ALL = [(op, alg) for op in OPS for alg in ALGORITHMS[op]]


# ----------------------------------------------------------------------------- formulas


@pytest.mark.parametrize("op, alg", ALL)
@pytest.mark.parametrize("p", [2, 3, 8, 64])
def test_time_matches_formula_inside_one_node(op, alg, p):
    hw = machine(per_node=64)
    for n in (1e3, 1e6, 3e9):
        expr = single_link(collective_expr(op, alg))
        want = evaluate(expr, n=n, p=p, alpha=hw.intra_node_latency,
                        beta=1 / hw.intra_node_bandwidth)
        got = collective_time(op, n, Placement(p, p), hw, alg)
        assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("op, alg", ALL)
@pytest.mark.parametrize("placement", [Placement(32, 8, 1, 8), Placement(16, 1, 8, 8),
                                       Placement(24, 4, 2, 8), Placement(12, 2, 1, 4)])
def test_time_matches_formula_across_nodes(op, alg, placement):
    hw = machine()
    nic = hw.inter_node_bandwidth * placement.node_size / placement.sharing
    group = 1 / min(hw.intra_node_bandwidth, nic)
    rank = 1 / min(hw.intra_node_bandwidth, nic / placement.per_node)
    n, p, q = 5e7, placement.size, placement.per_node
    expr = collective_expr(op, alg)
    if expr.has(SYMBOLS.q):
        want = evaluate(expr, n=n, p=p, q=q, alpha_intra=hw.intra_node_latency,
                        beta_intra=1 / hw.intra_node_bandwidth,
                        alpha_inter=hw.inter_node_latency, beta_inter=rank)
    else:
        beta = group if ALGORITHMS[op][alg].crossing == "group" else rank
        want = evaluate(expr, n=n, p=p, alpha=hw.inter_node_latency, beta=beta)
    assert collective_time(op, n, placement, hw, alg) == pytest.approx(want, rel=1e-12)


def test_textbook_formulas():
    s = SYMBOLS
    ring = collective_expr("all_reduce", "ring")
    assert (ring - (2 * (s.p - 1) * s.alpha + 2 * (s.p - 1) / s.p * s.n * s.beta)).simplify() == 0
    gather = collective_expr("all_gather", "ring")
    assert (gather - ((s.p - 1) * s.alpha + (s.p - 1) / s.p * s.n * s.beta)).simplify() == 0
    assert collective_expr("p2p", "direct") == s.alpha + s.n * s.beta
    # double binary tree: log-depth latency, bandwidth term 2 n beta
    assert evaluate(collective_expr("all_reduce", "tree"), n=0, p=1024, alpha=1, beta=0) == 20
    assert evaluate(collective_expr("all_reduce", "tree"), n=1, p=1024, alpha=0, beta=1) == 2
    # every two-level formula collapses to the flat ring when one link class serves all
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert (single_link(collective_expr(op, "hierarchical"))
                - collective_expr(op, "ring")).simplify() == 0


# ----------------------------------------------------------------------------- regimes


def test_tree_wins_small_messages_and_ring_wins_large_ones():
    hw, group = machine(per_node=64), Placement(64, 64)
    assert best_algorithm("all_reduce", 1e3, group, hw) == "tree"
    assert best_algorithm("all_reduce", 1e9, group, hw) == "ring"
    assert collective_time("all_reduce", 1e3, group, hw, "tree") < \
        collective_time("all_reduce", 1e3, group, hw, "ring")
    assert collective_time("all_reduce", 1e9, group, hw, "ring") < \
        collective_time("all_reduce", 1e9, group, hw, "tree")
    assert best_algorithm("broadcast", 1e3, group, hw) == "tree"
    assert best_algorithm("broadcast", 1e9, group, hw) == "ring"
    assert best_algorithm("all_to_all", 1e3, group, hw) == "tree"
    assert best_algorithm("all_to_all", 1e9, group, hw) == "ring"


@pytest.mark.parametrize("n", [1e4, 1e6, 1e9])
def test_hierarchical_wins_with_fast_nodes_and_slow_network(n):
    hw = machine(intra_bw=100e9, inter_bw=1e9)
    group = Placement(32, 8, 1, 8)  # four nodes, eight ranks of the group in each
    times = {alg: collective_time("all_reduce", n, group, hw, alg)
             for alg in ALGORITHMS["all_reduce"]}
    assert min(times, key=times.get) == "hierarchical"
    assert collective_time("all_reduce", n, group, hw) == times["hierarchical"]
    assert best_algorithm("all_gather", n, group, hw) == "hierarchical"


def test_flat_ring_beats_hierarchical_when_nodes_are_no_faster_than_the_network():
    hw = machine(intra_bw=8e9, inter_bw=1e9)  # a node's eight NICs carry what its fabric does
    group = Placement(32, 8, 1, 8)
    assert collective_time("all_reduce", 1e10, group, hw, "ring") < \
        collective_time("all_reduce", 1e10, group, hw, "hierarchical")


def test_hierarchical_inside_one_node_is_the_ring():
    hw, group = machine(), Placement(8, 8)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert collective_time(op, 1e7, group, hw, "hierarchical") == \
            pytest.approx(collective_time(op, 1e7, group, hw, "ring"))


def test_crossing_nodes_costs_more_than_staying_inside():
    hw = machine()
    inside, across = Placement(8, 8, 1, 8), Placement(8, 1, 8, 8)
    for op in OPS:
        assert collective_time(op, 1e7, across, hw) > collective_time(op, 1e7, inside, hw)


# ----------------------------------------------------------------------------- sharing


def test_sharing_lowers_inter_node_bandwidth():
    hw = machine(intra_bw=100e9, inter_bw=1e9)
    alone, shared = Placement(16, 8, 1, 8), Placement(16, 8, 4, 8)
    assert links(alone, hw).beta_inter_group == pytest.approx(1 / 8e9)
    assert links(shared, hw).beta_inter_group == pytest.approx(4 / 8e9)
    assert links(shared, hw).beta_inter_rank == pytest.approx(4 * 8 / 8e9)
    for op in OPS:
        assert collective_time(op, 1e8, shared, hw) > collective_time(op, 1e8, alone, hw)


def test_a_regular_layout_gives_each_rank_its_own_network_link():
    hw = machine(intra_bw=100e9, inter_bw=1e9)
    for axis, pl in placements({"tp": 4, "dp": 8, "pp": 4}, ("tp", "dp", "pp"), 8).items():
        if pl.spans_nodes:
            assert pl.sharing * pl.per_node == 8, axis
            assert links(pl, hw).beta_inter_rank == pytest.approx(1 / 1e9)


def test_a_rank_is_never_faster_than_its_node_fabric():
    hw = machine(intra_bw=2e9, inter_bw=1e9)
    assert links(Placement(16, 8, 1, 8), hw).beta_inter_group == pytest.approx(1 / 2e9)


# ----------------------------------------------------------------------------- placement


def brute_force(mesh, order, node):
    """Placement of every axis by listing each group's ranks and the node of each rank."""
    sizes = [mesh[a] for a in order]
    strides = [math.prod(sizes[:i]) for i in range(len(sizes))]
    out = {}
    for i, axis in enumerate(order):
        groups = {}
        for coord in itertools.product(*(range(k) for k in sizes)):
            rank = sum(c * s for c, s in zip(coord, strides))
            groups.setdefault(coord[:i] + coord[i + 1:], []).append(rank)
        counts = {}
        for key, ranks in groups.items():
            for r in ranks:
                counts[(key, r // node)] = counts.get((key, r // node), 0) + 1
        spanning = {key for key in groups if sum(1 for g, _ in counts if g == key) > 1}
        crossing = {}
        for key, where in counts:
            if key in spanning:
                crossing[where] = crossing.get(where, 0) + 1
        out[axis] = Placement(mesh[axis], min(counts.values()), max(crossing.values(), default=1),
                              node)
    return out


MESHES = [
    ({"tp": 8, "cp": 1, "dp": 4, "pp": 2}, ("tp", "cp", "dp", "pp")),
    ({"tp": 2, "cp": 2, "dp": 3, "pp": 2}, ("tp", "cp", "dp", "pp")),
    ({"tp": 4, "dp": 6}, ("tp", "dp")),
    ({"tp": 3, "dp": 4}, ("tp", "dp")),
    ({"dp": 4, "tp": 4, "pp": 2}, ("dp", "tp", "pp")),
    ({"dp": 12}, ("dp",)),
    ({"tp": 2, "cp": 4, "dp": 2, "pp": 4}, ("pp", "dp", "cp", "tp")),
]


@pytest.mark.parametrize("mesh, order", MESHES)
@pytest.mark.parametrize("node", [1, 2, 3, 4, 5, 6, 8, 16, 64])
def test_placements_match_brute_force(mesh, order, node):
    assert placements(mesh, order, node) == brute_force(mesh, order, node)


def test_placements_of_a_typical_cluster():
    pl = placements({"tp": 8, "cp": 1, "dp": 16, "pp": 4}, ("tp", "cp", "dp", "pp"), 8)
    assert pl["tp"] == Placement(8, 8, 1, 8)
    assert pl["dp"] == Placement(16, 1, 8, 8)
    pl = placements({"tp": 2, "dp": 16}, ("tp", "dp"), 8)  # dp: 4 ranks per node, 2 groups
    assert pl["dp"] == Placement(16, 4, 2, 8)


def test_placements_of_a_huge_regular_world_are_arithmetic(monkeypatch):
    def fail(*args):
        raise AssertionError("a regular layout must not be enumerated")

    comm._axis_placement.cache_clear()
    monkeypatch.setattr(comm, "_uneven_placement", fail)
    pl = placements({"tp": 8, "cp": 2, "dp": 1024, "pp": 8}, ("tp", "cp", "dp", "pp"), 8)
    assert pl["cp"] == Placement(2, 1, 8, 8)
    assert pl["pp"] == Placement(8, 1, 8, 8)
    comm._axis_placement.cache_clear()


# ----------------------------------------------------------------------------- calibrated


def test_a_calibrated_collective_inside_a_node_is_priced_by_its_own_figures():
    """A profile from `autopar calibrate` carries each collective's fitted alpha and beta:
    inside a node that op is priced by the formula it was fitted to with its own figures;
    other ops, groups across nodes and an explicit algorithm keep the link model."""
    import dataclasses

    plain = machine(per_node=4)
    fitted = {"all_gather": {"algorithm": "ring", "alpha": 1e-3, "beta": 2e-9},
              "all_to_all": {"algorithm": "ring", "alpha": 5e-4, "beta": 1e-9}}
    hw = dataclasses.replace(plain, collectives=fitted)
    n, inside = 8e6, Placement(4, 4)
    assert collective_time("all_gather", n, inside, hw) == pytest.approx(3 * 1e-3 + 0.75 * n * 2e-9)
    # pairwise exchange on one link class: p - 1 steps of n / p bytes
    assert collective_time("all_to_all", n, inside, hw) == pytest.approx(3 * (5e-4 + n / 4 * 1e-9))
    assert collective_time("all_gather", n, Placement(2, 2), hw) == pytest.approx(1e-3 + n * 1e-9)
    assert best_algorithm("all_gather", 1e3, inside, hw) == "ring"  # not the tree it fits
    for op in ("all_reduce", "p2p"):  # not calibrated: the link's figures
        assert collective_time(op, n, inside, hw) == collective_time(op, n, inside, plain)
    across = Placement(8, 4, 1, 4)
    assert collective_time("all_gather", n, across, hw) == collective_time("all_gather", n,
                                                                           across, plain)
    assert collective_time("all_gather", n, inside, hw, "tree") == collective_time(
        "all_gather", n, inside, plain, "tree")
    assert comm.fitted_time("all_gather", fitted["all_gather"], n, 4) == collective_time(
        "all_gather", n, inside, hw)


# ----------------------------------------------------------------------------- edges


@pytest.mark.parametrize("op", OPS)
def test_size_one_group_and_empty_message_cost_nothing(op):
    hw = machine()
    assert collective_time(op, 1e9, Placement(1, 1), hw) == 0.0
    assert collective_time(op, 0, Placement(16, 1, 8, 8), hw) == 0.0


def test_unknown_op_names_the_valid_ones():
    with pytest.raises(ValueError, match="valid ops are all_reduce, all_gather, .*p2p"):
        collective_time("allreduce", 1e6, Placement(2, 2), machine())
    with pytest.raises(ValueError, match="valid ops"):
        collective_expr("gather", "ring")
    with pytest.raises(ValueError, match="valid ops"):
        best_algorithm("scatter", 1e6, Placement(2, 2), machine())


def test_unknown_algorithm_names_the_valid_ones():
    with pytest.raises(ValueError, match="all_to_all has no algorithm 'hierarchical'; choose "
                                         "one of ring, tree or 'auto'"):
        collective_time("all_to_all", 1e6, Placement(2, 2), machine(), "hierarchical")
    with pytest.raises(ValueError, match="p2p has no algorithm 'ring'"):
        collective_time("p2p", 1e6, Placement(1, 1), machine(), "ring")  # checked even when free
    with pytest.raises(ValueError, match="cannot be negative"):
        collective_time("p2p", -1, Placement(2, 2), machine())


def test_bad_placements_are_refused():
    with pytest.raises(ValueError, match="per_node <= size"):
        Placement(4, 8)
    with pytest.raises(ValueError, match="must name each mesh axis"):
        placements({"tp": 2, "dp": 2}, ("tp",), 8)
    with pytest.raises(ValueError, match="positive integers"):
        placements({"tp": 0}, ("tp",), 8)


def test_a_profiles_collective_names_are_the_ones_comm_prices():
    """hardware.py checks a profile's `collectives` table against its own copy of the names
    (comm imports hardware, so it cannot import comm's): the two stay equal."""
    from autopar.cost import comm, hardware

    assert hardware.ALGORITHMS == {op: tuple(algs) for op, algs in comm.ALGORITHMS.items()}


def _counted_placement(stride: int, size: int, world: int, node: int):
    """The placement by counting every rank of the world (the definition)."""
    from autopar.cost import comm
    counts = comm._pair_counts(range(world), stride, stride * size, node)
    return comm._placement_of(counts, size, node)


@pytest.mark.parametrize("limit", [64, 1 << 16])
def test_uneven_placement_by_structure_equals_counting_every_rank(monkeypatch, limit):
    """Past `_ENUMERATE` ranks an unevenly cut axis is placed from the nodes a block
    boundary cuts (and a partial last node) alone; it equals counting every rank."""
    import random

    from autopar.cost import comm
    monkeypatch.setattr(comm, "_ENUMERATE", limit)
    rng = random.Random(0)
    checked = 0
    while checked < 400:
        node = rng.choice([2, 3, 4, 6, 8, 16, 72])
        stride, size = rng.randint(1, node - 1), rng.randint(2, 300)
        world = stride * size * rng.randint(1, 6)
        block = stride * size
        if world > 20000 or world <= node or node % block == 0 or \
                (node % stride == 0 and block % node == 0):
            continue  # the regular layouts, placed without counting
        got = comm._uneven_placement(stride, size, world, node)
        want = _counted_placement(stride, size, world, node)
        assert (got.per_node, got.sharing) == (want.per_node, want.sharing), \
            (stride, size, world, node)
        checked += 1


def test_an_axis_of_a_billion_ranks_counts_a_few_nodes(monkeypatch):
    from autopar.cost import comm
    counted = []
    original = comm._pair_counts

    def counting(ranks, *args):
        ranks = list(ranks)
        counted.append(len(ranks))
        return original(ranks, *args)

    monkeypatch.setattr(comm, "_pair_counts", counting)
    placement = comm._uneven_placement(5, 2 * 10**8, 10**9, 8)
    assert (placement.per_node, placement.sharing) == (1, 5)
    assert sum(counted) <= 8 * 8  # at most one node per block boundary in a period
