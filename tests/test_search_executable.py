"""The executable search (one search per tensor grid) against each grid's space searched whole.

Each grid's search walks only the meshes whose tensor group can form that grid, skips the
leaves that cannot beat the k best step times of the searches before it and the candidates
an earlier search already priced alike; the winner must stay the one of searching every
space whole, at no more candidates than the free search prices.
"""

import os

import pytest

from autopar.cost.comm import placements
from autopar.models import workload
from autopar.modes import CP, DP, ORDER, PP, RUNTIME, TP
from autopar.search import planner
from autopar.search.prepared import state_costs_of
from autopar.search.search import Options, Search, _mesh_walk
from autopar.world import World

SMALL = "gpt:layers=2,hidden=128,heads=8,vocab=512,seq=512"
GPT3_TP = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def _signature(cand) -> dict:
    return {"plan": cand.describe(), "step_time": float(cand.step_time).hex(),
            "memory": float(cand.memory_per_device).hex(), "stages": list(cand.stages),
            "states": [str(s) for s in cand.states]}


def _whole(chain, world, global_batch, constraints):
    """The winner of searching 1D alone and 1D with each grid, every space whole."""
    options = Options(global_batch=global_batch, executable=RUNTIME)
    sp_seq = planner._sequence_parallel_length(chain, world.devices)
    best = []
    for grid in [None] + planner._grids(world.devices):
        search = Search(chain, world, planner._narrowed(options, grid, sp_seq), constraints)
        try:
            res = search.run()
        except Exception:  # noqa: BLE001 - a grid with nothing under these constraints
            continue
        if res.best is not None:
            best.append(res.best)
    return min(best, key=lambda c: c.step_time)


@pytest.fixture(scope="module")
def small():
    w = workload(SMALL, max_layers=None)
    return planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                           tokens_per_sample=w.tokens_per_sample, tp_sizes=[1, 2, 4, 8])


@pytest.mark.parametrize("constraints", [{}, {"tp": 4}, {"tp": 8}, {"tp_mode": "2d"},
                                         {"tp": 8, "tp_mode": "3d"}, {"pp": 1, "zero": 3}])
def test_the_executable_winner_is_the_one_of_every_grid_searched_whole(small, constraints):
    world = World(16, per_node=8)
    got = planner.search(small, world, global_batch=32, executable=True,
                         constraints=constraints)
    assert _signature(got.best) == _signature(_whole(small, world, 32, constraints))


@pytest.fixture(scope="module")
def gpt3():
    w = workload("gpt3-175b", seq=2048)
    return planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                           repeat={"blocks.1": w.layers - 1},
                           tokens_per_sample=w.tokens_per_sample, tp_sizes=GPT3_TP)


def test_gpt3_executable_search_prices_no_more_than_the_free_one(gpt3):
    """GPT-3 175B on 1024 A100 (the case bench_search times): the same winner as every grid
    searched whole, at no more candidates than the free search (it was 7x as many: every grid's
    search priced the 1D leaves again; then 1582 against 1442 once cp ran beside the grids:
    the 2D search priced again the 1D candidates its 2x2 states could not better)."""
    chain = gpt3
    world = World(1024, per_node=8, device="a100-80gb")
    free = planner.search(chain, world, global_batch=1536)
    got = planner.search(chain, world, global_batch=1536, executable=True)
    assert got.candidates <= free.candidates
    assert _signature(got.best) == _signature(_whole(chain, world, 1536, None))


def _prepared(chain, world, grid, mesh, b):
    """The 1D search's and `grid`'s search's Prepared of one mesh and micro-batch."""
    sp_seq = planner._sequence_parallel_length(chain, world.devices)
    options = Options(global_batch=1536, executable=RUNTIME)
    base = Search(chain, world, planner._narrowed(options, None, sp_seq))
    search = Search(chain, world, planner._narrowed(options, grid, sp_seq), base=base)
    pl = placements(mesh, ORDER, world.per_node)
    return base._prepared(mesh, pl, None, b), search._prepared(mesh, pl, None, b).build()


