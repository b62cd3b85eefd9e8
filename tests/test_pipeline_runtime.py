"""Pipeline schedules on real gloo worlds (`autopar.runtime.pipeline.PipelineRunner`).

A model's training graph is cut into stages (`split_stages(..., targets=1)`), each member of
the pipeline runs its stages under a torch.distributed.pipelining schedule, and three AdamW
steps give the single-device run's losses and final weights (1e-5 relative), for GPipe,
1F1B, interleaved 1F1B (2 virtual stages per rank) and zero-bubble (ZBV, V-shaped) at 2 and
4 ranks. The GPT ties its embedding to the classifier, so the first and last stages share a
parameter whose gradient is summed between their ranks. Through `parallelize` (three steps:
Adam's moments in play from the second): pp 2 with every schedule, pp 4, pp2 x dp2,
pp2 x tp2 and pp2 x tp2 x dp2 (world 8), with the bytes each rank's stages move equal to
the plan's.
"""

import copy
import functools

import pytest
import torch
from equivalence import build, relative
from pretraced import forked_pool_fixture
from test_cp_combos import hf_llama

from autopar.errors import PlanError

GPT8 = "gpt:layers=8,hidden=32,heads=4,vocab=64,seq=16"
GPT2 = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"  # a block per stage: pp2 x more axes
GPT1 = "gpt:layers=1,hidden=32,heads=4,vocab=64,seq=16"  # too few blocks for two stages
STEPS = 3  # parallelize's runs beside one device
LLAMA4 = "llama:layers=4,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"
HEAVY_HEAD = "gpt:layers=8,hidden=64,heads=4,vocab=4096,seq=32"
# SGD for it: its zero-initialised biases move by about lr a step under Adam, and an element
# whose gradient is near 0 (1e-7) turns the micro-batches' other summation order (1e-9 in a
# gradient) into 1e-7 of a bias whose norm is 0.01: 1.1e-5 relative under AdamW at eps 1e-5
# and at 1e-4 alike on one machine, where SGD's weights are within 5e-7 (the split is exact;
# Adam's g / (|g| + eps) is what moved). AdamW in pipelines: the tests below.
HEAVY_OPT = functools.partial(torch.optim.SGD, lr=1e-2)

# each world forked from the test process once it traced the world's models (tests/pretraced.py)
pool2 = forked_pool_fixture(2, [GPT8, LLAMA4, GPT2, HEAVY_HEAD, GPT1])
pool4 = forked_pool_fixture(4, [GPT8, GPT2, LLAMA4])
pool8 = forked_pool_fixture(8, [GPT2, LLAMA4])
pool16 = forked_pool_fixture(16, [hf_llama], timeout_s=900)


def _runner(model, inputs, target, loss_fn, schedule: str, chunks: int, microbatches: int):
    """The model's training graph cut into contiguous stages, run by a PipelineRunner over
    every rank of the world: (runner, traced graph, stages)."""
    import torch.distributed as dist

    from autopar.graph.trace import trace
    from autopar.passes.pipeline import contiguous_stages, split_stages
    from autopar.runtime.mesh import axis_groups
    from autopar.runtime.pipeline import PipelineRunner, stage_count

    traced = trace(model, inputs, loss_fn=loss_fn, example_target=target, train=True)
    p = dist.get_world_size()
    n = stage_count(schedule, p, chunks)
    stages = split_stages(traced.gm, contiguous_stages([la.name for la in traced.layers], n),
                          n, targets=1)
    runner = PipelineRunner(stages, axis_groups({"pp": p})["pp"], schedule, microbatches)
    return runner, traced, stages


