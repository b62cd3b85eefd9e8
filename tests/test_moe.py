"""The dropless MoE layer (autopar.kernels.sparse_moe, autopar.kernels.moe) and the zoo's MoE model.

Routing against a hand-written top-k, the layer against a per-token loop over experts (forward
and gradients, grouped-matmul, loop and traced dense paths) and against transformers'
MixtralSparseMoeBlock, the balance loss against transformers' `load_balancing_loss_func`,
expert parallelism at ep = 2 and 4 on gloo against the one-device layer, and mixtral-8x7b /
moe-tiny in the zoo.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import dist_pool_fixture
from torch.export import Dim

from autopar.kernels.collectives import AxisGroup, CommLog
from autopar.kernels.moe import MoE
from autopar.kernels.routing import SIGMOID, SOFTMAX, route
from autopar.kernels.sparse_moe import SparseMoE
from autopar.models import build, format_spec, get_config, parse_spec, workload

pool2 = dist_pool_fixture(2, timeout_s=120)
pool4 = dist_pool_fixture(4, timeout_s=120)
TOL = 1e-5


def _reference_topk(scores: torch.Tensor, k: int):
    """The k largest scores of each row, largest first, by a plain sort."""
    values, index = [], []
    for row in scores.tolist():
        ranked = sorted(range(len(row)), key=lambda e: -row[e])[:k]
        index.append(ranked)
        values.append([row[e] for e in ranked])
    return torch.tensor(values, dtype=scores.dtype), torch.tensor(index)


@pytest.mark.parametrize("score, normalize", [(SOFTMAX, True), (SOFTMAX, False),
                                              (SIGMOID, True)])
def test_router_equals_a_hand_written_top_k(score, normalize):
    logits = torch.randn(12, 6, generator=torch.Generator().manual_seed(0))
    r = route(logits, 3, score, normalize)
    scores = logits.softmax(-1) if score == SOFTMAX else logits.sigmoid()
    values, index = _reference_topk(scores, 3)
    if normalize:
        values = values / values.sum(-1, keepdim=True)
    assert torch.equal(r.experts, index)
    torch.testing.assert_close(r.weights, values, rtol=1e-6, atol=0)
    torch.testing.assert_close(r.probs.sum(-1), torch.ones(12))


def test_router_breaks_ties_as_torch_topk():
    # equal logits: every row is a tie at the top-k boundary
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, -1.0], [0.5] * 5, [2.0, 2.0, 0.0, 0.0, 2.0]])
    r = route(logits, 2)
    scores = logits.softmax(-1)
    assert torch.equal(r.experts, torch.topk(scores, 2).indices)
    # whatever the tie order, the chosen scores are the k largest
    values, _ = _reference_topk(scores, 2)
    assert torch.equal(scores.gather(1, r.experts), values)
    torch.testing.assert_close(r.weights, torch.full((3, 2), 0.5))


def _naive(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, slot by slot: the definition of the layer."""
    x2 = x.reshape(-1, x.size(-1))
    r = route(layer.gate(x2), layer.top_k, router=layer.router)
    rows = []
    for t in range(x2.size(0)):
        y = torch.zeros(x2.size(1), dtype=torch.float32)
        for j in range(layer.top_k):
            e = int(r.experts[t, j])
            h = F.silu(layer.w1[e] @ x2[t]) * (layer.w3[e] @ x2[t])
            y = y + r.weights[t, j] * (layer.w2[e] @ h)
        rows.append(y.to(x.dtype))
    out = torch.stack(rows)
    if layer.shared_expert is not None:
        out = out + torch.sigmoid(layer.shared_gate(x2)) * layer.shared_expert(x2)
    return out.view(x.shape)


# ffn 16: grouped matmul (fp32 rows of 64 bytes); ffn 6: the loop over experts; float64: loop
@pytest.mark.parametrize("ffn, dtype, score, shared", [
    (16, torch.float32, SOFTMAX, 0), (16, torch.float32, SIGMOID, 8),
    (6, torch.float32, SOFTMAX, 8), (16, torch.float64, SOFTMAX, 0)])
