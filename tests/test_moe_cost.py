"""The planner's view of mixture-of-experts layers (autopar.cost.experts, the grouped matmul in
autopar.graph.analysis and autopar.cost.layer): active FLOPs, expert memory over ep, the
all-to-alls on the ep axis, the routing imbalance and the ep axis in the search."""

from __future__ import annotations

import functools

import pytest

from autopar.cost.experts import alltoall_s, routing_imbalance, tokens_per_expert
from autopar.graph.analysis import OpKind
from autopar.models import get_config, workload
from autopar.search.planner import model_flops, prepare


@functools.cache
def _chain(name: str, seq: int):
    w = workload(name, batch=1, seq=seq)
    return w, prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                      tp_sizes=(1,), layers=(w.traced_layers, w.layers))


def _active_matmul_params(cfg) -> int:
    """Weights a token multiplies by per step: attention, its top_k experts, the router and the
    output projection (the input embedding is a lookup)."""
    head = cfg.dim // cfg.n_head
    attention = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * cfg.n_kv_head * head
    experts = cfg.top_k * 3 * cfg.dim * cfg.ffn_hidden
    return cfg.n_layer * (attention + experts + cfg.dim * cfg.n_experts) + cfg.dim * cfg.vocab_size


def test_grouped_matmul_is_a_matmul_kind():
    w, chain = _chain("mixtral-8x7b", 1024)
    kinds = [n.meta["autopar"].kind for n in chain.traced.gm.graph.nodes
             if n.op == "call_function" and "_grouped_mm" in str(n.target)]
    assert kinds and all(k is OpKind.GROUPED_MM for k in kinds)
    moe = next(lt.experts for lt in chain.types if lt.experts is not None)
    cfg = w.config
    assert (moe.count, moe.top_k, moe.hidden) == (8, 2, 4096)
    assert moe.params == 3 * cfg.n_experts * cfg.dim * cfg.ffn_hidden


@pytest.mark.parametrize("seq", [1024, 4096])
def test_mixtral_model_flops_are_six_x_active_parameters_x_tokens_plus_attention(seq):
    w, chain = _chain("mixtral-8x7b", seq)
    cfg, batch = w.config, 8
    tokens = batch * seq
    # attention scores and weighted sum, forward 4·S²·H per sample and layer, x3 with backward
    attention = 3 * 4 * batch * seq * seq * cfg.dim * cfg.n_layer
    expected = 6 * _active_matmul_params(cfg) * tokens + attention
    assert model_flops(chain, batch) == pytest.approx(expected, rel=0.10)
    # active, not total: all eight experts would be about 3.6x the FLOPs
    assert model_flops(chain, batch) < 0.5 * 6 * chain.params * tokens


def test_routing_imbalance_is_measured_and_shrinks_with_tokens():
    assert routing_imbalance(8, 2, 1, 4096, 64) == 1.0
    few, many = routing_imbalance(8, 2, 8, 256, 4096), routing_imbalance(8, 2, 8, 65536, 4096)
    assert 1.0 < many < 1.05 < few < 1.5  # fewer tokens fluctuate more
    # a narrow router's experts differ in the norm of their gate columns: a lasting bias
    assert routing_imbalance(8, 2, 8, 65536, 64) > 1.1
    assert routing_imbalance(8, 2, 4, 4096, 64) == routing_imbalance(8, 2, 4, 4096, 64)


def test_all_to_alls_per_moe_layer_and_tokens_per_expert():
    from autopar.cost.comm import Placement
    from autopar.world import World

    _, chain = _chain("mixtral-8x7b", 1024)
    moe = next(lt.experts for lt in chain.types if lt.experts is not None)
    hw = World(devices=8).profile
    sec, nbytes, count = alltoall_s(moe, 1, 1, Placement(4, 4), hw, 1.0)
    assert count == 5  # counts, dispatch and combine forward; their mirrors backward
    rows = 1024 * 2 * 4096 * 2  # tokens x top-k x hidden x bf16
    assert nbytes == pytest.approx(3 / 4 * (4 * rows + 8 * 8))
    assert sec > 0 and alltoall_s(moe, 1, 1, Placement(4, 4), hw, 1.0, reruns=2)[2] == 8
    assert tokens_per_expert(moe, 1, 1, 4) == 1024 * 4 * 2 / 8


def test_config_counts_mixtral_active_parameters():
    cfg = get_config("mixtral-8x7b")
    assert _active_matmul_params(cfg) == pytest.approx(12.75e9, rel=0.01)