def _pp_run(spec: str, schedule: str, chunks: int = 1, microbatches: int = 4,
            steps: int = 2) -> dict:
    model, inputs, target, loss_fn = build(spec, 8)
    reference = copy.deepcopy(model)
    runner, traced, stages = _runner(model, inputs, target, loss_fn, schedule, chunks,
                                     microbatches)
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    optimizer, ref_opt = opt(runner.parameters()), opt(reference.parameters())
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = runner.step(inputs, target)
        optimizer.step()
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(*inputs), target)
        ref_loss.backward()
        ref_opt.step()
        losses.append(abs(loss - ref_loss.item()) / abs(ref_loss.item()))
    ref_state = reference.state_dict()
    held = {}
    for k in runner.mine:
        for name in stages.params[k]:
            held[traced.params[name].names[0]] = None
    by_target = {info.names[0]: target_name for target_name, info in traced.params.items()}
    weights = {}
    for key in held:
        value = traced.gm.get_parameter(by_target[key])
        weights[key] = relative(value.detach(), ref_state[key])
    return {"loss": max(losses), "weights": max(weights.values()), "held": sorted(held),
            "stages": runner.mine, "shared": sorted(stages.shared)}


def _check(results, n_stages: int):
    held = set()
    for r in results:
        assert r["loss"] < 1e-5, r
        assert r["weights"] < 1e-5, r
        held |= set(r["held"])
    assert sorted(s for r in results for s in r["stages"]) == list(range(n_stages))
    return held


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                             ("zero_bubble", 1)])
def test_pp2_schedules_equal_single_device(pool2, schedule, chunks):
    results = pool2.run(_pp_run, GPT8, schedule, chunks)
    _check(results, 2 if schedule in ("gpipe", "1f1b") else 4)
    assert results[0]["shared"] == ["model.lm_head.weight"]  # wte tied to lm_head


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                             ("zero_bubble", 1)])
def test_pp4_schedules_equal_single_device(pool4, schedule, chunks):
    _check(pool4.run(_pp_run, GPT8, schedule, chunks), 4 if schedule in ("gpipe", "1f1b")
           else 8)


def test_pp2_untied_llama_1f1b(pool2):
    results = pool2.run(_pp_run, LLAMA4, "1f1b")
    _check(results, 2)
    assert results[0]["shared"] == []


def test_schedule_and_stage_counts_are_checked():
    from autopar.runtime.pipeline import stage_count

    with pytest.raises(PlanError, match="unknown pipeline schedule 'looped'"):
        stage_count("looped", 2)
    with pytest.raises(PlanError, match="interleaved schedule needs chunks >= 2"):
        stage_count("interleaved", 2, 1)
    assert [stage_count(s, 4, 3) for s in ("gpipe", "1f1b", "interleaved", "zero_bubble")] == \
        [4, 4, 12, 8]


PP = lambda size, schedule="1f1b", **more: {  # noqa: E731
    "pipeline": {"size": size, "schedule": schedule, "microbatches": 4,
                 **({"chunks": 2} if schedule == "interleaved" else {})}, **more}


# 1f1b: test_pipeline_ranks_hold_only_their_stages_weights trains that very plan (PP(2)) the
# same steps through assert_equal, and checks what each rank holds besides.
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved", "zero_bubble"])
def test_parallelize_pp2_equals_single_device(pool2, schedule):
    """The one-liner with a pipeline plan: losses, final weights (gathered from the ranks
    that train them), and the bytes each rank's stages move equal the plan's."""
    from equivalence import assert_equal, compare

    assert_equal(pool2.run(compare, GPT8, PP(2, schedule), STEPS))


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero_bubble"])
def test_parallelize_pp2_with_data_parallelism(pool4, schedule):
    """pp2 x dp2: the runner averages over dp in buckets armed for each stage's last
    micro-batch backward (one bucket set per stage under interleaved), or after the
    schedule under zero-bubble, whose weight pass bypasses the accumulation hooks."""
    from equivalence import assert_equal, compare

    assert_equal(pool4.run(compare, GPT8, PP(2, schedule, data=2), STEPS))


