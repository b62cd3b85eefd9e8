"""ZeRO behind one interface (autopar.runtime.zero_state.ZeroState): each stage family says
what it holds, what it sends and how it hooks into the graphs and the pipeline, so runtime
code asks behaviour and never compares stage numbers; the engine reads `zero` and
`pipeline` from their one owner, the gradient path. Built here without a process group: a
data-parallel axis of 2 seen from rank 1 (nothing below sends)."""

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.kernels.collectives import AxisGroup, CommLog
from autopar.plans.schema import ZeroPlan
from autopar.runtime.engine import Engine
from autopar.runtime.gradients import ZERO_FAMILIES, make_zero, zero_family, zero_sharded
from autopar.runtime.zero import ZeroOne, ZeroTwo
from autopar.runtime.zero3 import ZeroThree
from autopar.runtime.zero_experts import ExpertDataZero, ExpertDataZeroThree, expert_zero
from autopar.runtime.zero_state import ZeroState

RUNTIME = Path(__file__).resolve().parents[1] / "autopar" / "runtime"


def _dp(size: int = 2, rank: int = 1, axis: str = "dp") -> AxisGroup:
    return AxisGroup(axis, size, rank, None, CommLog())


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(3, 5)), nn.Parameter(torch.randn(7))]


def test_runtime_asks_zero_behaviour_not_stage_numbers():
    """No runtime module compares a ZeRO stage number or probes a ZeRO object's attributes
    (hasattr/getattr): the families' methods answer instead."""
    compare = re.compile(r"\.stage\s*(==|!=|>=|<=|<|>|in\b)|\bstage\s*(==|!=|>=|<=|<|>)\s*\d")
    probe = re.compile(r"(hasattr|getattr)\([\w.]*zero\b")
    found = [f"{path.name}:{i}: {line.strip()}"
             for path in sorted(RUNTIME.glob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if compare.search(line) or probe.search(line)]
    assert found == []


def test_a_plan_stage_maps_to_its_family_in_one_place():
    assert ZERO_FAMILIES == {1: ZeroOne, 2: ZeroTwo, 3: ZeroThree}
    assert zero_family(ZeroPlan(stage=0)) is None
    assert not zero_sharded(ZeroPlan(stage=0), 8)
    assert not zero_sharded(ZeroPlan(stage=1), 1)
    assert zero_sharded(ZeroPlan(stage=1, offload=True), 1)
    for stage, family in ZERO_FAMILIES.items():
        zero = make_zero(ZeroPlan(stage=stage), _params(), _dp(), None, None)
        assert type(zero) is family and isinstance(zero, ZeroState) and zero.stage == stage


@pytest.mark.parametrize("family", [ZeroOne, ZeroTwo, ZeroThree])
def test_each_family_says_what_it_holds_and_sends(family):
    params = _params()
    shapes = [tuple(p.shape) for p in params]
    zero = family(params, _dp(), None)
    # rank 1 of 2: the second half of each flattened parameter (15 -> 8 + 7, 7 -> 4 + 3)
    pieces = zero.pieces()
    assert [pieces[id(p)][1] for p in params] == [8, 4]
    assert [pieces[id(p)][0].numel() for p in params] == [7, 3]
    assert zero.owners() == {id(s): p for s, p in zip(zero.shards, params)}
    assert zero.parts == (zero,)
    padded = 2 * (8 + 4) * 4  # both ranks' padded pieces, float32
    scattered, gathered, amax = zero.traffic(3, ())
    whole = [p.numel() * 4 for p in params]
    if family is ZeroOne:  # whole gradients through the backward: one reduce-scatter a step
        assert (scattered, gathered, amax) == (padded, padded, 0)
        assert [zero.tied_bytes(p) for p in params] == whole
    elif family is ZeroTwo:  # one reduce-scatter per micro-batch, one all-gather a step
        assert (scattered, gathered, amax) == (3 * padded, padded, 0)
        assert [zero.tied_bytes(p) for p in params] == [7 * 4, 3 * 4]
    else:  # no layer rewritten: nothing gathered
        assert (scattered, gathered, amax) == (0, 0, 0)
        assert [zero.tied_bytes(p) for p in params] == [7 * 4, 3 * 4]
    keeps = family.pieces_only
    assert [zero.keeps_only_piece(p) for p in params] == [keeps, keeps]
    assert [zero.local_shape(p) for p in params] == (shapes if keeps else [None, None])
    assert zero.keeps_only_piece(nn.Parameter(torch.zeros(2))) is False


def test_the_expert_pair_answers_through_its_parts():
    """Beside an expert axis: the dp part and the experts' edp part, one interface."""
    for stage in (1, 2, 3):
        data, experts = _params(), [nn.Parameter(torch.randn(4, 6))]
        expert_ids = {id(p) for p in experts}
        zero = expert_zero(ZERO_FAMILIES[stage], ZeroPlan(stage=stage), data + experts,
                           _dp(), _dp(2, 0, "edp"), 1.0,
                           lambda p, ids=expert_ids: id(p) in ids, None, None)
        assert isinstance(zero, ExpertDataZeroThree if stage == 3 else ExpertDataZero)
        dense, expert = zero.parts
        assert dense.params == data and expert.params == experts and zero.stage == stage
        assert zero.pieces()[id(experts[0])][1] == 0  # rank 0 of edp
        assert zero.pieces()[id(data[0])][1] == 8  # rank 1 of dp
        assert zero.traffic(2, ()) == dense.traffic(2, ())
        assert zero.expert_traffic(2, []) == expert.traffic(2, ())
        assert zero.local_shape(experts[0]) == ((4, 6) if stage == 3 else None)
        assert zero.tied_bytes(data[1]) == (7 * 4 if stage == 1 else 3 * 4)


def test_the_engine_reads_zero_and_pipeline_from_their_one_owner():
    """Engine.zero and Engine.pipeline are the gradient path's (no second copy to set)."""
    for name in ("zero", "pipeline", "held_optimizer"):
        attribute = getattr(Engine, name)
        assert isinstance(attribute, property) and attribute.fset is None, name


def test_checkpoint_writes_engine_state_through_its_owners_methods():
    """checkpoint.py sets no engine or scaler attribute (the step count, the loss scaler
    and held optimizer state are restored through their owners' public methods) but its
    own `engine.checkpointing`'s."""
    source = (RUNTIME / "checkpoint.py").read_text().splitlines()
    writes = re.compile(r"\b(engine\.(?!checkpointing\b)|scaler\.)\w+(\.\w+)*\s*=[^=]")
    assert [f"{i}: {line.strip()}" for i, line in enumerate(source, 1)
            if writes.search(line)] == []
