"""Activation recomputation at run time (autopar.passes.recompute): `full` runs each block
again in the backward from its input, `selective` the attention core that saves s x s tensors.
Each case trains equal to one device (losses and weights, fp32, 1e-4) with every collective's
bytes as `engine.predicted_comm` says (the recomputed forward's collectives counted again),
and the saved activations `engine.explain()` measures per layer are the plan's within 15%."""

import pytest
import torch
from equivalence import assert_equal_to_one_device, build, compare
from pretraced import forked_pool_fixture, mixtral

import autopar
from autopar.modes import (
    FULL,
    GPIPE,
    INTERLEAVED,
    NO_RECOMPUTE,
    RECOMPUTE,
    RUNTIME,
    SELECTIVE,
)

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"
LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"


def hf_llama(batch: int, layers: int = 2):
    """transformers' Llama from a config, eager attention: its s x s scores and
    probabilities are graph nodes, so selective recomputation has them to drop."""
    from equivalence import _lm_loss
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg)
    x = torch.randint(0, 64, (batch, 16))
    return model, (x,), torch.randint(0, 64, (batch, 16)), _lm_loss


def hf_llama4(batch: int):
    """`hf_llama` with four blocks (a zero-bubble V schedule runs 2 stages per rank)."""
    return hf_llama(batch, layers=4)


def gpt_with_dropout(batch: int):
    """The zoo's GPT with dropout: the CPU's attention takes the math path, which saves the
    s x s probabilities and dropout mask, what selective recomputation drops."""
    from equivalence import _lm_loss

    from autopar.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=32, block_size=16,
                          dropout=0.1))
    return model, (torch.randint(0, 64, (batch, 16)),), torch.randint(0, 64, (batch, 16)), \
        _lm_loss


# each world forked from the test process once it traced the world's models (tests/pretraced.py)
pool2 = forked_pool_fixture(2, [GPT, LLAMA, hf_llama, hf_llama4, gpt_with_dropout,
                                (mixtral, {"expert": 2, "recompute": FULL})])
pool4 = forked_pool_fixture(4, [GPT, (mixtral, {"expert": 2, "recompute": FULL,
                                                "pipeline": {"size": 2, "microbatches": 2}})])
pool8 = forked_pool_fixture(8, [GPT])


def _equal_after(model, plan: dict, batch: int = 8) -> dict:
    """Two steps: the second runs Adam on the first's state, its recomputed forward on the
    weights the first step wrote."""
    return compare(model, plan, 2, batch)


