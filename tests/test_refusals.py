"""A plan the runtime still refuses says so in one sentence naming each part it cannot run
and what to choose instead, never advising what the plan already uses."""

import dataclasses

import pytest

from autopar.modes import RUNTIME
from autopar.plans import Plan

CP_MEGATRON = {"sequence": 2, "tensor": {"size": 2, "mode": "1d", "sequence_parallel": True}}

# (plan, world, a runtime lacking one capability, the advice its refusal must give)
CASES = {
    "cp-megatron-sp": (CP_MEGATRON, 8, {"cp_with_megatron_sp": False},
                       "use sequence_parallel=False, or sequence size 1"),
    "cp-2d": ({"sequence": 2, "tensor": {"size": 4, "mode": "2d"}}, 8, {"cp_with_tp": ("1d",)},
              "use one of those, or sequence size 1"),
    "experts": ({"expert": 2}, 2, {"expert": False}, "use expert size 1"),
    "experts-pipeline": ({"expert": 2, "pipeline": 2}, 4, {"expert_with_pp": False},
                         "use pipeline size 1, or expert size 1"),
    "hybrid": ({"data": {"size": 4, "shard": 2}, "zero": {"stage": 3}}, 4,
               {"hybrid_shard": False}, "drop the data shard size"),
    "recompute": ({"recompute": "full"}, 2, {"recompute": ("none", "selective")},
                  "runs none, selective; use one of those"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_refused_part_names_what_to_choose_instead(case):
    spec, world, lacking, advice = CASES[case]
    plan = Plan.from_dict(spec, world)
    said = plan.refusal(dataclasses.replace(RUNTIME, **lacking))
    assert advice in said, said
    assert ". " not in said and said.endswith(".")  # one sentence


def test_cp_beside_megatron_sp_is_not_told_to_choose_what_it_uses():
    said = Plan.from_dict(CP_MEGATRON, 8).refusal(
        dataclasses.replace(RUNTIME, cp_with_megatron_sp=False))
    assert "1d" not in said and "choose data" not in said, said
