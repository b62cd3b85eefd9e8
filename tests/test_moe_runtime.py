"""Expert parallelism in the engine: MoE layers split over an ep axis inside the data ranks.

The zoo's moe-tiny (with its balance loss in the objective) and transformers' Mixtral and
Qwen2-MoE (shared expert) train equal to one device, losses and weights within 1e-5 over 5
AdamW steps, at expert 2 and 4 with data and tensor parallelism; the all-to-alls are logged
on axis "ep" with the bytes the step's measured routing implies; each substituted module
computes what the original does; bad plans are refused in one sentence.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from distributed import dist_pool_fixture
from torch import nn

import autopar
from autopar.errors import PlanError
from autopar.kernels.moe_layers import find_moe_layers, moe_op, opaque_moe, run, spec_key
from autopar.models import build as zoo_build
from autopar.plans import Plan

pool4 = dist_pool_fixture(4, timeout_s=300)
TOL = 1e-5
BATCH = 8
AUX = 0.01  # weight of the balance loss in the zoo model's objective


class WithAux(nn.Module):
    """The zoo's MoE transformer returning (logits, summed balance loss)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, idx):
        return self.model(idx, return_aux=True)


def _zoo_loss(out, target):
    logits, aux = out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1)) + AUX * aux


def _hf_loss(out, target):
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _hf_config(name: str):
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)
    if name == "hf-mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM, MixtralConfig(intermediate_size=16, num_local_experts=4,
                                                 num_experts_per_tok=2, **common)
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM, Qwen2MoeConfig(
        intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, **common)


def build(name: str, seed: int = 0):
    """(model, idx, target, loss_fn) on the CPU, the same for a seed."""
    torch.manual_seed(seed)
    if name == "moe-tiny":
        model, (idx,) = zoo_build("moe-tiny", batch=BATCH, device="cpu", seed=seed)
        idx = torch.randint(0, 256, (BATCH, 8))
        return WithAux(model), idx, torch.randint(0, 256, (BATCH, 8)), _zoo_loss
    cls, config = _hf_config(name)
    model = cls(config)
    for p in model.parameters():  # transformers leaves some at zero (a router): draw them all
        nn.init.normal_(p, std=0.1)
    idx = torch.randint(0, 64, (BATCH, 8))
    return model, idx, torch.randint(0, 64, (BATCH, 8)), _hf_loss


def _relative(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _train(name: str, plan: dict, steps: int = 5, precision: str = "fp32") -> dict:
    """On every rank: autopar under `plan` (and `precision`) and one device in fp32, side by
    side."""
    model, idx, target, loss_fn = build(name)
    reference = copy.deepcopy(model)
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    engine = autopar.parallelize(model, 4, example_inputs=(idx[:2],), loss_fn=loss_fn,
                                 optimizer=opt, plan=plan, precision=precision)
    ref_opt = opt(reference.parameters())
    losses, log, load, measured, predicted = [], [], {}, {}, {}
    for step in range(steps):
        engine.comm_log.clear()
        loss = engine.train_step((idx,), target)
        if step == 0:
            log = [(r.op, r.axis, r.phase, r.bytes) for r in engine.comm_log]
            load = engine.expert_load()
            measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
            predicted = engine.predicted_comm(BATCH)
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(idx), target)
        ref_loss.backward()
        ref_opt.step()
        losses.append(abs(loss - ref_loss.item()) / abs(ref_loss.item()))
    full, ref = engine.full_state_dict(), reference.state_dict()
    return {"loss": max(losses), "keys_equal": list(full) == list(ref),
            "weights": max(_relative(full[k], ref[k]) for k in ref
                           if ref[k].dtype.is_floating_point),
            "log": log, "load": load, "held": engine.parameter_bytes(),
            "measured": measured, "predicted": predicted}


def _ep_rows_bytes(load: dict, hidden: int, itemsize: int = 4) -> int:
    """Forward all-to-all bytes the measured routing implies on one rank: the rows it sends
    (its tokens' assignments) and the rows its experts return."""
    return sum((sum(v["routed"]) + sum(v["computed"])) * hidden * itemsize
               for v in load.values())


