"""Worlds forked from the test process after it traced their models, so no rank traces them.

An engine's start traces its model twice (the inference graph in `parallelize`, the training
graph at the first step), 75-85% of a rank's first start on a model, and every rank of a
world did it for itself. Here the test process traces each model a module trains, as an
engine does (autopar's trace cache keeps the graphs), and then forks the module's world
(`DistPool(world, fork=True)`): each rank finds the graphs in the cache it inherited, and a
start is a copy of them. In a test module::

    pool4 = forked_pool_fixture(4, [GPT, (hf_llama, {"expert": 2})])

    def test_something(pool4):
        assert_equal(pool4.run(compare, GPT, {"data": 4}))

A model is a name or builder of `equivalence.build`, or (model, plan) where the plan's
experts split (an MoE model: its MoE layers are traced opaque under such a plan, as the
engine traces them). A model left out is traced by the ranks, as in a fork server's world.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import DistPool


def _plan(plan, world: int):
    from autopar.plans.schema import Plan

    return None if plan is None else Plan.from_dict(copy.deepcopy(plan), world)


def pretrace(models, world: int) -> None:
    """Trace each model's inference and training graphs here, as an engine start does
    (`Engine.trace_for`, then the training graph with the loss on blank inputs), with the
    test process's random state and thread count put back after."""
    from equivalence import build

    from autopar.graph.trace import trace
    from autopar.kernels.moe_layers import expert_layers, opaque_moe
    from autopar.runtime.engine import Engine, _blank

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: a second thread only spins on these sizes
    try:
        with torch.random.fork_rng():
            # built first, all of them: building a transformers model sets a member of
            # torch.nn.Module (its init's helper) that every model's cache key reads, so a
            # graph traced before the first one is built would not be found after it
            built = []
            for entry in models:
                spec, plan = entry if isinstance(entry, tuple) else (entry, None)
                built.append((build(spec, 8), _plan(plan, world)))
            cpu = torch.device("cpu")
            for (model, inputs, target, loss_fn), plan in built:
                Engine.trace_for(model, tuple(t[:2] for t in inputs), plan)
                with opaque_moe(model, expert_layers(model, plan)):
                    trace(model, _blank(tuple(inputs), cpu), loss_fn=loss_fn,
                          example_target=_blank((target,), cpu)[0], train=True)
    finally:
        torch.set_num_threads(threads)


def forked_pool_fixture(world: int, models, *, timeout_s: float = 300.0):
    """A module-scoped fixture: `models` traced in the test process, then a world of
    `world` ranks forked from it (its workers inherit the traced graphs)."""

    @pytest.fixture(scope="module")
    def _forked_pool():
        pretrace(models, world)
        with DistPool(world, timeout_s=timeout_s, fork=True) as pool:
            yield pool

    return _forked_pool


def moe(name: str):
    """A builder of tests/test_moe_runtime.py's MoE model `name` (as its `_train` and
    test_accumulation's `_experts` build it), in `equivalence.build`'s form."""

    def built(batch: int):
        from test_moe_runtime import build

        model, idx, target, loss_fn = build(name)
        return model, (idx,), target, loss_fn

    return built


mixtral = moe("hf-mixtral")
