"""Context parallelism beside the other modes: cp beside Megatron sequence parallelism.

Beside cp, Megatron-SP splits each rank's cp block of the tokens again over tp (the layout
axis `CP_TP`, cp major): a row linear's partial sum is reduce-scattered over tp into that
block's tp part, a column linear all-gathers the part back over tp; nothing between the two
regions crosses cp. Each run trains transformers' Llama and Qwen2 (and the zoo's GPT, whose
LayerNorm is one op) equal to one device (tests/equivalence.py's `compare`: 2 AdamW steps,
the second on the state the first left; losses and weights within 1e-5) with measured communication equal to the plan's for every
(op, axis).
"""

import pytest
import torch
from equivalence import _lm_loss, assert_equal, build, compare
from pretraced import forked_pool_fixture, mixtral

import autopar
from autopar.errors import PlanError
from autopar.modes import CP, CP_TP, RUNTIME, TP
from autopar.sharding.layout import Layout


def hf_llama(batch):
    """A two-layer transformers Llama with grouped-query attention (2 kv heads of 4)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg), (torch.randint(0, 64, (batch, 16)),), \
        torch.randint(0, 64, (batch, 16)), _lm_loss


def hf_qwen2(batch):
    """A two-layer transformers Qwen2 (biased q, k, v projections)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return Qwen2ForCausalLM(cfg), (torch.randint(0, 64, (batch, 16)),), \
        torch.randint(0, 64, (batch, 16)), _lm_loss


# each world forked from the test process once it traced the world's models (tests/pretraced.py)
pool2 = forked_pool_fixture(2, [hf_llama])
pool4 = forked_pool_fixture(4, [hf_llama, hf_qwen2, "gpt-tiny", "hf-gpt2",
                                (mixtral, {"expert": 2, "sequence": {"size": 2, "mode": "ring"}})])


def cp_sp(mode, layout=None, cp=2, tp=2):
    sequence = {"size": cp, "mode": mode, **({"layout": layout} if layout else {})}
    return {"sequence": sequence, "tensor": {"size": tp, "mode": "1d", "sequence_parallel": True}}


def _probe(engine, inputs, target):
    """The layouts of the training graph's values (their reprs) and the (op, phase) of every
    collective its plan runs on cp."""
    sol = engine.train_solution
    return {"layouts": {repr(v) for v in sol.layouts.values() if isinstance(v, Layout)},
            "cp": {(c.op, c.phase) for c in sol.comm if c.axis == CP}}


def _check_sp_beside_cp(results, kernel_op):
    assert_equal(results)
    measured = results[0]["measured"]
    for op in ("reduce_scatter", "all_gather"):  # Megatron-SP's pair, on tp
        assert measured[(op, TP)] > 0, measured
    assert measured[(kernel_op, CP)] > 0
    # nothing crosses cp in the forward but the sequence kernels and the loss's two sums (a
    # whole position table's gradient is gathered over cp in the backward)
    probe = results[0]["probe"]
    assert {op for op, phase in probe["cp"] if phase == "forward"} <= {kernel_op, "all_reduce"}
    assert any("S(cp_tp)" in text for text in probe["layouts"])
    assert all(r["measured"] == measured for r in results)


@pytest.mark.parametrize("mode,layout", [("ring", "zigzag"), ("ring", "contiguous"),
                                         ("ulysses", None)])
def test_llama_cp2_tp2_megatron_sp_equals_one_device(pool4, mode, layout):
    results = pool4.run(compare, hf_llama, cp_sp(mode, layout), 2, probe=_probe)
    _check_sp_beside_cp(results, "p2p" if mode == "ring" else "all_to_all")


@pytest.mark.parametrize("name,mode", [(hf_qwen2, "ring"), ("gpt-tiny", "ulysses"),
                                       ("hf-gpt2", "ring")])
def test_other_models_cp2_tp2_megatron_sp_equal_one_device(pool4, name, mode):
    """Qwen2's biased projections, the zoo GPT's LayerNorm (one op, its own rule) and
    GPT-2's learned positions and Conv1D linears."""
    results = pool4.run(compare, name, cp_sp(mode), 2, probe=_probe)
    _check_sp_beside_cp(results, "p2p" if mode == "ring" else "all_to_all")


def test_cp_beside_megatron_sp_is_runnable():
    plan = autopar.Plan.from_dict(cp_sp("ring"), 4)
    assert RUNTIME.cp_with_megatron_sp and plan.unsupported() == []