def _is_expert(name: str) -> bool:
    """A routed or shared expert's weight (not a router, not the shared expert's gate)."""
    return ".experts." in name or name.rsplit(".", 1)[-1] in ("w1", "w2", "w3") or \
        ".shared_expert." in name


def _expert_shares(held: dict) -> dict[str, float]:
    """Per expert weight: the share of its bytes one rank holds."""
    return {k: mine / whole for k, (mine, whole) in held.items() if _is_expert(k)}


def _check(results: list[dict], hidden: int, ep: int, tp: int = 1) -> None:
    for rank, r in enumerate(results):
        assert r["loss"] <= TOL, (rank, r["loss"])
        assert r["weights"] <= TOL, (rank, r["weights"])
        assert r["keys_equal"]
        # every collective's bytes per (op, axis) as predicted from the routing taken
        assert r["measured"] == r["predicted"], (rank, r["measured"], r["predicted"])
        # each rank holds 1/ep of the routed experts, each cut over tp (the shared expert
        # only over tp); the routers stay whole
        shares = _expert_shares(r["held"])
        assert shares
        for name, share in shares.items():
            expected = 1 / tp if "shared_expert" in name else 1 / (ep * tp)
            assert share == pytest.approx(expected), (name, share)
        routers = [k for k in r["held"] if k.endswith(("mlp.gate.weight", "moe.gate.weight"))]
        assert routers and all(r["held"][k][0] == r["held"][k][1] for k in routers)
        forward = [b for op, axis, phase, b in r["log"] if op == "all_to_all" and axis == "ep"
                   and phase == "forward"]
        counts = [v for v in r["load"].values()]
        assert counts, "no MoE layer ran as autopar's kernel"
        if ep == 1:  # experts split over tp alone: nothing dispatched
            assert not forward
            continue
        # per layer and micro-batch: the counts (int64, E of them), then the rows out and back
        experts = len(counts[0]["routed"])
        sizes = sum(forward) - _ep_rows_bytes(r["load"], hidden)
        assert sizes > 0 and sizes % (len(counts) * experts * 8) == 0
        assert all(len(v["computed"]) == experts // ep for v in counts)
    # every token's top-k assignments were computed by some rank's experts (over the ranks
    # that run the layer: all, or a pipeline stage's)
    for layer in {name for r in results for name in r["load"]}:
        loads = [r["load"][layer] for r in results if layer in r["load"]]
        routed = torch.tensor([v["routed"] for v in loads]).sum(0)
        computed = torch.zeros_like(routed)
        for v in loads:
            computed[v["first_expert"]:v["first_expert"] + len(v["computed"])] += \
                torch.tensor(v["computed"])
        assert torch.equal(routed, computed)


@pytest.mark.parametrize("plan", [dict(expert=2), dict(expert=4)])
def test_zoo_moe_equals_one_device(pool4, plan):
    _check(pool4.run(_train, "moe-tiny", plan), 64, plan["expert"])


@pytest.mark.parametrize("plan", [dict(expert=2), dict(expert=2, tensor=2)])
def test_mixtral_equals_one_device(pool4, plan):
    _check(pool4.run(_train, "hf-mixtral", plan), 32, plan["expert"], plan.get("tensor", 1))


def test_mixtral_expert_4_equals_one_device(pool4):
    _check(pool4.run(_train, "hf-mixtral", dict(expert=4)), 32, 4)


@pytest.mark.parametrize("plan", [dict(expert=4), dict(expert=2, tensor=2)])
def test_qwen2_moe_with_shared_expert_equals_one_device(pool4, plan):
    _check(pool4.run(_train, "hf-qwen2-moe", plan), 32, plan["expert"], plan.get("tensor", 1))


def test_zoo_moe_with_tensor_2_equals_one_device(pool4):
    _check(pool4.run(_train, "moe-tiny", dict(expert=2, tensor=2)), 64, 2, 2)


# experts split over tp alone (no ep axis): the same kernel, nothing dispatched
@pytest.mark.parametrize("name,hidden", [("moe-tiny", 64), ("hf-mixtral", 32),
                                         ("hf-qwen2-moe", 32)])
def test_tensor_parallel_experts_equal_one_device(pool4, name, hidden):
    _check(pool4.run(_train, name, dict(tensor=2)), hidden, 1, 2)


def test_tensor_parallel_experts_in_a_pipeline_equal_one_device(pool4):
    plan = dict(tensor=2, pipeline=dict(size=2, microbatches=2))
    _check(pool4.run(_train, "hf-qwen2-moe", plan), 32, 1, 2)


def test_tensor_4_experts_equal_one_device(pool4):
    _check(pool4.run(_train, "moe-tiny", dict(tensor=4)), 64, 1, 4)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zoo_moe_with_zero_equals_one_device(pool4, stage):
    # experts' pieces over their expert-data group (2 ranks), the rest over dp (4)
    results = pool4.run(_train, "moe-tiny", dict(expert=2, zero=dict(stage=stage)))
    _check(results, 64, 2)
    axes = {(op, axis) for op, axis, _, _ in results[0]["log"]}
    assert {("reduce_scatter", "edp"), ("all_gather", "edp"), ("reduce_scatter", "dp")} <= axes


def test_qwen2_moe_with_zero_3_and_tensor_2_equals_one_device(pool4):
    _check(pool4.run(_train, "hf-qwen2-moe", dict(expert=2, tensor=2, zero=dict(stage=3))),
           32, 2, 2)


def test_mixtral_with_pipeline_2_equals_one_device(pool4):
    plan = dict(expert=2, pipeline=dict(size=2, microbatches=2))
    _check(pool4.run(_train, "hf-mixtral", plan), 32, 2)


def _balance_loss_in_a_pipeline() -> str:
    model, idx, target, loss_fn = build("moe-tiny")
    engine = autopar.parallelize(model, 4, example_inputs=(idx[:2],), loss_fn=loss_fn,
                                 plan=dict(expert=2, pipeline=dict(size=2, microbatches=2)))
    try:
        engine.train_step((idx,), target)
    except PlanError as e:
        return str(e)
    return "trained"


def test_a_balance_loss_in_a_pipeline_is_refused(pool4):
    for message in pool4.run(_balance_loss_in_a_pipeline):
        assert message.startswith("the model's MoE balance loss is a sum over layers over the "
                                  "whole batch, which a pipeline would split")


def _export_and_start_from_it(directory: str) -> dict:
    model, idx, target, loss_fn = build("hf-mixtral")
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    engine = autopar.parallelize(model, 4, example_inputs=(idx[:2],), loss_fn=loss_fn,
                                 optimizer=opt, plan=dict(expert=2))
    engine.train_step((idx,), target)
    engine.export(directory)
    trained = engine.full_state_dict()
    try:
        engine.save(directory + "-checkpoint")
        refusal = ""
    except PlanError as e:
        refusal = str(e)
    cls, config = _hf_config("hf-mixtral")
    with torch.device("meta"):
        fresh = cls(config)
    again = autopar.parallelize(fresh, 4, example_inputs=(idx[:2],), loss_fn=loss_fn,
                                optimizer=opt, plan=dict(expert=4), weights=directory)
    state = again.full_state_dict()
    return {"keys": list(state) == list(trained), "refusal": refusal,
            "error": max(float((state[k] - trained[k]).abs().max()) for k in trained)}


def _zero_3_from_meta() -> str:
    cls, config = _hf_config("hf-mixtral")
    with torch.device("meta"):
        model = cls(config)
    try:
        autopar.parallelize(model, 4, example_inputs=(torch.zeros(2, 8, dtype=torch.long),),
                            loss_fn=_hf_loss, plan=dict(expert=2, zero=dict(stage=3)))
    except PlanError as e:
        return str(e)
    return "built"


def test_zero_3_from_a_meta_model_is_refused(pool4):
    for message in pool4.run(_zero_3_from_meta):
        assert message.startswith("a meta model or weights= under ZeRO-3 would cut the experts")


def test_exported_experts_start_another_expert_plan(pool4, tmp_path):
    for r in pool4.run(_export_and_start_from_it, str(tmp_path / "export")):
        assert r["keys"] and r["error"] == 0.0
        assert r["refusal"].startswith("sharded checkpoints do not yet describe experts")


def _tensor_experts_round_trip(directory: str) -> dict:
    """Qwen2-MoE (fused gate_up_proj, shared expert) trained a step with its experts split
    over ep and tp, exported, started again from the export with weights= under tensor=2
    (experts split over tp alone), saved as a checkpoint and loaded into a third engine."""
    model, idx, target, loss_fn = build("hf-qwen2-moe")
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    engine = autopar.parallelize(model, 4, example_inputs=(idx[:2],), loss_fn=loss_fn,
                                 optimizer=opt, plan=dict(expert=2, tensor=2))
    engine.train_step((idx,), target)
    engine.export(directory)
    trained = engine.full_state_dict()
    cls, config = _hf_config("hf-qwen2-moe")
    with torch.device("meta"):
        fresh = cls(config)
    again = autopar.parallelize(fresh, 4, example_inputs=(idx[:2],), loss_fn=loss_fn,
                                optimizer=opt, plan=dict(tensor=2), weights=directory)
    state = again.full_state_dict()
    again.train_step((idx,), target)
    stepped = again.full_state_dict()
    again.save(directory + "-checkpoint")
    third = autopar.parallelize(build("hf-qwen2-moe", seed=1)[0], 4, example_inputs=(idx[:2],),
                                loss_fn=loss_fn, optimizer=opt, plan=dict(tensor=2))
    third.load(directory + "-checkpoint")
    loaded = third.full_state_dict()
    return {"keys": list(state) == list(trained) == list(loaded),
            "shares": _expert_shares(again.parameter_bytes()),
            "error": max(float((state[k] - trained[k]).abs().max()) for k in trained),
            "loaded": max(float((loaded[k] - stepped[k]).abs().max()) for k in stepped)}


def test_split_experts_export_start_and_checkpoint_whole_weights(pool4, tmp_path):
    for r in pool4.run(_tensor_experts_round_trip, str(tmp_path / "export")):
        assert r["keys"] and r["error"] == 0.0 and r["loaded"] == 0.0
        assert r["shares"] and all(share == 0.5 for share in r["shares"].values())


def test_mixtral_in_bf16_dispatches_bf16_rows(pool4):
    # bf16 compute on fp32 masters against fp32 on one device: bf16's rounding apart
    for r in pool4.run(_train, "hf-mixtral", dict(expert=2), 5, "bf16"):
        assert r["loss"] <= 1e-3 and r["weights"] <= 1e-2, (r["loss"], r["weights"])
        forward = sum(b for op, axis, phase, b in r["log"]
                      if (op, axis, phase) == ("all_to_all", "ep", "forward"))
        assert forward == _ep_rows_bytes(r["load"], 32, itemsize=2) + 2 * 4 * 8


def test_tensor_parallel_experts_in_bf16_all_reduce_bf16_rows(pool4):
    for r in pool4.run(_train, "hf-mixtral", dict(tensor=2), 5, "bf16"):
        assert r["loss"] <= 1e-3 and r["weights"] <= 1e-2, (r["loss"], r["weights"])
        assert r["measured"] == r["predicted"]  # the experts' rows all-reduced in 16 bits
        assert r["measured"][("all_reduce", "tp")] > 0


# ----------------------------------------------------------------------------------------
# One process: the substituted layers, the plan, the refusals
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["moe-tiny", "hf-mixtral", "hf-qwen2-moe"])
def test_substituted_layers_compute_what_the_original_does(name):
    model, _, _, _ = build(name)
    layers = find_moe_layers(model)
    assert len(layers) == 2
    for path, spec in layers.items():
        module = model.get_submodule(path)
        gate = model.get_submodule(path).get_parameter(spec.gate)
        with torch.no_grad():  # experts 0 and 1 tie on every token: torch.topk decides
            gate[1] = gate[0]
        x = torch.randn(3, 5, spec.hidden, requires_grad=True)
        dout = torch.randn(3, 5, spec.hidden)
        expected = module(x)
        ref_grads = torch.autograd.grad((expected * dout).sum(), [x])
        with opaque_moe(model, {path: spec}):
            got = module(x)
            with torch.no_grad():
                assert torch.equal(moe_op(x, *spec.op_args(module), spec_key(spec), False)[0],
                                   got)
        torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)
        assert "forward" not in module.__dict__  # the stand-in is gone after tracing
        # the kernel's gradients, through the engine's module, equal the original's
        layer = spec.kernel()
        out, _ = run(layer, spec, x, *spec.op_args(module), False)
        grads = torch.autograd.grad((out * dout).sum(), [x])
        torch.testing.assert_close(grads[0], ref_grads[0], rtol=TOL, atol=TOL)