CASES = {
    "data-full": (GPT, {"data": 2, "recompute": FULL}),
    "tensor-selective": (hf_llama, {"tensor": {"size": 2, "mode": "1d"}, "recompute": SELECTIVE}),
    "megatron-sp-full": (hf_llama, {"tensor": {"size": 2, "mode": "1d", "sequence_parallel": True},
                                    "recompute": FULL}),
    "ring-full": (GPT, {"sequence": {"size": 2, "mode": "ring"}, "recompute": FULL}),
    "ulysses-full": (LLAMA, {"sequence": {"size": 2, "mode": "ulysses"}, "recompute": FULL}),
    "ulysses-selective": (hf_llama, {"sequence": {"size": 2, "mode": "ulysses"},
                                     "recompute": SELECTIVE}),
    "pipeline-1f1b-full": (hf_llama, {"pipeline": {"size": 2, "microbatches": 2},
                                      "recompute": FULL}),
    "pipeline-gpipe-full": (hf_llama, {"pipeline": {"size": 2, "schedule": GPIPE,
                                                    "microbatches": 2}, "recompute": FULL}),
    "pipeline-interleaved-selective": (hf_llama4, {"pipeline": {"size": 2, "schedule": INTERLEAVED,
                                                               "chunks": 2, "microbatches": 2},
                                                  "recompute": SELECTIVE}),
    "pipeline-zero-bubble-selective": (hf_llama4, {"pipeline": {"size": 2, "schedule": "zero_bubble",
                                                               "microbatches": 2},
                                                  "recompute": SELECTIVE}),
    "zero1-full": (hf_llama, {"data": 2, "zero": {"stage": 1}, "recompute": FULL}),
    "zero2-selective": (hf_llama, {"data": 2, "zero": {"stage": 2}, "recompute": SELECTIVE}),
    "zero3-full": (hf_llama, {"data": 2, "zero": {"stage": 3}, "recompute": FULL}),
    "zero3-selective": (GPT, {"data": 2, "zero": {"stage": 3}, "recompute": SELECTIVE}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_recomputation_trains_equal_to_one_device(pool2, case):
    model, plan = CASES[case]
    assert_equal_to_one_device(pool2.run(_equal_after, model, plan))


def _saved_per_block(model, plan: dict, batch: int = 8) -> dict:
    """Per block: (planned, measured) saved bytes from engine.explain(), after two steps."""
    import torch.distributed as dist

    m, inputs, target, loss_fn = build(model, batch)
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine = autopar.parallelize(m, world, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, optimizer=None, plan=plan)
    for _ in range(2):
        engine.train_step(inputs, target)
    rows = engine.explain(format="json")["layers"]
    return {r["name"]: (r["predicted"]["activation_bytes"], r["measured"]["activation_bytes"])
            for r in rows if r["name"][-1].isdigit() and r["measured"]}  # (this rank's stages)


def _check_saved(by_mode: dict) -> None:
    for mode, blocks in by_mode.items():
        assert blocks, mode
        for name, (planned, measured) in blocks.items():
            assert abs(planned - measured) <= 0.15 * measured, (mode, name, planned, measured)
    for name in by_mode[NO_RECOMPUTE]:
        if FULL in by_mode:
            assert by_mode[FULL][name][1] < 0.5 * by_mode[NO_RECOMPUTE][name][1]
        assert by_mode[SELECTIVE][name][1] <= by_mode[NO_RECOMPUTE][name][1]


def test_saved_bytes_are_the_plans_under_megatron_sp(pool2):
    plan = {"tensor": {"size": 2, "mode": "1d", "sequence_parallel": True}}
    by_mode = {mode: pool2.run(_saved_per_block, GPT, {**plan, "recompute": mode})[0]
               for mode in RECOMPUTE}
    _check_saved(by_mode)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_saved_bytes_are_the_plans_under_tensor_with_attention_dropout(pool2, sequence_parallel):
    """The dropout GPT under tensor 2 (Megatron-SP and plain): the CPU's attention saves
    each tensor rank's probabilities and dropout mask for its heads, which selective drops."""
    plan = {"tensor": {"size": 2, "mode": "1d", "sequence_parallel": sequence_parallel}}
    by_mode = {mode: pool2.run(_saved_per_block, gpt_with_dropout, {**plan, "recompute": mode})[0]
               for mode in RECOMPUTE}
    _check_saved(by_mode)


def test_saved_bytes_are_the_plans_per_block_under_1f1b(pool2):
    """Two 1F1B stages, 2 micro-batches: the second micro-batch's tensors count where the
    first's freed storages were; each stage rebuilds the mask and rotary tables before its
    first block (a recomputed block stays one region) and its first block holds them."""
    plan = {"pipeline": {"size": 2, "microbatches": 2}}
    ranks = {mode: pool2.run(_saved_per_block, hf_llama4, {**plan, "recompute": mode})
             for mode in RECOMPUTE}
    by_mode = {mode: {**r[0], **r[1]} for mode, r in ranks.items()}
    assert all(len(blocks) == 4 for blocks in by_mode.values()), by_mode
    _check_saved(by_mode)
    for mode, blocks in by_mode.items():  # a stage's first block holds more than its second
        assert blocks["model.layers.2"][1] > blocks["model.layers.3"][1], (mode, blocks)


def test_selective_drops_the_s_by_s_tensors_as_planned():
    for model in (gpt_with_dropout, hf_llama):
        by_mode = {mode: _saved_per_block(model, {"recompute": mode}) for mode in RECOMPUTE}
        _check_saved(by_mode)
        for name in by_mode[NO_RECOMPUTE]:
            assert by_mode[SELECTIVE][name][1] < 0.95 * by_mode[NO_RECOMPUTE][name][1]


def test_full_recompute_keeps_a_tensor_several_blocks_read_once():
    """transformers' Llama: every block reads the rotary tables and the mask, which the first
    block keeps under full recomputation; the later blocks are priced without them."""
    saved = _saved_per_block(hf_llama4, {"recompute": FULL})
    first, *later = saved.values()
    assert first[1] > later[0][1]
    for planned, measured in saved.values():
        assert abs(planned - measured) <= 0.15 * measured, saved


def _dropout_grads(mode: str) -> list:
    """Gradients of one step of the dropout GPT on one process under `mode`."""
    m, inputs, target, loss_fn = build(gpt_with_dropout, 4)
    engine = autopar.parallelize(m, 1, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, optimizer=None, plan={"recompute": mode})
    engine.train_step(inputs, target)
    return [p.grad.clone() for p in engine.parameters()]


def test_a_recomputed_dropout_draws_the_forwards_mask():
    base = _dropout_grads(NO_RECOMPUTE)
    for mode in (SELECTIVE, FULL):
        assert all(torch.equal(a, b) for a, b in zip(_dropout_grads(mode), base)), mode


def test_the_executable_search_offers_recomputation(tmp_path, capsys):
    from autopar.cli import main
    from autopar.plans import Plan

    out = tmp_path / "plan.json"
    assert main(["search", "gpt-tiny", "--world", "2", "--dp", "2", "--recompute", FULL,
                 "--batch", "8", "--executable", "-o", str(out)]) == 0
    capsys.readouterr()
    plan = Plan.load(out)
    assert plan.unsupported() == []
    assert {lp.recompute for lp in plan.layers if lp.name.startswith("blocks.")} == {FULL}
    assert not any("recomputation" in note for note in plan.search["left_out"])


def test_the_runtime_runs_every_recompute_mode():
    assert RUNTIME.recompute == RECOMPUTE
    from autopar.plans import Plan

    for mode in RECOMPUTE:
        assert Plan.from_dict({"recompute": mode}, 2).unsupported() == []


def test_experts_recomputed_equal_one_device(pool2):
    """Mixtral's experts over ep 2, each block recomputed: the dispatch runs again in the
    backward (counted twice by the prediction), the routing is counted once."""
    from test_accumulation import _experts

    for r in pool2.run(_experts, "hf-mixtral", {"expert": 2, "recompute": FULL}):
        assert r["experts"]
        assert_equal_to_one_device([r])


def test_2d_tensor_recomputed_equals_one_device(pool4):
    """A 2D grid's broadcasts run again in the recomputed forward."""
    assert_equal_to_one_device(pool4.run(_equal_after, GPT, {"tensor": {"size": 4, "mode": "2d"},
                                                "recompute": FULL}))


def test_experts_in_a_pipeline_recomputed_equal_one_device(pool4):
    """Mixtral's experts over ep 2 inside dp 2, two pipeline stages, each block recomputed:
    the dispatch runs again in each stage's backward."""
    from test_accumulation import _experts

    plan = {"expert": 2, "pipeline": {"size": 2, "microbatches": 2}, "recompute": FULL}
    for r in pool4.run(_experts, "hf-mixtral", plan):
        assert r["experts"]
        assert_equal_to_one_device([r])


@pytest.mark.parametrize("tensor", [{"size": 8, "mode": "2.5d", "depth": 2},
                                    {"size": 8, "mode": "3d"}], ids=["2.5d", "3d"])
def test_multid_tensor_recomputed_equals_one_device(pool8, tensor):
    """2.5D's and 3D's broadcasts and gathers run again in the recomputed forward."""
    assert_equal_to_one_device(pool8.run(_equal_after, GPT, {"tensor": tensor,
                                                              "recompute": FULL}))
