"""Graphs traced once in the test process, then a world forked from it that finds them.

An engine start traces its model twice in every rank (the inference graph in `parallelize`,
the training graph with the loss at the first step): most of a rank's first start on a model.
A module whose worlds start a few models under many plans traces each model's graphs here
once, as an engine start traces them (`engine_graphs`), inside `pretracing()`, and forks its
worlds from this process afterwards (`forked_pool_fixture`): every rank finds the graphs in
its copy of the trace cache (autopar/graph/trace_cache.py, keyed by the model's structure,
the plan's opaque MoE layers and the loss, not by the instance) and traces none of them. A
graph traced here that fails is left to the ranks, which meet the failure again in the test
that starts it and report it there.

    @pytest.fixture(scope="module")
    def pretraced():
        with pretracing():
            engine_graphs(model, (idx,), target, loss_fn, dict(expert=2), world=4)
            yield

    pool4 = forked_pool_fixture(4)      # asks for the module's `pretraced` first
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from distributed import DistPool

__all__ = ["engine_graphs", "forked_pool_fixture", "pretracing"]

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
    MoE layer the plan splits as the opaque op in both. A failing trace is left to the
    ranks."""
    from autopar.kernels.moe_layers import expert_layers, opaque_moe
    from autopar.plans import Plan
    from autopar.runtime import engine

    chosen = Plan.from_dict(copy.deepcopy(plan), world) if plan is not None else None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def blank(t):
        return torch.zeros((2, *t.shape[1:]), dtype=t.dtype, device=device)

    try:
        engine.Engine.trace_for(model, tuple(blank(t) for t in inputs), chosen)
        with opaque_moe(model, expert_layers(model, chosen)):
            engine.trace(model, tuple(blank(t) for t in inputs), loss_fn=loss_fn,
                         example_target=blank(target), train=True)
    except Exception:  # noqa: BLE001 - the ranks trace it themselves and report it
        pass


def forked_pool_fixture(world: int, timeout_s: float = 300.0):
    """A module fixture: a world of `world` ranks forked from the test process once the
    module's `pretraced` fixture traced its graphs here."""

    @pytest.fixture(scope="module")
    def pool(pretraced):
        with DistPool(world, timeout_s=timeout_s, fork=True) as forked:
            yield forked

    return pool
