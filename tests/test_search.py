"""The strategy search: its dynamic programs against brute force, its space, its answers.

Small zoo specs keep the searches to milliseconds; one GPT-3 175B case checks the plan the
planner gives at the scale it is built for.
"""

import dataclasses
import functools
import itertools
import math
import random
import re

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from autopar.cost.hardware import load_hardware
from autopar.cost.model import tensor_modes
from autopar.errors import PlanError, WorldError
from autopar.models import workload
from autopar.plans import Plan
from autopar.search import planner
from autopar.search.partition import balance, balance_dp, balance_within, choose_states
from autopar.search.prepared import _count_order, _count_with, _counts
from autopar.world import World

SMALL = "gpt:layers=2,hidden=128,heads=8,vocab=512,seq=512"
GPT3_TP = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


@pytest.fixture(scope="module")
def small():
    w = workload(SMALL, max_layers=None)
    return planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                           tokens_per_sample=w.tokens_per_sample, tp_sizes=[1, 2, 4, 8])


@pytest.fixture(scope="module")
def gpt3():
    w = workload("gpt3-175b", seq=2048)
    chain = planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                            repeat={"blocks.1": w.layers - 1},
                            tokens_per_sample=w.tokens_per_sample, tp_sizes=GPT3_TP)
    return w, chain


@pytest.fixture(scope="module")
def tight(small, tmp_path_factory):
    """World 8 (4 per node) on an A100 whose memory is half what the free winner needs."""
    free = planner.search(small, World(8, per_node=4), global_batch=16).best
    hw = dataclasses.replace(load_hardware("a100-80gb"), name="a100-tight",
                             memory_bytes=int(free.memory_per_device / 0.92 * 0.5))
    path = tmp_path_factory.mktemp("profiles") / "a100-tight.json"
    hw.save(str(path))
    return World(8, per_node=4, device=str(path))


# ----------------------------------------------------------------------- partition


def _bottleneck(costs, stages) -> float:
    per = {}
    for c, s in zip(costs, stages):
        per[s] = per.get(s, 0.0) + c
    return max(per.values())


def _brute_bottleneck(costs, k) -> float:
    n = len(costs)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.one_of(st.integers(0, 50).map(float),
                          st.floats(0, 1e3, allow_nan=False, allow_infinity=False)),
                min_size=1, max_size=24),
       st.integers(1, 24))
def test_balance_reaches_the_dp_bottleneck(costs, k):
    k = min(k, len(costs))
    stages = balance(costs, k)
    # k contiguous, non-empty stages in order
    assert stages[0] == 0 and stages[-1] == k - 1
    assert all(b - a in (0, 1) for a, b in zip(stages, stages[1:]))
    ref = balance_dp(costs, k)
    assert _bottleneck(costs, stages) == pytest.approx(_bottleneck(costs, ref), rel=1e-9, abs=1e-9)
    if len(costs) <= 9:
        assert _bottleneck(costs, ref) == pytest.approx(_brute_bottleneck(costs, k), abs=1e-9)



@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(0.1, 5), st.floats(0.1, 3), st.floats(0, 3)),
                min_size=1, max_size=8),
       st.integers(1, 4), st.floats(1, 12))
# cut from the first stage, the two light layers filled stage 0 and the last one, with
# activations, landed on stage 1, which keeps one micro-batch more than stage 2
@example(layers=[(1.0, 1.0, 0.0), (1.0, 1.0, 0.0), (1.0, 1.0, 1.0)], k=3, cap=2.0)
# the last layer alone is the bottleneck, and its time read off the prefix sums rounds
# below its own cost
@example(layers=[(1.012282850841164, 1.0, 0.0), (1.8, 1.0, 0.0), (0.8, 1.0, 0.0),
                 (4.592776171893837, 1.0, 0.0)], k=2, cap=3.0)
def test_balance_within_memory_is_the_best_contiguous_split_that_fits(layers, k, cap):
    """Against every contiguous split: stage s holds parameters and (k - s) micro-batches
    of activations, as a 1F1B pipeline does."""
    k = min(k, len(layers))
    n = len(layers)
    times = [t for t, _, _ in layers]
    weights = np.array([[p + (k - s) * a for _, p, a in layers] for s in range(k)])
    capacity = np.full(k, cap)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        st_of = [sum(i >= c for c in cuts) for i in range(n)]
        if all(sum(weights[s, i] for i in range(n) if st_of[i] == s) <= cap for s in range(k)):
            b = _bottleneck(times, st_of)
            best = b if best is None else min(best, b)
    got = balance_within(times, weights, capacity, k)
    if best is None:
        assert got is None
    else:
        assert got is not None and sorted(set(got)) == list(range(k))
        assert all(sum(weights[s, i] for i in range(n) if got[i] == s) <= cap * (1 + 1e-9)
                   for s in range(k))
        assert _bottleneck(times, got) == pytest.approx(best, rel=1e-9)