def test_plan_json_carries_the_expert_axis():
    plan = Plan.from_dict(dict(expert=2, tensor=2), 8)
    assert plan.ep == 2 and plan.world_size == 8 and plan.mesh["dp"] == 4
    data = plan.to_json()
    assert data["mesh"] == {"pp": 1, "dp": 4, "cp": 1, "tp": 2, "ep": 2}
    again = Plan.from_json(data)
    assert again.ep == 2 and again.mesh == plan.mesh
    assert "ep" not in Plan.from_dict({}, 4).to_json()["mesh"]
    assert Plan.from_dict(dict(expert=dict(size=4)), 4).ep == 4


def test_ep_not_dividing_the_data_ranks_is_refused():
    with pytest.raises(PlanError, match=r"expert size 3 does not divide the data x sequence "
                                        r"ranks \(4 x 1 = 4\)"):
        Plan.from_dict(dict(expert=3), 4)
    with pytest.raises(PlanError, match="expert size must be a positive whole number"):
        Plan(mesh={"dp": 2, "ep": 0})


def _refused(name: str, plan: dict, **config) -> str:
    if name == "moe-tiny":
        model, idx, target, loss_fn = build(name)
    else:
        cls, cfg = _hf_config(name)
        for k, v in config.items():
            setattr(cfg, k, v)
        model, idx, loss_fn = cls(cfg), torch.randint(0, 64, (2, 8)), _hf_loss
    with pytest.raises(PlanError) as info:
        autopar.parallelize(model, 4, example_inputs=(idx[:2],), loss_fn=loss_fn, plan=plan)
    return str(info.value)


