"""Megatron sequence parallelism (Korthikanti et al. 2022) with 1D tensor parallelism.

Between tensor-parallel regions activations are split on the sequence dim over "tp": each
row-split linear's partial sum is reduce-scattered into the sequence split (its backward an
all-gather) and each column-split linear all-gathers its input (its backward a reduce-
scatter). The runs equal the single-device run (tests/equivalence.py's `compare`, 2 AdamW
steps: the second on the state the first left), measured communication equals the plan's,
and no activation is all-reduced over "tp" inside a block: what all-reduces there are the
gradients of norm weights and row-linear biases (each rank computed them from its own
tokens), plus the vocabulary-parallel loss's three.
"""

import pytest
import torch
from distributed import dist_pool_fixture
from equivalence import assert_equal, build, compare

import autopar
from autopar.errors import PlanError

pool2 = dist_pool_fixture(2)
pool4 = dist_pool_fixture(4)

SP = lambda size: {"tensor": {"size": size, "mode": "1d", "sequence_parallel": True}}  # noqa
MODELS = ("gpt-tiny", "llama-tiny", "hf-gpt2")
BLOCK = ("blocks.", "transformer.h.")


def sp_probe(engine, inputs, target):
    """Where the plan's all-reduces on tp sit, and the tokens a norm inside a block reads."""
    import torch.fx as fx

    from autopar.graph.analysis import OpKind

    sol = engine.train_solution
    all_reduces = []
    for t in sol.transitions:
        for c in t.comm:
            if c.op == "all_reduce" and c.axis == "tp":
                layer = t.consumers[0].meta["autopar"].layer
                all_reduces.append((layer, t.producer.op, t.producer.name, c.phase))
    for node, s in sol.strategies.items():
        for c in s.comm:
            if c.op == "all_reduce" and c.axis == "tp":
                all_reduces.append((node.meta["autopar"].layer, "call_function", node.name,
                                    c.phase))
    # the first norm-like op of each block: layer_norm, or RMSNorm's pow
    norm_inputs = {}

    class Shapes(fx.Interpreter):
        def run_node(self, n):
            info = n.meta.get("autopar")
            if n.op == "call_function" and info is not None and \
                    info.layer.startswith(BLOCK) and info.layer not in norm_inputs and \
                    (info.kind is OpKind.NORM or n.target is torch.ops.aten.pow.Tensor_Scalar):
                x = self.env[n.args[0]]
                norm_inputs[info.layer] = (tuple(x.shape), tuple(info.shape))
            return super().run_node(n)

    *local, local_target = engine.batches.local(tuple(inputs) + (target,))
    engine.comm_log.enabled = False
    try:
        with torch.no_grad():
            Shapes(engine.train_gm).run(*local, local_target)
    finally:
        engine.comm_log.enabled = True
    return {"all_reduces": all_reduces, "norm_inputs": norm_inputs,
            "seq": sol.seq, "tp": engine.groups["tp"].size}


def _check(results, tp):
    assert_equal(results)
    measured = results[0]["measured"]
    assert measured[("reduce_scatter", "tp")] > 0 and measured[("all_gather", "tp")] > 0
    probe = results[0]["probe"]
    for layer, producer, name, phase in probe["all_reduces"]:
        if layer.startswith(BLOCK):  # inside blocks only parameter gradients are all-reduced
            assert producer == "get_attr" and phase == "backward", (layer, name)
    assert probe["norm_inputs"]
    for layer, (local, whole) in probe["norm_inputs"].items():
        assert local[1] * tp == whole[1] == probe["seq"], (layer, local, whole)
    return probe


@pytest.mark.parametrize("model", MODELS)
def test_world2_sequence_parallel_equals_single_device(pool2, model):
    _check(pool2.run(compare, model, SP(2), 2, 8, sp_probe), 2)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp", [4, 2])
def test_world4_sequence_parallel_equals_single_device(pool4, model, tp):
    """tp 4, and tp 2 x dp 2."""
    probe = _check(pool4.run(compare, model, SP(tp), 2, 8, sp_probe), tp)
    outside = sorted({(layer, name) for layer, _, name, _ in probe["all_reduces"]
                      if not layer.startswith(BLOCK)})
    # what stays all-reduced outside blocks: the loss, and gradients of the final norm
    assert all(layer in ("loss", "ln_f", "norm", "transformer.ln_f") for layer, _ in outside), \
        outside



def _searched_sp(name: str, world: int):
    """The executable search's plan with 1D + Megatron-SP fixed, searched once here (every
    rank would search alike: the search is deterministic and reads no process group)."""
    from autopar.search import planner
    from autopar.world import World

    model, inputs, target, loss_fn = build(name, 8)
    return planner.plan(model, inputs, World(world, per_node=world), loss_fn=loss_fn,
                        example_target=target, executable=True,
                        constraints={"tp": world, "tp_mode": "1d", "sp": "megatron"})


def test_searched_sequence_parallel_plan_runs_and_equals_single_device(pool4):
    plan = _searched_sp("gpt-tiny", 4)
    assert "megatron" in {lp.sp for lp in plan.layers}
    results = pool4.run(compare, "gpt-tiny", plan, 2)
    for r in results:
        assert r["loss"] <= 1e-5 and r["weights"] <= 1e-5, (r["loss"], r["weights"])
        assert r["measured"] == r["predicted"]
    assert ("reduce_scatter", "tp") in results[0]["measured"]


def _bad(plan, model="gpt-tiny", world=4):
    m, inputs, _, _ = build(model, 2)
    with pytest.raises(PlanError) as err:
        autopar.parallelize(m, world, example_inputs=inputs, plan=plan)
    text = str(err.value)
    assert text.count(". ") == 0 and text.endswith("."), text  # one sentence
    return text


def test_sequence_parallel_needs_tensor_size_above_one():
    text = _bad({"tensor": {"size": 1, "sequence_parallel": True}}, world=1)
    assert "size of 2 or more" in text


@pytest.mark.parametrize("mode", ["2d", "2.5d", "3d"])
def test_sequence_parallel_needs_1d(mode):
    tensor = {"size": 4 if mode != "3d" else 8, "mode": mode, "sequence_parallel": True}
    if mode == "2.5d":
        tensor["depth"] = 1
    text = _bad({"tensor": tensor}, world=tensor["size"])
    assert "mode='1d'" in text and mode in text


def test_sequence_length_must_divide_by_tensor_size():
    text = _bad(SP(3), model="hf-gpt2", world=3)  # 8 tokens over 3 ranks
    assert "8 tokens" in text and "6 or 9" in text


def test_plan_no_longer_lists_megatron_sp_as_unsupported():
    plan = autopar.Plan.from_dict(SP(4), 4)
    assert plan.unsupported() == []
