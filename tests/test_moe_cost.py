"""The planner's view of mixture-of-experts layers (autopar.cost.experts, the grouped matmul in
autopar.graph.analysis and autopar.cost.layer): active FLOPs, expert memory over ep, the
all-to-alls on the ep axis, the routing imbalance and the ep axis in the search."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from autopar.cost.comm import Placement
from autopar.cost.experts import alltoall_s, routing_imbalance, tokens_per_expert
from autopar.cost.model import Context, LayerState, TensorMode, state_cost
from autopar.cost.precision import precision_of
from autopar.cost.step import expert_split, memory_by_kind
from autopar.errors import PlanError
from autopar.graph.analysis import OpKind
from autopar.models import get_config, workload
from autopar.plans import Plan
from autopar.report.html import plan_html
from autopar.search.planner import model_flops, prepare, search, to_plan
from autopar.search.space import divisors
from autopar.world import World


@functools.cache
def _chain(name: str, seq: int, tp_sizes=(1,)):
    w = workload(name, batch=1, seq=seq)
    return w, prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                      tp_sizes=tp_sizes, layers=(w.traced_layers, w.layers))


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
    _, chain = _chain("mixtral-8x7b", 1024)
    moe = next(lt.experts for lt in chain.types if lt.experts is not None)
    hw = World(devices=8).profile
    sec, nbytes, count = alltoall_s(moe, 1, 1, Placement(4, 4), hw, 1.0)
    assert count == 5  # counts, dispatch and combine forward; their mirrors backward
    rows = 1024 * 2 * 4096 * 2  # tokens x top-k x hidden x bf16
    assert nbytes == pytest.approx(3 / 4 * (4 * rows + 8 * 8))
    assert sec > 0 and alltoall_s(moe, 1, 1, Placement(4, 4), hw, 1.0, reruns=2)[2] == 8
    assert tokens_per_expert(moe, 1, 1, 4) == 1024 * 4 * 2 / 8


def test_tensor_parallel_experts_halve_expert_flops_and_weights_and_all_reduce_the_rows():
    _, chain = _chain("mixtral-8x7b", 1024, (1, 2))
    block = next(lt for lt in chain.types if lt.experts is not None)
    moe, two = block.experts, block.sharded[2]
    experts = [i for i, g in enumerate(block.gemms) if g.expert]
    router = next(i for i, g in enumerate(block.gemms) if g.n == moe.count)
    # each expert's FFN split over tp: its GEMMs and weights halve; the router stays whole
    assert experts and all(two.gemm_split[i] for i in experts) and not two.gemm_split[router]
    assert two.expert_split == 2 and block.sharded[1].expert_split == 1
    assert block.sharded[1].param_bytes - two.param_bytes >= moe.param_bytes / 2
    # the expert rows [T·k, H] all-reduced forward, the input's gradient [T, H] backward
    rows = moe.rows
    assert rows(1) == 1024 * 2 * 4096 * 2  # tokens x top-k x hidden x bf16
    assert two.expert_comm == [("all_reduce", "forward", rows),
                               ("all_reduce", "backward", rows.scale(1 / moe.top_k))]
    hw = World(devices=8).profile
    one = Placement(1, 1)
    whole = state_cost(block, LayerState(TensorMode("1d", 1)), 1, Context(hw, "bf16", one, one))
    split = state_cost(block, LayerState(TensorMode("1d", 2)), 1,
                       Context(hw, "bf16", Placement(2, 2), one))
    assert whole.expert_params == moe.param_bytes
    assert split.expert_params == moe.param_bytes / 2
    assert whole.params - split.params >= moe.param_bytes / 2
    # Mixtral's FLOPs are mostly its experts': the split layer runs in little over half
    assert split.forward < 0.6 * whole.forward
    assert split.comm_bytes >= rows(1) + rows(1) / moe.top_k  # at least the expert rows
    # beside a cp axis the engine keeps every expert whole on each tensor rank: priced so
    cp2 = state_cost(block, LayerState(TensorMode("1d", 2)), 1,
                     Context(hw, "bf16", Placement(2, 2), Placement(2, 2)))
    assert cp2.expert_params == moe.param_bytes and cp2.params > split.params


def test_config_counts_mixtral_active_parameters():
    cfg = get_config("mixtral-8x7b")
    assert _active_matmul_params(cfg) == pytest.approx(12.75e9, rel=0.01)


@functools.cache
def _mixtral_64():
    """Mixtral-8x7B planned on 64 A100s at its 32k context, global batch 8 (explain's default)."""
    w = workload("mixtral-8x7b", batch=1)
    chain = prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                    tp_sizes=divisors(64), layers=(w.traced_layers, w.layers))
    return chain, World(devices=64)


