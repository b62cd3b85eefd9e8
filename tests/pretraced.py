"""Worlds forked from the test process after it traced their models, so no rank traces them.

An engine's start traces its model twice in every rank (the inference graph in `parallelize`,
the training graph with the loss at the first step): 75-85% of a rank's first start on a
model. Here the test process traces each model a module's worlds train once, as an engine
start traces them (`engine_graphs`), inside `pretracing()`, and forks the module's worlds
afterwards (`DistPool(world, fork=True)`): every rank finds the graphs in its copy of the
trace cache (autopar/graph/trace_cache.py, keyed by the model's structure, the plan's opaque
MoE layers and the loss, not by the instance) and traces none of them. A model left out is
traced by the ranks, as in a fork server's world; a graph whose trace fails here is left to
the ranks too, which meet the failure again in the test that starts it and report it there.

A module lists its models, each a name or builder of `equivalence.build`, or (model, plan)
where the plan's experts split (its MoE layers are traced opaque, as the engine traces them)::

    pool4 = forked_pool_fixture(4, [GPT, (hf_llama, {"expert": 2})])

    def test_something(pool4):
        assert_equal(pool4.run(compare, GPT, {"data": 4}))

or traces them itself in a module fixture named `pretraced`, which the pool then asks for::

    @pytest.fixture(scope="module")
    def pretraced():
        with pretracing():
            engine_graphs(model, (idx,), target, loss_fn, dict(expert=2), world=4)
            yield

    pool4 = forked_pool_fixture(4)
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from distributed import DistPool

__all__ = ["engine_graphs", "forked_pool_fixture", "mixtral", "moe", "pretrace", "pretracing"]

ENTRIES = 64  # graphs a module's ranks keep (the cache's default keeps 16, two per model)


@contextlib.contextmanager
def pretracing():
    """Trace on one thread, as the ranks run (a second thread only spins on these tiny
    tensors), with the test process's random state put back after, and a trace cache large
    enough to hold every graph of the module (the forked ranks inherit its size)."""
    from autopar.graph import trace_cache

    threads, entries = torch.get_num_threads(), trace_cache.MAX_ENTRIES
    torch.set_num_threads(1)
    trace_cache.MAX_ENTRIES = max(entries, ENTRIES)
    try:
        with torch.random.fork_rng():
            yield
    finally:
        torch.set_num_threads(threads)
        trace_cache.MAX_ENTRIES = entries


def engine_graphs(model, inputs: tuple, target: torch.Tensor, loss_fn, plan: dict | None,
                  world: int) -> None:
    """Trace `model`'s two graphs as an engine start under `plan` at `world` traces them:
    the inference graph (`Engine.trace_for`) and the training graph with `loss_fn`, every
    MoE layer the plan splits as the opaque op in both (the cache's key leaves the batch
    out, so blank inputs of two samples stand for any batch). A failing trace is left to
    the ranks."""
    from autopar.graph.trace import trace
    from autopar.kernels.moe_layers import expert_layers, opaque_moe
    from autopar.plans import Plan
    from autopar.runtime.engine import Engine

    chosen = Plan.from_dict(copy.deepcopy(plan), world) if plan is not None else None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def blank(t):
        return torch.zeros((2, *t.shape[1:]), dtype=t.dtype, device=device)

    try:
        Engine.trace_for(model, tuple(blank(t) for t in inputs), chosen)
        with opaque_moe(model, expert_layers(model, chosen)):
            trace(model, tuple(blank(t) for t in inputs), loss_fn=loss_fn,
                  example_target=blank(target), train=True)
    except Exception:  # noqa: BLE001 - the ranks trace it themselves and report it
        pass


def pretrace(models, world: int) -> None:
    """Trace each of `models` (see the module's docstring) as an engine start at `world`
    does."""
    from equivalence import build

    with pretracing():
        for entry in models:
            spec, plan = entry if isinstance(entry, tuple) else (entry, None)
            model, inputs, target, loss_fn = build(spec, 8)
            engine_graphs(model, tuple(inputs), target, loss_fn, plan, world)


def forked_pool_fixture(world: int, models=None, *, timeout_s: float = 300.0):
    """A module-scoped fixture: a world of `world` ranks forked from the test process once
    `models` were traced here, or, without them, once the module's own `pretraced` fixture
    traced its graphs."""

    if models is None:
        @pytest.fixture(scope="module")
        def _forked_pool(pretraced):
            with DistPool(world, timeout_s=timeout_s, fork=True) as pool:
                yield pool
    else:
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