def test_balance_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="3 layers into 4 stages"):
        balance([1.0, 2.0, 3.0], 4)


def test_counts_is_the_cheapest_assignment_within_budget():
    rng = random.Random(7)
    for _ in range(400):
        n_states = rng.randint(1, 5)
        times = [rng.choice([rng.uniform(0, 10), float(rng.randint(0, 4))])
                 for _ in range(n_states)]
        mems = [float(rng.randint(0, 20)) for _ in range(n_states)]
        options = rng.sample(range(n_states), rng.randint(1, min(4, n_states)))
        n = rng.randint(1, 6)
        budget = float(rng.randint(0, 20 * n))
        brute = [(sum(times[k] for k in combo), combo)
                 for combo in itertools.combinations_with_replacement(options, n)
                 if sum(mems[k] for k in combo) <= budget]
        got = _counts(options, times, mems, n, budget)
        if not brute:
            assert got is None
            continue
        t, mem, assignment = got
        assert t == pytest.approx(min(b[0] for b in brute), abs=1e-9)
        assert len(assignment) == n and set(assignment) <= set(options)
        assert sum(times[k] for k in assignment) == pytest.approx(t, abs=1e-9)
        assert sum(mems[k] for k in assignment) == pytest.approx(mem) and mem <= budget + 1e-9


def test_counts_memo_answers_as_a_fresh_count():
    """`_count_with`'s memo (shared by a search's Prepareds) returns what a fresh count
    would, also for another kind's lists of equal values."""
    rng = random.Random(11)
    memo: dict = {}
    cases = []
    for _ in range(150):
        times = [rng.uniform(0, 4) for _ in range(3)]
        mems = [float(rng.randint(1, 12)) for _ in range(3)]
        n = rng.randint(1, 8)
        cases.append((times, mems, n, float(rng.randint(0, 12 * n))))
    hits = 0
    for times, mems, n, budget in cases + cases:
        order = _count_order([0, 1, 2], list(times), list(mems))
        before = len(memo)
        got = _count_with(order, list(times), list(mems), n, budget, memo)
        hits += len(memo) == before and order[1] is not None and len(order[2]) == 1
        assert got == _count_with(order, times, mems, n, budget)
    assert hits >= len(cases)

def test_choose_states_is_the_cheapest_path():
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 6))
        sizes = [int(rng.integers(1, 4)) for _ in range(n)]
        time = [rng.uniform(0, 5, s) for s in sizes]
        memory = [rng.uniform(0, 5, s) for s in sizes]
        convert = [None] + [rng.choice([0.0, 1.0, 2.5], (sizes[i - 1], sizes[i]))
                            for i in range(1, n)]
        price = float(rng.choice([0.0, 0.3]))

        def cost(path, time=time, memory=memory, convert=convert, price=price, n=n):
            c = sum(time[i][s] + price * memory[i][s] for i, s in enumerate(path))
            return c + sum(convert[i][path[i - 1], path[i]] for i in range(1, n))

        path, total = choose_states(sizes, time, memory, convert, price)
        assert len(path) == n and all(0 <= s < k for s, k in zip(path, sizes))
        assert cost(path) == pytest.approx(total)
        assert total == pytest.approx(min(cost(p) for p in itertools.product(
            *[range(s) for s in sizes])))


# ----------------------------------------------------------------------- tensor modes


def _valid_shapes(size: int) -> set:
    out = {("1d", 1, 1)}
    for q in range(2, size + 1):
        if q * q == size:
            out.add(("2d", q, 1))
        for d in range(2, size + 1):
            if q * q * d == size:
                out.add(("2.5d", q, d))
        if q ** 3 == size:
            out.add(("3d", q, q))
    return out


@pytest.mark.parametrize("size", [*range(1, 70), 72, 81, 96, 125, 128, 216, 256, 343, 512, 1024])
def test_tensor_modes_are_exactly_the_valid_shapes(size):
    modes = tensor_modes(size)
    shapes = [(m.name, m.q, m.d) for m in modes]
    assert len(shapes) == len(set(shapes))
    assert all(m.size == size for m in modes)
    assert set(shapes) == _valid_shapes(size)