def test_parallelize_pp2_with_tensor_parallelism(pool4):
    """pp2 x tp2 (1d inside each stage). Every collective of a stage runs once per
    micro-batch: the position embedding's all-reduce over tp ([S, hidden], no batch dim)
    moves 4 x its bytes with 4 micro-batches, and the plan predicts that."""
    from equivalence import assert_equal, compare

    assert_equal(pool4.run(compare, GPT8, PP(2, tensor={"size": 2, "mode": "1d"}), STEPS))


def _bad_pipeline(spec: str, plan: dict, batch: int) -> str:
    """The sentence a pipeline plan that cannot run gets (caught on every rank, so the pool
    survives)."""
    import torch.distributed as dist

    import autopar

    model, inputs, target, loss_fn = build(spec, batch)
    try:
        engine = autopar.parallelize(model, dist.get_world_size(),
                                     example_inputs=tuple(t[:2] for t in inputs),
                                     loss_fn=loss_fn, plan=plan)
        engine.train_step(inputs, target)
    except PlanError as e:
        return str(e)
    return ""


def test_bad_pipeline_plans_get_one_sentence(pool2):
    more_stages = pool2.run(_bad_pipeline, GPT1, PP(2), 8)
    assert all("a 2-stage pipeline needs at least 2 blocks; the model has 1" in m
               for m in more_stages), more_stages
    uneven = pool2.run(_bad_pipeline, GPT2, PP(2), 6)
    assert all("a batch of 6 does not split into 4 micro-batches" in m for m in uneven), uneven
    few = pool2.run(_bad_pipeline, GPT2, {"pipeline": {"size": 2, "microbatches": 1}}, 8)
    assert all(m == "" for m in few)  # microbatches 1 means "choose": one per stage
    one = {"pipeline": {"size": 2, "schedule": "gpipe", "microbatches": 1}}
    assert all(m == "" for m in pool2.run(_bad_pipeline, GPT2, one, 8))


@pytest.mark.parametrize("schedule", ["1f1b", "zero_bubble"])
def test_parallelize_pp4_equals_single_device(pool4, schedule):
    from equivalence import assert_equal, compare

    assert_equal(pool4.run(compare, GPT8, PP(4, schedule), STEPS))


def test_parallelize_pp2_tp2_dp2_equals_single_device(pool8):
    from equivalence import assert_equal, compare

    assert_equal(pool8.run(compare, GPT2, PP(2, tensor={"size": 2, "mode": "1d"}, data=2),
                           STEPS))


def test_1f1b_with_fewer_microbatches_than_stages_is_refused(pool4):
    said = pool4.run(_bad_pipeline, GPT8, {"pipeline": {"size": 4, "microbatches": 2}}, 8)
    assert all("the 1f1b schedule over 4 stages needs at least 4 micro-batches, not 2" in m
               for m in said), said


# ---------------------------------------------------------------- the schedule model
def _runtime_order(schedule: str, chunks: int, microbatches: int = 4) -> list:
    """The compute actions torch's live schedule runs on this rank, after one step."""
    import torch.distributed as dist

    model, inputs, target, loss_fn = build(GPT8, 8)
    runner, _, _ = _runner(model, inputs, target, loss_fn, schedule, chunks, microbatches)
    runner.step(inputs, target)
    ops = runner._schedule.pipeline_order[dist.get_rank()]
    return [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in ops
            if a is not None and a.computation_type.value in ("F", "B", "I", "W")]


@pytest.mark.parametrize("schedule,chunks", [("interleaved", 2), ("zero_bubble", 2)])
def test_schedule_model_runs_the_runtime_order(pool2, schedule, chunks):
    """`autopar.cost.schedule.order` is the order torch's schedule runs, action for action,
    so the bubble and memory the planner predicts are those of the schedule that runs."""
    from autopar.cost.schedule import order

    got = pool2.run(_runtime_order, schedule, chunks)
    assert got == [list(ops) for ops in order(schedule, 2, 4, chunks)]


