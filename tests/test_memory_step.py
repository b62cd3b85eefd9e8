"""The optimizer step's temporaries (autopar.cost.state.step_workspace) and where they sit in
the peak: measured on the CPU as the live bytes of the tensors `step()` makes
(autopar.runtime.measure.measure_transient_bytes), for every optimizer and implementation the
memory model names, and on the local shards of a tensor-parallel and a ZeRO-1 engine against
the planner's own figure. The step runs after the backward has freed the activations, so the
peak is state + max(activations + buffers, the step's temporaries).
"""

import functools

import pytest
import torch
from distributed import dist_pool_fixture
from equivalence import build

import autopar
from autopar.cost.state import (
    FOR_LOOP,
    FOREACH,
    FUSED,
    StepTemps,
    optimizer_step_bytes,
    step_workspace,
)
from autopar.models import build as zoo_build
from autopar.optim import LAMB, LARS
from autopar.report.predicted import plan_text
from autopar.runtime.measure import measure_transient_bytes
from autopar.world import World

pool2 = dist_pool_fixture(2)

# (memory model's name, implementation, the optimizer a run passes)
OPTIMIZERS = [
    ("adamw", FOR_LOOP, functools.partial(torch.optim.AdamW, lr=1e-3)),
    ("adamw", FOREACH, functools.partial(torch.optim.AdamW, lr=1e-3, foreach=True)),
    ("adamw", FUSED, functools.partial(torch.optim.AdamW, lr=1e-3, fused=True)),
    ("adam", FOR_LOOP, functools.partial(torch.optim.Adam, lr=1e-3)),
    ("adamw_amsgrad", FOR_LOOP, functools.partial(torch.optim.AdamW, lr=1e-3, amsgrad=True)),
    ("adamw_amsgrad", FOREACH, functools.partial(torch.optim.AdamW, lr=1e-3, amsgrad=True,
                                                 foreach=True)),
    ("sgd", FOR_LOOP, functools.partial(torch.optim.SGD, lr=0.1)),
    ("sgd_momentum", FOR_LOOP, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)),
    ("sgd_momentum", FOREACH, functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9,
                                                foreach=True)),
    ("lamb", FOR_LOOP, functools.partial(LAMB, lr=1e-3)),
    ("lars", FOR_LOOP, functools.partial(LARS, lr=0.1)),
]


def _second_step_temporaries(params: list, factory) -> int:
    """The step's temporaries on its second step (the first also makes the state)."""
    opt = factory(params)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        measured = measure_transient_bytes(opt.step)
    return measured


@pytest.mark.parametrize("name,implementation,factory", OPTIMIZERS,
                         ids=[f"{n}-{i}" for n, i, _ in OPTIMIZERS])
def test_step_workspace_is_what_a_real_step_allocates(name, implementation, factory):
    """Every rule equals the measured peak of the step's live temporaries, byte for byte, on
    a GPT's parameters in the order the optimizer holds them."""
    model, _ = zoo_build("gpt:layers=2,hidden=64,heads=4,vocab=512,seq=16", batch=1,
                         device="cpu")
    params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    sizes = [p.numel() * p.element_size() for p in params]
    measured = _second_step_temporaries(params, factory)
    assert measured == step_workspace(sizes, name, implementation)
    if (name, implementation) == ("adamw", FOR_LOOP):  # the embedding comes first: 2 copies
        assert measured == 2 * sizes[0] == StepTemps.of(sizes).peak
    if implementation == FOREACH and name.startswith("adam"):  # one copy of every moment
        assert measured == sum(sizes)


def test_stage_memory_prices_each_layer_on_each_pipeline_rank():
    """cost.step.stage_memory: what the search balances stages under (Search._memory_split
    only chooses): 2 bytes of bf16 weights carry 2 + 2 + 12 = 16 bytes of state at ZeRO-0,
    16 / 8 of the optimizer part at ZeRO-1 over 8 ranks; activations count once per
    micro-batch in flight; each rank's room is the capacity less the biggest layer's flat
    buffers (2 for dp sync, 2 more for ZeRO-3's gathers)."""
    import numpy as np

    from autopar.cost.precision import Precision
    from autopar.cost.step import stage_memory
    from autopar.search import search

    mixed = Precision(weights=2, gradients=2, master=4, optimizer=8)
    params, acts, in_flight = np.array([2.0, 4.0]), np.array([10.0, 1.0]), np.array([3.0, 1.0])
    weights, room = stage_memory(params, acts, in_flight, 4.0, 100.0, mixed, 8, 0, False)
    assert weights.tolist() == [[2 * 8 + 30, 4 * 8 + 3], [2 * 8 + 10, 4 * 8 + 1]]
    assert room.tolist() == [100 - 8, 100 - 8]
    weights, room = stage_memory(params, acts, in_flight, 4.0, 100.0, mixed, 8, 3, True)
    assert weights.tolist() == [[2 * (1 / 8 + 1 / 8) + 30, 4 * (1 / 8 + 1 / 8) + 3],
                                [2 * (1 / 8 + 1 / 8) + 10, 4 * (1 / 8 + 1 / 8) + 1]]
    assert room.tolist() == [100 - 16, 100 - 16]
    _, room = stage_memory(params, acts, in_flight, 4.0, 100.0, mixed, 1, 0, False)
    assert room.tolist() == [100, 100]  # one replica: no sync buffers
    # the search prices no state itself: its split asks the cost model
    assert not any(hasattr(search, f) for f in ("state_factors", "buffer_bytes"))


