"""The grid searches' priced-free floors (`autopar.search.floors`): never over a grid state's
priced seconds, and the executable search they cut returns what it returns without them."""

import dataclasses

import pytest
from chains import prepared_chain, result_bits

from autopar.cost.comm import placements
from autopar.cost.model import state_cost
from autopar.modes import CP, DP, FP8, ORDER, PP, RUNTIME, TP, TP_1D
from autopar.search import floors, planner
from autopar.search import search as search_module
from autopar.search.bounds import group_bound
from autopar.search.floors import grid_floor
from autopar.search.prepared import least_total
from autopar.search.search import Floor, Options, Search
from autopar.world import World

SMALL = "gpt:layers=2,hidden=128,heads=8,vocab=512,seq=512"




@pytest.fixture(scope="module")
def small():
    return prepared_chain(SMALL, [1, 2, 4, 8, 16], max_layers=None)


@pytest.fixture(scope="module")
def gpt3():
    return prepared_chain("gpt3-175b", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], seq=2048)


@pytest.mark.parametrize("dtype, compile, grid, tp, cp, device", [
    ("bf16", False, ("2d", None), 4, 1, "a100-80gb"),
    ("bf16", False, ("2d", None), 16, 1, "a100-80gb"),
    ("bf16", False, ("2.5d", 2), 8, 1, "a100-80gb"), ("fp32", True, ("3d", None), 8, 2, "a100-80gb"),
    (FP8, False, ("2d", None), 4, 2, "h100-80gb")])