@pytest.mark.parametrize("tp, grid, adds", [(4, ("2d", None), False), (16, ("2d", None), True)])
def test_a_grid_adds_states_only_where_a_candidate_can_take_them(gpt3, tp, grid, adds):
    """GPT-3's 2x2 SUMMA states are slower than 1D with Megatron-SP at no fewer activations,
    so no candidate of tp=4 takes them and the 2D search leaves those leaves to the 1D one;
    its 4x4 states at tp=16 are the fastest there and stay."""
    world = World(1024, per_node=8, device="a100-80gb")
    mesh = {PP: 8, DP: 1024 // (8 * tp), CP: 1, TP: tp}
    base, prep = _prepared(gpt3, world, grid, mesh, 4)
    assert prep.base is base and prep.adds_nothing() is not adds


def test_states_no_candidate_takes_leave_the_candidates_as_they_are(gpt3):
    """What `adds_nothing` claims, whole: on GPT-3's tp=4 meshes every candidate of the
    2D space (its 2x2 states beside the 1D ones) is one of the 1D space's."""
    world = World(1024, per_node=8, device="a100-80gb")
    sp_seq = planner._sequence_parallel_length(gpt3, world.devices)
    options = Options(global_batch=1536, executable=RUNTIME)
    got = {}
    for grid in (None, ("2d", None)):
        fixed = {"tp": 4, "pp": 8, "micro_batch_size": 4}
        cands = Search(gpt3, world, planner._narrowed(options, grid, sp_seq), fixed).every()
        got[grid] = sorted((c.describe(), float(c.step_time).hex(),
                            float(c.memory_per_device).hex()) for c in cands)
    assert got[None] and got[None] == got[("2d", None)]


def _base_and_2d_grid(small):
    """World 16 (8 a node), the executable 1D search over `small` (run) and its 2D grid
    search beside it (not run)."""
    world = World(16, per_node=8)
    sp_seq = planner._sequence_parallel_length(small, world.devices)
    options = Options(global_batch=32, executable=RUNTIME)
    base = Search(small, world, planner._narrowed(options, None, sp_seq))
    grid = Search(small, world, planner._narrowed(options, ("2d", None), sp_seq), base=base)
    base.run()
    return world, base, grid


def test_a_grid_search_reuses_the_base_searchs_placement_caches(small):
    """The cost contexts, the dp sync's and the in-flight caches depend on placements alone,
    so each grid's search reads the 1D search's instead of building and pricing them again."""
    world, base, grid = _base_and_2d_grid(small)
    assert base._contexts and grid._contexts is base._contexts
    pl = placements({PP: 1, DP: 16, CP: 1, TP: 1}, ORDER, world.per_node)[DP]
    assert grid._dp_cache(pl) is base._dp_cache(pl)


def test_a_grid_search_finds_the_base_searchs_states_and_placements_by_identity(small):
    """The grid searches share the 1D search's state costs and contexts, keyed by states and
    placements: the same objects (not equal copies, which every lookup would compare field by
    field) for each state value and each mesh, whichever search made them first."""
    world = World(16, per_node=8)
    sp_seq = planner._sequence_parallel_length(small, world.devices)
    options = Options(global_batch=32, executable=RUNTIME)
    base = Search(small, world, planner._narrowed(options, None, sp_seq))
    grid = Search(small, world, planner._narrowed(options, ("2d", None), sp_seq), base=base)
    for lt in small.types:
        had = base.space.states(lt, 4)
        got = grid.space.states(lt, 4)
        assert had and len(got) >= len(had)
        assert all(a is b for a, b in zip(had, got))
    mesh = {PP: 1, DP: 4, CP: 1, TP: 4}
    heads = min(a.heads for lt in small.types for a in lt.attention)
    had, got = base._leaves(mesh, heads), grid._leaves(mesh, heads)
    assert had and got and all(leaf.pl is had[0].pl and leaf.grad_pl is had[0].grad_pl
                               for leaf in had + got)


def test_a_grid_that_adds_nothing_is_known_before_its_leaf_is_built(gpt3):
    """GPT-3's 2x2 SUMMA states at tp=4 lose to 1D with Megatron-SP, one layout beating them
    for every kind of layer: the 2D search learns it from the states' costs alone, before
    the chain tables and the fastest path are built (its leaves there built both, only to
    find that their candidates are the 1D search's); its 4x4 states at tp=16 are the
    fastest there, and stay."""
    world = World(1024, per_node=8, device="a100-80gb")
    sp_seq = planner._sequence_parallel_length(gpt3, world.devices)
    options = Options(global_batch=1536, executable=RUNTIME)
    base = Search(gpt3, world, planner._narrowed(options, None, sp_seq))
    search = Search(gpt3, world, planner._narrowed(options, ("2d", None), sp_seq), base=base)
    got = {}
    for tp in (4, 16):
        mesh = {PP: 8, DP: 1024 // (8 * tp), CP: 1, TP: tp}
        prep = search._prepared(mesh, placements(mesh, ORDER, world.per_node), None, 4)
        got[tp] = (prep.adds_nothing(), prep.built)
    assert got == {4: (True, False), 16: (False, False)}


def test_a_grid_search_walks_its_base_searchs_meshes(small):
    """A grid search's space is its base's but for the tensor modes: the meshes, and each
    mesh's placements, micro-batches, cp modes, expert splits and ZeRO options, are the
    base's own objects (made once), not made again per grid."""
    world, base, grid = _base_and_2d_grid(small)
    heads = min(a.heads for lt in small.types for a in lt.attention)
    for mesh in grid.space.meshes(world.devices):
        had = _mesh_walk(base, mesh, heads)
        assert _mesh_walk(grid, mesh, heads) is had
        if had is not None:
            assert had[4] and all(zeros for _, _, _, zeros, _ in had[4])
    grid.run()
    assert grid._shared["meshes"] is base._shared["meshes"]


@pytest.mark.parametrize("grid, tp", [(("2d", None), 4), (("2d", None), 16),
                                      (("2.5d", 2), 8), (("3d", None), 64)])
def test_a_leaf_groups_least_seconds_are_its_prepareds_before_it_is_made(gpt3, grid, tp):
    """Under a cutoff a grid search reads a placement's `min_total` from its kinds' least
    seconds (`least_total`) and makes the Prepared only where a leaf's first bound is under
    the cutoff: the same states priced, the same sum, to the bit."""
    world = World(1024, per_node=8, device="a100-80gb")
    sp_seq = planner._sequence_parallel_length(gpt3, world.devices)
    options = Options(global_batch=1536, executable=RUNTIME)
    base = Search(gpt3, world, planner._narrowed(options, None, sp_seq), state_costs={})
    search = Search(gpt3, world, planner._narrowed(options, grid, sp_seq),
                    state_costs=base._state_costs, base=base)
    mesh = {PP: 8, DP: 1024 // (8 * tp), CP: 1, TP: tp}
    pl = placements(mesh, ORDER, world.per_node)
    for b in (1, 2, 4, 8):
        least = search._prepared(mesh, pl, None, b, least=True)
        prep = search._prepared(mesh, pl, None, b)
        if prep is None:
            assert least is None
            continue
        assert least.__class__ is float and least.hex() == prep.min_total.hex()
        assert search._prepared(mesh, pl, None, b, least=True) is prep  # made: itself


def test_a_grid_search_leaves_micro_batches_no_grid_state_divides_to_its_base(gpt3):
    """2x2 SUMMA splits a micro-batch in two: at b=1 GPT-3's kinds at tp=4 have only their 1D
    states, so the 2D search knows its leaves there are the 1D search's before making any
    state list (`Space.takes_grid`), and at b=2 it makes them."""
    world = World(1024, per_node=8, device="a100-80gb")
    sp_seq = planner._sequence_parallel_length(gpt3, world.devices)
    options = Options(global_batch=1536, executable=RUNTIME)
    base = Search(gpt3, world, planner._narrowed(options, None, sp_seq))
    search = Search(gpt3, world, planner._narrowed(options, ("2d", None), sp_seq), base=base)
    assert [search.space.takes_grid(4, b, False) for b in (1, 2, 3, 4)] == \
        [False, True, False, True]
    mesh = {PP: 8, DP: 32, CP: 1, TP: 4}
    assert search._prepared(mesh, placements(mesh, ORDER, world.per_node), None, 1) is None
    assert search.space._kinds == {}


def test_the_shared_state_costs_are_found_by_identity_once_per_context(small):
    """The executable search's shared state costs: one table per micro-batch and context
    (whose key, holding placements, is hashed once per Prepared, not per state), and within
    it each state's cost by the kind's and the state's identity, priced once for every
    search sharing it."""
    world = World(16, per_node=8)
    sp_seq = planner._sequence_parallel_length(small, world.devices)
    options = Options(global_batch=32, executable=RUNTIME)
    shared: dict = {}
    base = Search(small, world, planner._narrowed(options, None, sp_seq), state_costs=shared)
    grid = Search(small, world, planner._narrowed(options, ("2d", None), sp_seq),
                  state_costs=shared, base=base)
    base.run()
    grid.run()
    assert shared and all(isinstance(b, int) and isinstance(table, dict)
                          for (b, _), table in shared.items())
    for table in shared.values():
        for (kind, state), (lt, s, _) in table.items():
            assert kind == id(lt) and state == id(s)
    mesh = {PP: 1, DP: 4, CP: 1, TP: 4}
    pl = placements(mesh, ORDER, world.per_node)
    prep = grid._prepared(mesh, pl, None, 8).build()
    lt, states = prep.kinds[-1]
    again = state_costs_of(lt, states, 8, *prep.context)
    assert all(a is b for a, b in zip(again, prep.per_type[-1][1]))


def test_bench_search_times_the_executable_searchs_own_1d_search(small, monkeypatch):
    """bench_search splits the executable search's CPU into its 1D search and the rest by
    running that 1D search alone: it must be the same search (the same best plan and the
    same candidates priced) as the one the executable search runs first, and its Python
    call count, which the bench prints beside the seconds, a part of the executable one's."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                             "benchmarks"))
    import bench_search

    world = World(16, per_node=8)
    first = []
    real = Search.run

    def run(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self._base is None:
            first.append((self.candidates, _signature(out.best)))
        return out

    monkeypatch.setattr(Search, "run", run)
    planner.search(small, world, global_batch=32, executable=True)
    alone = bench_search._line_search_cpu(small, world, 32)
    assert len(first) == 2 and first[0] == first[1] and first[0][0] > 0 and alone > 0
    monkeypatch.undo()
    calls = bench_search._calls(small, world, 32)
    assert 0 < calls["executable_1d"] < calls["executable"]
    assert calls["free"] > 0