def test_mixtral_on_64_devices_chooses_an_expert_axis():
    chain, world = _mixtral_64()
    result = search(chain, world, global_batch=8)
    best = result.best
    assert best.ep > 1 and (best.mesh["dp"] * best.mesh["cp"]) % best.ep == 0
    plan = to_plan(chain, world, result, 8, "bf16", 0.0)
    data = plan.to_json()
    assert data["mesh"]["ep"] == best.ep and plan.world_size == 64
    again = Plan.from_json(json.loads(json.dumps(data)))
    assert again.ep == best.ep and again.mesh == plan.mesh
    e = plan.detail["experts"]
    assert e["experts_per_rank"] == 8 // best.ep and e["routing_imbalance"] > 1.0
    assert e["all_to_alls_per_step"] > 0 and plan.detail["comm_by_axis"]["ep"]["bytes"] > 0
    assert "experts     8 per MoE layer" in plan.explain()
    page = plan_html(plan.detail, "mixtral-8x7b")
    assert '<table id="experts">' in page and f"ep{best.ep}" in page


def test_experts_over_ep_hold_one_ep_th_of_the_expert_weights_and_zero_shards_them():
    chain, world = _mixtral_64()
    block = next(lt for lt in chain.types if lt.experts is not None)
    moe, hw = block.experts, world.profile
    mesh = {"pp": 1, "dp": 8, "cp": 1, "tp": 1}
    split = expert_split(mesh, 4, 8)
    one = Placement(1, 1)
    state = LayerState(TensorMode("1d", 1))
    alone = state_cost(block, state, 1, Context(hw, "bf16", one, one))
    split4 = state_cost(block, state, 1, Context(hw, "bf16", one, one, ep=split.dispatch))
    assert alone.expert_params == moe.param_bytes and split4.expert_params == moe.param_bytes / 4
    assert alone.params - split4.params == pytest.approx(moe.param_bytes * 3 / 4)
    assert alone.ep_comm == 0 and split4.ep_comm > 0 and split4.comm > alone.comm
    assert split4.workspace >= 2 * moe.rows(1)  # the rows received and sent back
    # ZeRO-1 shards the experts' master and moments over the 2 ranks holding the same experts
    precision = precision_of(chain.param_dtype)
    dense = np.array([alone.params - alone.expert_params])
    experts = np.array([split4.expert_params])
    parts = memory_by_kind(dense + experts, np.zeros(1), 0.0, 8, 1, False, np.ones(1), precision,
                           experts_dev=experts, split=split)
    optim = (precision.master + precision.optimizer) / precision.weights
    assert parts["optimizer"][0] == pytest.approx(optim * (dense[0] / 8 + experts[0] / 2))
    assert parts["parameters"][0] == pytest.approx(dense[0] + experts[0])


@pytest.mark.parametrize("model, constraints, words", [
    ("gpt-tiny", dict(ep=2), "no mixture-of-experts layer"),
    ("moe-tiny", dict(ep=3), "8 experts do not split over ep=3"),
    ("moe-tiny", dict(ep=4, dp=2, pp=2, tp=1, cp=1), "must divide the data-parallel ranks"),
])
def test_a_fixed_ep_no_mesh_can_take_is_one_sentence(model, constraints, words):
    w = workload(model, batch=4)
    chain = prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                    tp_sizes=(1, 2, 4), layers=(w.traced_layers, w.layers))
    with pytest.raises(PlanError, match=words):
        search(chain, World(devices=4), global_batch=4, constraints=constraints)


def test_a_plan_refuses_an_ep_that_does_not_divide_its_data_ranks():
    with pytest.raises(PlanError, match="expert size 4 does not divide the data x sequence ranks"):
        Plan(mesh={"dp": 2, "tp": 2, "ep": 4})
    assert Plan(mesh={"dp": 4, "ep": 4}).to_json()["mesh"]["ep"] == 4
    assert "ep" not in Plan(mesh={"dp": 4}).to_json()["mesh"]


def test_the_command_line_fixes_ep(capsys, tmp_path):
    from autopar.cli import main

    out = tmp_path / "plan.json"
    assert main(["search", "moe-tiny", "--world", "4", "--ep", "2", "-o", str(out)]) == 0
    assert "ep=2 (experts over ep ranks" in capsys.readouterr().out
    saved = Plan.load(out)
    assert saved.ep == 2 and saved.world_size == 4
    assert saved.unsupported() == []  # the runtime runs an ep axis inside dp
    assert main(["explain", "moe-tiny", "--world", "4", "--ep", "3"]) == 2
    assert "8 experts do not split over ep=3" in capsys.readouterr().err
