"""The search against an independent brute-force walk of its own space (the optimality
section of benchmarks/bench_search.py) on two instances small enough for the suite: the walk
enumerates every mesh, micro-batch, schedule, ZeRO option and per-layer state and prices
each with the search's primitives, so a difference is the search's, or a pricing the two
no longer share."""

import os
import sys

import pytest

from autopar.search import planner

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import bench_search as bs  # noqa: E402

# Four blocks on four devices of one node, memory half what the unconstrained winner needs:
# ZeRO-1 with recomputation wins; ZeRO-3, whose gathers and reduce-scatters run layer by
# layer, would win were its sync priced as one collective. Layers split 1D at tensor size 1
# only (the grids at 4 stay), so the walk takes about a second.
INSTANCE = bs.Instance("gpt:layers=4,hidden=256,heads=8,vocab=1024,seq=512", 4, 4, 16, 0.5)
# bench_search's eleventh: two blocks on two nodes of two, tensor sizes 1, 2 and 4. The memory
# fit moves the blocks to Megatron-SP's layout; the layers beside them (embeddings, dropout,
# final norm, classifier, loss) hold little and must follow, or the path pays four layout
# conversions the optimum does not (the search was 2.739% over the walk).
ELEVENTH = bs.INSTANCES[10]
CASES = {"four blocks": (INSTANCE, [1]), "layouts after the fit": (ELEVENTH, [1, 2, 4])}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    inst, tp_sizes = CASES[request.param]
    chain = bs.small_chain(inst.spec, tp_sizes)
    world, _ = bs.tight_world(inst, 0, chain, str(tmp_path_factory.mktemp("profiles")))
    return inst, chain, world


def test_the_search_finds_the_optimum_a_brute_force_walk_of_its_space_finds(case):
    inst, chain, world = case
    best = planner.search(chain, world, global_batch=inst.batch).best
    walk = bs.exhaustive(chain, world, inst.batch)["best"]
    assert walk is not None and best is not None
    assert best.step_time == pytest.approx(walk["step_time"], rel=1e-12), (
        best.describe(), bs.describe(walk))
    # and the search prices the walk's optimum as the walk does (ZeRO-3 among the rest: the
    # walk once priced its sync as one collective where the search runs one per layer
    # holding parameters, took a ZeRO-3 plan for 3.3% faster than this one and reported the
    # search that far off the optimum)
    assert bs.at_optimum_leaf(chain, world, inst.batch, walk) == pytest.approx(
        walk["step_time"], rel=1e-12)

