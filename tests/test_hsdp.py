"""Hybrid sharded data parallelism (HSDP): ZeRO over a shard group of neighbouring dp ranks,
replicated over the groups (`dict(data=dict(size=4, shard=2), zero=...)`; world 8 as 2 x 4).
Each run equals one device (loss and weights within 1e-5), the bytes of every collective
per (op, axis) are the plan's prediction (gathers and reduce-scatters on dp_shard, one
all-reduce of each piece on dp_replicate), a rank holds 1/shard of the state, and a checkpoint saved under
HSDP loads under another plan."""

import json

import pytest
from equivalence import assert_equal, assert_equal_to_one_device, compare
from pretraced import forked_pool_fixture
from test_checkpoint import _reshard

from autopar.errors import PlanError
from autopar.plans import Plan

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
# worlds forked from the test process once it traced their models (tests/pretraced.py): the
# experts' graphs as an expert split traces them (its MoE layers opaque)
EXPERTS = {"expert": 2, "data": {"size": 4, "shard": 2}, "zero": {"stage": 1}}
pool4 = forked_pool_fixture(4, [GPT, ("moe-tiny", EXPERTS)])
pool8 = forked_pool_fixture(8, [GPT])


def _state_bytes(engine, inputs, target) -> dict:
    """The optimizer state this rank holds, and that of the whole model."""
    state = [v for per in engine.optimizer.state.values() for v in per.values()
             if hasattr(v, "numel") and v.numel() > 1]
    return {"state": sum(v.numel() * v.element_size() for v in state),
            "whole": 2 * sum(whole for _, whole in engine.parameter_bytes().values()),
            "pieces": sum(s.numel() * s.element_size() for s in engine.zero.shards)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hsdp_2x2_equals_one_device_with_exact_comm(pool4, stage):
    plan = {"data": {"size": 4, "shard": 2}, "zero": {"stage": stage}}
    results = pool4.run(compare, GPT, plan, 3, 8, _state_bytes, 1.0)
    assert_equal(results)
    for r in results:
        measured = r["measured"]
        assert measured[("reduce_scatter", "dp_shard")] > 0
        assert measured[("all_gather", "dp_shard")] > 0
        # the replicas sum each rank's piece: half the reduce-scatter's bytes at shard 2
        assert measured[("all_reduce", "dp_replicate")] == \
            measured[("reduce_scatter", "dp_shard")] // 2
        assert ("reduce_scatter", "dp") not in measured
        probe = r["probe"]  # AdamW's two moments: half of them on each rank of a shard
        assert abs(probe["state"] - probe["whole"] / 2) <= 0.02 * probe["whole"] / 2, probe
        # every stage's pieces are 1/shard of each parameter (ZeRO-3 keeps only them)
        assert abs(probe["pieces"] - probe["whole"] / 4) <= 0.02 * probe["whole"] / 4
        for (a, b) in r["norms"]:  # clipping counts each replicated piece once
            assert abs(a - b) <= 1e-5 * b


def test_hsdp_2x4_zero3_equals_one_device_with_exact_comm(pool8):
    """dp 8 as 2 replicas of 4-rank shard groups, the plan dict of the public contract."""
    plan = {"data": {"size": 8, "shard": 4}, "zero": {"stage": 3}}
    results = pool8.run(compare, GPT, plan, 2, 8, _state_bytes)
    assert_equal(results)
    for r in results:
        measured = r["measured"]
        assert measured[("all_reduce", "dp_replicate")] == \
            measured[("reduce_scatter", "dp_shard")] // 4
        probe = r["probe"]  # a quarter of the state on each rank of a shard group
        assert abs(probe["pieces"] - probe["whole"] / 8) <= 0.03 * probe["whole"] / 8

def test_hsdp_checkpoint_loads_under_another_plan(tmp_path, pool4):
    """Saved from ZeRO-3 pieces cut over shard groups of 2 (each piece written by both
    replicas), loaded under tensor x data parallelism, then saved again from there."""
    _reshard(tmp_path, pool4, {"data": {"size": 4, "shard": 2}, "zero": {"stage": 3}},
             pool4, {"data": 2, "tensor": {"size": 2, "mode": "1d"}})


def test_the_plan_dict_and_json_carry_the_shard_size():
    plan = Plan.from_dict({"data": {"size": 8, "shard": 4}, "zero": {"stage": 3}}, 8)
    assert (plan.mesh["dp"], plan.dp_shard, plan.dp_replicate) == (8, 4, 2)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.zero.shard == 4 and again.dp_replicate == 2
    assert Plan.from_dict({"data": 8, "zero": {"stage": 3}}, 8).dp_replicate == 1
    assert plan.unsupported() == []


@pytest.mark.parametrize("spec, words", [
    ({"data": {"size": 4, "shard": 3}, "zero": {"stage": 3}}, "divide the data-parallel size 4"),
    ({"data": {"size": 4, "shard": 1}, "zero": {"stage": 3}}, "must be 2 or more"),
    ({"data": {"size": 4, "shard": 2}}, "no ZeRO stage"),
    ({"data": {"size": 4, "replicas": 2}}, "unknown key(s) ['replicas'] under 'data'"),
])
def test_a_wrong_shard_size_is_refused_in_one_sentence(spec, words):
    with pytest.raises(PlanError) as e:
        Plan.from_dict(spec, 4)
    assert words in str(e.value) and str(e.value).count(". ") == 0


def test_a_plan_file_refuses_unknown_zero_keys():
    data = Plan.from_dict({"data": {"size": 4, "shard": 2}, "zero": {"stage": 2}}, 4).to_json()
    data["zero"]["replicas"] = 2
    with pytest.raises(PlanError, match="unknown key"):
        Plan.from_json(data)


def test_hsdp_beside_a_pipeline_or_experts_is_executable():
    for spec, world in (({"pipeline": 2, "data": {"size": 4, "shard": 2}, "zero": {"stage": 1}},
                         8), ({"expert": 2, "data": {"size": 4, "shard": 2},
                               "zero": {"stage": 3}}, 4)):
        assert Plan.from_dict(spec, world).unsupported() == []


def _hsdp_axes(measured: dict, shard: int) -> None:
    """ZeRO on dp_shard only; each reduce-scattered piece summed once over the replicas."""
    assert measured[("reduce_scatter", "dp_shard")] > 0
    assert measured[("all_reduce", "dp_replicate")] == \
        measured[("reduce_scatter", "dp_shard")] // shard
    assert ("reduce_scatter", "dp") not in measured and ("all_gather", "dp") not in measured


@pytest.mark.parametrize("stage", [2, 3])
def test_hsdp_beside_a_pipeline_equals_one_device_with_exact_comm(pool8, stage):
    """pp 2 x dp 4 as 2 replicas of 2-rank shard groups: each stage's dp ranks make their own
    shard and replica groups; clipped by the global norm, each replicated piece once."""
    plan = {"pipeline": {"size": 2, "microbatches": 2}, "data": {"size": 4, "shard": 2},
            "zero": {"stage": stage}}
    results = pool8.run(compare, GPT, plan, 3, 8, None, 1.0)
    assert_equal_to_one_device(results, 1e-4)
    for r in results:
        _hsdp_axes(r["measured"], 2)
        assert any(axis == "pp" for _, axis in r["measured"])
        for (a, b) in r["norms"]:
            assert abs(a - b) <= 1e-5 * b


@pytest.mark.parametrize("stage", [1, 3])
def test_hsdp_beside_experts_equals_one_device_with_exact_comm(pool4, stage):
    """ep 2 inside dp 4 as 2 x 2: the dense weights' ZeRO over the shard groups and their
    replicas, the experts' over their expert-data group (whose pieces no replica repeats).
    Before, the dense part divided its sums by the shard size alone: weights 1% off."""
    plan = {"expert": 2, "data": {"size": 4, "shard": 2}, "zero": {"stage": stage}}
    results = pool4.run(compare, "moe-tiny", plan, 3, 8, None, 1.0)
    assert_equal_to_one_device(results, 1e-4)
    for r in results:
        _hsdp_axes(r["measured"], 2)
        assert r["measured"][("reduce_scatter", "edp")] > 0
        for (a, b) in r["norms"]:
            assert abs(a - b) <= 1e-5 * b


# ----------------------------------------------------------------------- planned
MEDIUM = "llama:layers=4,hidden=2048,heads=16,kv_heads=8,ffn=5632,vocab=32000,seq=2048"


@pytest.fixture(scope="module")
def medium():
    from autopar.models import workload
    from autopar.search import planner

    w = workload(MEDIUM, max_layers=None)
    return planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                           tokens_per_sample=w.tokens_per_sample, tp_sizes=[1])


