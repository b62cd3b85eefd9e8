"""One capability table (autopar.plans.capabilities): for every field of the runtime's
`Capabilities`, a plan that uses it is refused by `Plan.unsupported()`, named by
`search.why.not_executable` (what `--executable` leaves out) in the same words, and not
offered by the search space (search/space.py) when the runtime lacks it; and accepted by
all three when it has it."""

from dataclasses import fields, replace
from types import SimpleNamespace

import pytest

from autopar.cost.model import LayerState, TensorMode
from autopar.modes import PLANNER, RUNTIME, Capabilities
from autopar.plans import Plan
from autopar.plans.capabilities import ROWS
from autopar.search.space import Constraints, Options, Space
from autopar.search.why import not_executable

FULL = Capabilities()  # every field at what the planner prices


class _Any:
    def __contains__(self, tp) -> bool:  # every tensor size splits this model's layers
        return True


def _space(caps) -> Space:
    block = SimpleNamespace(is_block=True, attention=True, sharded=_Any(),
                            experts=SimpleNamespace(count=8))
    chain = SimpleNamespace(layers=lambda: [block] * 8, types=[block], tokens_per_sample=4096,
                            refused=[])
    return Space(chain, Options(global_batch=64, executable=caps), Constraints())


def _mesh(pp=1, dp=1, cp=1, tp=1) -> dict:
    return {"pp": pp, "dp": dp, "cp": cp, "tp": tp}


def _stages(space, mesh, per_node=4):
    return {(z, o, s is not None) for z, o, s in space.zero_options(mesh, per_node)}


def _experts(space, mesh, stage):
    zeros = [(z, False, None) for z in (0, 1, 2, 3)]
    return 2 in space.ep_sizes(mesh) and \
        stage in {z for z, _, _ in space.expert_zero_options(mesh, zeros)}


# field -> (what the runtime lacks, a plan using it, whether a space offers that plan's choice)
CASES = {
    "tp_modes": ((TP := "2d"), dict(tensor=dict(size=4, mode="2d")),
                 lambda sp: TP in {m.name for m in sp.tp_modes(4)}),
    "axes": ("cp", dict(sequence=2, data=2),
             lambda sp: any(m["cp"] > 1 for m in sp.meshes(4))),
    "cp_with_tp": ("2d", dict(sequence=2, tensor=dict(size=4, mode="2d")),
                   lambda sp: sp.beside_cp(LayerState(TensorMode("2d", 4, 2)))),
    "cp_with_megatron_sp": (False, dict(sequence=2, tensor=dict(size=2, sequence_parallel=True)),
                            lambda sp: sp.beside_cp(LayerState(TensorMode("1d", 2), "megatron"))),
    "recompute": ("full", dict(data=2, recompute="full"), lambda sp: "full" in sp.recompute()),
    "zero": (2, dict(data=4, zero=dict(stage=2)),
             lambda sp: (2, False, False) in _stages(sp, _mesh(dp=4))),
    "zero_with_pp": (3, dict(data=2, pipeline=2, zero=dict(stage=3)),
                     lambda sp: (3, False, False) in _stages(sp, _mesh(pp=2, dp=4))),
    "sequence_parallel": ("megatron", dict(tensor=dict(size=2, sequence_parallel=True)),
                          lambda sp: "megatron" in sp.sp_modes(TensorMode("1d", 2))),
    "schedules": ("interleaved", dict(pipeline=dict(size=2, schedule="interleaved",
                                                    microbatches=4)),
                  lambda sp: "interleaved" in {s for s, _ in sp.schedules(2, 8)}),
    "offload": (False, dict(data=2, zero=dict(stage=1, offload=True)),
                lambda sp: (1, True, False) in _stages(sp, _mesh(dp=4))),
    "offload_zero3_single_rank": (False, dict(sequence=2, zero=dict(stage=3, offload=True)),
                                  lambda sp: (3, True, False) in _stages(sp, _mesh(cp=2))),
    "accumulation": (False, dict(data=2, microbatches=4),
                     lambda sp: any(b < 8 for b in sp.micro_batches(8, 1))),
    "tp_depth": (1, dict(tensor=dict(size=8, mode="2.5d", depth=2)),
                 lambda sp: any(m.name == "2.5d" and m.d == 2 for m in sp.tp_modes(8))),
    "expert": (False, dict(data=4, expert=2), lambda sp: 2 in sp.ep_sizes(_mesh(dp=4))),
    "expert_with_cp": (False, dict(data=2, sequence=2, expert=2),
                       lambda sp: 2 in sp.ep_sizes(_mesh(dp=2, cp=2))),
    "expert_cp_extras": (False, dict(data=2, sequence=2, tensor=2, expert=2),
                         lambda sp: 2 in sp.ep_sizes(_mesh(dp=2, cp=2, tp=2))),
    "expert_zero": (1, dict(data=4, expert=2, zero=dict(stage=1)),
                    lambda sp: _experts(sp, _mesh(dp=4), 1)),
    "expert_with_pp": (False, dict(data=2, pipeline=2, expert=2),
                       lambda sp: 2 in sp.ep_sizes(_mesh(dp=2, pp=2))),
    "expert_zero_with_pp": (2, dict(data=2, pipeline=2, expert=2, zero=dict(stage=2)),
                            lambda sp: _experts(sp, _mesh(dp=2, pp=2), 2)),
    "hybrid_shard": (False, dict(data=dict(size=8, shard=4), zero=dict(stage=3)),
                     lambda sp: (3, False, True) in _stages(sp, _mesh(dp=8))),
    "hybrid_with_pp": (False, dict(data=dict(size=8, shard=4), pipeline=2, zero=dict(stage=3)),
                       lambda sp: (3, False, True) in _stages(sp, _mesh(pp=2, dp=8))),
    "hybrid_with_ep": (False, dict(data=dict(size=8, shard=4), expert=2, zero=dict(stage=3)),
                       lambda sp: any(s is not None for _, _, s in sp.expert_zero_options(
                           _mesh(dp=8), sp.zero_options(_mesh(dp=8), 4)))),
}


