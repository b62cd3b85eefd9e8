"""Gradient accumulation without a pipeline: a plan with pp 1 and `microbatches` m runs each
data-parallel replica's batch as m micro-batches, forward and backward each, the gradients
summed and reduced over dp once per step (ZeRO-2/3: reduce-scattered per micro-batch, as
`autopar.cost.step.dp_time` prices them). Each case trains 2 AdamW steps equal to one device
on the whole batch (losses and weights within 1e-4 relative, fp32) with every collective's
bytes as `engine.predicted_comm` says; a micro-batch saves about 1/m of the batch's
activations."""

import pytest
import torch
from equivalence import assert_equal_to_one_device, build, compare
from pretraced import forked_pool_fixture, mixtral, moe

import autopar
from autopar.errors import PlanError
from autopar.modes import RUNTIME
from autopar.plans import Plan
from autopar.runtime.measure import measure_peak_saved_activations

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"
# each world forked from the test process once it traced the world's models (tests/pretraced.py)
pool2 = forked_pool_fixture(2, [GPT, LLAMA, (mixtral, {"expert": 2, "microbatches": 2}),
                                (moe("moe-tiny"), {"expert": 2})])
pool4 = forked_pool_fixture(4, [LLAMA])


def _equal_after(model: str, plan: dict, batch: int = 8) -> dict:
    """Two steps (the second runs Adam on the first's state) beside one device; under
    "last", the last step's collectives counted per (op, axis) and the micro-batch count."""
    return compare(model, plan, 2, batch, last=lambda engine: _last_step(engine, batch))


STEP = ("forward", "backward", "step")  # not "state": compare's full_state_dict after it


def _last_step(engine, batch: int) -> dict:
    counts = {}
    for r in engine.comm_log.records:  # compare clears the log before each step
        if r.phase in STEP:
            counts[(r.op, r.axis)] = counts.get((r.op, r.axis), 0) + 1
    return {"microbatches": engine.microbatches, "counts": counts,
            "measured": engine.comm_log.totals(phases=STEP),
            "predicted": engine.predicted_comm(batch)}


def _counts(model: str, plan: dict, batch: int = 8) -> dict:
    """One warm-up step, then one step's collectives counted per (op, axis), and the
    engine's micro-batch count."""
    import torch.distributed as dist

    m, inputs, target, loss_fn = build(model, batch)
    engine = autopar.parallelize(m, dist.get_world_size(),
                                 example_inputs=tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), plan=plan)
    engine.train_step(inputs, target)
    engine.comm_log.clear()
    engine.train_step(inputs, target)
    return _last_step(engine, batch)


def test_data_parallel_with_four_micro_batches_equals_one_device(pool2):
    """One run: equal to one device, and its second step's collectives counted."""
    results = pool2.run(_equal_after, GPT, {"data": 2, "microbatches": 4})
    assert_equal_to_one_device(results)
    for r in (r["last"] for r in results):
        assert r["microbatches"] == 4
        assert r["measured"] == r["predicted"]
        # the gradients' all-reduce once per step, however many micro-batches
        grads = sum(1 for op, axis in r["counts"] if (op, axis) == ("all_reduce", "dp"))
        assert grads == 1, r["counts"]


def test_tensor_parallel_with_micro_batches_equals_one_device(pool2):
    assert_equal_to_one_device(pool2.run(_equal_after, LLAMA, {"tensor": {"size": 2, "mode": "1d"},
                                                  "microbatches": 2}))


def test_megatron_sp_with_micro_batches_equals_one_device(pool2):
    assert_equal_to_one_device(pool2.run(_equal_after, LLAMA, {
        "tensor": {"size": 2, "mode": "1d", "sequence_parallel": True},
        "pipeline": {"size": 1, "microbatches": 2}}))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_micro_batches_equals_one_device(pool2, stage):
    plan = {"data": 2, "zero": {"stage": stage}, "microbatches": 4}
    results = pool2.run(_equal_after, GPT, plan)  # also counts its last step's collectives
    assert_equal_to_one_device(results)
    one = pool2.run(_counts, GPT, {"data": 2, "zero": {"stage": stage}})
    for a, b in zip(one, (r["last"] for r in results)):
        assert b["measured"] == b["predicted"]
        rs = ("reduce_scatter", "dp")
        # ZeRO-1 reduce-scatters the summed gradients once a step; ZeRO-2 and 3 each
        # micro-batch's, as the plan prices them (dp_time: m x reduce-scatter)
        assert b["measured"][rs] == (4 if stage >= 2 else 1) * a["measured"][rs]
        assert b["counts"][rs] == (4 if stage >= 2 else 1) * a["counts"][rs]


