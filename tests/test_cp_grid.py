"""Context parallelism beside 2D, 2.5D and 3D tensor parallelism.

The grid's mesh holds cp as its outermost dim (pp, dp, cp, then the grid's dims): the grid
splits weights and the batch and hidden dims of activations, cp the tokens. Grid linears,
norms and embeddings are per token, so they keep their input's split over cp (their
weights' gradients summed over dp x cp after the backward); attention runs ring (zigzag or contiguous) or Ulysses
over cp on the batch and heads block the grid leaves each rank. At world 8 (cp 2 x a grid
of 4) each run trains 2 AdamW steps equal to one device (tests/equivalence.py: losses and
weights within 1e-5) with measured communication equal to the plan's for every (op, axis),
and the parameters' gradients summed once over dp x cp as the planner prices that sync (2D).
cp 2 beside a 3D cube of 8 runs at world 16 (gpt-tiny, ring), and its solution under both
sequence modes is checked in one process.

A value whose batch and tokens are flattened into one dim (the language model's logits and
targets, GPT-2's Conv1D inputs) lies over `cp_<batch axis>`: cp's per-sample runs of tokens,
then the grid's batch split, which are the rows a rank holds; grid linears and the grid's
cross-entropy take their rows there (the loss summed over cp and the batch axes), so
nothing gathers the sequence.
"""

import pytest
import torch
from equivalence import assert_equal, build, compare
from pretraced import forked_pool_fixture
from test_cp_combos import hf_llama

import autopar
from autopar.modes import CP, RING, TP
from autopar.sharding.layout import Layout

# each world forked from the test process once it traced the world's models (tests/pretraced.py)
pool8 = forked_pool_fixture(8, ["gpt-tiny", "hf-gpt2", hf_llama, "llama-tiny"], timeout_s=900)
pool16 = forked_pool_fixture(16, [hf_llama], timeout_s=900)

STEPS = 2  # the second runs Adam on the first's state; each step more cost seconds at world 8
GRIDS = {"2d": {"size": 4, "mode": "2d"}, "2.5d": {"size": 4, "mode": "2.5d", "depth": 1},
         "3d": {"size": 8, "mode": "3d"}}


def cp_grid(mode, grid, layout=None):
    sequence = {"size": 2, "mode": mode, **({"layout": layout} if layout else {})}
    return {"sequence": sequence, "tensor": GRIDS[grid]}


@pytest.mark.parametrize("name,grid,mode,layout", [
    ("gpt-tiny", "2d", "ring", "zigzag"), ("hf-gpt2", "2d", "ring", "contiguous"),
    ("hf-llama", "2d", "ulysses", None), ("llama-tiny", "2.5d", "ulysses", None)])
def test_cp2_beside_a_grid_of_4_equals_one_device(pool8, name, grid, mode, layout):
    """hf-gpt2: transformers' GPT-2, whose Conv1D linears read [batch x tokens, hidden] (over
    cp and the grid's batch axis, like the loss); hf-llama: transformers' Llama with
    grouped-query attention (2 kv heads of 4: one per grid rank, repeated for Ulysses' head
    split)."""
    results = pool8.run(compare, hf_llama if name == "hf-llama" else name,
                        cp_grid(mode, grid, layout), STEPS, last=_sync)
    assert_equal(results)
    measured = results[0]["measured"]
    assert measured[("p2p" if mode == "ring" else "all_to_all", CP)] > 0  # the sequence kernel
    assert measured[("broadcast", "tp_i")] > 0 and measured[("broadcast", "tp_j")] > 0  # SUMMA
    assert measured[("all_reduce", CP)] > 0  # the loss's sums
    assert measured[("all_reduce", "dp")] > 0  # the gradients, once over dp x cp
    assert all(r["measured"] == measured for r in results)
    if grid == "2d":  # (2.5D's explain rows price llama-tiny's parameters short of what it holds)
        _check_sync(results)


def _sync(engine) -> dict:
    """The plan's parameter bytes on this rank (engine.explain(): the planner's per layer),
    the bytes the planner's gradient sync sends for them over dp x cp, the parameters the
    training graph still sums over cp in its backward, and the sync's ranks."""
    from autopar.cost.precision import mixed
    from autopar.cost.step import sync_bytes

    rows = engine.explain(format="json")["layers"]
    params = sum(r["predicted"].get("param_bytes", 0) for r in rows if r["here"])
    ranks = engine.grads.sync_ranks
    sent = sync_bytes(params, ranks, 0, False, mixed(torch.float32))[1]
    in_graph = [c for c in engine.train_solution.comm
                if c.axis == CP and c.op == "all_reduce" and c.phase == "backward"]
    return {"params": params, "sent": sent, "ranks": ranks, "in_graph": len(in_graph),
            "held": sum(p.numel() * p.element_size() for p in engine.parameters())}


def _check_sync(results) -> None:
    """cp 2 x a 2D grid of 4: the parameters' gradients are summed in one all-reduce over the
    dp x cp ranks (logged as dp), none over cp in the graph, so what the runtime sends is
    what the planner prices: its parameter bytes are the rank's, and its sync's bytes (a
    ring all-reduce over dp x cp) are 2(n - 1)/n of the all-reduce's. gpt-tiny's position
    table, read whole on cp, is averaged alike."""
    for r in results:
        sync = r["last"]
        assert sync["in_graph"] == 0 and sync["ranks"] == 2
        assert r["measured"][("all_reduce", "dp")] == sync["held"], sync
        assert sync["held"] == sync["params"], sync
        n = sync["ranks"]
        assert sync["sent"] == 2 * (n - 1) / n * r["measured"][("all_reduce", "dp")]