def _without(field: str, value) -> Capabilities:
    """FULL lacking `value` of a tuple field, or with a flag or the depth set to `value`."""
    have = getattr(FULL, field)
    if isinstance(have, tuple):
        return replace(FULL, **{field: tuple(v for v in have if v != value)})
    return replace(FULL, **{field: value})


def _plan(spec: dict) -> Plan:
    size = 1
    for axis in ("data", "sequence", "tensor", "pipeline"):
        v = spec.get(axis, 1)
        size *= v["size"] if isinstance(v, dict) else v
    return Plan.from_dict(spec, size)


def test_every_field_has_a_row_and_a_case():
    names = {f.name for f in fields(Capabilities)}
    assert set(ROWS) == names and set(CASES) == names


@pytest.mark.parametrize("field", sorted(CASES))
def test_the_three_agree_on_each_capability(field):
    value, spec, offered = CASES[field]
    row, plan, lacks = ROWS[field], _plan(spec), _without(field, value)
    # present: accepted by all three
    assert plan.unsupported(FULL) == []
    assert not_executable(FULL) == []
    assert offered(_space(FULL)) is True
    # missing: refused by all three, Plan.unsupported and why in the same words
    words = row.words(value if not isinstance(value, bool) else True)
    refused = plan.unsupported(lacks)
    assert [line for line in refused if line.startswith(words)] == refused != [], refused
    assert not_executable(lacks) == [f"{words}: the runtime cannot execute it yet"]
    assert offered(_space(lacks)) is False


@pytest.mark.parametrize("axis", ["pp", "dp", "cp", "tp"])
def test_the_three_agree_on_each_axis(axis):
    """A runtime without an axis: its plans refused, the axis named, no mesh offering it."""
    lacks = _without("axes", axis)
    plan = _plan({axis_key: 2 for axis_key, a in
                  (("pipeline", "pp"), ("data", "dp"), ("sequence", "cp"), ("tensor", "tp"))
                  if a == axis})
    words = ROWS["axes"].words(axis)
    assert plan.unsupported(FULL) == [] and plan.unsupported(lacks) == [
        f"{words} (use {axis} size 1)"]
    assert not_executable(lacks) == [f"{words}: the runtime cannot execute it yet"]
    assert any(m[axis] > 1 for m in _space(FULL).meshes(16))
    assert not any(m[axis] > 1 for m in _space(lacks).meshes(16))


def test_the_runtime_table_is_what_the_search_leaves_out():
    """RUNTIME's missing capabilities are what the executable search says it left out: none,
    since cp runs beside every tensor mode and hybrid sharding beside pipelines and experts
    (the runtime runs every plan the planner prices); a runtime lacking one is told."""
    left = not_executable(RUNTIME)
    assert left == [f"{ROWS[f].words(v)}: the runtime cannot execute it yet"
                    for f in ROWS for v in ROWS[f].lacking(RUNTIME)]
    assert PLANNER == FULL and RUNTIME == FULL and left == []
    older = replace(RUNTIME, hybrid_with_pp=False)
    assert not_executable(older) == [
        "hybrid sharding beside a pipeline: the runtime cannot execute it yet"]
