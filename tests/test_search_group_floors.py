"""The free search's group floors (`autopar.search.floors.state_floor`, `group_floor`): never
over a state's priced seconds, parameters read to the bit, and a search that makes a group's
Prepared only once its floor comes first returns what it returns with every group made."""

import random

import pytest
from chains import prepared_chain, result_bits

from autopar.cost.comm import placements
from autopar.cost.model import state_cost, state_params
from autopar.modes import CP, DP, FP8, ORDER, PP, RING, TP, ULYSSES
from autopar.search import bounds as bounds_module
from autopar.search import planner
from autopar.search import search as search_module
from autopar.search.floors import group_params, state_floor, state_work
from autopar.search.prepared import Prepared
from autopar.search.search import Options, Search
from autopar.world import World

SPECS = ("gpt:layers=2,hidden=128,heads=8,vocab=512,seq=512",
         "llama:layers=2,hidden=128,heads=8,kv_heads=2,vocab=512,seq=512",
         "moe:layers=2,hidden=128,experts=4,top_k=2,seq=256")




@pytest.fixture(scope="module")
def chains():
    out = [prepared_chain(spec, [1, 2, 4, 8, 16], max_layers=None) for spec in SPECS]
    return out + [prepared_chain("gpt3-175b", [1, 2, 4, 8, 16, 64], seq=2048)]


def test_a_state_floor_is_never_over_its_seconds_on_random_layers_and_contexts(chains):
    """60 random (model, device, dtype, compile, mesh, cp mode, micro-batch) draws: every
    state of every kind (1D of any size, 2D, 2.5D, 3D), priced: its seconds are its floor or
    more, the floor its work (`state_work`, no collective) or more, and its parameter bytes
    are `state_params`' to the bit."""
    rng = random.Random(7)
    checked = 0
    for _ in range(60):
        chain = rng.choice(chains)
        device = rng.choice(["a100-80gb", "h100-80gb"])
        dtype = rng.choice(["bf16", "fp32"] + ([FP8] if device == "h100-80gb" else []))
        tp, cp = rng.choice([1, 2, 4, 8, 16]), rng.choice([1, 1, 2, 4])
        pp = rng.choice([1, 2])
        world = World(pp * tp * cp * rng.choice([1, 2]), per_node=8, device=device)
        options = Options(global_batch=64, dtype=dtype, compile=rng.random() < 0.3)
        search = Search(chain, world, options)
        mesh = {PP: pp, DP: world.devices // (pp * tp * cp), CP: cp, TP: tp}
        pl = placements(mesh, ORDER, world.per_node)
        b = rng.choice([1, 2, 4, 8])
        prep = search._prepared(mesh, pl, rng.choice([RING, ULYSSES]) if cp > 1 else None, b)
        if prep is None:
            continue
        ctx = prep.context[0]
        for lt, states in prep.kinds:
            for state in states:
                cost = state_cost(lt, state, b, ctx)
                work = state_work(lt, state, b, ctx)
                assert 0 <= work <= state_floor(lt, state, b, ctx) <= cost.time
                assert state_params(lt, state, ctx) == (cost.params, cost.expert_params)
                checked += 1
    assert checked > 1000


def _every_group(search, kinds, b, ctx, work=False, had=None):
    """`floors.group_floor` with no bound of the seconds: every group made at once."""
    return 0.0, 0.0


@pytest.mark.parametrize("spec, devices, gb, constraints", [
    (SPECS[0], 16, 32, {}), (SPECS[0], 64, 64, {}), (SPECS[1], 64, 128, {"cp": 2}),
    (SPECS[2], 32, 64, {}), (SPECS[0], 16, 32, {"tp": 4, "pp": 2}),
    (SPECS[1], 16, 64, {"tp": 2, "pp": 2, "zero": 3})])
def test_the_group_floors_leave_the_free_search_as_it_was(chains, monkeypatch, spec, devices,
                                                          gb, constraints):
    """Best, alternatives (their reasons and the bounded meshes' "at least" too), candidate
    count and notes: the same with the group floors as with every group's Prepared made
    before a leaf is priced; and the best is the fastest fitting of every candidate."""
    chain = chains[SPECS.index(spec)]
    world = World(devices, per_node=8)
    kw = dict(global_batch=gb, constraints=constraints, top=6)
    got = planner.search(chain, world, **kw)
    with monkeypatch.context() as m:
        m.setattr(bounds_module, "group_floor", _every_group)
        plain = planner.search(chain, world, **kw)
    assert result_bits(got) == result_bits(plain)
    every = Search(chain, world, Options(global_batch=gb, top=6), constraints).every()
    assert got.best.step_time == min(c.step_time for c in every if c.fits)


def test_gpt3_free_search_leaves_groups_unpriced_by_their_floors(chains, monkeypatch):
    """GPT-3 175B on 1024 A100 (bench_search's search): most leaf groups are never priced
    (their floors pass the k best first), and the search returns what it returns with
    every group's Prepared made."""
    chain = chains[-1]
    world = World(1024, per_node=8, device="a100-80gb")
    made = []
    real = Prepared.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Prepared, "__init__", init)
    got = planner.search(chain, world, global_batch=1536)
    floored = len(made)
    made.clear()
    monkeypatch.setattr(bounds_module, "group_floor", _every_group)
    plain = planner.search(chain, world, global_batch=1536)
    assert result_bits(got) == result_bits(plain)
    assert 0 < floored < len(made) / 2


@pytest.mark.parametrize("spec, devices", [(SPECS[2], 32), (SPECS[1], 64)])
def test_a_groups_parameter_bytes_shared_by_list_are_its_own_to_the_bit(chains, spec, devices):
    """The least parameter bytes of a group's gradient sync (`bounds._params`), read once per
    state list, cp size and ep size for the group numbers that share them, are on every group
    of every mesh (every cp mode, placement and expert split) what `floors.group_params` gives
    with the group's own Context, and the ``min_params - min_experts`` of its Prepared."""
    chain = chains[SPECS.index(spec)]
    world = World(devices, per_node=8)
    search = Search(chain, world, Options(global_batch=64))
    meshes, heads = search_module._meshes(search)
    checked = shared = experts = 0
    for mesh in meshes:
        walk = search_module._mesh_walk(search, mesh, heads)
        for group in walk[4] if walk is not None else ():
            cp_mode, split, b = group[:3]
            kinds = search.space.kinds(mesh[TP], b, mesh[CP] > 1)
            if kinds is None:
                continue
            ep = split.ep if split is not None else 1
            shared += ("params", group[4]) not in search._floors and \
                ("params", id(kinds), mesh[CP], ep) in search._floors
            experts += ep > 1
            got = bounds_module._params(search, mesh, walk, group)
            ctx = search._context((walk[0][TP], walk[0][CP], cp_mode,
                                   split.dispatch if split is not None else None))
            assert got.hex() == group_params(search, kinds, ctx).hex()
            prep = search._prepared(mesh, walk[0], cp_mode, b, split)
            assert got.hex() == float(prep.min_params - prep.min_experts).hex()
            checked += 1
    # (the MoE spec's groups: expert splits, each number its own list; the Llama spec's: cp
    # placements and modes, several numbers to a list)
    assert checked >= 50 and (experts >= 10 if "moe" in spec else shared >= 10)