def test_tensor_modes_respects_allowed():
    assert [m.name for m in tensor_modes(64, ("1d", "3d"))] == ["1d", "3d"]
    assert [str(m) for m in tensor_modes(8, ("2.5d",))] == ["2.5d(2x2x2)"]


# ----------------------------------------------------------------------- the search


def _fingerprint(res):
    b = res.best
    return (b.describe(), b.mesh, b.micro_batch, b.microbatches, b.schedule, b.chunks, b.zero,
            b.offload, b.cp_mode, b.states, b.stages, b.step_time, b.memory_per_device,
            [(c.describe(), c.step_time) for c, _ in res.alternatives], res.candidates)


def test_search_is_deterministic(small, tight):
    first = planner.search(small, tight, global_batch=16)
    second = planner.search(small, tight, global_batch=16)
    assert first.best is not None and first.best.fits
    assert _fingerprint(first) == _fingerprint(second)


def test_tight_memory_makes_the_search_trade_speed_for_memory(small, tight):
    free = planner.search(small, World(8, per_node=4), global_batch=16).best
    best = planner.search(small, tight, global_batch=16).best
    capacity = tight.profile.memory_bytes * 0.92
    assert free.memory_per_device > capacity  # the free winner no longer fits
    assert best.fits and best.memory_per_device <= capacity
    assert best.step_time > free.step_time


@pytest.mark.parametrize("fixed", [
    dict(tp=2, pp=2, zero=1, recompute="selective"),
    dict(tp=4, tp_mode="2d", recompute="full"),
    dict(tp=2, sp="megatron", zero=2, offload=True),
    dict(cp=2, sp="ulysses", zero=3),
    dict(pp=2, schedule="gpipe", microbatches=4, micro_batch_size=2),
])
def test_fixed_constraints_appear_in_the_plan(small, fixed):
    world = World(8, per_node=4)
    res = planner.search(small, world, global_batch=16, constraints=fixed)
    best = res.best
    assert best is not None and best.fits
    for axis in ("tp", "pp", "cp"):
        if axis in fixed:
            assert best.mesh[axis] == fixed[axis]
    blocks = [s for s, lt in zip(best.states, small.layers()) if lt.is_block]
    if "recompute" in fixed:
        assert {s.recompute for s in blocks} == {fixed["recompute"]}
    if "tp_mode" in fixed:
        assert {s.mode.name for s in blocks} == {fixed["tp_mode"]}
    if fixed.get("sp") == "megatron":
        assert {s.sp for s in best.states} == {"megatron"}
    if fixed.get("sp") == "ulysses":
        assert best.cp_mode == "ulysses"
    assert best.zero == fixed.get("zero", best.zero)
    assert best.offload == fixed.get("offload", best.offload)
    assert best.schedule == fixed.get("schedule", best.schedule)
    assert best.microbatches == fixed.get("microbatches", best.microbatches)
    assert best.micro_batch == fixed.get("micro_batch_size", best.micro_batch)
    plan = planner.to_plan(small, world, res, 16, "bf16", 0.0)
    assert plan.mesh == best.mesh and plan.zero.stage == best.zero
    if "recompute" in fixed:
        assert plan.recompute == fixed["recompute"]


@pytest.mark.parametrize("fixed, product", [(dict(tp=3), 3), (dict(tp=4, pp=4), 16)])
def test_a_fixed_plan_the_world_cannot_host_names_the_divisors(small, fixed, product):
    with pytest.raises(PlanError) as err:
        planner.search(small, World(8, per_node=4), global_batch=16, constraints=fixed)
    msg = str(err.value)
    assert f"product {product}" in msg and "world of 8 devices" in msg
    assert "divisors: 1, 2, 4, 8" in msg


def test_unknown_constraint_is_refused(small):
    with pytest.raises(PlanError, match="unknown constraint.*'tensor'"):
        planner.search(small, World(8), global_batch=16, constraints={"tensor": 2})


def test_unknown_device_names_the_nearest():
    with pytest.raises(WorldError) as err:
        World(8, device="a100")
    assert "Did you mean 'a100-80gb'?" in str(err.value)
    with pytest.raises(WorldError, match="h100-80gb"):
        World(8, device="h100")