def test_layer_equals_a_per_token_loop(ffn, dtype, score, shared):
    torch.manual_seed(0)
    layer = SparseMoE(8, ffn, 4, 2, score=score, shared_ffn=shared).to(dtype)
    x = torch.randn(3, 5, 8, dtype=dtype)
    dout = torch.randn(3, 5, 8, dtype=dtype)
    out = layer(x)
    grads = torch.autograd.grad((out * dout).sum(), list(layer.parameters()))
    ref = _naive(layer, x)
    ref_grads = torch.autograd.grad((ref * dout).sum(), list(layer.parameters()))
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)
    for g, rg in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, rg, rtol=TOL, atol=TOL)
    counts = torch.bincount(route(layer.gate(x.reshape(-1, 8)), 2, score).experts.reshape(-1),
                            minlength=4)
    assert torch.equal(layer.last_tokens_per_expert, counts)


# grouped matmul in bfloat16 (what its meta kernel takes); else every expert on every row
@pytest.mark.parametrize("ffn, dtype", [(16, torch.bfloat16), (16, torch.float32),
                                        (6, torch.float32)])
def test_exported_layer_has_a_dynamic_batch_and_equals_eager(ffn, dtype):
    torch.manual_seed(0)
    layer = SparseMoE(8, ffn, 4, 2, shared_ffn=8).to(dtype)
    x = torch.randn(2, 5, 8, dtype=dtype)
    exported = torch.export.export(layer, (x,), dynamic_shapes=({0: Dim("batch")},),
                                   strict=False)
    ops = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert ("aten._grouped_mm.default" in ops) == (dtype == torch.bfloat16)
    other = torch.randn(3, 5, 8, dtype=dtype)
    tol = TOL if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(exported.module()(other), layer(other), rtol=tol, atol=tol)


def test_balance_loss_equals_transformers_mixtral():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    torch.manual_seed(0)
    layer = SparseMoE(8, 16, 8, 2)
    x = torch.randn(4, 6, 8)
    _, aux = layer(x, return_aux=True)
    expected = mixtral.load_balancing_loss_func((layer.gate(x.reshape(-1, 8)),), 8, 2)
    torch.testing.assert_close(aux, expected, rtol=1e-6, atol=0)


def test_layer_equals_transformers_mixtral_block():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    from transformers import MixtralConfig

    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=8, intermediate_size=16, num_local_experts=4,
                           num_experts_per_tok=2)
    reference = mixtral.MixtralSparseMoeBlock(config).eval()
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.5)
    layer = SparseMoE(8, 16, 4, 2)
    w1, w3 = reference.experts.gate_up_proj.detach().chunk(2, dim=1)
    layer.load_state_dict({"gate.weight": reference.gate.weight.detach(), "w1": w1, "w3": w3,
                           "w2": reference.experts.down_proj.detach()})
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(layer(x), reference(x), rtol=TOL, atol=TOL)


def test_bad_expert_counts_are_refused():
    with pytest.raises(ValueError, match="top_k=3 must be between 1 and the number of experts"):
        SparseMoE(8, 16, 2, 3)
    group = AxisGroup("ep", 3, 0, None, CommLog())
    with pytest.raises(ValueError, match="8 experts do not split over ep=3 ranks"):
        MoE(8, 16, 8, 2, ep=group)


def test_the_router_alone_owns_the_routing_properties():
    """How the logits choose the experts lives on `Router` only: the one-device layer, the
    kernel and the spec of a recognised MoE module each hold a router and re-declare none of
    its fields (two copies of a field could disagree)."""
    import dataclasses

    from autopar.kernels.moe_layers import MoESpec
    from autopar.kernels.routing import Router

    fields = {f.name for f in dataclasses.fields(Router)}
    for owner in (SparseMoE, MoE, MoESpec):
        assert not fields & set(vars(owner)), (owner.__name__, fields & set(vars(owner)))
    layer = SparseMoE(8, 16, 4, 2, score=SIGMOID, normalize=False)
    assert layer.router == Router(SIGMOID, False)


# ----------------------------------------------------------------------------------------
# Expert parallelism on gloo (worker side)
# ----------------------------------------------------------------------------------------