def test_cp2_beside_3d_equals_one_device(pool16):
    """transformers' Llama, the model of every world-16 run (test_cp_grid_combos,
    test_pipeline_runtime's pp2 x 3D), traced by the test process for all 16 ranks."""
    results = pool16.run(compare, hf_llama, cp_grid("ring", "3d"), STEPS)
    assert_equal(results)
    measured = results[0]["measured"]
    assert measured[("p2p", CP)] > 0 and measured[("all_gather", "tp_a")] > 0


def test_cp_beside_a_grid_runs_and_holds_cp_outermost():
    for grid in GRIDS:
        plan = autopar.Plan.from_dict(cp_grid("ring", grid), 2 * GRIDS[grid]["size"])
        assert plan.unsupported() == []
        mesh = plan.tensor_mesh()
        assert mesh.physical[0] == CP and mesh.size(CP) == 2
        assert mesh.size(TP) == GRIDS[grid]["size"]  # tp: the grid alone


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_cp2_beside_3d_keeps_the_tokens_split_through_every_block(mode):
    """The training graph of cp 2 x 3D 8 solved in one process: every linear keeps its input's
    tokens on cp beside the cube's batch and hidden splits, attention runs the sequence
    kernel on the ranks' batch x heads block, and what crosses cp is that kernel's traffic,
    the weights' gradient sums, the loss's sum and the position table's gradient gather;
    the loss takes the logits' rows where they lie, over cp and the cube's batch axes, and
    the targets' rows there too (cp's runs kept, a rank's part cut over the batch axes):
    nothing crosses cp in the forward but the kernel and the loss's sum."""
    from autopar.graph.trace import trace
    from autopar.sharding.solve import solve

    plan = autopar.Plan.from_dict(cp_grid(mode, "3d"), 16)
    model, inputs, target, loss_fn = build("gpt-tiny", 8)
    traced = trace(model, tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                   example_target=target[:2], train=True)
    sol = solve(traced, axis=TP, size=8, modes=plan.layer_modes(), default_mode="3d",
                mesh=plan.tensor_mesh(), sequence_mode=plan.sequence_mode or RING,
                sequence_layout=plan.cp_layout())
    linears = [n for n, s in sol.strategies.items() if s.name == "3d linear"]
    assert len(linears) == 9
    for node in linears[:-1]:  # the blocks' linears: [B, S, features] in and out
        assert sol.strategies[node].needs[node.args[0]].layout.shard_of_dim(1).axis == CP
        assert sol.layouts[node].shard_of_dim(1).axis == CP
    attention = [s for s in sol.strategies.values() if s.name.endswith("sequence")]
    assert len(attention) == 2
    q = Layout.replicated(4).with_shard(2, CP)
    assert all(len(s.needs) == 3 and all(n.layout.shard_on(CP) == q.shards[0]
                                         for n in s.needs.values()) for s in attention)
    kernel = "p2p" if mode == "ring" else "all_to_all"
    cp_ops = {(c.op, c.where.startswith("scaled_dot")) for c in sol.comm if c.axis == CP}
    assert cp_ops == {(kernel, True), ("all_reduce", False), ("all_gather", False)}
    gathers = {(c.where, c.phase) for c in sol.comm if c.axis == CP and c.op == "all_gather"}
    assert not [w for w, _ in gathers if w.startswith("reshape")], gathers  # the logits' view
    assert {phase for _, phase in gathers} == {"backward"}, gathers  # not the targets
    loss = next(s for s in sol.strategies.values() if s.name == "3d vocab_parallel")
    logits, target = (need.layout.shard_of_dim(0) for need in loss.needs.values())
    assert logits == target and logits.axis in ("cp_tp_ba", "cp_tp_bc") and logits.groups < 0
    assert loss.args["batch"][0] == CP


def test_planner_prices_ulysses_beside_2d_as_the_solution_sends():
    """8 heads, 2 kv heads: a 2D grid of 2 x 2 leaves a rank 4 heads and 1 kv head, which
    Ulysses over cp 2 repeats twice. The planner's bytes per attention (what a rank sends,
    (c - 1)/c of each buffer) equal the solution's all-to-alls over cp at the same batch."""
    import sympy

    from autopar.cost.comm import Placement
    from autopar.cost.cp import context_comm
    from autopar.cost.hardware import load_hardware
    from autopar.cost.model import Context, TensorMode
    from autopar.graph.ir import BATCH
    from autopar.graph.trace import trace
    from autopar.models import workload
    from autopar.search import planner
    from autopar.sharding.solve import solve

    w = workload("llama:layers=1,hidden=64,heads=8,kv_heads=2,ffn=128,vocab=64,seq=32", seq=32)
    chain = planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                            tp_sizes=[1])
    block = next(lt for lt in chain.types if lt.attention)
    ctx = Context(load_hardware("a100-80gb"), "fp32", Placement(4, 4), Placement(2, 2),
                  "ulysses")
    mode = TensorMode("2d", 4, q=2)
    priced = context_comm(block, mode, 4, ctx, [0.0], False).nbytes * 2  # c / (c - 1)

    plan = autopar.Plan.from_dict(cp_grid("ulysses", "2d"), 8)
    traced = trace(w.model, tuple(w.inputs), loss_fn=w.loss_fn, example_target=w.target,
                   train=True)
    sol = solve(traced, axis=TP, size=4, modes=plan.layer_modes(), default_mode="2d",
                mesh=plan.tensor_mesh(), sequence_mode="ulysses")
    sent = sum(sympy.sympify(c.bytes).subs(BATCH, 4) for c in sol.comm
               if c.axis == CP and c.op == "all_to_all")
    assert sent > 0 and float(sent) == pytest.approx(priced)