def test_executable_search_keeps_to_what_the_runtime_runs(small):
    world = World(8, per_node=4)
    full = planner.search(small, world, global_batch=16)
    res = planner.search(small, world, global_batch=16, executable=True)
    # the full search does use something the runtime cannot run yet
    assert full.best.zero > 0 or full.best.mesh["pp"] > 1 or full.best.mesh["cp"] > 1
    for cand in [res.best] + [c for c, _ in res.alternatives]:
        if cand.mesh["pp"] > 1:  # pipelines run, with the schedule's own stages per rank
            assert cand.schedule in ("gpipe", "1f1b", "interleaved", "zero_bubble")
            if cand.stages:  # (a candidate only bounded, never priced, has none)
                assert max(cand.stages) + 1 == cand.mesh["pp"] * cand.chunks
        assert cand.zero in (0, 1, 2, 3)  # every ZeRO stage runs, with pipelines too
        assert not cand.offload or cand.zero >= 1
        # the runtime runs one grid per plan, which 1D layers may join
        grids = {(s.mode.name, s.mode.q, s.mode.d) for s in cand.states if s.mode.name != "1d"}
        assert len(grids) <= 1, grids
    said = " | ".join(res.left_out)
    assert "recomputation" not in said, said  # every recompute mode runs
    # the search chooses pipelines for parallelize, with every ZeRO stage
    assert [n for n in res.left_out if "pipeline" in n] == []
    # 2D/2.5D/3D, Megatron-SP and cp beside every tensor mode run
    assert [n for n in res.left_out if "cp" in n or "2d" in n.lower() or "Megatron" in n] == []
    # cp beside a grid, fixed, is what the executable search answers
    beside = planner.search(small, world, global_batch=16, executable=True,
                            constraints={"cp": 2, "tp": 4, "tp_mode": "2d"})
    assert beside.best.mesh["cp"] == 2 and {s.mode.name for s, lt in zip(
        beside.best.states, small.layers()) if lt.is_block} == {"2d"}
    # every grid of the world was searched: forced to 3D blocks, the search still answers
    forced = planner.search(small, world, global_batch=16, executable=True,
                            constraints={"tp": 8, "tp_mode": "3d"})
    assert {s.mode.name for s, lt in zip(forced.best.states, small.layers())
            if lt.is_block} == {"3d"}
    plan = planner.to_plan(small, world, res, 16, "bf16", 0.0)
    assert plan.search["left_out"] == res.left_out