def test_a_grid_floor_is_never_over_a_grid_states_seconds(small, gpt3, dtype, compile, grid,
                                                          tp, cp, device):
    """Every multi-dimensional state of every kind, priced: its seconds are the floor or more
    (the floor is priced without it)."""
    for chain, world, gb in ((small, World(64, per_node=8, device=device), 64),
                             (gpt3, World(512, per_node=8, device=device), 512)):
        options = Options(global_batch=gb, executable=RUNTIME, dtype=dtype, compile=compile)
        sp_seq = planner._sequence_parallel_length(chain, world.devices)
        search = Search(chain, world, planner._narrowed(options, grid, sp_seq))
        mesh = {PP: 2, DP: world.devices // (2 * tp * cp), CP: cp, TP: tp}
        pl = placements(mesh, ORDER, world.per_node)
        checked = 0
        for b in (2, 4, 8):
            prep = search._prepared(mesh, pl, "ring" if cp > 1 else None, b)
            if prep is None:
                continue
            prep.build()
            ctx = prep.context[0]
            for (lt, states), (_, costs) in zip(prep.kinds, prep.per_type):
                for state, cost in zip(states, costs):
                    if state.mode.name != TP_1D:
                        assert 0 < grid_floor(lt, state, b, ctx) <= cost.time
                        checked += 1
        assert checked


def _no_floor(*args, **kwargs):
    return None


@pytest.mark.parametrize("devices, gb, constraints", [
    (16, 32, {}), (64, 64, {}), (64, 128, {"tp": 16}), (64, 64, {"tp_mode": "2d"}),
    (32, 64, {"pp": 1, "zero": 3})])
def test_the_floors_leave_the_executable_search_as_it_was(small, monkeypatch, devices, gb,
                                                          constraints):
    """Best, alternatives (their reasons too), candidate count and notes: the same with the
    floors as with the grids' least seconds priced wherever a bound asks them, and the best
    the fastest fitting plan of every executable candidate (`Search.every`, no bound)."""
    world = World(devices, per_node=8)
    kw = dict(global_batch=gb, executable=True, constraints=constraints, top=6)
    with_floors = planner.search(small, world, **kw)
    monkeypatch.setattr(search_module, "least_floor", _no_floor)
    monkeypatch.setattr(search_module, "grid_past", _never_past)
    without = planner.search(small, world, **kw)
    assert result_bits(with_floors) == result_bits(without)
    every = planner.executable_candidates(small, world, global_batch=gb, dtype="bf16",
                                          constraints=constraints)
    fastest = min((c for c in every if c.fits), key=lambda c: c.step_time)
    assert with_floors.best.step_time == fastest.step_time


def test_gpt3_grid_searches_skip_groups_by_their_floors_alone(gpt3, monkeypatch):
    """GPT-3 175B on 512 A100 (bench_search's model): the grid searches leave groups out by
    their floors with nothing priced for them (fewer state costs in the shared tables), and
    the search returns what it returns without the floors."""
    world = World(512, per_node=8, device="a100-80gb")
    counts = {}

    def counted(floors: bool):
        made = []
        real = search_module.Search.__init__

        def init(self, *args, **kwargs):
            real(self, *args, **kwargs)
            made.append(self)

        monkeypatch.setattr(search_module.Search, "__init__", init)
        if not floors:
            monkeypatch.setattr(search_module, "least_floor", _no_floor)
            monkeypatch.setattr(search_module, "grid_past", _never_past)
        res = planner.search(gpt3, world, global_batch=512, executable=True)
        monkeypatch.undo()
        tables = made[0]._state_costs
        counts[floors] = sum(len(t) for t in tables.values())
        bounds = sum(isinstance(v, Floor) for s in made for v in s._by_group.values())
        return res, bounds

    got, floors = counted(True)
    plain, none = counted(False)
    assert result_bits(got) == result_bits(plain)
    assert floors > 0 and none == 0 and counts[True] < counts[False]


def test_a_floor_comes_only_from_a_grid_search_under_a_cutoff(small):
    """An ask without `floor`, and the base (1D) search's, read the exact least seconds."""
    world = World(16, per_node=8)
    options = Options(global_batch=32, executable=RUNTIME)
    sp_seq = planner._sequence_parallel_length(small, world.devices)
    base = Search(small, world, planner._narrowed(options, None, sp_seq), state_costs={})
    grid = Search(small, world, planner._narrowed(options, ("2d", None), sp_seq),
                  state_costs=base._state_costs, base=base)
    mesh = {PP: 1, DP: 4, CP: 1, TP: 4}
    pl = placements(mesh, ORDER, world.per_node)
    exact = grid._prepared(mesh, pl, None, 8, least=True)
    floor = grid._prepared(mesh, pl, None, 8, least=True, floor=True)
    assert exact.__class__ is float and floor.__class__ is Floor and floor <= exact
    assert base._prepared(mesh, pl, None, 8, least=True, floor=True).__class__ is not Floor


def _exact_least(search, kinds, b, context, base, which):
    return least_total(search, kinds, b, context, base)


def _never_past(*args):
    return False


@pytest.mark.parametrize("spec, devices, gb, constraints", [
    (SMALL, 64, 64, {}), (SMALL, 16, 32, {"pp": 2}),
    ("llama:layers=2,hidden=128,heads=8,kv_heads=4,vocab=512,seq=512", 64, 128, {}),
    ("gpt:layers=4,hidden=256,heads=16,vocab=512,seq=256", 128, 128, {"cp": 1}),
    ("moe:layers=2,hidden=128,experts=4,top_k=2,seq=256", 32, 64, {})])
def test_the_group_bounds_leave_the_executable_search_as_it_was(monkeypatch, spec, devices, gb,
                                                                constraints):
    """The groups a grid search leaves out before pricing them (`bounds.grid_past`: its
    floors, before anything is priced; `bounds.past`: each schedule's pipeline bound from a
    Floor's least seconds and its bound of the slowest kind), and the least seconds priced
    in the order of the floors (`floors.least_priced`): best, alternatives with their
    reasons, candidates and notes the same as with every group's least seconds priced whole
    and no pipeline bound before its Prepared."""
    chain = prepared_chain(spec, [1, 2, 4, 8, 16], max_layers=None)
    world = World(devices, per_node=8)
    kw = dict(global_batch=gb, executable=True, constraints=constraints, top=6)
    made = []

    def asked(real):
        def bound(*args):
            made.append(real(*args))
            return made[-1]
        return bound

    monkeypatch.setattr(search_module, "past", asked(search_module.past))
    monkeypatch.setattr(search_module, "grid_past", asked(search_module.grid_past))
    bounded = planner.search(chain, world, **kw)
    monkeypatch.setattr(search_module, "past", _never_past)
    monkeypatch.setattr(search_module, "grid_past", _never_past)
    monkeypatch.setattr(search_module, "least_priced", _exact_least)
    plain = planner.search(chain, world, **kw)
    assert result_bits(bounded) == result_bits(plain)
    assert made  # the bound was asked


def test_least_priced_is_least_total_to_the_bit(gpt3, monkeypatch):
    """On GPT-3 175B on 512 A100, the groups a 2D grid search asks: the least seconds priced in
    the order of the floors are the ones priced whole, bit for bit, with no more states."""
    world = World(512, per_node=8, device="a100-80gb")
    options = Options(global_batch=512, executable=RUNTIME)
    sp_seq = planner._sequence_parallel_length(gpt3, world.devices)
    base = Search(gpt3, world, planner._narrowed(options, None, sp_seq), state_costs={})

    def least(mesh, b, tables):
        grid = Search(gpt3, world, planner._narrowed(options, ("2d", None), sp_seq),
                      state_costs=tables, base=base)
        pl = placements(mesh, ORDER, world.per_node)
        return grid._prepared(mesh, pl, "ring" if mesh[CP] > 1 else None, b, least=True)

    asked = fewer = 0
    for tp, cp in ((4, 1), (16, 1), (4, 2)):
        mesh = {PP: 8, DP: 512 // (8 * tp * cp), CP: cp, TP: tp}
        for b in (1, 2, 4):
            kept, whole = {}, {}
            got = least(mesh, b, kept)
            with monkeypatch.context() as m:
                m.setattr(search_module, "least_priced", _exact_least)
                exact = least(mesh, b, whole)
            if exact is None:
                continue
            asked += 1
            assert got.__class__ is float and got.hex() == exact.hex()
            priced, all_priced = (sum(len(t) for t in d.values()) for d in (kept, whole))
            assert priced <= all_priced
            fewer += priced < all_priced
    assert asked and fewer


def _grid_searches(chain, world, gb, grids):
    """The executable 1D search over `chain` (run) and a grid search per entry of `grids`
    beside it, sharing its caches (not run)."""
    options = Options(global_batch=gb, executable=RUNTIME)
    sp_seq = planner._sequence_parallel_length(chain, world.devices)
    tables: dict = {}
    base = Search(chain, world, planner._narrowed(options, None, sp_seq), state_costs=tables)
    base.run()
    return base, [Search(chain, world, planner._narrowed(options, grid, sp_seq),
                         state_costs=tables, base=base) for grid in grids]


def test_a_grid_search_reads_its_base_floors_to_the_bit(gpt3):
    """GPT-3 on 512 A100, the 2D and 3D grid searches beside the 1D one: each group floor read
    from the 1D search's floors of its own lists (`base_lists`) beside the least over the
    layouts the grid adds is the floor over the whole lists, to the bit, work and collectives."""
    world = World(512, per_node=8, device="a100-80gb")
    base, grids = _grid_searches(gpt3, world, 512, [("2d", None), ("3d", None)])
    asked = 0
    for grid in grids:
        for tp, cp in ((4, 1), (8, 1), (16, 1), (4, 2), (64, 1)):
            mesh = {PP: 8, DP: 512 // (8 * tp * cp), CP: cp, TP: tp}
            pl = placements(mesh, ORDER, world.per_node)
            for b in (1, 2, 4):
                kinds = grid.space.kinds(tp, b, cp > 1)
                had = floors.base_lists(grid, mesh, b, kinds) if kinds is not None else None
                if had is None or not grid.space.takes_grid(tp, b, cp > 1):
                    continue
                ctx = grid._context((pl[TP], pl[CP], "ring" if cp > 1 else None, None))
                for work in (True, False):
                    shared = floors.group_floor(grid, kinds, b, ctx, work, had)
                    whole = floors.group_floor(grid, kinds, b, ctx, work)
                    assert [x.hex() for x in shared] == [x.hex() for x in whole]
                    asked += 1
    assert asked >= 8


def test_a_group_number_past_by_throughput_is_past_on_every_mesh_it_names(gpt3):
    """The numbers a grid search marks past by their floor's work per stage
    (`bounds._throughput_past`): on every mesh of the 1D walk holding that number with as
    many micro-batches per stage or more, each schedule's bound of the group (its floor with
    the collectives, which its work's only lowers) is at the cutoff or over."""
    world = World(512, per_node=8, device="a100-80gb")
    got = planner.search(gpt3, world, global_batch=512)  # (the k best: the grids' cutoff)
    base, grids = _grid_searches(gpt3, world, 512, [("2d", None), ("2.5d", 2)])
    cutoff = sorted([got.best.step_time] + [c.step_time for c, _ in got.alternatives
                                            if c.fits])[-1]
    checked = 0
    for grid in grids:
        grid._cutoff = cutoff
        meshes, heads = search_module._meshes(grid)
        for mesh in meshes:
            walk = search_module._mesh_walk(grid, mesh, heads)
            for group in walk[4] if walk is not None else ():
                search_module.grid_past(grid, mesh, walk, group)
        marked = {k[1]: r for k, r in grid._floors.items() if isinstance(k, tuple) and
                  k[0] == "past"}
        for mesh in meshes:
            walk = search_module._mesh_walk(grid, mesh, heads)
            for group in walk[4] if walk is not None else ():
                rate = marked.get(group[4])
                if rate is None or (walk[3] // group[2]) / mesh[PP] < rate:
                    continue
                bound = group_bound(grid, mesh, walk, group)  # (with its collectives)
                assert bound is None or bound >= cutoff
                checked += 1
    assert checked >= 20


@pytest.mark.parametrize("grid, cp_modes", [(("2d", None), ("ring", "ulysses")),
                                           (("3d", None), ("ring", "ulysses"))])
def test_contexts_sharing_their_prices_price_as_each_alone(small, grid, cp_modes):
    """A search's contexts share collective prices and a grid's GEMM collectives by tensor
    placement (`Context.shared`): every state of every kind costs, to the bit, what a context
    with prices of its own gives, for each cp mode and placement in turn."""
    world = World(64, per_node=8)
    options = Options(global_batch=64, executable=RUNTIME)
    sp_seq = planner._sequence_parallel_length(small, world.devices)
    search = Search(small, world, planner._narrowed(options, grid, sp_seq))
    checked = 0
    for tp, cp in ((4, 2), (8, 2), (8, 4)):
        for mode in cp_modes:
            mesh = {PP: 1, DP: 64 // (tp * cp), CP: cp, TP: tp}
            pl = placements(mesh, ORDER, world.per_node)
            ctx = search._context((pl[TP], pl[CP], mode, None))
            alone = dataclasses.replace(ctx, shared=None, _memo={})
            for b in (2, 4):
                kinds = search.space.kinds(tp, b, True)
                for lt, states in kinds or ():
                    for state in states:
                        assert state_cost(lt, state, b, ctx) == state_cost(lt, state, b, alone)
                        checked += state.mode.name != TP_1D
    assert ctx.shared is not None and checked
