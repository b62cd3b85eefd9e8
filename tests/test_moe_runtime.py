"""Expert parallelism in the engine: MoE layers split over an ep axis inside the data ranks.

The zoo's moe-tiny (with its balance loss in the objective; also with a dense first block
and a shared expert, as DeepSeek-V3's) and transformers' Mixtral and
Qwen2-MoE (shared expert) train equal to one device, losses and weights within 1e-5 over 3
AdamW steps, at expert 2 and 4 with data and tensor parallelism, ZeRO 1-3, pipelines (the
balance loss under gpipe) and beside context parallelism (ep inside dp x cp); the
all-to-alls are logged
on axis "ep" with the bytes the step's measured routing implies; each substituted module
computes what the original does; bad plans are refused in one sentence. Checkpoints of
split experts (their ZeRO pieces over edp) load under another expert size, without ep and
under tensor parallelism, and train on as one device; a meta Mixtral started from its own
initialization or from a save_pretrained directory (the Hub's one tensor per expert) keeps
only its experts (under ZeRO-3 its pieces of them) and trains as one device.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn.functional as F
from equivalence import assert_equal_to_one_device, compare
from pretraced import engine_graphs, forked_pool_fixture, pretracing
from torch import nn

import autopar
from autopar.errors import PlanError
from autopar.kernels.moe_layers import find_moe_layers, moe_op, opaque_moe, run, spec_key
from autopar.models import build as zoo_build
from autopar.plans import Plan

# worlds forked from the test process once `pretraced` traced every model here (where the
# world's size is not the point: 2)
pool2 = forked_pool_fixture(2)
pool4 = forked_pool_fixture(4)
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


def _hf_config(name: str, layers: int = 2):
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32)
    if name == "hf-mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        return MixtralForCausalLM, MixtralConfig(intermediate_size=16, num_local_experts=4,
                                                 num_experts_per_tok=2, **common)
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM, Qwen2MoeConfig(
        intermediate_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, **common)


# moe-tiny's shapes with 3 blocks, the first dense (as DeepSeek-V3's first three), a shared
# expert in the MoE blocks
DENSE_FIRST = ("moe:layers=3,hidden=64,heads=8,kv_heads=4,ffn=32,experts=8,top_k=2,vocab=256,"
               "seq=32,shared_ffn=32,dense=1")


def build(name: str, seed: int = 0, layers: int = 2):
    """(model, idx, target, loss_fn) on the CPU, the same for a seed (`layers`: a
    transformers model's)."""
    torch.manual_seed(seed)
    if name in ("moe-tiny", DENSE_FIRST):
        model, (idx,) = zoo_build(name, batch=BATCH, device="cpu", seed=seed)
        idx = torch.randint(0, 256, (BATCH, 8))
        return WithAux(model), idx, torch.randint(0, 256, (BATCH, 8)), _zoo_loss
    cls, config = _hf_config(name, layers)
    model = cls(config)
    for p in model.parameters():  # transformers leaves some at zero (a router): draw them all
        nn.init.normal_(p, std=0.1)
    idx = torch.randint(0, 64, (BATCH, 8))
    return model, idx, torch.randint(0, 64, (BATCH, 8)), _hf_loss


@pytest.fixture(scope="module")
def pretraced():
    """Every graph the module's ranks start, traced here once (they are forked after it):
    each model with its MoE layers opaque (every plan that splits experts), Mixtral also
    whole (a plan that splits none) and on meta, Qwen2-MoE on meta, and moe-tiny's training
    graph under a loss that squares its balance loss."""
    with pretracing():
        for name, layers in (("hf-mixtral", 2), ("hf-mixtral", 4), ("hf-qwen2-moe", 2),
                             ("moe-tiny", 2), (DENSE_FIRST, 2)):
            model, idx, target, loss_fn = build(name, layers=layers)
            engine_graphs(model, (idx,), target, loss_fn, dict(expert=2), 4)
        model, idx, target, _ = build("moe-tiny")
        engine_graphs(model, (idx,), target, _squared_loss, dict(expert=2), 4)
        mixtral, idx, target, _ = build("hf-mixtral")
        engine_graphs(mixtral, (idx,), target, _hf_loss, None, 4)
        for name in ("hf-mixtral", "hf-qwen2-moe"):
            cls, config = _hf_config(name)
            with torch.device("meta"):
                meta = cls(config)
            engine_graphs(meta, (idx,), target, _hf_loss, dict(expert=2), 4)
        yield


def _relative(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _train(name: str, plan: dict, steps: int = 3, precision: str = "fp32",
           layers: int = 2) -> dict:
    """On every rank: autopar under `plan` (and `precision`) and one device in fp32, side by
    side (equivalence.compare), with the first step's log and expert load."""
    def built(batch: int):
        model, idx, target, loss_fn = build(name, layers=layers)
        return model, (idx,), target, loss_fn

    result = compare(built, plan, steps=steps, batch=BATCH, probe=_first_step,
                     precision=precision)
    return {**result, **result["probe"]}


def _first_step(engine, inputs, target) -> dict:
    return {"log": [(r.op, r.axis, r.phase, r.bytes) for r in engine.comm_log],
            "load": engine.expert_load()}


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
    # every collective's bytes per (op, axis) as predicted from the routing taken
    assert_equal_to_one_device(results, TOL)
    for r in results:
        assert r["noise_abs"] <= TOL, r["noise_abs"]
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


# (moe-tiny at expert 2: the dense-first model below is moe-tiny's MoE blocks at expert 2,
# with a dense block and a shared expert besides; its ZeRO stages are trained further down)
def test_zoo_moe_equals_one_device(pool4):
    _check(pool4.run(_train, "moe-tiny", dict(expert=4)), 64, 4)


def test_zoo_moe_with_a_dense_first_layer_equals_one_device(pool4):
    results = pool4.run(_train, DENSE_FIRST, dict(expert=2))
    _check(results, 64, 2)
    # the MoE blocks run over ep; the dense block has no router and no all-to-all
    for r in results:
        assert sorted(name.rpartition("blocks.")[2] for name in r["load"]) == ["1.moe", "2.moe"]


# (Mixtral at plain expert 2 over edp 2: the same dispatch and edp sums as the zoo's
# dense-first model at expert 2; Mixtral's own blocks at expert 2 train below under ZeRO-3,
# a pipeline, bf16 and beside cp, and reload from checkpoints under expert 2)
def test_mixtral_equals_one_device(pool4):
    _check(pool4.run(_train, "hf-mixtral", dict(expert=2, tensor=2)), 32, 2, 2)


def test_mixtral_expert_4_equals_one_device(pool4):
    _check(pool4.run(_train, "hf-mixtral", dict(expert=4)), 32, 4)


@pytest.mark.parametrize("plan", [dict(expert=4), dict(expert=2, tensor=2)])
def test_qwen2_moe_with_shared_expert_equals_one_device(pool4, plan):
    _check(pool4.run(_train, "hf-qwen2-moe", plan), 32, plan["expert"], plan.get("tensor", 1))


def test_zoo_moe_with_tensor_2_equals_one_device(pool4):
    _check(pool4.run(_train, "moe-tiny", dict(expert=2, tensor=2)), 64, 2, 2)


# ep beside cp: the ep groups lie inside dp x cp (at expert 2 beside cp 2 on 2 ranks, the cp
# pair; at 4, all four of dp 2 x cp 2; beside cp 4, no dp, two ep groups averaged over edp),
# each rank routes its own tokens of the sequence, the balance loss's statistics are summed
# over dp x cp (Ulysses beside ep: Mixtral's expert 4 case below)
@pytest.mark.parametrize("plan, world", [(dict(expert=2, sequence=dict(size=2, mode="ring")), 2),
                                         (dict(expert=4, sequence=dict(size=2, mode="ring")), 4),
                                         (dict(expert=2, sequence=dict(size=4, mode="ring")), 4)])
def test_zoo_moe_beside_cp_equals_one_device(request, plan, world):
    pool = request.getfixturevalue(f"pool{world}")
    _check(pool.run(_train, "moe-tiny", plan), 64, plan["expert"])


@pytest.mark.parametrize("plan, world", [
    (dict(expert=2, sequence=dict(size=2, mode="ring")), 2),
    (dict(expert=4, sequence=dict(size=2, mode="ulysses")), 4)])
def test_mixtral_beside_cp_equals_one_device(request, plan, world):
    pool = request.getfixturevalue(f"pool{world}")
    _check(pool.run(_train, "hf-mixtral", plan), 32, plan["expert"])


# experts split over tp alone (no ep axis): the same kernel, nothing dispatched; on 2 ranks,
# as a dp axis beside it adds nothing to the experts (moe-tiny: at tensor 4 below)
@pytest.mark.parametrize("name,hidden", [("hf-mixtral", 32), ("hf-qwen2-moe", 32)])
def test_tensor_parallel_experts_equal_one_device(pool2, name, hidden):
    _check(pool2.run(_train, name, dict(tensor=2)), hidden, 1, 2)


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


def test_mixtral_with_zero_3_equals_one_device(pool4):
    # experts' pieces over edp (2 ranks), the rest over dp (4), gathered layer by layer
    results = pool4.run(_train, "hf-mixtral", dict(expert=2, zero=dict(stage=3)))
    _check(results, 32, 2)
    axes = {(op, axis) for op, axis, _, _ in results[0]["log"]}
    assert {("reduce_scatter", "edp"), ("all_gather", "edp"), ("reduce_scatter", "dp")} <= axes


# (Qwen2-MoE at expert 2 in a plain pipeline: Mixtral's above is the same plan; Qwen2-MoE's
# shared expert in a pipeline trains under tensor 2 and under ZeRO-3 with expert 2)


# ZeRO beside ep 2 and a pipeline, pp 2 x dp 2, ep 2 inside dp: the experts' pieces over
# edp (one rank, divided by ep), the rest over dp; stage 1 under gpipe (moe-tiny's balance
# loss, below), stage 2 reduce-scatters per micro-batch (ZB-V), stage 3 gathers per stage
# (interleaved, and Qwen2-MoE's shared expert under 1F1B), each with these axes checked
def _check_zero_beside_pp(results: list[dict], hidden: int = 32) -> None:
    _check(results, hidden, 2)
    for r in results:
        axes = {(op, axis) for op, axis, _, _ in r["log"]}
        assert {("reduce_scatter", "dp"), ("all_gather", "dp")} <= axes
        # the experts' group here is one rank: ZeRO copies its pieces, nothing on edp
        assert not {a for a in axes if a[1] == "edp"}


@pytest.mark.parametrize("pipeline,stage", [(dict(schedule="zero_bubble"), 2),
                                            (dict(schedule="interleaved", chunks=2), 3)])
def test_mixtral_with_zero_beside_two_stages_per_rank_equals_one_device(pool4, pipeline, stage):
    # 4 stages on 2 pipeline ranks (4 layers): ZB-V's split backward, interleaved's chunks
    plan = dict(expert=2, pipeline=dict(size=2, microbatches=2, **pipeline),
                zero=dict(stage=stage))
    _check_zero_beside_pp(pool4.run(_train, "hf-mixtral", plan, 3, "fp32", 4))


def test_qwen2_moe_with_zero_3_and_pipeline_2_equals_one_device(pool4):
    # pp 2 x dp 2 as the interleaved Mixtral above at stage 3, the shared expert's pieces
    # over dp
    plan = dict(expert=2, pipeline=dict(size=2, microbatches=2, schedule="1f1b"),
                zero=dict(stage=3))
    _check_zero_beside_pp(pool4.run(_train, "hf-qwen2-moe", plan))


# (without ZeRO: the correction is the runner's, whatever ZeRO does to the gradients after)
@pytest.mark.parametrize("plan", [
    dict(expert=2, pipeline=dict(size=2, microbatches=4, schedule="gpipe"), zero=dict(stage=1)),
    dict(expert=2, pipeline=dict(size=2, microbatches=2, schedule="gpipe"), zero=dict(stage=3)),
])
def test_zoo_moe_balance_loss_under_gpipe_equals_one_device(pool4, plan):
    # each micro-batch's balance loss differs from the whole batch's; its backward takes the
    # step's statistics (every forward of a stage runs first) and the reported loss is
    # corrected from them after the schedule
    _check_zero_beside_pp(pool4.run(_train, "moe-tiny", plan), 64)


def _balance_loss_in_a_pipeline(schedule: str) -> str:
    model, idx, target, loss_fn = build("moe-tiny")
    try:
        autopar.parallelize(model, 4, example_inputs=(idx[:2],), loss_fn=loss_fn,
                            plan=dict(expert=2, pipeline=dict(size=2, microbatches=2,
                                                              schedule=schedule)))
    except PlanError as e:
        return str(e)
    return "built"


def _squared_loss(out, target):  # not a constant times the balance loss
    return _zoo_loss(out, target) + out[1] ** 2


def _squared_balance_loss_under_gpipe() -> str:
    model, idx, target, _ = build("moe-tiny")
    engine = autopar.parallelize(model, 4, example_inputs=(idx[:2],), loss_fn=_squared_loss,
                                 plan=dict(expert=2, pipeline=dict(size=2, microbatches=2,
                                                                   schedule="gpipe")))
    try:
        engine.train_step((idx,), target)
    except PlanError as e:
        return str(e)
    return "trained"


def test_a_balance_loss_weighed_by_more_than_a_constant_is_refused(pool4):
    for message in pool4.run(_squared_balance_loss_under_gpipe):
        assert message.startswith("the loss weighs the MoE balance loss by something other "
                                  "than a constant"), message


def test_a_balance_loss_in_a_pipeline_other_than_gpipe_is_refused(pool4):
    for message in pool4.run(_balance_loss_in_a_pipeline, "1f1b"):
        assert message.startswith("the model's MoE balance loss is a sum over the whole batch, "
                                  "which a pipeline takes exactly only under the gpipe "
                                  "schedule"), message
        assert "not 1f1b" in message


def _export_then_start(name: str, plan: dict, again_plan: dict, directory: str):
    """`name` trained a step under `plan`, exported to `directory`, and started again on
    meta from the export under `again_plan`: (engine again, its weights, the trained ones,
    the batch, the loss and optimizer)."""
    model, idx, target, loss_fn = build(name)
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    engine = autopar.parallelize(model, 4, example_inputs=(idx[:2],), loss_fn=loss_fn,
                                 optimizer=opt, plan=plan)
    engine.train_step((idx,), target)
    engine.export(directory)
    trained = engine.full_state_dict()
    cls, config = _hf_config(name)
    with torch.device("meta"):
        fresh = cls(config)
    again = autopar.parallelize(fresh, 4, example_inputs=(idx[:2],), loss_fn=loss_fn,
                                optimizer=opt, plan=again_plan, weights=directory)
    return again, again.full_state_dict(), trained, (idx, target), loss_fn, opt


def _export_and_start_from_it(directory: str) -> dict:
    _, state, trained, _, _, _ = _export_then_start("hf-mixtral", dict(expert=2),
                                                    dict(expert=4), directory)
    return {"keys": list(state) == list(trained),
            "error": max(float((state[k] - trained[k]).abs().max()) for k in trained)}


def _batch(step: int):
    """The global batch of a training step, the same for every run that reaches it."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 64, (BATCH, 8), generator=gen), \
        torch.randint(0, 64, (BATCH, 8), generator=gen)


def _mixtral_engine(plan: dict, seed: int = 0):
    model, idx, _, loss_fn = build("hf-mixtral", seed)
    return autopar.parallelize(model, 4, example_inputs=(idx[:2],), loss_fn=loss_fn,
                               plan=plan, optimizer=functools.partial(torch.optim.AdamW,
                                                                      lr=1e-3, eps=1e-5))


def _mixtral_reference(steps: int) -> list[dict]:
    """One device, uninterrupted: the loss and the weights after each step."""
    model, _, _, loss_fn = build("hf-mixtral")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5)
    out = []
    for s in range(steps):
        x, y = _batch(s)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        out.append({"loss": loss.item(),
                    "weights": {k: v.clone() for k, v in model.state_dict().items()}})
    return out


def _experts_save(plan: dict, steps: int, root: str) -> list[float]:
    engine = _mixtral_engine(plan)
    losses = [engine.train_step(*_batch(s)) for s in range(steps)]
    engine.save(root)
    return losses


def _experts_load(plan: dict, root: str, steps: int, resaved: str) -> dict:
    """An engine from other weights under `plan` loads the checkpoint, saves it again at once
    (the round trip through this plan) and trains on from the loaded step."""
    engine = _mixtral_engine(plan, seed=1)
    engine.load(root)
    start = engine.steps
    engine.save(resaved)
    losses = [engine.train_step(*_batch(s)) for s in range(start, start + steps)]
    return {"start": start, "losses": losses, "full": engine.full_state_dict()}


def _same_checkpoint(a: str, b: str) -> None:
    from autopar.runtime.checkpoint import load_full_optimizer_state, load_full_state_dict

    wa, wb = load_full_state_dict(a), load_full_state_dict(b)
    assert list(wa) == list(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = load_full_optimizer_state(a), load_full_optimizer_state(b)
    assert set(sa) == set(sb)
    for name, per in sa.items():
        assert set(per) == set(sb[name])
        for key, v in per.items():
            assert torch.equal(v, sb[name][key]) if isinstance(v, torch.Tensor) \
                else v == sb[name][key], (name, key)


# Saved by a pipeline that trained (each stage's experts over ep 2); then each plan loads
# the checkpoint the plan before it saved again, so every layout is both read and written:
# experts split over ep 2 and 4, whole (no ep), cut over tp beside ep and alone, their ZeRO-1
# and ZeRO-3 pieces over edp (ZeRO-2 saves ZeRO-1's layout: its gradient pieces are not
# state), a pipeline's stages before their first step (the state held for them).
SAVED = dict(expert=2, pipeline=dict(size=2, microbatches=2))
# (Plain ep 2 and ep 4 hold the experts as ep 2 inside the pipeline's stages and ep 4 under
# ZeRO-1 do, their moments whole as beside tp 2.)
RELOADED = [dict(expert=4, zero=dict(stage=3)), {}, dict(expert=2, tensor=2),
            dict(expert=2, zero=dict(stage=3)), dict(expert=4, zero=dict(stage=1)),
            dict(tensor=2), dict(expert=2, tensor=2, zero=dict(stage=3)), SAVED]


def test_expert_checkpoint_loads_under_another_plan(pool4, tmp_path):
    """Experts split over ep (each rank's block of dim 0, their ZeRO pieces over edp) are
    saved as boxes of the whole stacked weights: the checkpoint holds one device's weights,
    reloads bit-equal under every plan, and training continues as one uninterrupted run.
    A meta model started from it (weights=) under expert 4 and ZeRO-3 holds only its pieces
    of the experts and trains as one device."""
    from autopar.runtime.checkpoint import load_full_state_dict

    before, after = 2, 1  # the step after the load runs on the loaded AdamW moments
    root = str(tmp_path / "ckpt")
    ref = _mixtral_reference(before + after)
    for losses in pool4.run(_experts_save, SAVED, before, root):
        for got, want in zip(losses, ref):
            assert abs(got - want["loss"]) <= TOL * abs(want["loss"])
    weights = load_full_state_dict(root)
    # (and the rotary table, a buffer state_dict leaves out)
    assert [k for k in weights if k in ref[0]["weights"]] == list(ref[0]["weights"])
    assert max(_relative(weights[k], v) for k, v in ref[before - 1]["weights"].items()
               if v.dtype.is_floating_point) <= TOL
    final, source = ref[-1]["weights"], root
    for i, plan in enumerate(RELOADED):
        resaved = str(tmp_path / f"resaved-{i}")
        for r in pool4.run(_experts_load, plan, source, after, resaved):
            assert r["start"] == before, plan
            for got, want in zip(r["losses"], ref[before:]):
                assert abs(got - want["loss"]) <= TOL * abs(want["loss"]), (plan, got, want)
            assert list(r["full"]) == list(final)
            assert max(_relative(r["full"][k], v) for k, v in final.items()
                       if v.dtype.is_floating_point) <= TOL, plan
        _same_checkpoint(root, resaved)
        source = resaved
    _check_meta_start(pool4.run(_meta_start, dict(expert=4, zero=dict(stage=3)), root))


def _meta_start(plan: dict, weights: str | None, seed: int = 3, steps: int = 2) -> dict:
    """Mixtral built on meta and started under `plan` from `weights` (a save_pretrained
    directory) or, without, from its own initialization under `seed`, beside one device
    (from_pretrained, or the same construction seeded alike) over AdamW steps."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from autopar.runtime.checkpoint import load_full_state_dict

    cls, config = _hf_config("hf-mixtral")
    if weights is not None and os.path.exists(os.path.join(weights, "latest")):
        reference = cls(config)  # an autopar checkpoint: its weights, read whole
        stored = load_full_state_dict(weights)
        reference.load_state_dict({k: stored[k] for k in reference.state_dict()})
    elif weights is not None:
        reference = cls.from_pretrained(weights)
    else:
        torch.manual_seed(seed)
        reference = cls(config)
    with torch.device("meta"):
        meta = cls(config)
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    engine = autopar.parallelize(meta, 4, example_inputs=(torch.zeros(2, 8, dtype=torch.long),),
                                 loss_fn=_hf_loss, optimizer=opt, plan=plan, weights=weights,
                                 seed=None if weights is not None else seed)
    # what a rank keeps: ZeRO-3's pieces (the experts' over edp), no whole parameter
    zero = engine.zero
    held = sum({StorageWeakRef(t.untyped_storage()).cdata: t.untyped_storage().nbytes()
                for t in list(engine.parameters()) + list(getattr(zero, "shards", ()))
                }.values())
    experts = zero.parts[1] if zero is not None else None
    ref_state = reference.state_dict()
    full = engine.full_state_dict()
    differ = [k for k in ref_state if not torch.equal(full[k], ref_state[k])]
    ref_opt = opt(reference.parameters())
    losses = []
    for s in range(steps):
        x, y = _batch(s)
        loss = engine.train_step((x,), y)
        ref_opt.zero_grad()
        ref_loss = _hf_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        losses.append(abs(loss - ref_loss.item()) / abs(ref_loss.item()))
    full, ref_state = engine.full_state_dict(), reference.state_dict()
    return {"keys": list(full) == list(ref_state), "differ": differ, "loss": max(losses),
            "weights": max(_relative(full[k], v) for k, v in ref_state.items()
                           if v.dtype.is_floating_point),
            "held": held, "model": sum(t.numel() * t.element_size()
                                       for t in ref_state.values()),
            "expert_pieces": [s.numel() for s in experts.shards] if experts else None,
            "experts": [ref_state[engine.params.name_of(p)].numel() for p in experts.params]
            if experts else None}


def _check_meta_start(results: list[dict], pieces: int = 4) -> None:
    """As one device; under ZeRO-3 each rank holds its 1/`pieces` of each expert weight."""
    for r in results:
        assert r["keys"] and r["differ"] == [], r["differ"]
        assert r["loss"] <= TOL and r["weights"] <= TOL, (r["loss"], r["weights"])
        if r["experts"] is None:
            continue
        # each expert weight: a quarter (ep 2 and edp 2, or ep 2 and tp 2) on every rank
        assert r["experts"] and all(pieces * k == n for k, n in zip(r["expert_pieces"],
                                                                   r["experts"]))
        assert r["held"] <= r["model"] / pieces + 1024, (r["held"], r["model"])


def test_zero_3_from_pretrained_weights_equals_from_pretrained(pool4, tmp_path):
    model, _, _, _ = build("hf-mixtral")
    model.save_pretrained(tmp_path / "pretrained")  # the Hub's layout: one tensor per expert
    _check_meta_start(pool4.run(_meta_start, dict(expert=2, zero=dict(stage=3)),
                                str(tmp_path / "pretrained")))


# (a meta model started from a checkpoint of split experts: test_expert_checkpoint_loads_under_another_plan)


# (expert 2 under ZeRO-3 alone: the seeded pieces as under tensor 2 below; pieces over an edp
# of 2 started from weights in the two tests above)
@pytest.mark.parametrize("plan, pieces", [
    (dict(expert=2, tensor=2, zero=dict(stage=3)), 4),  # ep 2 x tp 2 (FFN), edp 1
    (dict(expert=2, pipeline=dict(size=2, microbatches=2)), None),
])
def test_a_meta_model_with_experts_equals_the_seeded_build(pool4, plan, pieces):
    _check_meta_start(pool4.run(_meta_start, plan, None), pieces)


def test_exported_experts_start_another_expert_plan(pool4, tmp_path):
    for r in pool4.run(_export_and_start_from_it, str(tmp_path / "export")):
        assert r["keys"] and r["error"] == 0.0


def _tensor_experts_round_trip(directory: str) -> dict:
    """Qwen2-MoE (fused gate_up_proj, shared expert) trained a step with its experts split
    over ep and tp, exported, started again from the export with weights= under tensor=2
    (experts split over tp alone), saved as a checkpoint, stepped on and loaded back (its
    weights moved by the step after the save: the load puts every one back)."""
    again, state, trained, (idx, target), _, _ = _export_then_start(
        "hf-qwen2-moe", dict(expert=2, tensor=2), dict(tensor=2), directory)
    again.train_step((idx,), target)
    stepped = again.full_state_dict()
    again.save(directory + "-checkpoint")
    again.train_step((idx,), target)
    moved = again.full_state_dict()
    again.load(directory + "-checkpoint")
    loaded = again.full_state_dict()
    return {"keys": list(state) == list(trained) == list(loaded),
            "shares": _expert_shares(again.parameter_bytes()),
            "error": max(float((state[k] - trained[k]).abs().max()) for k in trained),
            "loaded": max(float((loaded[k] - stepped[k]).abs().max()) for k in stepped),
            "moved": min(float((moved[k] - stepped[k]).abs().max()) for k in stepped
                         if stepped[k].dtype.is_floating_point and ".experts." in k)}


def test_split_experts_export_start_and_checkpoint_whole_weights(pool4, tmp_path):
    for r in pool4.run(_tensor_experts_round_trip, str(tmp_path / "export")):
        assert r["keys"] and r["error"] == 0.0 and r["loaded"] == 0.0 and r["moved"] > 0
        assert r["shares"] and all(share == 0.5 for share in r["shares"].values())


def test_mixtral_in_bf16_dispatches_bf16_rows(pool2):
    # bf16 compute on fp32 masters against fp32 on one device: bf16's rounding apart
    for r in pool2.run(_train, "hf-mixtral", dict(expert=2), 3, "bf16"):
        assert r["loss"] <= 1e-3 and r["weights"] <= 1e-2, (r["loss"], r["weights"])
        forward = sum(b for op, axis, phase, b in r["log"]
                      if (op, axis, phase) == ("all_to_all", "ep", "forward"))
        assert forward == _ep_rows_bytes(r["load"], 32, itemsize=2) + 2 * 4 * 8


def test_tensor_parallel_experts_in_bf16_all_reduce_bf16_rows(pool2):
    for r in pool2.run(_train, "hf-mixtral", dict(tensor=2), 3, "bf16"):
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


@pytest.mark.parametrize("name", ["hf-mixtral", "hf-qwen2-moe"])
def test_weights_stored_one_tensor_per_expert_read_as_the_stacked_weights(name, tmp_path):
    """save_pretrained writes the Hub's layout (experts.{e}.w1/w3/w2 under Mixtral's
    block_sparse_moe, or gate_proj/up_proj/down_proj): weights= reads it as the model's
    stacked gate_up_proj and down_proj, any region of them, and refuses nothing."""
    from autopar.runtime.startup import check_weights

    model, _, _, _ = build(name)
    model.save_pretrained(tmp_path)
    source = check_weights(model, str(tmp_path))
    state = model.state_dict()
    assert set(source.keys()) <= set(state) and not any(".experts.0." in k
                                                        for k in source.keys())
    for k, v in state.items():
        if k in source:
            assert torch.equal(source.read(k), v), k
    layer = "model.layers.1.mlp.experts."
    whole = state[layer + "gate_up_proj"]  # experts 1, 2; rows across w1 and w3
    got = source.read_grid(layer + "gate_up_proj", [[slice(1, 3)], [slice(3, 5),
                                                                    slice(14, 20)]])
    assert torch.equal(got, torch.cat([whole[1:3, 3:5], whole[1:3, 14:20]], 1))
    assert source.read(layer + "down_proj", (slice(3, 4), slice(0, 0))).shape == (1, 0, 16)


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


def test_zero_beside_experts_and_a_pipeline_runs():
    from autopar.modes import Capabilities

    for stage in (1, 2, 3):
        plan = Plan.from_dict(dict(expert=2, pipeline=2, zero=dict(stage=stage)), 4)
        assert plan.unsupported() == []
        # a runtime without it says so
        assert plan.unsupported(Capabilities(expert_zero_with_pp=(0,))) == [
            "ZeRO beside both expert parallelism and a pipeline (drop one of the three)"]
    assert Plan.from_dict(dict(expert=2, pipeline=2), 4).unsupported() == []
    # and the search may propose them
    from types import SimpleNamespace

    from autopar.modes import RUNTIME
    from autopar.search.space import Space

    zeros = [(z, False, None) for z in (0, 1, 2, 3)]  # (stage, offload, no HSDP shard)
    assert Space.expert_zero_options(SimpleNamespace(caps=RUNTIME), {"pp": 2}, zeros) == zeros
    assert Space.expert_zero_options(SimpleNamespace(caps=RUNTIME), {"pp": 1, "cp": 2},
                                     zeros) == zeros


def test_experts_beside_cp_run_with_tensor_pipeline_and_zero():
    """(Trained equal to one device in tests/test_cp_combos.py.)"""
    from types import SimpleNamespace

    from autopar.modes import RUNTIME, Capabilities
    from autopar.search.space import Space

    for ep in (2, 4):
        assert Plan.from_dict(dict(expert=ep, sequence=2), 4).unsupported() == []
    extras = ("tensor, pipeline or ZeRO beside both expert parallelism and a cp axis (ep "
              "beside cp runs with data and sequence ranks alone)")
    for more in (dict(tensor=2), dict(pipeline=2), dict(zero=dict(stage=1))):
        plan = Plan.from_dict(dict(expert=2, sequence=2, **more), 8)
        assert plan.unsupported() == [], more
        # a runtime without it says so
        assert plan.unsupported(Capabilities(expert_cp_extras=False)) == [extras], more
    assert Plan.from_dict(dict(expert=2, sequence=2), 4).unsupported(
        Capabilities(expert_with_cp=False)) == [
        "expert parallelism beside a cp axis (the expert groups lie inside dp; use sequence "
        "size 1)"]
    # the search proposes ep dividing dp x cp beside cp, beside a tensor axis there too
    space = SimpleNamespace(caps=RUNTIME, expert_counts=lambda: {8}, c=SimpleNamespace(ep=None))
    assert Space.ep_sizes(space, {"dp": 2, "cp": 2, "tp": 1, "pp": 1}) == [1, 2, 4]
    assert Space.ep_sizes(space, {"dp": 2, "cp": 2, "tp": 2, "pp": 1}) == [1, 2, 4]


def test_per_rank_router_logits_are_refused():
    message = _refused("hf-mixtral", dict(expert=2), output_router_logits=True)
    assert "set config.output_router_logits=False" in message