# tokens per rank: uneven, one rank with a single token and one with none, so some splits
# are empty
TOKENS = {2: [7, 4], 4: [6, 1, 0, 5]}


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _ep_against_one_device(shared: int, score: str, raw_group: bool) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = SparseMoE(8, 16, 8, 2, score=score, shared_ffn=shared)
    sizes = TOKENS[world]
    x = torch.randn(sum(sizes), 8, requires_grad=True)
    dout = torch.randn(sum(sizes), 8)
    out, aux = full(x, return_aux=True)
    loss = (out * dout).sum() + aux
    *grads, x_grad = torch.autograd.grad(loss, [*full.parameters(), x])
    ref = dict(zip([n for n, _ in full.named_parameters()], grads, strict=True))
    ref_counts = full.last_tokens_per_expert

    log = CommLog()
    group = AxisGroup("ep", world, rank, dist.group.WORLD, log)
    layer = MoE.shard(full, dist.group.WORLD if raw_group else group)
    log = layer.ep.log
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    x_local = x[mine].detach().clone().requires_grad_(True)
    out_local, aux_local = layer(x_local, return_aux=True)
    # the ranks' losses add up to the one-device loss
    ((out_local * dout[mine]).sum() + aux_local / world).backward()
    grads = dict(layer.named_parameters())
    experts = slice(layer.first_expert, layer.first_expert + layer.w1.size(0))
    errors = {"out": _largest_difference(out_local, out[mine]),
              "aux": abs(aux_local.item() - aux.item()),
              "x": _largest_difference(x_local.grad, x_grad[mine])}
    for name in ("w1", "w3", "w2"):
        errors[name] = _largest_difference(grads[name].grad, ref[name][experts])
    for name, p in grads.items():  # replicated weights: their gradients summed over ranks
        if name not in ("w1", "w3", "w2"):
            g = p.grad.clone()
            dist.all_reduce(g)
            errors[name] = _largest_difference(g, ref[name])
    ops = [(r.op, r.axis, r.phase, r.bytes) for r in log]
    return {"errors": errors, "ops": ops,
            "tokens": layer.last_tokens_per_expert.tolist(),
            "expected_tokens": ref_counts[experts].tolist(),
            "routed": layer.last_routed.tolist()}


def _check_ep(results: list[dict], world: int) -> None:
    for rank, r in enumerate(results):
        assert max(r["errors"].values()) < TOL, (rank, r["errors"])
        assert r["tokens"] == r["expected_tokens"]
        # each rank sends its tokens' top-2 rows of 8 floats and returns the rows its own
        # experts computed; the backward sends the same amounts in reverse
        rows, computed = TOKENS[world][rank] * 2 * 8 * 4, sum(r["tokens"]) * 8 * 4
        assert r["ops"] == [("all_to_all", "ep", "forward", 8 * 8),  # counts, int64
                            ("all_to_all", "ep", "forward", rows),
                            ("all_to_all", "ep", "forward", computed),
                            ("all_reduce", "ep", "forward", (2 * 8 + 1) * 4),
                            ("all_reduce", "ep", "backward", (2 * 8 + 1) * 4),
                            ("all_to_all", "ep", "backward", rows),
                            ("all_to_all", "ep", "backward", computed)]
    routed = torch.tensor([r["routed"] for r in results]).sum(0)
    assert routed.sum().item() == 2 * sum(TOKENS[world])


@pytest.mark.parametrize("shared, score", [(0, SOFTMAX), (8, SIGMOID)])
def test_expert_parallel_2_equals_one_device(pool2, shared, score):
    _check_ep(pool2.run(_ep_against_one_device, shared, score, False), 2)


def test_expert_parallel_4_equals_one_device(pool4):  # given a torch process group
    _check_ep(pool4.run(_ep_against_one_device, 8, SOFTMAX, True), 4)


# ----------------------------------------------------------------------------------------
# The zoo's MoE model
# ----------------------------------------------------------------------------------------


def test_mixtral_8x7b_has_46_7_billion_parameters():
    model, (idx,) = build("mixtral-8x7b")
    assert idx.is_meta and all(p.is_meta for p in model.parameters())
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 46.7e9) / 46.7e9 < 0.01
    cfg = get_config("mixtral-8x7b")
    assert parse_spec("moe:layers=32,hidden=4096,experts=8,top_k=2,ffn=14336,kv_heads=8") == cfg
    assert parse_spec(format_spec(cfg)) == cfg


def test_mixtral_8x7b_traces_two_blocks_on_meta():
    import autopar

    w = workload("mixtral-8x7b", seq=64)
    assert (w.layers, w.traced_layers) == (32, 2)
    traced = autopar.trace(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target)
    ops = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert ops.count("aten._grouped_mm.default") == 2 * 3  # w1, w3, w2 of each block
    assert "aten.topk.default" in ops


def test_moe_tiny_trains_and_reports_its_balance_loss():
    model, (idx,) = build("moe-tiny", device="cpu", seed=0, batch=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        logits, aux = model(idx, return_aux=True)
        loss = F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten()) + 0.01 * aux
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert torch.isfinite(aux) and aux.item() > 0
    torch.testing.assert_close(model(idx), model(idx, return_aux=True)[0], rtol=0, atol=0)