def _search(chain, **constraints):
    from autopar.search import planner
    from autopar.world import World

    world = World(64, per_node=8, device="h100-80gb")
    fixed = dict(tp=1, pp=1, cp=1, **constraints)
    result = planner.search(chain, world, global_batch=64, constraints=fixed)
    return planner.to_plan(chain, world, result, 64, "bf16", 0.0), result.best


def test_the_search_keeps_zero3_gathers_inside_a_node_and_explains_both_groups(medium):
    """At dp 64 over 8 nodes, ZeRO-3's per-layer gathers across every node cost more than
    inside a shard group of 1 to 8 nodes plus one all-reduce of each piece over the replicas."""
    plan, best = _search(medium, zero=3)
    assert best.dp_shard in (8, 16, 32) and plan.zero.shard == best.dp_shard
    _, full = _search(medium, zero=3, dp_shard=64)  # ZeRO over all of dp
    assert full.dp_shard is None and best.dp_comm_s < full.dp_comm_s
    text = plan.explain()
    assert f"dp_shard={plan.dp_shard}" in text and f"dp_replicate={plan.dp_replicate}" in text


def test_hsdp_state_is_the_state_over_the_shard_size(medium):
    """Parameters, gradients and optimizer state per device are those of ZeRO-3 over 64
    ranks, times 64 / 8 with a shard group of 8."""
    _, hybrid = _search(medium, zero=3, dp_shard=8)
    _, full = _search(medium, zero=3, dp_shard=64)
    for kind in ("parameters", "gradients", "optimizer"):
        assert hybrid.memory[kind] == pytest.approx(full.memory[kind] * 8, rel=1e-9), kind