def test_executable_search_offers_gradient_accumulation_without_a_pipeline(small):
    """The runtime accumulates gradients over micro-batches without a pipeline, so the
    executable search prices pp 1 with micro-batches too, as the free search does, and
    leaves nothing about accumulation out."""
    world = World(8, per_node=4)
    cands = planner.executable_candidates(small, world, global_batch=16)
    flat = [c for c in cands if c.mesh["pp"] == 1]
    assert any(c.microbatches > 1 for c in flat)
    assert all(c.micro_batch * c.microbatches == 16 // c.mesh["dp"] for c in flat)
    res = planner.search(small, world, global_batch=16, executable=True)
    assert not any("gradient accumulation" in n for n in res.left_out)
    fixed = planner.search(small, world, global_batch=16, executable=True,
                           constraints={"pp": 1, "microbatches": 2})
    assert fixed.best.mesh["pp"] == 1 and fixed.best.microbatches == 2


def test_executable_candidates_are_the_whole_executable_space(small, tmp_path):
    """Every executable plan, priced: the executable search's winner among them and the
    fastest of them, each description once, Megatron-SP on and off, and each one a Plan
    the runtime executes, predicted as its candidate was."""
    world = World(4, per_node=4)
    cands = planner.executable_candidates(small, world, global_batch=16, dtype="fp32")
    names = [c.describe() for c in cands]
    assert len(names) == len(set(names))
    fits = [c for c in cands if c.fits]
    assert [c.step_time for c in fits] == sorted(c.step_time for c in fits)
    best = planner.search(small, world, global_batch=16, dtype="fp32", executable=True).best
    assert best.describe() in names and best.step_time == pytest.approx(fits[0].step_time)
    tp2 = [c for c in cands if c.mesh == {"pp": 1, "dp": 2, "cp": 1, "tp": 2} and c.zero == 0]
    assert {"megatron" in c.describe() for c in tp2} == {True, False}
    assert {c.mesh["pp"] for c in cands} == {1, 2}  # two blocks: two stages at most
    # the 2x2 grid's blocks are there even where 1D beats them (a hopeless profile for 2D)
    hw = dataclasses.replace(load_hardware("cpu"), collectives={
        "all_gather": {"algorithm": "ring", "alpha": 1.0, "beta": 1e-3}})
    path = str(tmp_path / "slow-gather.json")
    hw.save(path)
    slow = planner.executable_candidates(small, World(4, per_node=4, device=path),
                                         global_batch=16, dtype="fp32")
    for space in (cands, slow):
        assert any(all(s.mode.name == "2d" for s, name in zip(c.states, small.names)
                       if name.startswith("blocks.")) for c in space)
    assert {c.schedule for c in cands if c.mesh["pp"] > 1} == {"gpipe", "1f1b"}
    assert {(c.zero, c.offload) for c in cands if c.mesh["dp"] > 1} == {
        (0, False), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)}
    for cand in cands[:: max(1, len(cands) // 12)]:
        plan = planner.candidate_plan(cand, small, world, 16, "fp32")
        assert plan.unsupported() == [] and plan.mesh == cand.mesh
        assert plan.predicted["step_time_s"] == cand.step_time
        assert plan.search["winner"] == cand.describe()
        plan.check_grid()
        plan.check_sequence_parallel()


def test_every_candidate_prices_the_space_run_searches(small):
    """`Search.every` prices every leaf with no bound: `run`'s top plans are among its
    candidates, and its fastest is `run`'s winner."""
    from autopar.search.search import Constraints, Options, Search

    world = World(8, per_node=4)
    options = Options(global_batch=16, dtype="bf16", top=3)
    every = Search(small, world, options, Constraints(tp=2)).every()
    run = Search(small, world, options, Constraints(tp=2)).run()
    fastest = min((c for c in every if c.fits), key=lambda c: c.step_time)
    assert fastest.step_time == pytest.approx(run.best.step_time)
    assert len(every) > run.candidates
    assert {c.describe() for c in every} >= {c.describe() for c, _ in run.alternatives
                                             if c.stages}


def test_time_shared_cores_go_to_the_busy_ranks():
    """Ranks sharing fewer cores: the schedule played as a fluid, a waiting rank's cores
    going to the ranks that can run. With enough cores it is the schedule itself; with
    fewer it lies between the cores' work (m x the mean rank) and the critical path at a
    whole core per rank (share x the schedule's step)."""
    from autopar.cost.schedule import simulate, stage_owner, step_time, time_shared

    for schedule, p, m, v, stages in [("gpipe", 2, 4, 1, [1.0, 3.0]), ("1f1b", 4, 8, 1,
                                      [1.0, 2.0, 3.0, 1.5]), ("interleaved", 2, 4, 2,
                                      [1.0, 2.0, 1.0, 2.0]), ("zero_bubble", 2, 4, 2,
                                      [1.0, 1.0, 2.0, 1.0])]:
        alone = simulate(schedule, p, m, v, forward=[x / 3 for x in stages],
                         backward=[2 * x / 3 for x in stages]).step_s
        assert time_shared(schedule, p, m, stages, 1.0, v) == pytest.approx(alone)
        per_rank = [0.0] * p
        for s_, x in enumerate(stages):
            per_rank[stage_owner(schedule, s_, p)] += x
        for share in (0.75, 0.5, 0.25):
            t = time_shared(schedule, p, m, stages, share, v)
            assert max(m * sum(per_rank) / p, share * alone) * (1 - 1e-9) <= t <= alone
    # two ranks on one core, the light one waiting half the time: the heavy one takes the
    # whole core then, and the step is the pair's work (1 + 3 per micro-batch, 4 of them)
    # spread over the core at twice the all-busy rate: 16 / 2
    assert step_time("gpipe", 2, 4, [1.0, 3.0]) == 13.0
    assert time_shared("gpipe", 2, 4, [1.0, 3.0], 0.5) == pytest.approx(8.0)
    # one pipeline of 4 ranks on 2 cores fills them only once 2 ranks run: its ramp-up
    # leaves a core idle, so it takes longer than its work over the cores
    t = time_shared("gpipe", 4, 4, [1.0] * 4, 0.5)
    assert 4 * 1.0 < t < 0.5 * step_time("gpipe", 4, 4, [1.0] * 4) + 4 * 1.0


def test_ranks_sharing_cores_absorb_the_pipeline_bubble(small, tmp_path):
    """CPU ranks that outnumber their cores (compute_share < 1): a rank busy while others
    wait, in the bubble or on a lighter stage, gives its cores to the busy ones, so a
    pipeline's step shrinks (`time_shared`); nothing changes without a pipeline, and the
    search stays exact (its bounds shrink alike)."""
    from autopar.search.search import Constraints, Options, Search

    plain = World(4, per_node=4, device="cpu")
    path = str(tmp_path / "cpu-shared.json")
    dataclasses.replace(load_hardware("cpu"), name="cpu-shared", compute_share=0.5).save(path)
    shared = World(4, per_node=4, device=path)
    options = Options(global_batch=16, dtype="fp32", top=3)

    def every(world, **fixed):
        return {c.describe(): c for c in Search(small, world, options,
                                                Constraints(**fixed)).every()}

    alone, together = every(plain, pp=2), every(shared, pp=2)
    assert alone.keys() == together.keys()
    lighter = False
    for name, c in together.items():
        before = alone[name]
        pipe_before = before.step_time - before.dp_comm_s - before.optimizer_s
        busy = pipe_before - before.bubble_s  # m x the slowest rank's time per micro-batch
        pipe = c.step_time - c.dp_comm_s - c.optimizer_s
        # at most the busiest rank's own time (or the halved critical path), at least
        # the halved critical path and m x the mean rank (at most the busiest)
        assert 0.5 * pipe_before * (1 - 1e-9) <= pipe <= max(busy, 0.5 * pipe_before) * (1 + 1e-9)
        assert 0 <= c.bubble_s <= before.bubble_s
        lighter |= pipe < busy * (1 - 1e-6)  # below the busiest rank: uneven stages
    assert any(c.step_time < alone[n].step_time for n, c in together.items())
    assert lighter
    flat_alone, flat_together = every(plain, pp=1), every(shared, pp=1)
    assert {n: c.step_time for n, c in flat_alone.items()} == \
        {n: c.step_time for n, c in flat_together.items()}
    best = Search(small, shared, options, Constraints(pp=2)).run().best
    assert best.step_time == pytest.approx(min(c.step_time for c in together.values()
                                               if c.fits))


def test_zero3_pays_collective_latency_once_per_layer(small):
    """ZeRO-3 gathers and reduce-scatters layer by layer: the data-parallel sync of a
    device with k layers of parameters is, per micro-batch, k reduce-scatters and 2k - 1
    gathers on 1/k of the bytes (each layer gathered for its forward and its backward, but
    the last, whose forward gather the backward keeps)."""
    from autopar.cost.comm import collective_time, placements
    from autopar.search.search import Constraints, Options, Search

    search = Search(small, World(8, per_node=8, device="cpu"), Options(global_batch=16),
                    Constraints())
    pl = placements({"dp": 8}, ("dp",), 8)["dp"]
    one = search._dp_time(8e6, 3, 2, pl)
    four = search._dp_time(8e6, 3, 2, pl, units=4)
    rs, ag = (collective_time(op, 2e6, pl, search.hw) for op in ("reduce_scatter", "all_gather"))
    assert four == pytest.approx(2 * (4 * rs + 7 * ag))
    assert one == pytest.approx(2 * (collective_time("reduce_scatter", 8e6, pl, search.hw) +
                                     collective_time("all_gather", 8e6, pl, search.hw)))
    assert four > one  # more latency, the same bytes
    assert search._dp_time(8e6, 1, 2, pl, units=4) == search._dp_time(8e6, 1, 2, pl)
    cands = Search(small, World(8, per_node=8, device="cpu"), Options(global_batch=16),
                   Constraints(tp=1, pp=1, zero=3)).every()
    layers = sum(1 for lt in small.layers() if lt.param_bytes > 0)
    c = cands[0]
    assert c.dp_comm_s == pytest.approx(search._dp_time(
        c.memory["parameters"] * 8, 3, c.microbatches, pl, units=layers))


def test_identical_blocks_split_differently_by_1d_are_different_kinds():
    # mlp-tiny: three Linear+GELU blocks of one structure; 1D splits the first by columns
    # (its input needs no gradient), the second by rows (an all-reduce forward), the third
    # by columns again with an all-reduce of its input's gradient
    w = workload("mlp-tiny", max_layers=None)
    chain = planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                            tp_sizes=[2])
    blocks = [lt for lt in chain.layers() if lt.name.startswith("blocks.")]
    comm = [[(op, phase) for op, phase, _ in lt.sharded[2].comm] for lt in blocks]
    assert comm == [[], [("all_reduce", "forward")], [("all_reduce", "backward")]]
    assert len({id(lt) for lt in blocks}) == 3
    kinds = [chain.types[i].name for i in chain.order]
    assert [k for k in kinds if k.startswith("blocks.")] == ["blocks.0", "blocks.1", "blocks.2"]


def test_too_few_microbatches_for_the_pipeline_is_named(small):
    # pp fixed to 2 with one sequence per step: fewer micro-batches than stages
    with pytest.raises(PlanError, match="micro-batches as stages.*at least 2"):
        planner.search(small, World(8, per_node=4), global_batch=1, constraints={"pp": 2})
    # more stages than blocks
    with pytest.raises(PlanError, match="pp 4 needs at least 4 blocks.*has 3; use pp 2"):
        planner.search(small, World(8, per_node=4), global_batch=16, constraints={"pp": 4})


# ----------------------------------------------------------------------- GPT-3 175B


def test_gpt3_plan_keeps_tp_in_a_node_and_fits(gpt3):
    _, chain = gpt3
    world = World(1024, per_node=8, device="a100-80gb")
    res = planner.search(chain, world, global_batch=1536)
    best = res.best
    assert best is not None and best.fits
    assert best.mesh["tp"] <= 8
    assert math.prod(best.mesh.values()) == 1024
    assert best.mesh["dp"] * best.micro_batch * best.microbatches == 1536
    assert best.memory_per_device <= 0.92 * world.profile.memory_bytes
    # root, wte, wpe, drop, 96 blocks, ln_f, lm_head, loss
    assert len(best.states) == len(best.stages) == 103
    # a plausible fraction of peak (Megatron-LM reached 44-52% on A100s in 2021, before
    # FlashAttention; the planner prices fused attention by default)
    flops = planner.model_flops(chain, 1536)
    mfu = flops / (best.step_time * 1024 * world.profile.flops("bf16"))
    assert 0.3 < mfu < 0.8


def test_a_model_that_fits_nowhere_names_the_closest_plan_and_the_devices_needed(gpt3):
    w, chain = gpt3
    world = World(2, per_node=8)
    res = planner.search(chain, world, global_batch=1536)
    assert res.best is None and res.alternatives
    with pytest.raises(PlanError) as err:
        planner.to_plan(chain, world, res, 1536, "bf16", 0.0)
    msg = str(err.value)
    assert "no plan fits in memory on 2 x a100-80gb" in msg and "the closest, pp" in msg
    found = re.search(r"about (\d+) devices|--world (\d+)", msg)
    assert found, msg
    need = int(found.group(1) or found.group(2))
    assert need > 2 and need % 8 == 0
    # the suggested world is enough
    assert planner.search(chain, World(need, per_node=8), global_batch=1536).best is not None
    with pytest.raises(PlanError, match=r"closest.*(about \d+ devices|--world \d+)"):
        planner.plan(w.model, w.inputs, world, global_batch=1536, loss_fn=w.loss_fn,
                     example_target=w.target, repeat={"blocks.1": w.layers - 1})


def test_wide_tensor_groups_pick_a_grid_for_the_blocks(gpt3):
    """Across nodes a 1D group of 16 or 64 all-reduces whole activations; 2D and 3D move
    blocks of them, so the search gives the transformer blocks a grid and keeps the
    embeddings, final norm, classifier and loss 1D (converting at the block boundaries)."""
    _, chain = gpt3
    world = World(1024, per_node=8)
    for tp, grid in ((16, "2d"), (64, "3d")):
        res = planner.search(chain, world, global_batch=1536, constraints={"tp": tp})
        modes = {True: set(), False: set()}
        for s, name in zip(res.best.states, chain.names):
            modes[name.startswith("blocks.")].add(s.mode.name)
        assert modes[True] == {grid} and modes[False] == {"1d"}, modes
        if 96 % tp:  # 1d cannot split GPT-3's 96 heads over 64: refused, not planned
            with pytest.raises(PlanError, match="96 heads, which do not split over tensor "
                                                f"size {tp}"):
                planner.search(chain, world, global_batch=1536,
                               constraints={"tp": tp, "tp_mode": "1d"})
            continue
        one_d = planner.search(chain, world, global_batch=1536,
                               constraints={"tp": tp, "tp_mode": "1d"})
        assert res.best.step_time < one_d.best.step_time


def test_executable_search_offers_megatron_sp_only_where_the_runtime_splits_sequences(small):
    world = World(4, per_node=4)
    fixed = {"tp": 4, "tp_mode": "1d", "sp": "megatron"}
    res = planner.search(small, world, global_batch=16, executable=True, constraints=fixed)
    assert {s.sp for s, lt in zip(res.best.states, small.layers()) if lt.is_block} == \
        {"megatron"}
    # an image model has no token sequence to split: the executable search never uses SP
    w = workload("vit-tiny", max_layers=None)
    vit = planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                          tp_sizes=[1, 2, 4])
    res = planner.search(vit, world, global_batch=8, executable=True,
                         constraints={"tp": 4, "tp_mode": "1d"})
    assert {s.sp for s in res.best.states} == {"none"}


