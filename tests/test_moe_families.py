"""The MoE blocks of transformers' families as autopar's MoE op, split over experts.

Each family's block is recognised structurally (experts as fused gate_up_proj/down_proj, a
router of one linear map, maybe a correction bias and a shared expert) and its routing
(softmax or sigmoid scores, a correction bias on the scores or the logits, group-limited
top-k, normalisation, a scaling factor) chosen by a probe that checks the op's output and
gradients against the block on random weights and inputs (autopar.kernels.moe_layers).
Under expert=2 at world 2, DeepSeek-V3 (sigmoid, correction bias, grouped top-k, scaling,
a shared expert with no gate, a dense first layer), DeepSeek-V2 (softmax, group-limited
greedy, scaling), Qwen3-MoE, OLMoE and HunYuan-MoE (a router `wg`, a shared `shared_mlp`)
train equal to one device over 3 AdamW steps (fp32, losses and weights within 1e-4),
every collective's bytes as predicted, and the engine's explain lists each layer's experts
over ep; DeepSeek-V3 also under tensor=2, and the planner prices its experts split. Other
families' blocks are checked equal to the op on one process (output and gradients), a
block whose forward differs is refused by the probe, the probe is decided per setting and
runs narrowed on large or meta blocks, and the families the op does not compute are
refused with one sentence naming the block and why (docs/moe-families.md lists them all).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from equivalence import assert_equal_to_one_device, compare
from pretraced import engine_graphs, forked_pool_fixture, pretracing
from torch import nn

import autopar
from autopar.errors import PlanError
from autopar.kernels.moe_layers import find_moe_layers, moe_op, opaque_moe, run, spec_key
from autopar.kernels.routing import GROUP_MAX, GROUP_TOP2, SIGMOID, SOFTMAX

pool2 = forked_pool_fixture(2)  # forked once `pretraced` traced every family here
TOL = 1e-4
BATCH, SEQ, VOCAB = 4, 8, 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=32)
MLA = dict(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
           v_head_dim=8, num_key_value_heads=4)


def _config(family: str):
    """(model class, tiny config) of a family trained under expert=2."""
    import transformers as tr

    if family == "deepseek_v3":  # first layer dense, 8 experts in 4 groups, 2 groups kept
        return tr.DeepseekV3ForCausalLM, tr.DeepseekV3Config(
            intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, **MLA, **COMMON)
    if family == "deepseek_v2":
        return tr.DeepseekV2ForCausalLM, tr.DeepseekV2Config(
            intermediate_size=32, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, topk_method="group_limited_greedy",
            n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=1.5, **MLA,
            **COMMON)
    if family == "qwen3_moe":
        return tr.Qwen3MoeForCausalLM, tr.Qwen3MoeConfig(
            intermediate_size=32, moe_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=True, num_key_value_heads=2, head_dim=8,
            **COMMON)
    if family == "olmoe":
        return tr.OlmoeForCausalLM, tr.OlmoeConfig(
            intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_key_value_heads=2,
            **COMMON)
    if family == "granitemoe":
        return tr.GraniteMoeForCausalLM, tr.GraniteMoeConfig(
            intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
            num_key_value_heads=2, **COMMON)
    if family == "hunyuan_v1_moe":
        return tr.HunYuanMoEV1ForCausalLM, tr.HunYuanMoEV1Config(
            intermediate_size=16, num_experts=4, moe_topk=2, num_key_value_heads=2, head_dim=8,
            **COMMON)
    if family == "kolibri1":
        return tr.Kolibri1ForCausalLM, tr.Kolibri1Config(
            intermediate_size=32, moe_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, shared_expert_intermediate_size=16, num_key_value_heads=2,
            head_dim=8, **COMMON)
    raise KeyError(family)


# the families the issue names, and one whose router and shared expert are named otherwise
TRAINED = ["deepseek_v3", "deepseek_v2", "qwen3_moe", "olmoe", "hunyuan_v1_moe"]


def build(family: str, seed: int = 0):
    """The family's tiny causal LM with every weight and router bias drawn (transformers
    leaves routers and correction biases at zero), a batch and its targets."""
    torch.manual_seed(seed)
    cls, config = _config(family)
    model = cls(config)
    with torch.no_grad():
        for p in model.parameters():
            nn.init.normal_(p, std=0.1)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.normal_(std=0.1)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, idx, torch.randint(0, VOCAB, (BATCH, SEQ))


def _loss(out, target):
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def _train(family: str, plan: dict, steps: int = 3) -> dict:
    """On each rank: autopar under `plan` beside the same model on one device
    (equivalence.compare), with the first step's expert load and the last step's explain."""
    def built(batch: int):
        model, idx, target = build(family)
        return model, (idx,), target, _loss

    result = compare(built, plan, steps=steps, batch=BATCH,
                     probe=lambda engine, inputs, target: engine.expert_load(),
                     last=lambda engine: engine.explain(format="json").get("experts"))
    return {**result, "load": result["probe"], "explain": result["last"],
            "experts_held": {k: mine / whole for k, (mine, whole) in result["held"].items()
                             if k.endswith(("experts.gate_up_proj", "experts.down_proj"))},
            "layers": sorted(find_moe_layers(build(family)[0]))}


@pytest.fixture(scope="module")
def pretraced():
    """Each trained family's two graphs with its MoE layers opaque (expert=2 and tensor=2
    trace the same), traced here once for both ranks."""
    with pretracing():
        for family in TRAINED:
            model, idx, target = build(family)
            engine_graphs(model, (idx,), target, _loss, dict(expert=2), 2)
        yield


@pytest.mark.parametrize("family", TRAINED)
def test_family_under_expert_2_equals_one_device(pool2, family):
    results = pool2.run(_train, family, dict(expert=2))
    assert_equal_to_one_device(results, TOL)
    for r in results:
        assert r["noise_abs"] <= TOL, r["noise_abs"]
        assert ("all_to_all", "ep") in r["measured"]
        # every MoE layer ran as the op over ep; each rank holds half of its experts
        assert r["layers"] and sorted(r["load"]) == r["layers"]
        assert r["experts_held"] and all(s == 0.5 for s in r["experts_held"].values())
        # explain: per MoE layer its experts over ep, the all-to-all bytes predicted from
        # the routing taken equal to those sent
        assert sorted(e["module"] for e in r["explain"]) == r["layers"]
        for e in r["explain"]:
            assert e["ep"] == 2 and e["experts"] == len(e["measured"]["routed"])
            assert len(e["measured"]["computed"]) * 2 == e["experts"]
            # (the step's bytes, exact above; here the last step's routing beside the mean)
            assert e["predicted"]["alltoall_bytes"] > 0 and e["measured"]["alltoall_bytes"] > 0


def test_deepseek_v3_experts_split_over_tensor_2_equal_one_device(pool2):
    """Under tensor=2 the op splits each expert's FFN width (the shared expert's too, which
    has no gate) over tp, the router and its correction bias whole."""
    results = pool2.run(_train, "deepseek_v3", dict(tensor=2))
    assert_equal_to_one_device(results, TOL)
    for r in results:
        assert ("all_reduce", "tp") in r["measured"] and ("all_to_all", "ep") not in r["measured"]
        assert r["experts_held"] and all(s == 0.5 for s in r["experts_held"].values())


def test_the_planner_prices_deepseek_v3_experts_split():
    """autopar.plan traces each recognised block as the op (its own per-expert loop holds no
    grouped matmul to price): under ep=2 the plan's experts are split, 4 of 8 per rank, the
    first block dense, and its explain says so."""
    model, idx, target = build("deepseek_v3")
    plan = autopar.plan(model, (idx[:2],), 2, loss_fn=_loss, example_target=target[:2],
                        constraints=dict(ep=2, tp=1, pp=1, zero=0, recompute="none"))
    data = plan.detail["experts"]
    assert plan.ep == 2 and data["experts"] == 8 and data["experts_per_rank"] == 4
    assert data["moe_layers"] == 1 and data["dense_layers"] == 1
    assert data["all_to_all_bytes_per_step"] > 0
    assert "8 per MoE layer (top-2) over ep=2: 4 per rank" in plan.explain()


@pytest.mark.parametrize("family, router", [
    ("deepseek_v3", dict(score=SIGMOID, normalize=True, scale=2.5, corrected=True, groups=4,
                         topk_groups=2, group_score=GROUP_TOP2)),
    ("deepseek_v2", dict(score=SOFTMAX, normalize=False, scale=1.5, corrected=False,
                         groups=4, topk_groups=2, group_score=GROUP_MAX)),
    ("qwen3_moe", dict(score=SOFTMAX, normalize=True, corrected=False, groups=1)),
    ("olmoe", dict(score=SOFTMAX, normalize=False, corrected=False, groups=1)),
    ("kolibri1", dict(score=SIGMOID, corrected=True, corrects_logits=True)),
])
def test_the_probe_reads_each_routing(family, router):
    model, _, _ = build(family)
    layers = find_moe_layers(model)
    assert layers
    for spec in layers.values():
        got = {k: getattr(spec.router, k) for k in router}
        assert got == router, got


def _same_as_the_block(model) -> int:
    """Each MoE block of `model` and the op in its place (its own weights, a fresh input):
    output and input gradient within TOL. Returns the number of blocks."""
    layers = find_moe_layers(model)
    for path, spec in layers.items():
        module = model.get_submodule(path)
        x = torch.randn(2, 5, spec.hidden, requires_grad=True)
        dout = torch.randn(2, 5, spec.hidden)
        expected = module(x)
        (want,) = torch.autograd.grad((expected * dout).sum(), [x])
        with opaque_moe(model, {path: spec}):
            got = module(x)
            with torch.no_grad():
                assert torch.equal(moe_op(x, *spec.op_args(module), spec_key(spec), False)[0],
                                   got)
        torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL)
        out, _ = run(spec.kernel(), spec, x, *spec.op_args(module), False)
        (grad,) = torch.autograd.grad((out * dout).sum(), [x])
        torch.testing.assert_close(grad, want, rtol=TOL, atol=TOL)
    return len(layers)


# every other family of the installed transformers whose MoE block the op computes: its
# block class and a tiny config (the config class's own keys)
OTHERS = {
    "MixtralSparseMoeBlock": ("Mixtral", dict(intermediate_size=16, num_local_experts=4)),
    "GraniteMoeMoE": ("GraniteMoe", dict(intermediate_size=16, num_local_experts=4)),
    "Qwen2MoeSparseMoeBlock": ("Qwen2Moe", dict(moe_intermediate_size=16, num_experts=4,
                                                shared_expert_intermediate_size=16)),
    "Qwen3NextSparseMoeBlock": ("Qwen3Next", dict(moe_intermediate_size=16, num_experts=4,
                                                  shared_expert_intermediate_size=16,
                                                  layer_types=["full_attention"] * 2)),
    "Glm4MoeMoE": ("Glm4Moe", dict(moe_intermediate_size=16, n_routed_experts=4, n_group=2,
                                   topk_group=1, first_k_dense_replace=0)),
    "Ernie4_5_MoeSparseMoeBlock": ("Ernie4_5_Moe", dict(moe_intermediate_size=16,
                                                        moe_num_experts=4, moe_k=2,
                                                        moe_layer_start_index=0)),
    "MiniMaxSparseMoeBlock": ("MiniMax", dict(intermediate_size=16, num_local_experts=4,
                                              layer_types=["full_attention"] * 2)),
    "MiniMaxM2SparseMoeBlock": ("MiniMaxM2", dict(intermediate_size=16, num_local_experts=4)),
    "JambaSparseMoeBlock": ("Jamba", dict(intermediate_size=16, num_experts=4,
                                          expert_layer_period=1, expert_layer_offset=0)),
    "Dots1MoE": ("Dots1", dict(moe_intermediate_size=16, n_routed_experts=4, n_group=2,
                               topk_group=1, n_shared_experts=1, first_k_dense_replace=0)),
    "AfmoeSparseMoeBlock": ("Afmoe", dict(moe_intermediate_size=16, num_experts=4,
                                          num_dense_layers=0, layer_types=["full_attention"] * 2,
                                          global_attn_every_n_layers=1)),
}


@pytest.mark.parametrize("block", sorted(OTHERS))
def test_other_families_blocks_run_as_the_op(block):
    import transformers as tr

    prefix, extra = OTHERS[block]
    config = getattr(tr, f"{prefix}Config")(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_experts_per_tok=2,
        **({"head_dim": 8} if "head_dim" in getattr(tr, f"{prefix}Config")().to_dict()
           else {}), **extra)
    torch.manual_seed(0)
    model = getattr(tr, f"{prefix}ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            nn.init.normal_(p, std=0.1)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.normal_(std=0.1)
    assert {type(model.get_submodule(p)).__name__ for p in find_moe_layers(model)} == {block}
    assert _same_as_the_block(model) >= 1


# ----------------------------------------------------------------------------------------
# Refused families: one sentence naming the block and why
# ----------------------------------------------------------------------------------------

REFUSED = {
    "PhimoeSparseMoeBlock": ("Phimoe", dict(intermediate_size=16, num_local_experts=4),
                             "routes with SparseMixer"),
    "Llama4TextMoe": ("Llama4Text/Llama4", dict(intermediate_size=16, intermediate_size_mlp=32,
                                         num_local_experts=4, num_experts_per_tok=1),
                      "scales each token by its router score before the experts run"),
    "GptOssMLP": ("GptOss", dict(intermediate_size=16, num_local_experts=4,
                                 layer_types=["full_attention"] * 2),
                  "add biases or hold weights beside gate_up_proj and down_proj"),
    "NemotronHMoE": ("NemotronH", dict(moe_intermediate_size=16, n_routed_experts=4,
                                       layers_block_type=["moe", "moe"]),
                     "are not gated SwiGLU experts stored as gate_up_proj and down_proj"),
    "AriaTextMoELayer": ("AriaText", dict(intermediate_size=16, moe_num_experts=4,
                                          moe_topk=2),
                         "store their weights transposed"),
}


@pytest.mark.parametrize("block", sorted(REFUSED))
def test_families_the_op_does_not_compute_are_refused_in_a_sentence(block):
    import transformers as tr

    names, extra, why = REFUSED[block]
    prefix, _, model_prefix = names.partition("/")  # (the config's, the model's)
    config = getattr(tr, f"{prefix}Config")(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, **extra)
    model = getattr(tr, f"{model_prefix or prefix}ForCausalLM")(config)
    idx = torch.zeros(2, SEQ, dtype=torch.long)
    with pytest.raises(PlanError) as info:
        autopar.parallelize(model, 2, example_inputs=(idx,), loss_fn=_loss,
                            plan=dict(expert=2))
    message = str(info.value)
    assert why in message and block in message, message
    assert message.endswith("drop expert= from the plan.") and message.count(". ") == 0


def test_a_block_whose_forward_differs_is_refused_not_mis_run():
    """A block of a recognised structure whose forward the op does not compute (here one
    that doubles its output) fails the probe: refused, never run as the op."""
    model, idx, _ = build("qwen3_moe")
    block = model.model.layers[0].mlp

    class DoubledSparseMoeBlock(type(block)):
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    block.__class__ = DoubledSparseMoeBlock
    with pytest.raises(PlanError) as info:
        autopar.parallelize(model, 2, example_inputs=(idx[:2],), loss_fn=_loss,
                            plan=dict(expert=2))
    assert str(info.value).startswith(
        "MoE layer model.layers.0.mlp (DoubledSparseMoeBlock) routes or combines its experts "
        "in a way autopar's MoE op does not compute"), str(info.value)


def test_a_large_block_on_meta_is_probed_with_narrowed_experts(monkeypatch):
    """A block above the probe's size (here: any) is checked with its FFN widths narrowed,
    also on meta (a model started from weights=, or the planner's config path); the spec
    keeps the real widths."""
    from autopar.kernels import moe_layers

    model, _, _ = build("deepseek_v3")
    whole = find_moe_layers(model)
    monkeypatch.setattr(moe_layers, "_PROBE_WHOLE", 0)
    monkeypatch.setattr(moe_layers, "_probed", {})
    cls, config = _config("deepseek_v3")
    with torch.device("meta"):
        meta = cls(config)
    assert find_moe_layers(meta) == whole
    assert next(iter(whole.values())).ffn == 16


def test_the_probe_decides_per_setting_not_per_class():
    """Two blocks of one class and shape that route differently (DeepSeek-V2's
    group-limited top-k keeping one group of two experts, and its greedy top-k) are probed
    each: the second does not reuse the first's routing."""
    import transformers as tr

    config = dict(_config("deepseek_v2")[1].to_dict(), topk_group=1)
    routers = []
    for method in ("group_limited_greedy", "greedy"):
        torch.manual_seed(0)
        model = tr.DeepseekV2ForCausalLM(tr.DeepseekV2Config(**dict(config, topk_method=method)))
        routers.append({(s.router.groups, s.router.topk_groups)
                        for s in find_moe_layers(model).values()})
    assert routers == [{(4, 1)}, {(1, 1)}]