# One engine per micro-batch count serves both tests below (they measure the same
# engines two ways); a test run alone builds its own.
_MICRO: dict[int, dict] = {}


def _micro(m: int) -> dict:
    """GPT on one process with `m` micro-batches: the most bytes autograd holds saved in its
    second step, and engine.explain()'s report after it."""
    if m not in _MICRO:
        model, inputs, target, loss_fn = build(GPT, 8)
        engine = autopar.parallelize(model, 1, example_inputs=tuple(t[:2] for t in inputs),
                                     loss_fn=loss_fn, optimizer=None,
                                     plan={"microbatches": m})
        engine.train_step(inputs, target)  # traces and builds the training graph
        params = list(engine.parameters())
        peak = measure_peak_saved_activations(lambda: engine.train_step(inputs, target),
                                              exclude=params, inputs=inputs)
        _MICRO[m] = {"peak": peak, "microbatches": engine.microbatches,
                     "explain": engine.explain(format="json")}
    return _MICRO[m]


def test_a_micro_batch_saves_about_one_mth_of_the_batch():
    whole = _micro(1)
    assert whole["microbatches"] == 1
    for m in (2, 4):
        part = _micro(m)
        assert part["microbatches"] == m
        assert abs(part["peak"] * m / whole["peak"] - 1) <= 0.1, (m, part["peak"], whole["peak"])


def test_explain_measures_activations_per_micro_batch():
    """engine.explain() reports the saved bytes of one micro-batch per layer, as the plan
    prices them, and names the micro-batches."""
    rows = {}
    for m in (1, 4):
        data = _micro(m)["explain"]
        assert data["microbatches"] == m
        rows[m] = {r["name"]: r for r in data["layers"]}
    blocks = [n for n in rows[1] if n.startswith("blocks.")]
    assert blocks
    for name in blocks:
        whole = rows[1][name]["measured"]["activation_bytes"]
        part = rows[4][name]["measured"]["activation_bytes"]
        assert abs(4 * part / whole - 1) <= 0.1, (name, part, whole)
        planned = rows[4][name]["predicted"]["activation_bytes"]
        assert abs(4 * planned / rows[1][name]["predicted"]["activation_bytes"] - 1) <= 0.01


def test_plans_with_micro_batches_and_no_pipeline_run():
    plan = Plan.from_dict({"data": 2, "microbatches": 4}, 2)
    assert plan.mesh["pp"] == 1 and plan.pipeline.microbatches == 4
    assert plan.unsupported() == []
    assert Plan.from_dict({"pipeline": {"size": 1, "microbatches": 4}}, 2).unsupported() == []
    assert Plan.from_dict({"pipeline": 2, "microbatches": 4}, 2).pipeline.microbatches == 4
    with pytest.raises(PlanError, match="disagree"):
        Plan.from_dict({"microbatches": 4, "pipeline": {"microbatches": 2}}, 2)
    with pytest.raises(PlanError, match="microbatches must be a positive whole number"):
        Plan.from_dict({"microbatches": 0}, 2)
    # a runtime without accumulation refuses it in words that say what to choose instead
    from dataclasses import replace

    missing = plan.unsupported(replace(RUNTIME, accumulation=False))
    assert len(missing) == 1 and missing[0].startswith(
        "gradient accumulation over micro-batches without a pipeline (4 of them;")
    assert "microbatches=1" in missing[0]


def test_a_batch_that_does_not_split_into_the_micro_batches_is_refused():
    model, inputs, target, loss_fn = build(GPT, 6)
    engine = autopar.parallelize(model, 1, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, optimizer=None, plan={"microbatches": 4})
    with pytest.raises(PlanError, match="does not split into 4 micro-batches.*multiple of 4"):
        engine.train_step(inputs, target)


