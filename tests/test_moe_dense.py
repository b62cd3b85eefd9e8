"""MoE models whose first layers are dense (DeepSeek-V3's first three of 61): the spec keys
`dense`, `dense_ffn` and `shared_ffn`, the zoo's deepseek-v3-moe, its parameter and FLOP
counts, the planner tracing one block of each kind, and the search pricing dense layers
with no all-to-all and no expert memory."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from autopar.cost.model import LayerState
from autopar.kernels.routing import SIGMOID
from autopar.kernels.sparse_moe import SwiGLU
from autopar.models import build, format_spec, get_config, parse_spec, workload
from autopar.report.html import plan_html
from autopar.report.predicted import layer_costs, plan_report, pricing_context, tensor_mode
from autopar.search.planner import model_flops, prepare, search, to_plan
from autopar.world import World

DEEPSEEK_SPEC = ("moe:layers=61,hidden=7168,heads=128,experts=256,top_k=8,ffn=2048,"
                 "shared_ffn=2048,dense=3,vocab=129280,seq=4096")
SMALL = "moe:layers=6,hidden=256,experts=8,top_k=2,dense=2,vocab=512,seq=256"


# ----------------------------------------------------------------------------------------
# The spec and the model
# ----------------------------------------------------------------------------------------


def test_the_spec_reads_dense_layers_and_defaults_their_width_to_the_active_experts():
    cfg = parse_spec(DEEPSEEK_SPEC)
    # dense_ffn defaults to top_k x ffn + shared_ffn: DeepSeek-V3's 18432 = 8 x 2048 + 2048
    assert (cfg.dense_layers, cfg.dense_ffn, cfg.shared_ffn) == (3, 18432, 2048)
    zoo = get_config("deepseek-v3-moe")
    assert zoo.score == SIGMOID and zoo.normalize_topk
    # the spec carries the shape; the router's score and RoPE base are not shape
    assert cfg == dataclasses.replace(zoo, score=cfg.score, rope_theta=cfg.rope_theta)
    assert parse_spec(format_spec(cfg)) == cfg
    assert "dense=3,dense_ffn=18432" in format_spec(zoo)
    # a model without dense layers or shared expert writes neither key (values are positive)
    mixtral = format_spec(get_config("mixtral-8x7b"))
    assert "dense" not in mixtral and "shared_ffn" not in mixtral
    assert parse_spec("moe:layers=4,hidden=64,experts=8,top_k=2,dense=1,dense_ffn=96") \
        .dense_ffn == 96


@pytest.mark.parametrize("spec, words", [
    ("moe:layers=3,hidden=64,experts=8,top_k=2,dense=3",
     r"dense_layers=3 must be at least 0 and fewer than n_layer=3, so that one MoE block"),
    ("moe:layers=3,hidden=64,experts=8,top_k=2,dense=7",
     r"dense_layers=7 must be at least 0 and fewer than n_layer=3"),
    ("moe:layers=3,hidden=64,experts=8,top_k=2,dense_ffn=128",
     r"dense_ffn=128 must be positive exactly when there are dense layers \(dense_layers=0\)"),
    ("moe:layers=3,hidden=64,experts=8,top_k=2,dense=0", r"'0' of key 'dense'.*positive"),
    ("moe:layers=3,hidden=64,experts=8,top_k=2,dense=1,dense_ffn=-4",
     r"'-4' of key 'dense_ffn'.*positive"),
    ("moe:layers=3,hidden=64,experts=8,top_k=2,dense=1,dense=2", r"'dense' is given twice"),
])
def test_bad_dense_values_are_refused_in_one_sentence(spec, words):
    with pytest.raises(ValueError, match=words) as info:
        parse_spec(spec)
    message = str(info.value)
    assert message.endswith(".") and ". " not in message.replace(spec, "")


def test_dense_first_blocks_run_a_swiglu_and_the_balance_loss_sums_the_moe_blocks():
    model, (idx,) = build("moe:layers=4,hidden=64,heads=8,experts=8,top_k=2,dense=2,"
                          "vocab=128,seq=16", device="cpu", seed=0, batch=2)
    kinds = [(b.dense, isinstance(getattr(b, "ffn", None), SwiGLU), hasattr(b, "moe"))
             for b in model.blocks]
    assert kinds == [(True, True, False)] * 2 + [(False, False, True)] * 2
    assert model.blocks[0].ffn.w1.weight.shape == (2 * 224, 64)  # top_k x ffn (3.5 x 64)
    logits, aux = model(idx, return_aux=True)
    # the loss sums the MoE blocks' own: recompute it block by block
    x = model.tok_embeddings(idx)
    cos, sin = model.rope_cos[:idx.size(1)], model.rope_sin[:idx.size(1)]
    losses = []
    for block in model.blocks:
        x, block_aux = block(x, cos, sin, return_aux=True)
        assert (block_aux is None) == block.dense
        if block_aux is not None:
            losses.append(block_aux)
    torch.testing.assert_close(aux, torch.stack(losses).sum())
    torch.testing.assert_close(logits, model(idx))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(4):
        optimizer.zero_grad()
        logits, aux = model(idx, return_aux=True)
        loss = F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten()) + 0.01 * aux
        loss.backward()
        optimizer.step()
        first = loss.item() if first is None else first
    assert loss.item() < first


# ----------------------------------------------------------------------------------------
# deepseek-v3-moe: parameters and FLOPs
# ----------------------------------------------------------------------------------------


def _counts(cfg):
    """(total parameters, matmul parameters a token multiplies by) of the zoo's MoE model,
    by hand: attention is this family's (q, k, v, o); an MoE block holds the router, the
    routed experts, the shared expert and its [H, 1] gate; a dense block one SwiGLU."""
    h = cfg.dim
    head = h // cfg.n_head
    attention = 2 * h * h + 2 * h * cfg.n_kv_head * head
    norms = 2 * h
    swiglu = 3 * h  # per unit of FFN width
    moe_blocks = cfg.n_layer - cfg.dense_layers
    shared = swiglu * cfg.shared_ffn + h if cfg.shared_ffn else 0
    dense_block = attention + norms + swiglu * cfg.dense_ffn
    moe_block = attention + norms + h * cfg.n_experts + cfg.n_experts * swiglu * cfg.ffn_hidden \
        + shared
    embeddings = 2 * cfg.vocab_size * h  # untied input and output
    total = cfg.dense_layers * dense_block + moe_blocks * moe_block + embeddings + h
    active = cfg.dense_layers * (attention + swiglu * cfg.dense_ffn) + moe_blocks * (
        attention + h * cfg.n_experts + cfg.top_k * swiglu * cfg.ffn_hidden + shared) \
        + cfg.vocab_size * h
    return total, active


# MLA as DeepSeek-V3 shapes it (report §4.2 and the released configuration: q rank 1536, kv
# rank 512, 128 heads of 128 + 64 rotary dims, values of 128): its weights per layer
MLA = (7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * (512 + 64) + 512 + 512 * 128 * 256
       + 128 * 128 * 7168)


def test_deepseek_v3_moe_parameters_by_hand_and_against_the_report():
    cfg = get_config("deepseek-v3-moe")
    model, _ = build(cfg)
    n = sum(p.numel() for p in model.parameters())
    total, active = _counts(cfg)
    assert n == total
    # The report's 671B (and 37B activated) is the model with MLA and without its shared
    # expert gate (MTP not included). Our attention is the family's: take the difference out
    attention = 4 * cfg.dim * cfg.dim
    as_published = n - cfg.n_layer * (attention - MLA) - (cfg.n_layer - cfg.dense_layers) * cfg.dim
    assert as_published == pytest.approx(671e9, rel=0.002)
    active_mla = active - cfg.n_layer * (attention - MLA) + cfg.vocab_size * cfg.dim  # + lookup
    assert active_mla == pytest.approx(37e9, rel=0.02)


@functools.cache
@functools.cache  # (read only by the tests: traced and priced once for the four of them)
def _deepseek_chain(seq: int = 4096):
    w = workload("deepseek-v3-moe", batch=1, seq=seq)
    chain = prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                    tp_sizes=(1, 2, 4, 8), layers=w.layer_counts)
    return w, chain


def test_the_planner_traces_one_dense_and_one_moe_block_and_counts_each():
    w, chain = _deepseek_chain()
    assert (w.layers, w.traced_layers) == (61, 2)
    assert w.layer_counts == {"blocks.0": 3, "blocks.1": 58}
    assert [b.dense for b in w.model.blocks] == [True, False]
    blocks = [lt for lt in chain.layers() if lt.attention]
    assert len(blocks) == 61
    assert [lt.experts is None for lt in blocks] == [True] * 3 + [False] * 58
    dense, moe = blocks[0], blocks[3]
    assert dense is not moe and dense.name != moe.name  # two layer kinds for the search
    assert chain.params == sum(p.numel() for p in build("deepseek-v3-moe")[0].parameters())
    names = [name for name in chain.names if name.startswith("blocks.")]
    assert names == [f"blocks.{i}" for i in range(61)]


def test_moe_blocks_with_a_shared_expert_gate_take_1d_tensor_sizes():
    # the shared expert's [H, 1] gate and the router stay whole on every tensor rank, as in
    # the engine's opaque MoE op: no tensor size is refused for them
    _, chain = _deepseek_chain()
    moe = next(lt for lt in chain.types if lt.experts is not None)
    assert all(moe.sharded[tp].refused is None for tp in (2, 4, 8))
    assert chain.refused == []


def test_deepseek_v3_moe_model_flops_are_six_x_active_parameters_x_tokens_plus_attention():
    w, chain = _deepseek_chain()
    cfg, batch, seq = w.config, 4, 4096
    tokens = batch * seq
    _, active = _counts(cfg)
    attention = 3 * 4 * batch * seq * seq * cfg.dim * cfg.n_layer
    assert model_flops(chain, batch) == pytest.approx(6 * active * tokens + attention, rel=0.03)
    assert model_flops(chain, batch) < 0.1 * 6 * chain.params * tokens  # 9 of 257 experts


# ----------------------------------------------------------------------------------------
# The search
# ----------------------------------------------------------------------------------------


def _check_layers(plan, chain):
    """Per layer of the plan's own report: dense blocks price no all-to-all and hold no
    experts; MoE blocks hold 1/ep of theirs and send all-to-alls on ep."""
    data = plan_report(plan, chain)
    blocks = [(row, lt) for row, lt in zip(data["layers"], chain.layers()) if lt.attention]
    ep = plan.ep
    states = [LayerState(tensor_mode(lp.tp_mode, plan.mesh["tp"], plan.tp_depth), lp.sp,
                         lp.recompute) for lp in plan.layers]
    costs = layer_costs(chain, states, pricing_context(plan),
                        plan.pipeline.micro_batch_size or 1)
    dense = [c for c, lt in zip(costs, chain.layers()) if lt.attention and lt.experts is None]
    moe = [(c, lt) for c, lt in zip(costs, chain.layers()) if lt.experts is not None]
    assert dense and moe and len(dense) + len(moe) == len(blocks)
    assert all(c.ep_comm == 0 and c.ep_comm_bytes == 0 and c.expert_params == 0 for c in dense)
    assert all(c.ep_comm > 0 and c.ep_comm_bytes > 0 for c, _ in moe)
    assert all(c.expert_params == pytest.approx(lt.experts.param_bytes / ep) for c, lt in moe)
    kinds = {row["ffn"]["kind"]: row for row in data["layer_kinds"] if row.get("ffn")}
    assert kinds["dense"]["ffn"]["all_to_all_bytes"] == 0
    assert kinds["dense"]["ffn"]["expert_param_bytes_per_device"] == 0
    assert kinds["moe"]["ffn"]["all_to_alls"] >= 5 and kinds["moe"]["ffn"]["ep"] == ep
    return data


def test_search_on_a_dense_first_model_picks_ep_and_prices_no_all_to_all_on_dense_layers():
    w = workload(SMALL, batch=1)
    chain = prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                    tp_sizes=(1, 2, 4), layers=w.layer_counts)
    world = World(devices=16)
    result = search(chain, world, global_batch=32)
    plan = to_plan(chain, world, result, 32, "bf16", 0.0)
    assert plan.ep > 1
    data = _check_layers(plan, chain)
    assert data["experts"]["moe_layers"] == 4 and data["experts"]["dense_layers"] == 2
    text = plan.explain()
    assert "4 MoE layers, 2 dense layers (no experts, no all-to-all)" in text
    assert "blocks.0 .. blocks.1" in text and "blocks.2 .. blocks.5" in text
    assert "dense FFN: no experts, no all-to-all on ep (0 B per micro-batch)" in text
    assert f"MoE FFN: 8 experts top-2, {8 // plan.ep} per rank over ep={plan.ep}" in text
    page = plan_html(plan.detail, SMALL)
    assert "dense layers (no experts, no all-to-all)</td><td class=\"num\">2<" in page


def test_pipeline_stages_balance_the_unequal_costs_of_dense_and_moe_layers():
    # the first four blocks' dense FFN (65536 wide) outweighs the MoE blocks' two experts
    spec = "moe:layers=8,hidden=256,experts=8,top_k=2,dense=4,dense_ffn=65536,vocab=512,seq=256"
    w = workload(spec, batch=1)
    chain = prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                    tp_sizes=(1,), layers=w.layer_counts)
    world = World(devices=4)
    result = search(chain, world, global_batch=8, constraints=dict(
        pp=2, tp=1, cp=1, microbatches=4, schedule="1f1b"))
    plan = to_plan(chain, world, result, 8, "bf16", 0.0)
    times = [row["time_s"] for row in plan.detail["layers"]]
    stage = [lp.stage for lp in plan.layers]
    index = {lp.name: i for i, lp in enumerate(plan.layers)}
    dense = times[index["blocks.0"]]
    assert dense > 1.2 * times[index["blocks.4"]]  # unequal layers

    def bottleneck(cut: int) -> float:
        return max(sum(times[:cut]), sum(times[cut:]))

    cut = stage.index(1)
    # the planner's cut is the best of every contiguous two-stage cut on the real costs, and
    # puts fewer of the heavy dense blocks in stage 0 than a split by block count would
    assert bottleneck(cut) == pytest.approx(min(bottleneck(c) for c in range(1, len(times))))
    assert cut < index["blocks.4"] and bottleneck(cut) < bottleneck(index["blocks.4"])
    assert [s["layers"] for s in plan.detail["stages"]] == [cut, len(times) - cut]


def test_deepseek_v3_moe_on_256_devices_picks_an_expert_axis():
    w, chain = _deepseek_chain()
    world = World(devices=256, device="h100-80gb")
    result = search(chain, world, global_batch=512)
    plan = to_plan(chain, world, result, 512, "bf16", 0.0)
    assert plan.ep > 1 and plan.predicted["memory_per_device_bytes"] <= 80 * 2 ** 30
    _check_layers(plan, chain)
    text = plan.explain()
    assert "256 per MoE layer (top-8)" in text and "58 MoE layers, 3 dense layers" in text
    assert "blocks.0 .. blocks.2" in text and "blocks.3 .. blocks.60" in text
    assert "dense FFN: no experts, no all-to-all on ep" in text