def test_cp_beside_megatron_sp_refuses_tokens_that_do_not_divide():
    """12 tokens: 2 zigzag cp blocks of 6 do not split over tp 4."""
    model, (x,), _, loss_fn = build(hf_llama, 2)
    with pytest.raises(PlanError, match=r"over tensor size 4 within each of the sequence size "
                                        r"2's blocks, and 12 does not divide by 8: use a "
                                        r"sequence length of 8 or 16, or a tensor size that "
                                        r"divides 12 / 2"):
        autopar.parallelize(model, 8, example_inputs=(x[:, :12],), loss_fn=loss_fn,
                            plan=cp_sp("ring", tp=4))


def test_steps_inside_a_cp_block_run_over_tp_alone():
    """The redistributions between a cp block and its tp parts: a partial sum
    reduce-scattered over tp, the parts gathered over tp (the gradient reduce-scattered when
    asked), a whole block split; batch-major flattened tokens (runs of 16 per sample) keep
    runs of 16 / cp in a rank's block. Bytes are those of the cp block (1/cp of the tensor)."""
    from autopar.sharding.axes import TensorMesh
    from autopar.sharding.redistribute import steps_between
    from autopar.sharding.strategy import Need

    mesh = TensorMesh.with_cp(2, 4)
    block = Layout.replicated(3).with_shard(1, CP)
    parts = block.with_shard(1, CP_TP)
    steps = lambda src, dst, grads=False: [(s.kind, s.axis, s.dim, s.groups, s.parts)  # noqa
                                           for s in steps_between(src, Need(dst, grads), TP,
                                                                  mesh)]
    assert steps(block.with_partial(TP), parts) == [("reduce_scatter", TP, 1, 1, 2)]
    assert steps(parts, block) == [("gather", TP, 1, 1, 2)]
    assert steps(parts, block, (TP,)) == [("gather_sum_grads", TP, 1, 1, 2)]
    assert steps(block, parts) == [("split", TP, 1, 1, 2)]
    assert steps(parts, Layout.replicated(3)) == [("gather", TP, 1, 1, 2),
                                                  ("gather", CP, 1, 1, 1)]
    flat = Layout.replicated(2).with_shard(0, CP, -16)
    assert steps(flat.with_partial(TP), flat.with_shard(0, CP_TP, -16)) == \
        [("reduce_scatter", TP, 0, -8, 2)]


# ZeRO-3 offload with one data-parallel rank: the pieces are whole parameters on the host,
# each layer's copied up for its use; no collective runs over the one-rank dp axis

def test_zero3_offload_on_one_data_rank_equals_one_device(pool2):
    plan = {"tensor": 2, "zero": {"stage": 3, "offload": True}}
    assert autopar.Plan.from_dict(plan, 2).unsupported() == []
    results = pool2.run(compare, hf_llama, plan, 2)
    assert_equal(results)
    assert {axis for _, axis in results[0]["measured"]} == {TP}


# experts (ep inside dp x cp) beside cp together with tensor, pipeline or ZeRO: Mixtral
# trained as in tests/test_moe_runtime.py

def _check_experts(results):
    for r in results:
        assert r["loss"] <= 1e-5 and r["weights"] <= 1e-5, (r["loss"], r["weights"])
        assert r["keys_equal"] and r["measured"] == r["predicted"]
        assert r["measured"][("all_to_all", "ep")] > 0
        assert r["measured"][("all_to_all" if "ulysses" in r["plan"] else "p2p", CP)] > 0


def _train_experts(plan):
    from test_moe_runtime import _train

    return {**_train("hf-mixtral", plan, steps=2), "plan": repr(plan)}


@pytest.mark.parametrize("more", [
    dict(zero=dict(stage=1)), dict(zero=dict(stage=3)), dict(tensor=2),
    dict(pipeline=dict(size=2, microbatches=2), sequence=dict(size=2, mode="ulysses"))])
def test_mixtral_experts_beside_cp_with_more_equals_one_device(pool4, more):
    """At world 4: cp 2 x dp 2 with ZeRO (the experts' pieces over edp, their sums divided
    by dp = edp x ep / cp as beside cp without ZeRO), cp 2 x tp 2, pp 2 x cp 2."""
    plan = {"expert": 2, "sequence": dict(size=2, mode="ring"), **more}
    _check_experts(pool4.run(_train_experts, plan))
