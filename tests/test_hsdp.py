"""Hybrid sharded data parallelism (HSDP): ZeRO over a shard group of neighbouring dp ranks,
replicated over the groups (`dict(data=dict(size=4, shard=2), zero=...)`). Each run equals
one device (loss and weights within 1e-5), the bytes of every collective per (op, axis)
are the plan's prediction (gathers and reduce-scatters on dp_shard, one all-reduce of each
piece on dp_replicate), a rank holds 1/shard of the state, and a checkpoint saved under
HSDP loads under another plan."""

import json

import pytest

from distributed import dist_pool_fixture
from equivalence import assert_equal, compare
from test_checkpoint import _reshard

from autopar.errors import PlanError
from autopar.plans import Plan

pool4 = dist_pool_fixture(4)

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"


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


def test_hsdp_checkpoint_loads_under_another_plan(tmp_path, pool4):
    """Saved from ZeRO-3 pieces cut over shard groups of 2 (each piece written by both
    replicas), loaded under tensor x data parallelism, then saved again from there."""
    _reshard(tmp_path, pool4, {"data": {"size": 4, "shard": 2}, "zero": {"stage": 3}},
             pool4, {"data": 2, "tensor": {"size": 2, "mode": "1d"}}, before=2, after=2)


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


def test_the_runtime_refuses_hsdp_beside_a_pipeline():
    plan = Plan.from_dict({"data": {"size": 4, "shard": 2}, "zero": {"stage": 1},
                           "pipeline": 2}, 8)
    assert any("hybrid sharding beside a pipeline" in u for u in plan.unsupported())
