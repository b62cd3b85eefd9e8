"""The runtime's MoE layers in the cost model: the opaque op `autopar::moe` the engine traces
in place of an MoE module is priced as the planner prices the grouped-matmul graph of the same
model (autopar.cost.layer._moe), and `engine.explain()` puts the planner's tokens per expert
and the ep all-to-all bytes beside what an ep engine measured."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture

import autopar
from autopar.cost.step import chain_of
from autopar.graph.analysis import OpKind
from autopar.graph.trace import trace
from autopar.kernels.moe_layers import expert_layers, opaque_moe
from autopar.models import build as zoo_build
from autopar.models import workload
from autopar.modes import STEP
from autopar.plans import Plan
from autopar.search.planner import model_flops, prepare

pool4 = dist_pool_fixture(4, timeout_s=300)
BATCH = 8


def _hf_mixtral():
    """A tiny transformers Mixtral in bf16 on the CPU (its grouped-matmul experts trace on
    real tensors, not on meta), with a token loss."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=32, intermediate_size=32,
                           num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).to(torch.bfloat16)
    idx = torch.zeros(2, 16, dtype=torch.long)

    def loss(out, target):
        logits = out.logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))

    return model, (idx,), loss, torch.zeros(2, 16, dtype=torch.long), 16


def _zoo_moe():
    w = workload("moe-tiny", batch=2)
    return w.model, w.inputs, w.loss_fn, w.target, w.tokens_per_sample


@functools.cache
def _chains(name: str):
    """(planner's chain from the plain trace, chain of the engine's training trace under an
    ep plan, that trace) of one bf16 model."""
    model, inputs, loss_fn, target, tokens = _hf_mixtral() if name == "hf-mixtral" else \
        _zoo_moe()
    planner = prepare(model, inputs, loss_fn=loss_fn, example_target=target, tp_sizes=(1, 2))
    plan = Plan.from_dict(dict(expert=2), world_size=4)
    # what Engine.ensure_train_graph traces: each MoE module as one autopar::moe op
    with opaque_moe(model, expert_layers(model, plan)):
        traced = trace(model, inputs, loss_fn=loss_fn, example_target=target, train=True)
    return planner, chain_of(traced, tokens, (1, 2)), traced


@pytest.mark.parametrize("name", ["moe-tiny", "hf-mixtral"])
def test_the_runtime_trace_prices_moe_layers_as_the_planner_does(name):
    planner, runtime, traced = _chains(name)
    assert any(n.meta["autopar"].kind is OpKind.MOE for n in traced.gm.graph.nodes)
    assert not any("grouped_mm" in str(n.target) for n in traced.gm.graph.nodes)
    assert model_flops(runtime, BATCH) == model_flops(planner, BATCH)
    assert runtime.params == planner.params
    moe_p = [lt for lt in planner.layers() if lt.experts is not None]
    moe_r = [lt for lt in runtime.layers() if lt.experts is not None]
    assert len(moe_r) == len(moe_p) == 2
    for p, r in zip(moe_p, moe_r):
        assert r.experts == p.experts  # count, top-k, width, weights, dispatched rows
        assert r.param_bytes == p.param_bytes
        assert r.forward_flops(3) == p.forward_flops(3)
        assert sum(g.flops(3) for g in r.gemms if g.expert) == \
            sum(g.flops(3) for g in p.gemms if g.expert) > 0
        # saved activations and memory-bound bytes: the zoo's SparseMoE, op by op, which
        # autopar's kernel runs in transformers' place too (whose own code saves and moves
        # a little otherwise: within 10%)
        tol = 0 if name == "moe-tiny" else 0.10
        for b in (1, 4):
            assert r.sharded[1].act_replicated(b) == pytest.approx(
                p.sharded[1].act_replicated(b), rel=tol)
            assert r.traffic(b) == pytest.approx(p.traffic(b), rel=tol)
        # under 1D tensor parallelism each expert's FFN is split over tp: the expert GEMMs
        # and weights halve per rank, the router stays whole, and the expert rows are
        # all-reduced (T·k rows forward, the input's T rows backward), in both traces alike
        for lt in (p, r):
            one, two = lt.sharded[1], lt.sharded[2]
            experts = [i for i, g in enumerate(lt.gemms) if g.expert]
            assert experts and all(two.gemm_split[i] for i in experts)
            router = next(i for i, g in enumerate(lt.gemms) if g.n == lt.experts.count)
            assert not two.gemm_split[router]
            assert one.param_bytes - two.param_bytes >= lt.experts.param_bytes // 2
        assert r.sharded[2].param_bytes == p.sharded[2].param_bytes
        rows = r.experts.rows
        for lt in (p, r):
            assert lt.sharded[2].expert_comm == [
                ("all_reduce", "forward", rows),
                ("all_reduce", "backward", rows.scale(1 / r.experts.top_k))]
        assert sorted(r.sharded[2].comm, key=repr) == sorted(p.sharded[2].comm, key=repr)