def test_step_temps_join_in_order():
    """A pair straddling two runs counts: the later run's first tensor beside the earlier
    run's last."""
    a, b = [5, 1, 3], [4, 2]
    assert StepTemps.of(a).then(StepTemps.of(b)) == StepTemps.of(a + b)
    assert StepTemps.of(a + b).peak == max(2 * 4 + 3, 2 * 5)
    assert StepTemps.of([]).then(StepTemps.of(b)) == StepTemps.of(b)


# ------------------------------------------------------------------------ world 2
PLANS = {"tensor": dict(tp=2, dp=1, pp=1, zero=0, tp_mode="1d"),
         "zero1": dict(tp=1, dp=2, pp=1, zero=1)}


def _engine_step(name: str, constraints: dict, optimizer: str) -> dict:
    """On each rank: the planner's step temporaries for this plan on the CPU profile, the
    memory model's on the planner's trace, and what the engine's optimizer.step() made."""
    import torch.distributed as dist

    from autopar.search import planner
    from autopar.sharding.solve import solve

    world = dist.get_world_size()
    model, inputs, target, loss_fn = build(name, 4)
    plan = autopar.plan(model, inputs, World(world, per_node=world, device="cpu"),
                        global_batch=4, loss_fn=loss_fn, example_target=target,
                        executable=True, top=1,
                        constraints={**constraints, "recompute": "none", "sp": "none"})
    chain = planner.prepare(model, inputs, loss_fn=loss_fn, example_target=target)
    solution = solve(chain.traced, axis="tp", size=constraints["tp"]) \
        if constraints["tp"] > 1 else None
    modelled = optimizer_step_bytes(chain.traced, solution, optimizer, FOR_LOOP,
                                    constraints["zero"], constraints["dp"])
    factory = {"adamw": functools.partial(torch.optim.AdamW, lr=1e-3),
               "sgd_momentum": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)}
    engine = autopar.parallelize(model, world, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, optimizer=factory[optimizer], plan=plan)
    measured = []
    step = engine.optimizer.step
    engine.optimizer.step = lambda: measured.append(measure_transient_bytes(step))
    for _ in range(2):
        engine.train_step(inputs, target)
    return {"planned": plan.predicted["optimizer_step_workspace_bytes"],
            "modelled": modelled, "measured": measured[-1]}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_planned_step_temporaries_are_what_the_engine_allocates(pool2, name, plan):
    """tp 2 and ZeRO-1 over dp 2 on the CPU (AdamW's for-loop step): the plan's figure, the
    memory model's on the trace and the engine's measured step agree exactly, every rank."""
    for rank, r in enumerate(pool2.run(_engine_step, name, PLANS[plan], "adamw")):
        assert r["measured"] > 0, (rank, r)
        assert r["planned"] == r["modelled"] == r["measured"], (rank, r)


def test_sgd_steps_in_place(pool2):
    for rank, r in enumerate(pool2.run(_engine_step, "gpt-tiny", PLANS["tensor"],
                                       "sgd_momentum")):
        assert r["modelled"] == r["measured"] == 0, (rank, r)


# ------------------------------------------------------------------------ the peak
TINY = "gpt:layers=2,hidden=64,heads=4,vocab=4096,seq=8"  # a large embedding, few tokens
LONG = "gpt:layers=2,hidden=64,heads=4,vocab=4096,seq=32"  # the same, 4x the tokens


def _plan(batch: int, device: str = "cpu", spec: str = TINY, **constraints):
    model, (x,) = zoo_build(spec, batch=batch)
    return autopar.plan(model, (x,), World(2, per_node=2, device=device), global_batch=batch,
                        executable=True, top=1,
                        constraints={"pp": 1, "recompute": "none", "sp": "none",
                                     "offload": False, **constraints})


def _parts(plan) -> tuple:
    pred = plan.predicted
    parts = pred["memory_breakdown_bytes"]
    state = parts["parameters"] + parts["gradients"] + parts["optimizer"]
    return pred["memory_per_device_bytes"], parts, state, \
        pred["optimizer_step_workspace_bytes"]


def test_the_step_adds_only_what_the_backward_freed_short_of():
    """Many tokens: the activations outweigh the step's temporaries, which add nothing. One
    short sample: the step's two copies of the embedding set the peak. (Many tokens per
    sample: the search accumulates micro-batches of at most 16 samples.)"""
    total, parts, state, step = _parts(_plan(256, tp=2, dp=1, zero=0, spec=LONG))
    assert 0 < step < parts["activations"] + parts["buffers"]
    assert parts["optimizer_step"] == 0
    assert total == sum(parts.values()) == state + parts["activations"] + parts["buffers"]

    plan = _plan(2, tp=2, dp=1, zero=0)
    total, parts, state, step = _parts(plan)
    wte = 4096 * 64 * 4
    assert step == 2 * wte // 2  # for-loop AdamW on the CPU: root and quotient of its half
    assert parts["optimizer_step"] == step - parts["activations"] - parts["buffers"] > 0
    assert abs(total - (state + step)) <= len(parts)  # each part rounds down alone
    assert "opt step    for_loop temporaries 1.0 MiB after the backward" in plan_text(
        plan.detail)


def test_foreach_copies_every_local_moment_on_gpus():
    """A GPU profile prices torch's foreach step: one copy of every local moment (fp32 here,
    as the parameters), a ZeRO-1 piece under ZeRO, nothing on the device when offloaded."""
    total, parts, state, step = _parts(_plan(2, "a100-80gb", tp=2, dp=1, zero=0))
    assert abs(step - parts["parameters"]) <= 1
    total, parts, state, step = _parts(_plan(2, "a100-80gb", tp=1, dp=2, zero=1))
    assert abs(step - parts["parameters"] / 2) <= 1
    total, parts, state, step = _parts(_plan(2, "a100-80gb", tp=1, dp=2, zero=1,
                                             offload=True))
    assert step == parts["optimizer_step"] == 0