def test_dp_shard_on_the_command_line(capsys):
    from autopar import cli

    cli.main(["explain", MEDIUM, "--world", "64", "--device", "h100-80gb", "--batch", "64",
              "--tp", "1", "--pp", "1", "--cp", "1", "--zero", "2", "--dp-shard", "16",
              "--format", "json"])
    data = json.loads(capsys.readouterr().out)
    assert data["zero"] == {"stage": 2, "offload": False, "shard": 16}


def _held_beside_experts(plan_jsons: list[dict]) -> list[dict]:
    """Per plan, this rank's state bytes under it (transformers' Qwen3-MoE block, 4
    experts): parameters held and AdamW's moments after a step."""
    import functools

    import torch
    import torch.distributed as dist
    from test_moe_families import _loss, build

    import autopar

    out = []
    for plan_json in plan_jsons:
        model, idx, target = build("qwen3_moe")
        trained = {n for n, _ in model.named_parameters()}
        engine = autopar.parallelize(model, dist.get_world_size(), example_inputs=(idx[:1],),
                                     loss_fn=_loss, plan=Plan.from_json(plan_json),
                                     optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
        engine.train_step((idx,), target)
        state = [v for per in engine.optimizer.state.values() for v in per.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0]
        out.append({"parameters": sum(held for n, (held, _) in engine.parameter_bytes().items()
                                      if n in trained),
                    "pieces": sum(s.numel() * s.element_size() for s in engine.zero.shards),
                    "optimizer": sum(v.numel() * v.element_size() for v in state)})
    return out


def test_the_search_offers_hsdp_beside_experts_at_the_bytes_the_runtime_holds(pool4):
    """The search plans HSDP beside experts (ep 2 inside dp 4 as 2 shard groups of 2; before,
    it had no ZeRO option with a shard size beside an ep axis) and prices its state as the
    runtime cuts it: the dense weights over their shard group, the experts over their whole
    expert-data group. ZeRO-1 and ZeRO-3 searched on one prepared model, run in one call."""
    from test_moe_families import _loss, build

    from autopar.search import planner
    from autopar.world import World

    model, idx, target = build("qwen3_moe")
    world = World(4, device="cpu")
    chain = planner.prepare(model, (idx[:1],), loss_fn=_loss, example_target=target[:1],
                            tp_sizes=[1])
    plans = {}
    for stage in (1, 3):
        constraints = {"tp": 1, "pp": 1, "cp": 1, "ep": 2, "dp_shard": 2, "zero": stage,
                       "offload": False, "recompute": "none"}
        result = planner.search(chain, world, global_batch=4, constraints=constraints,
                                dtype="fp32")
        plans[stage] = planner.to_plan(chain, world, result, 4, "fp32", 0.0)
        assert (plans[stage].ep, plans[stage].dp_shard, plans[stage].zero.stage) == \
            (2, 2, stage)
    results = pool4.run(_held_beside_experts, [p.to_json() for p in plans.values()])
    for i, (stage, plan) in enumerate(plans.items()):
        predicted = plan.predicted["memory_breakdown_bytes"]
        # ZeRO-3 keeps only its pieces of the weights (ZeRO-1 keeps them whole)
        for kind, measured in (("parameters", "parameters" if stage == 1 else "pieces"),
                               ("optimizer", "optimizer")):
            held = max(r[i][measured] for r in results)
            # ZeRO pads each flat bucket to a multiple of its group: a few elements at most
            assert abs(predicted[kind] - held) <= 64 * 4, (stage, kind, predicted[kind], held)