def test_the_executable_search_offers_micro_batches_without_a_pipeline():
    """What the search offers, parallelize runs: with pp 1 the executable search now picks
    micro-batches too, and says nothing about accumulation being left out."""
    from autopar.search import planner
    from autopar.search.why import not_executable
    from autopar.world import World

    assert not any("accumulation" in n for n in not_executable(RUNTIME))
    model, inputs, target, loss_fn = build(GPT, 8)
    chain = planner.prepare(model, tuple(t[:2] for t in inputs), loss_fn=loss_fn,
                            example_target=target[:2], tp_sizes=[1, 2])
    world = World(2, per_node=2)
    res = planner.search(chain, world, global_batch=8, executable=True,
                         constraints={"pp": 1, "microbatches": 4})
    plan = planner.to_plan(chain, world, res, 8, "bf16", 0.0)
    assert plan.mesh["pp"] == 1 and plan.pipeline.microbatches == 4
    assert plan.unsupported() == []


def _experts(name: str, plan: dict) -> dict:
    """A transformers MoE model (tests/test_moe_runtime.py's) under `plan`, 2 AdamW steps
    (the second on the first's state) beside one device; or the refusal's message."""
    import copy
    import functools

    import torch.distributed as dist
    from test_moe_runtime import _relative
    from test_moe_runtime import build as moe_build

    model, idx, target, loss_fn = moe_build(name)
    reference = copy.deepcopy(model)
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    engine = autopar.parallelize(model, dist.get_world_size(), example_inputs=(idx[:2],),
                                 loss_fn=loss_fn, optimizer=opt, plan=plan)
    ref_opt = opt(reference.parameters())
    losses, measured, predicted = [], {}, {}
    for step in range(2):
        engine.comm_log.clear()
        try:
            loss = engine.train_step((idx,), target)
        except PlanError as e:
            return {"refused": str(e)}
        if step == 0:
            measured = engine.comm_log.totals()
            predicted = engine.predicted_comm(idx.shape[0])
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(idx), target)
        ref_loss.backward()
        ref_opt.step()
        losses.append(abs(loss - ref_loss.item()) / abs(ref_loss.item()))
    full, ref = engine.full_state_dict(), reference.state_dict()
    return {"loss": max(losses), "keys_equal": list(full) == list(ref),
            "weights": max(_relative(full[k], ref[k]) for k in ref
                           if ref[k].dtype.is_floating_point),
            "measured": measured, "predicted": predicted,
            "microbatches": engine.microbatches, "experts": bool(engine.expert_load())}


def test_experts_over_ep_with_micro_batches_equal_one_device(pool2):
    """Mixtral's experts split over ep 2 (inside dp 2), each replica's batch in 2
    micro-batches: every micro-batch dispatches its own tokens."""
    for r in pool2.run(_experts, "hf-mixtral", {"expert": 2, "microbatches": 2}):
        assert r["experts"] and r["microbatches"] == 2
        assert_equal_to_one_device([r])


def test_a_balance_loss_with_micro_batches_is_refused(pool2):
    """The MoE balance loss is a sum over the whole batch's routing: each micro-batch's
    backward, right after its own forward, cannot know it, so the engine says so (the
    shared pool: every rank refuses alike, and `_experts` returns the sentence)."""
    for r in pool2.run(_experts, "moe-tiny", {"expert": 2, "microbatches": 2}):
        assert "balance loss" in r["refused"] and "microbatches=1" in r["refused"], r


def test_context_parallel_with_micro_batches_equals_one_device(pool2):
    """cp 2 (ring attention, zigzag): the tokens are cut over cp, the micro-batches over the
    batch."""
    assert_equal_to_one_device(pool2.run(_equal_after, GPT, {"sequence": {"size": 2, "mode": "ring"},
                                                "microbatches": 2}))


def test_explain_plan_keeps_the_micro_batches(tmp_path, capsys):
    """`autopar explain --plan` of a plan with micro-batches and no pipeline prices that
    plan, its micro-batches included."""
    import json

    from autopar.cli import main

    plan = Plan.from_dict({"data": 2, "microbatches": 4}, 2)
    path = tmp_path / "accum.json"
    plan.save(path)
    assert main(["explain", GPT, "--world", "2", "--batch", "8", "--plan", str(path), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"]["pp"] == 1 and data["pipeline"]["microbatches"] == 4


def test_2d_tensor_with_micro_batches_equals_one_device(pool4):
    """A 2 x 2 SUMMA grid splits each micro-batch over its rows: 8 samples in 2
    micro-batches of 4, each split in 2."""
    assert_equal_to_one_device(pool4.run(_equal_after, LLAMA, {"tensor": {"size": 4, "mode": "2d"},
                                                  "microbatches": 2}))