# ---------------------------------------------------------------- hybrid meshes
def test_parallelize_pp2_with_context_parallelism(pool4):
    """pp2 x cp2: ring attention (zigzag) in a GPT, Ulysses in a GQA llama; the stages pass
    each rank's own tokens."""
    from equivalence import assert_equal, compare

    assert_equal(pool4.run(compare, GPT2, PP(2, sequence={"size": 2, "mode": "ring"}), STEPS))
    assert_equal(pool4.run(compare, LLAMA4, PP(2, "zero_bubble",
                                               sequence={"size": 2, "mode": "ulysses"}),
                           STEPS))


def test_parallelize_pp2_with_2d_tensor_and_with_cp_tp(pool8):
    """pp2 x 2D (tp 4 as a 2 x 2 grid): later stages read the batch size from a carried
    activation that the grid splits (times its pieces), and a weight's redistribution runs
    on the stage of the layer that reads it, where the plan counts its bytes. And
    pp2 x cp2 x tp2 under zero-bubble."""
    from equivalence import assert_equal, compare

    assert_equal(pool8.run(compare, GPT2, PP(2, tensor={"size": 4, "mode": "2d"}), 3, 16))
    assert_equal(pool8.run(compare, LLAMA4, PP(2, "zero_bubble",
                                               sequence={"size": 2, "mode": "ring"},
                                               tensor={"size": 2, "mode": "1d"}), 3, 16))


def test_parallelize_pp2_with_3d_tensor(pool16):
    """pp2 x 3D (tp 8 as 2 x 2 x 2) at world 16, on test_cp_grid*'s transformers Llama,
    traced by the test process for all 16 ranks (a parameter tied across the stages under a
    grid: the pp2 x 2D run above)."""
    from equivalence import assert_equal, compare

    assert_equal(pool16.run(compare, hf_llama, {"pipeline": {"size": 2, "microbatches": 2},
                                                "tensor": {"size": 8, "mode": "3d"}}, 2, 16))


# ---------------------------------------------------------------- planner's stages

def _stages_probe(engine, inputs, target):
    return dict(engine.stage_of_layer)


def test_stages_are_balanced_by_predicted_time(pool2):
    """A dict plan names no stages: the engine takes the planner's split for that plan. A
    classifier over 4096 words costs about as much as one of this GPT's blocks (on this
    machine's profile), so the last stage gets fewer blocks than the first, and training
    still equals one device."""
    from equivalence import assert_equal, compare

    two = {"pipeline": {"size": 2, "microbatches": 2}}  # micro-batches of 4
    results = pool2.run(compare, HEAVY_HEAD, two, 3, 8, _stages_probe, optimizer=HEAVY_OPT)
    assert_equal(results)
    split = results[0]["probe"]
    blocks = [split[f"blocks.{i}"] for i in range(8)]
    assert blocks == sorted(blocks) and blocks.count(0) > blocks.count(1) >= 1, split
    assert split["lm_head"] == 1 and split["wte"] == 0