def test_experts_not_dividing_over_ep_are_refused():
    message = _refused("hf-mixtral", dict(expert=4), num_local_experts=6)
    assert "MoE layer model.layers.0.mlp has 6 experts, which do not split over expert size 4" \
        in message


def test_top_k_above_the_experts_is_refused():
    message = _refused("hf-mixtral", dict(expert=2), num_experts_per_tok=5)
    assert "routes each token to top_k=5 experts but has 4" in message


def test_an_expert_plan_on_a_dense_model_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                         num_attention_heads=4, intermediate_size=16))
    with pytest.raises(PlanError, match="has no MoE layer autopar runs"):
        autopar.parallelize(model, 4, example_inputs=(torch.zeros(2, 8, dtype=torch.long),),
                            loss_fn=_hf_loss, plan=dict(expert=2))


def test_zero_beside_experts_and_a_pipeline_is_refused():
    plan = Plan.from_dict(dict(expert=2, pipeline=2, zero=dict(stage=1)), 4)
    assert plan.unsupported() == ["ZeRO beside both expert parallelism and a pipeline (drop "
                                  "one of the three)"]
    assert Plan.from_dict(dict(expert=2, pipeline=2), 4).unsupported() == []
    assert Plan.from_dict(dict(expert=2, sequence=2), 4).unsupported() == [
        "expert parallelism beside a cp axis (the expert groups lie inside dp; use sequence "
        "size 1)"]


def test_per_rank_router_logits_are_refused():
    message = _refused("hf-mixtral", dict(expert=2), output_router_logits=True)
    assert "set config.output_router_logits=False" in message