def _token_loss(out, t):  # (module level: the second test's ranks find its traced graph)
    return F.cross_entropy(out.reshape(-1, out.size(-1)), t.reshape(-1))


def _explained(expert: int) -> dict:
    """On every rank: moe-tiny at `expert` over world 4, two steps (the first a warm-up),
    then explain() and what the engine measured and predicted."""
    torch.manual_seed(0)
    model, _ = zoo_build("moe-tiny", batch=BATCH, device="cpu", seed=0)
    idx = torch.randint(0, 256, (BATCH, 8))
    target = torch.randint(0, 256, (BATCH, 8))
    engine = autopar.parallelize(model, 4, example_inputs=(idx[:2],), loss_fn=_token_loss,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                 plan=dict(expert=expert))
    for _ in range(2):
        engine.comm_log.clear()
        engine.train_step((idx,), target)
    ep_log = sum(r.bytes for r in engine.comm_log if r.axis == "ep")
    return {"data": engine.explain(format="json"), "text": engine.explain(),
            "load": engine.expert_load(), "ep_log": ep_log,
            "ep_predicted": sum(n for (_, axis), n in engine.predicted_comm(BATCH).items()
                                if axis == "ep")}


@pytest.mark.parametrize("expert", [2, 4])
def test_explain_puts_tokens_per_expert_and_ep_bytes_beside_the_measured(pool4, expert):
    for rank, r in enumerate(pool4.run(_explained, expert)):
        rows = r["data"]["experts"]
        assert [e["module"] for e in rows] == list(r["load"]), rank
        for e in rows:
            measured, predicted = e["measured"], e["predicted"]
            for key, value in r["load"][e["module"]].items():
                assert measured[key] == value, (rank, e["module"], key)
            assert e["ep"] == expert and e["experts"] == 8 and e["top_k"] == 2
            assert predicted["tokens_per_expert"] > 0
            assert predicted["imbalance"] >= 1.0
            assert predicted["busiest_tokens_per_expert"] >= predicted["tokens_per_expert"]
            # balanced routing: the ep group's tokens (BATCH/4 samples of 8 on each rank),
            # top 2 of 8 experts
            assert predicted["tokens_per_expert"] == pytest.approx(expert * 2 * 8 * 2 / 8)
            assert measured["tokens_per_expert"] == pytest.approx(
                sum(measured["computed"]) / (8 // expert))
            assert predicted["alltoall_bytes"] > 0
            assert measured["alltoall_bytes"] == predicted["alltoall_bytes"], (rank, e)
        # the layers' ep bytes are the step's: predicted from the routing taken == sent
        assert sum(e["measured"]["alltoall_bytes"] for e in rows) == r["ep_log"] == \
            r["ep_predicted"]
        ep_axis = next(a for a in r["data"]["axes"] if a["axis"] == "ep")
        assert ep_axis["predicted"]["bytes"] == ep_axis["measured"]["bytes"] == r["ep_log"]
        # the experts' gradient sync over edp is the step's, as predicted
        step = next(row for row in r["data"]["layers"] if row["name"] == STEP)
        assert step["measured"]["comm_bytes"] == step["predicted"]["comm_bytes"] > 0
        assert "per MoE layer" in r["text"] and rows[0]["layer"] in r["text"]