def _planned(world: int) -> dict:
    """A plan from autopar.plan (pipeline fixed to 2 stages), run by parallelize: the engine
    cuts where the plan says."""
    import copy

    import autopar

    model, inputs, target, loss_fn = build(HEAVY_HEAD, 8)
    made = autopar.plan(copy.deepcopy(model), tuple(t[:2] for t in inputs), world,
                        global_batch=8, constraints={"pp": 2, "dp": world // 2, "tp": 1},
                        loss_fn=loss_fn, example_target=target[:2], dtype="fp32",
                        executable=True)
    return {"plan": made.to_json(), "stages": {lp.name: lp.stage for lp in made.layers}}


def test_parallelize_runs_the_planners_stages(pool2):
    from equivalence import assert_equal, compare

    from autopar.plans import Plan

    planned = _planned(2)
    plan = Plan.from_json(planned["plan"])
    results = pool2.run(compare, HEAVY_HEAD, plan, 3, 8, _stages_probe, optimizer=HEAVY_OPT)
    assert_equal(results)
    assert results[0]["probe"] == planned["stages"]
    assert not [n for n in plan.search.get("left_out", []) if "pipeline parallelism" in n]


def _held_weights(engine) -> dict:
    """Bytes of parameters this rank holds, and those its stages read."""
    held = sum(p.untyped_storage().nbytes() for p in engine.parameters())
    mine = sum(p.numel() * p.element_size() for p in engine.pipeline.parameters())
    whole = sum(p.numel() * p.element_size()
                for p in engine.train_graph.gm.parameters())  # the model's own tensors
    return {"held": held, "mine": mine, "whole": whole}


def _held_shapes_inference(engine, inputs, target) -> dict:
    """After the first step: `_held_weights`; again right after the run that finds the
    stages' shapes (made again here, as a new micro-batch shape would: every weight is
    fetched for it); then the largest relative difference between the engine's inference
    (called twice) and the model given the engine's full_state_dict (checked against one
    device's by compare, at the end)."""
    after_step = _held_weights(engine)
    runner = engine.pipeline
    runner._shapes = None
    runner._prepare(tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,))
    after_shapes = _held_weights(engine)
    with torch.no_grad():
        got = [engine(*inputs), engine(*inputs)]
    model = build(GPT8, 8)[0]
    model.load_state_dict(engine.full_state_dict())
    with torch.no_grad():
        want = model(*inputs)
    return {"step": after_step, "shapes": after_shapes,
            "inference": max(relative(g, want) for g in got)}


def test_pipeline_ranks_hold_only_their_stages_weights(pool2):
    """While it trains, a pipeline rank holds the weights its stages read and no others
    (the tied embedding on both ranks); full_state_dict and inference fetch the rest from
    their owners, and training goes on equal to one device. The schedule starts holding
    only this rank's stages' weights: the other stages' weights fetched to find the shapes
    are given back before it. Inference after training runs the whole model on every rank
    with the weights the other ranks trained (shared first, once per step)."""
    from equivalence import assert_equal, compare

    results = pool2.run(compare, GPT8, PP(2), STEPS, 8, _held_shapes_inference)
    assert_equal(results)
    for r in results:
        for probe in (r["probe"]["step"], r["probe"]["shapes"]):
            assert probe["held"] == probe["mine"] < probe["whole"], probe
        assert r["probe"]["inference"] < 1e-5, r["probe"]["inference"]
    held = [r["probe"]["step"]["held"] for r in results]
    assert sum(held) < 1.3 * results[0]["probe"]["step"]["whole"]


def _split_by_rank_zero(fails: str) -> str | list:
    """What `stage_of_layers`' split broadcast gives this rank when only rank 0's planner
    runs: rank 0's split (the others' planners would answer otherwise), or the error every
    rank raises when rank 0's planner fails (`fails`: "plan" a PlanError, "other" another
    exception)."""
    import torch.distributed as dist

    from autopar.runtime.stages import _rank_zeros_stages

    def planner(rank):
        if fails == "plan":
            raise PlanError("no split fits the device.")
        if fails == "other":
            raise KeyError("layer_7")
        return [0, 0, 1, 1] if rank == 0 else [0, 1, 1, 1]

    try:
        return _rank_zeros_stages(planner, dist.get_rank())
    except Exception as e:  # noqa: BLE001 - the test reads which error each rank raised
        return f"{type(e).__name__}: {e}"


def test_rank_zeros_stage_split_is_every_ranks(pool2):
    assert pool2.run(_split_by_rank_zero, "") == [[0, 0, 1, 1]] * 2
    assert pool2.run(_split_by_rank_zero, "plan") == ["PlanError: no split fits the device."] * 2
    other = pool2.run(_split_by_rank_zero, "other")
    assert other[0] == "KeyError: 'layer_7'", other
    assert other[1] == ("PlanError: rank 0's pipeline stage planner failed "
                        "(KeyError: 'layer_7')."), other