@pytest.mark.parametrize("seq,layout", [(1536, "zigzag"), (1539, "contiguous")])
def test_ring_plans_take_the_zigzag_layout_where_2cp_divides_the_sequence(small, seq, layout):
    """Ring attention's plan runs zigzag (balanced causal work) when the sequence splits into
    2 x cp chunks, and contiguous blocks when it only splits into cp."""
    chain = dataclasses.replace(small, tokens_per_sample=seq)
    world = World(6, per_node=6)
    res = planner.search(chain, world, global_batch=6, constraints=dict(cp=3, sp="ring"))
    assert res.best is not None and res.best.cp_mode == "ring"
    plan = planner.to_plan(chain, world, res, 6, "bf16", 0.0)
    assert plan.mesh["cp"] == 3 and plan.cp_layout() == layout
    assert Plan.from_json(plan.to_json()).cp_layout() == layout


def _priced_states(chain):
    """Every (layer kind, state, micro-batch, cp mode) the search prices on 8 ranks under
    tp 1, 2 (1D) and 4 (1D, 2D) with and without 2-way context parallelism."""
    from autopar.cost.comm import placements
    from autopar.cost.model import Context, LayerState, tensor_modes
    from autopar.modes import ORDER, RECOMPUTE

    hw = load_hardware("a100-80gb")
    for tp, cp, cp_mode in ((1, 1, None), (2, 1, None), (4, 1, None), (2, 2, "ring"),
                            (2, 2, "ulysses"), (4, 2, "ring")):
        pl = placements({"pp": 1, "dp": 8 // (tp * cp), "cp": cp, "tp": tp}, ORDER, 4)
        for b in (1, 2, 4):
            for lt in chain.types:
                for mode in tensor_modes(tp):
                    if b % mode.batch_split or (mode.name == "1d" and tp not in lt.sharded):
                        continue
                    for sp in ("none", "megatron"):
                        yield functools.partial(Context, hw, "bf16", pl["tp"], pl["cp"],
                                                cp_mode), \
                            lt, [LayerState(mode, sp, r) for r in RECOMPUTE], b


def test_a_shared_context_prices_each_state_as_a_fresh_one(small):
    """The states of one layout share their compute and collectives through the Context's
    memo: pricing them in one Context gives exactly what a fresh Context per state does."""
    from autopar.cost.model import state_cost

    for make, lt, states, b in _priced_states(small):
        shared = make()
        for state in states:
            assert state_cost(lt, state, b, shared) == state_cost(lt, state, b, make())


def test_recomputing_never_speeds_a_layout_nor_changes_its_bytes_held(small):
    """The search bounds a leaf from each layout's least-recomputing state alone
    (`least_recompute`): recomputation only adds time (compute and rerun collectives),
    and parameters and workspace do not depend on it."""
    from autopar.cost.model import state_cost

    for make, lt, states, b in _priced_states(small):
        ctx = make()
        none, selective, full = (state_cost(lt, s, b, ctx) for s in states)
        assert none.time <= selective.time <= full.time
        assert none.params == selective.params == full.params
        assert none.workspace == selective.workspace == full.workspace


def test_divisors_come_from_pairs_below_the_square_root():
    """The search factors the world through divisors(): for a world of 10^9 devices it
    must not loop 10^9 times (it walked every number up to n before)."""
    from autopar.search.space import divisors

    for n in range(1, 500):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]
    big = divisors(10 ** 9)
    assert len(big) == 100 and big[:4] == [1, 2, 4, 5] and big[-1] == 10 ** 9
