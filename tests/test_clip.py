"""Gradient clipping by the global norm over every shard (`max_grad_norm`).

Each rank adds the squared norms of the gradients it holds, each divided by the number of
ranks that hold the same values (tensor-axis copies of a replicated or partly split
parameter, data-parallel replicas, pipeline members sharing a tied embedding; ZeRO
pieces are all distinct), and one scalar all-reduce over the world gives the norm of the
whole model's gradient. Every plan below clips (the limit is below the norm) and equals
one device clipping with torch.nn.utils.clip_grad_norm_: losses, weights, and the norm of
every step.
"""

import pytest
from distributed import dist_pool_fixture
from equivalence import assert_equal, compare

pool2 = dist_pool_fixture(2)
pool4 = dist_pool_fixture(4)

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
GPT4 = "gpt:layers=4,hidden=32,heads=4,vocab=64,seq=16"
LIMIT = 0.05


def _check(results):
    assert_equal(results)
    for r in results:
        assert r["norms"], r
        for ours, theirs in r["norms"]:
            assert theirs > LIMIT  # the limit bites
            assert ours == pytest.approx(theirs, rel=1e-5)


@pytest.mark.parametrize("plan", [
    {"data": 2},
    {"tensor": {"size": 2, "mode": "1d"}},
    {"data": 2, "zero": {"stage": 2}},
    {"sequence": {"size": 2, "mode": "ring"}},
    {"pipeline": {"size": 2, "microbatches": 2}},
], ids=["dp2", "tp2", "zero2", "cp2", "pp2-tied"])
def test_clipping_equals_one_device_at_world_2(pool2, plan):
    _check(pool2.run(compare, GPT4, plan, 3, 8, None, LIMIT))


@pytest.mark.parametrize("plan", [
    {"tensor": {"size": 4, "mode": "2d"}},
    {"data": 2, "tensor": {"size": 2, "mode": "1d"}, "zero": {"stage": 1}},
    {"data": 2, "tensor": {"size": 2, "mode": "1d"}, "zero": {"stage": 3}},
], ids=["2d", "dp2-tp2-zero1", "dp2-tp2-zero3"])
def test_clipping_equals_one_device_at_world_4(pool4, plan):
    _check(pool4.run(compare, GPT, plan, 3, 8, None, LIMIT))


def test_a_bad_limit_is_refused():
    import torch

    import autopar
    from autopar.errors import PlanError
    from autopar.models import build

    model, (x,) = build(GPT, batch=2, device="cpu", seed=0)
    with pytest.raises(PlanError, match="max_grad_norm must be a positive number, not 0"):
        autopar.parallelize(model, 1, example_inputs=(x,), max_grad_norm=0,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
