"""Megatron sequence parallelism in the solver, without processes: per-layer sp, the
collectives it plans, and the layers it cannot split."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from equivalence import build  # noqa: E402

from autopar.errors import PlanError  # noqa: E402
from autopar.graph.trace import trace  # noqa: E402
from autopar.sharding.solve import solve  # noqa: E402


def _traced(name):
    model, inputs, target, loss_fn = build(name, 2)
    return trace(model, inputs, loss_fn=loss_fn, example_target=target, train=True)


def _kinds(solution):
    return {(c.op, c.phase) for c in solution.comm if c.axis == "tp"}


def test_plan_wide_sp_replaces_block_all_reduces():
    sol = solve(_traced("gpt-tiny"), axis="tp", size=4, sequence_parallel=True)
    assert sol.seq == 32
    assert {("reduce_scatter", "forward"), ("all_gather", "backward"),
            ("all_gather", "forward"), ("reduce_scatter", "backward")} <= _kinds(sol)
    forward_all_reduces = {c.where for c in sol.comm
                           if c.op == "all_reduce" and c.phase == "forward"}
    assert forward_all_reduces == {"cross_entropy_loss"}


def test_per_layer_sp_only_where_asked():
    sol = solve(_traced("gpt-tiny"), axis="tp", size=4, sequence_parallel={"blocks.1"})
    assert sol.sp_layers == {"blocks.1"}
    rows = {n.name: s.rewrite for n, s in sol.strategies.items() if s.name == "row"}
    assert rows == {"linear_1": "row_linear", "linear_3": "row_linear",
                    "linear_5": "partial_linear", "linear_7": "partial_linear"}


def test_models_without_token_sequences_are_refused_with_the_reason():
    with pytest.raises(PlanError, match="token sequences"):
        solve(_traced("vit-tiny"), axis="tp", size=2, sequence_parallel=True)
