"""The pure helpers of benchmarks/bench_regret.py: Spearman's rank correlation, and the
candidates it runs becoming plans that `parallelize` accepts (no timing here)."""

import os
import sys

import pytest

from autopar.api import _check_executable, _resolve_plan
from autopar.plans import Plan
from autopar.plans.checks import check_context_dims, check_grid_dims, check_sequence_dims
from autopar.runtime.engine import Engine
from autopar.world import World

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import bench_regret as br  # noqa: E402

SPEC = "gpt:layers=4,hidden=64,heads=4,vocab=128,seq=16"


def test_ranks_average_ties():
    assert br.ranks([30, 10, 20]) == [3, 1, 2]
    assert br.ranks([1, 2, 2, 3]) == [1, 2.5, 2.5, 4]
    assert br.ranks([5, 5, 5]) == [2, 2, 2]


def test_spearman():
    assert br.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert br.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2, 3, 4, 5) against (2, 1, 4, 3, 5): 1 - 6 * 4 / (5 * 24) = 0.8
    assert br.spearman([1, 2, 3, 4, 5], [0.2, 0.1, 0.4, 0.3, 0.5]) == pytest.approx(0.8)
    # with ties: Pearson of the average ranks (1, 2.5, 2.5, 4) and (1, 2, 3, 4)
    assert br.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert br.spearman([1, 1, 1], [1, 2, 3]) != br.spearman([1, 1, 1], [1, 2, 3])  # nan
    with pytest.raises(ValueError):
        br.spearman([1, 2], [1])


def test_short_drops_what_every_plan_shares():
    assert br.short("pp1 dp4 cp1 tp1, tp -, mb 4x1, zero 0, recompute none") == \
        "pp1 dp4 tp1, tp -, mb 4x1, zero 0"


def test_every_candidate_becomes_a_plan_parallelize_accepts():
    """What parallelize checks before any process work, on every plan the benchmark runs;
    the choice is among them, and the plans are distinct."""
    world = World(devices=br.WORLD, per_node=br.WORLD, device="cpu")
    plans = br.candidate_plans(SPEC, 8, world)
    names = [p["plan"] for p in plans]
    assert len(names) == len(set(names)) > 10
    assert br.choice(SPEC, 8, world) in names
    assert [p["predicted_s"] for p in plans] == sorted(p["predicted_s"] for p in plans)
    assert {Plan.from_json(p["json"]).mesh["pp"] for p in plans} == {1, 2, 4}
    from autopar.models import build

    model, (x,) = build(SPEC, batch=8, device="cpu", seed=0)
    traced = Engine.trace_for(model, (x,))
    for p in plans:
        plan = _resolve_plan(Plan.from_json(p["json"]), br.WORLD, br.WORLD)
        _check_executable(plan)
        if plan.tensor_mesh().mode != "1d":
            check_grid_dims(traced, plan, plan.tensor_mesh())
        if plan.mesh["cp"] > 1:
            check_context_dims(traced, plan)
        if plan.sequence_parallel_layers():
            check_sequence_dims(traced, plan)
        assert plan.predicted["step_time_s"] == p["predicted_s"]
