"""cp beside a 2D/2.5D/3D grid together with the other modes: a pipeline, ZeRO 1/2/3 and
layers of mixed tensor modes (1D blocks beside 2D ones).

Each run trains transformers' Llama (grouped-query attention) 2 AdamW steps equal to one
device (tests/equivalence.py's `compare`: losses and weights within 1e-5) with the bytes of
every collective, per (op, axis), on every rank equal to `engine.predicted_comm`. Two steps
are enough: the second runs Adam on the state the first left, and every collective, ZeRO
piece and pipeline send of a step runs in each; at worlds 8 and 16 on two cores each further
step cost seconds.
"""

import pytest
import torch
from equivalence import _lm_loss, assert_equal, compare
from pretraced import forked_pool_fixture
from test_cp_combos import hf_llama

from autopar.modes import CP

STEPS = 2


def hf_llama8(batch):
    """transformers' Llama with 8 heads and 4 kv heads: 2 and 1 per rank of a 1D layer over
    4 tensor ranks, so Ulysses splits a 1D layer's heads over cp 2 too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32)
    return LlamaForCausalLM(cfg), (torch.randint(0, 64, (batch, 16)),), \
        torch.randint(0, 64, (batch, 16)), _lm_loss


# each world forked from the test process once it traced the world's models (tests/pretraced.py)
pool8 = forked_pool_fixture(8, [hf_llama8], timeout_s=900)
pool16 = forked_pool_fixture(16, [hf_llama], timeout_s=900)


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
    results = pool8.run(compare, hf_llama8, plan, STEPS)
    _check(results, "p2p" if mode == "ring" else "all_to_all")
    measured = results[0]["measured"]
    assert measured[("all_reduce", "tp")] > 0 and measured[("broadcast", "tp_j")] > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cp2_beside_2d_under_zero_equals_one_device(pool16, stage):
    results = pool16.run(compare, hf_llama, cp_grid(zero={"stage": stage}), STEPS)
    _check(results)


def test_cp2_beside_2d_in_a_pipeline_equals_one_device(pool16):
    results = pool16.run(compare, hf_llama, cp_grid(pipeline={"size": 2, "microbatches": 2}),
                          STEPS)
    _check(results)


# The gradients' one sync over dp x cp, priced as sent (none over cp in the graph), is
# checked on every run of tests/test_cp_grid.py's cp 2 beside a grid of 4 (gpt-tiny and
# transformers' Llama among them), which train the same plans.
