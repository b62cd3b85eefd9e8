"""cp beside a 2D/2.5D/3D grid together with the other modes: a pipeline, ZeRO 1/2/3 and
layers of mixed tensor modes (1D blocks beside 2D ones).

Each run trains transformers' Llama (grouped-query attention) 5 AdamW steps equal to one
device (tests/equivalence.py's `compare`: losses and weights within 1e-5) with the bytes of
every collective, per (op, axis), on every rank equal to `engine.predicted_comm`.
"""

import pytest
import torch
from distributed import dist_pool_fixture
from equivalence import _lm_loss, assert_equal, compare
from test_cp_combos import hf_llama

from autopar.modes import CP

pool8 = dist_pool_fixture(8, timeout_s=900)
pool16 = dist_pool_fixture(16, timeout_s=900)


def hf_llama8(batch):
    """transformers' Llama with 8 heads and 4 kv heads: 2 and 1 per rank of a 1D layer over
    4 tensor ranks, so Ulysses splits a 1D layer's heads over cp 2 too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32)
    return LlamaForCausalLM(cfg), (torch.randint(0, 64, (batch, 16)),), \
        torch.randint(0, 64, (batch, 16)), _lm_loss


def cp_grid(mode="ring", layout=None, grid="2d", **more):
    sequence = {"size": 2, "mode": mode, **({"layout": layout} if layout else {})}
    tensor = {"size": 4, "mode": grid, **({"depth": 1} if grid == "2.5d" else {})}
    return {"sequence": sequence, "tensor": tensor, **more}


def _check(results, kernel="p2p"):
    assert_equal(results)
    measured = results[0]["measured"]
    assert measured[(kernel, CP)] > 0


@pytest.mark.parametrize("mode,layout", [("ring", "zigzag"), ("ulysses", None)])
def test_cp2_beside_mixed_1d_and_2d_layers_equals_one_device(pool8, mode, layout):
    """The first decoder layer in 1D over the four tensor ranks, the rest in 2D."""
    plan = cp_grid(mode, layout)
    plan["tensor"]["layers"] = {"model.layers.0": "1d"}
    results = pool8.run(compare, hf_llama8, plan)
    _check(results, "p2p" if mode == "ring" else "all_to_all")
    measured = results[0]["measured"]
    assert measured[("all_reduce", "tp")] > 0 and measured[("broadcast", "tp_j")] > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cp2_beside_2d_under_zero_equals_one_device(pool16, stage):
    results = pool16.run(compare, hf_llama, cp_grid(zero={"stage": stage}))
    _check(results)


def test_cp2_beside_2d_in_a_pipeline_equals_one_device(pool16):
    results = pool16.run(compare, hf_llama, cp_grid(pipeline={"size": 2, "microbatches": 2}))
    _check(results)


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


@pytest.mark.parametrize("name", ["gpt-tiny", hf_llama])
def test_grid_gradients_sync_once_over_dp_x_cp_as_priced(pool8, name):
    """cp 2 x 2D 4: the parameters' gradients are summed in one all-reduce over the dp x cp
    ranks (logged as dp), none over cp in the graph, so what the runtime sends is what the
    planner prices: its parameter bytes are the rank's, and its sync's bytes (a ring
    all-reduce over dp x cp) are 2(n - 1)/n of the all-reduce's. gpt-tiny's position table,
    read whole on cp, is averaged alike."""
    results = pool8.run(compare, name, cp_grid(), last=_sync)
    assert_equal(results)
    for r in results:
        sync = r["last"]
        assert sync["in_graph"] == 0 and sync["ranks"] == 2
        assert r["measured"][("all_reduce", "dp")] == sync["held"], sync
        assert sync["held"] == sync["params"], sync
        n = sync["ranks"]
        assert sync["sent"] == 2 * (n - 1) / n * r["measured"][("all_reduce", "dp")]
