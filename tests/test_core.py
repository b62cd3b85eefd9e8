"""Unit tests of trace, layouts, catalog, solver, passes, plan and the one-liner at world 1."""

import functools
import json

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.graph import OpKind, trace
from autopar.graph.trace import BATCH
from autopar.kernels.collectives import Redistribute
from autopar.models import build
from autopar.passes import apply_solution, shard_parameters
from autopar.passes.tensor_parallel import local_parameters
from autopar.plans import Plan
from autopar.sharding.layout import Layout, Shard
from autopar.sharding.redistribute import steps_between
from autopar.sharding.rules.views import reshape_shard
from autopar.sharding.solve import solve
from autopar.sharding.strategy import Need


def _lm_loss(out, y):
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


@pytest.fixture(scope="module")
def gpt_meta():
    model, (x,) = build("gpt-tiny", batch=2, device="meta")
    return trace(model, (x,), loss_fn=_lm_loss, example_target=torch.zeros_like(x))


def test_trace_keeps_batch_symbolic_and_groups_layers(gpt_meta):
    assert gpt_meta.tracer == "export"
    shapes = [n.meta["autopar"].shape for n in gpt_meta.graph.nodes
              if n.meta["autopar"].shape]
    assert any(BATCH in sympy.sympify(s[0]).free_symbols for s in shapes if s)
    names = [layer.name for layer in gpt_meta.layers]
    assert "blocks.0" in names and "blocks.1" in names and names[-1] == "loss"
    groups = {layer.name: layer.group for layer in gpt_meta.layers}
    assert groups["blocks.0"] == groups["blocks.1"]
    assert groups["blocks.0"] != groups["wte"]
    kinds = {n.meta["autopar"].kind for n in gpt_meta.graph.nodes}
    assert {OpKind.LINEAR, OpKind.ATTENTION, OpKind.EMBEDDING, OpKind.LOSS} <= kinds


class _Loopy(nn.Module):
    """export traces this, fx cannot (a Python loop over a size): export path."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        for _ in range(x.shape[1] // 4):
            x = self.lin(x)
        return x


class _FxOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _NeedsFallbackInner()

    def forward(self, x):
        return self.inner(x).sum(-1)


class _NeedsFallbackInner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        torch._check(True)
        return self.lin(x)


class _Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: neither tracer can follow it
            return self.lin(x)
        return x


def test_both_tracers_give_the_same_vocabulary():
    model = _Loopy()
    traced = trace(model, (torch.randn(3, 8),))
    assert traced.tracer == "export"
    fx_traced = trace(_FxOnly(), (torch.randn(3, 8),))
    assert any(n.meta["autopar"].kind is OpKind.LINEAR for n in fx_traced.graph.nodes)


def test_fallback_tracer_is_used_when_export_fails(monkeypatch):
    import sys

    tr = sys.modules["autopar.graph.trace"]
    def broken(*args, **kwargs):
        raise RuntimeError("simulated export failure")

    monkeypatch.setattr(tr, "_via_export", broken)
    model, (x,) = build("gpt-tiny", batch=2, device="meta")
    traced = trace(model, (x,))
    assert traced.tracer == "fx"
    assert "simulated export failure" in traced.fallback_reason
    modules = {n.meta["autopar"].module for n in traced.graph.nodes}
    assert "blocks.0.attn.c_attn" in modules
    solution = solve(traced, size=2)
    assert solution.comm, "the fx graph is sharded like the export graph"


def test_a_trace_captures_no_stack_trace_per_node(monkeypatch):
    """Both tracers export without capturing and symbolizing a Python stack per node (a
    tenth to a fifth of a trace's CPU, read by nothing), and leave torch's switch as it was."""
    import sys

    from autopar.graph import trace_cache

    monkeypatch.setenv("AUTOPAR_TRACE_CACHE", "0")
    model, (x,) = build("gpt-tiny", batch=2, device="meta")
    assert not torch.fx.config.do_not_emit_stack_traces
    exported = trace(model, (x,))
    monkeypatch.setattr(sys.modules["autopar.graph.trace"], "_via_export",
                        lambda *args: (_ for _ in ()).throw(RuntimeError("no export")))
    fallback = trace(model, (x,))
    assert (exported.tracer, fallback.tracer) == ("export", "fx")
    for traced in (exported, fallback):
        # (torch's passes label a node they insert with their own line: no capture)
        captured = [n.name for n in traced.graph.nodes if n.meta.get("stack_trace")
                    and "torch/fx/passes/" not in n.meta["stack_trace"]]
        assert not captured
    assert not torch.fx.config.do_not_emit_stack_traces
    assert trace_cache.enabled() is False


def test_untraceable_model_names_the_line():
    with pytest.raises(autopar.TraceError) as err:
        trace(_Untraceable(), (torch.randn(3, 8),))
    assert "test_core.py" in str(err.value) and "x.sum() > 0" in str(err.value)


def test_layout_repr_and_redistribution_steps():
    lay = Layout.replicated(3).with_shard(2, "tp", 3)
    assert repr(lay) == "R R S(tp)x3"
    assert repr(Layout.replicated(2).with_partial("tp")) == "R R P(tp)"
    assert [s.kind for s in steps_between(Layout.replicated(2), Need(lay.without("tp")), "tp")] == []
    split = Layout.replicated(2).with_shard(1, "tp")
    assert [s.kind for s in steps_between(Layout.replicated(2), Need(split), "tp")] == ["split"]
    assert [s.kind for s in steps_between(split, Need(Layout.replicated(2)), "tp")] == ["gather"]
    assert [s.kind for s in steps_between(split, Need(Layout.replicated(2), True), "tp")] == \
        ["gather_sum_grads"]
    assert [s.kind for s in steps_between(Layout.replicated(2), Need(Layout.replicated(2), True),
                                          "tp")] == ["sum_grads"]
    partial = Layout.replicated(2).with_partial("tp")
    assert [s.kind for s in steps_between(partial, Need(Layout.replicated(2)), "tp")] == ["reduce"]
    assert [s.kind for s in steps_between(partial, Need(split), "tp")] == ["reduce_scatter"]


def test_reshape_carries_the_split_dim():
    B = BATCH
    # heads: [B, T, C] split on C -> [B, T, H, D] split on H
    assert reshape_shard((B, 8, 32), (B, 8, 4, 8), Shard(2, "tp"), 2) == (Shard(2, "tp"), None)
    # fused qkv blocks: [B, T, 3C] in 3 blocks -> [B, T, 3, H, D] split on H
    assert reshape_shard((B, 8, 96), (B, 8, 3, 4, 8), Shard(2, "tp", 3), 2) == \
        (Shard(3, "tp", 1), None)
    # without the blocks the same view would need them: the solver asks for 3
    assert reshape_shard((B, 8, 96), (B, 8, 3, 4, 8), Shard(2, "tp"), 2) == (None, 3)
    # merge back: [B, T, H, D] split on H -> [B, T, C]
    assert reshape_shard((B, 8, 4, 8), (B, 8, 32), Shard(2, "tp"), 2) == (Shard(2, "tp"), None)
    # flattening the batch into rows keeps the feature split
    assert reshape_shard((B, 8, 32), (8 * B, 32), Shard(2, "tp"), 2) == (Shard(1, "tp"), None)


def test_solver_finds_the_megatron_pattern(gpt_meta):
    solution = solve(gpt_meta, size=2)
    by_module = {}
    for node, strategy in solution.strategies.items():
        info = node.meta["autopar"]
        if info.kind in (OpKind.LINEAR, OpKind.EMBEDDING, OpKind.LOSS, OpKind.ATTENTION):
            by_module[(info.module, info.kind)] = strategy.name
    assert by_module[("blocks.0.attn.c_attn", OpKind.LINEAR)] == "column"
    assert by_module[("blocks.0.attn.c_proj", OpKind.LINEAR)] == "row"
    assert by_module[("blocks.0.mlp.c_fc", OpKind.LINEAR)] == "column"
    assert by_module[("blocks.0.mlp.c_proj", OpKind.LINEAR)] == "row"
    assert by_module[("blocks.0.attn", OpKind.ATTENTION)] == "heads"
    assert by_module[("wte", OpKind.EMBEDDING)] == "vocab_parallel"
    loss_strategy = [s for n, s in solution.strategies.items()
                     if n.meta["autopar"].kind is OpKind.LOSS][0]
    assert loss_strategy.name == "vocab_parallel"
    qkv = [t for t in solution.params if t.endswith("c_attn.weight")][0]
    assert repr(solution.params[qkv]) == "S(tp)x3 R"
    # 1D: only all-reduces; per block two in forward (after each row linear) and two in
    # backward (the gradients of the inputs of c_attn and c_fc)
    assert {c.op for c in solution.comm} == {"all_reduce"}
    block0 = [c for c in solution.comm if c.where.startswith(("linear", "addmm"))]
    assert len([c for c in block0 if c.phase == "forward"]) == 2 * 2
    assert len([c for c in block0 if c.phase == "backward"]) == 2 * 2 + 1  # + lm_head input


@pytest.mark.parametrize("size", [2, 4])
def test_llama_attention_stays_head_sharded_through_rotary(size):
    model, (x,) = build("llama-tiny", batch=2, device="meta")
    traced = trace(model, (x,), loss_fn=_lm_loss, example_target=torch.zeros_like(x))
    solution = solve(traced, size=size)
    aten = torch.ops.aten
    cats = [n for n in solution.strategies if n.target is aten.cat.default]
    assert len(cats) == 2 * 2  # rotary on q and k in each of the two blocks
    for cat in cats:
        assert solution.strategies[cat].name == "follow"
        assert repr(solution.layouts[cat]) == "R S(tp) R R"  # [B, heads, T, head_dim]
    for attn in (n for n in solution.strategies if n.meta["autopar"].kind is OpKind.ATTENTION):
        assert solution.strategies[attn].name == "heads"
        for qkv in attn.args[:3]:
            assert repr(solution.layouts[qkv]) == "R S(tp) R R"
    # no op runs replicated, and the only redistribution left is the gradient sum in front
    # of the column linears: q and k are never gathered and re-split around the rotation
    assert solution.notes() == []
    assert {s.kind for t in solution.transitions for s in t.steps} == {"sum_grads"}
    assert {c.op for c in solution.comm} == {"all_reduce"}


class _Joined(nn.Module):
    """Two column-split projections joined on their split features, then a row-split one."""

    def __init__(self, left: int = 32, right: int = 32):
        super().__init__()
        self.a = nn.Linear(16, left)
        self.b = nn.Linear(16, right)
        self.out = nn.Linear(left + right, 8)

    def forward(self, x):
        return self.out(torch.cat((self.a(x), self.b(x)), dim=-1))


def test_cat_on_the_split_dim_keeps_one_block_per_input():
    traced = trace(_Joined().to("meta"), (torch.randn(4, 16, device="meta"),))
    solution = solve(traced, size=2)
    cat = next(n for n in solution.strategies if n.target is torch.ops.aten.cat.default)
    assert solution.strategies[cat].name == "blocks"
    assert repr(solution.layouts[cat]) == "R S(tp)x2"
    assert repr(solution.params["model.out.weight"]) == "R S(tp)x2"
    assert [s.name for n, s in solution.strategies.items()
            if n.meta["autopar"].kind is OpKind.LINEAR] == ["column", "column", "row"]
    assert not any(s.kind == "gather" for t in solution.transitions for s in t.steps)
    # pieces of unequal length cannot be blocks of one split: gathered, and explain says why
    uneven = trace(_Joined(32, 16).to("meta"), (torch.randn(4, 16, device="meta"),))
    solution = solve(uneven, size=2)
    cat = next(n for n in solution.strategies if n.target is torch.ops.aten.cat.default)
    assert solution.strategies[cat].name == "replicate"
    assert "unequal sizes along dimension 1" in solution.strategies[cat].note
    assert [s.kind for t in solution.transitions if cat in t.consumers for s in t.steps] == \
        ["gather", "gather"]


class _CumsumBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.cumsum(self.lin(x), dim=1)


class _RepeatedUnknown(nn.Module):
    """Four identical layers, each with an op the catalog has no entry for."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_CumsumBlock() for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.flip(0)


def test_explain_groups_repeated_replicated_ops():
    from autopar.report import layers as explain

    traced = trace(_RepeatedUnknown().to("meta"), (torch.randn(2, 16, device="meta"),))
    solution = solve(traced, size=2)
    data = explain.report(traced, solution, Plan(mesh={"tp": 2, "dp": 1}), 2, 1)
    assert len(data["replicated_ops"]) == 5
    text = explain.as_text(data)
    cumsum_lines = [line for line in text.splitlines() if "cumsum" in line]
    assert cumsum_lines == ["    blocks.0 (cumsum) ... blocks.3 (cumsum) (4 ops in 4 layers): no "
                            "catalog entry for aten.cumsum.default; runs replicated"]
    assert "    flip: no catalog entry for aten.flip.default; runs replicated" in text


def test_shard_parameters_installs_the_tensors_it_is_given():
    model, (x,) = build("gpt-tiny", batch=2, device="cpu", seed=0)
    traced = trace(model, (x,))
    solution = solve(traced, size=2)
    gm = apply_solution(traced.gm, solution)
    local = local_parameters(gm, solution, {"tp": 1})
    qkv = next(t for t in local if t.endswith("c_attn.weight"))
    whole = traced.gm.get_parameter(qkv)
    assert local[qkv].shape[0] * 2 == whole.shape[0]
    # rank 1's part of each of the q, k and v blocks
    torch.testing.assert_close(local[qkv], torch.cat([b[b.shape[0] // 2:]
                                                      for b in whole.detach().chunk(3)]))
    shard_parameters(gm, local)
    for target, tensor in local.items():
        module, _, attr = target.rpartition(".")
        assert getattr(gm.get_submodule(module), attr) is tensor
    assert isinstance(gm.get_parameter(qkv), nn.Parameter)
    assert traced.gm.get_parameter(qkv) is whole, "the traced graph keeps the whole tensor"


def test_pass_emits_exactly_the_solution_collectives(gpt_meta):
    solution = solve(gpt_meta, size=2)
    gm = apply_solution(gpt_meta.gm, solution)
    emitted = [m for m in gm.modules() if isinstance(m, Redistribute)]
    assert len(emitted) == sum(len(t.steps) for t in solution.transitions) + sum(
        1 for s in solution.strategies.values() if s.rewrite == "row_linear")
    code = gm.code
    assert "tp_all_reduce" in code and "tp_sum_grads" in code and "vocab_cross_entropy" in code


def test_plan_dict_json_and_errors(tmp_path):
    plan = autopar.Plan.from_dict({"tensor": {"size": 4, "mode": "1d"}}, 8)
    assert plan.mesh == {"pp": 1, "dp": 2, "cp": 1, "tp": 4}
    path = tmp_path / "plan.json"
    plan.save(path)
    assert autopar.Plan.load(path).mesh == plan.mesh
    assert json.loads(path.read_text())["version"] == 1
    with pytest.raises(autopar.PlanError, match="does not divide the world size 8"):
        autopar.Plan.from_dict({"tensor": {"size": 3}}, 8)
    with pytest.raises(autopar.PlanError, match="unknown plan key"):
        autopar.Plan.from_dict({"tensr": 2}, 8)
    with pytest.raises(autopar.PlanError, match="unknown key"):
        autopar.Plan.from_dict({"tensor": {"sise": 2}}, 8)
    with pytest.raises(autopar.PlanError, match="unknown tensor mode"):
        autopar.Plan.from_dict({"tensor": {"size": 2, "mode": "4d"}}, 8)
    with pytest.raises(autopar.PlanError, match="positive whole number"):
        autopar.Plan.from_dict({"tensor": {"size": "two"}}, 8)
    with pytest.raises(autopar.WorldError, match="unknown device"):
        autopar.World(8, device="a100-90gb")


def test_parallelize_world1_matches_eager_and_rejects_bad_input():
    model, (x,) = build("gpt-tiny", batch=4, device="cpu", seed=0)
    y = torch.randint(0, 64, x.shape)
    # eps 1e-5 as tests/equivalence.py: an element whose gradient is rounding noise (a
    # never-targeted class's table row can sum to about 0) takes full-size Adam steps in
    # random directions under the default 1e-8, so any rounding difference between the two
    # runs shows (seen once, under heavy load: logits 3e-4 apart at a column no target names)
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    reference = build("gpt-tiny", batch=4, device="cpu", seed=0)[0]
    engine = autopar.parallelize(model, 1, example_inputs=(x,), loss_fn=_lm_loss, optimizer=opt)
    ref_opt = opt(reference.parameters())
    for _ in range(3):
        loss = engine.train_step(x, y)
        ref_opt.zero_grad()
        ref_loss = _lm_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
    torch.testing.assert_close(engine(x), reference(x))
    with pytest.raises(autopar.PlanError, match="not execute yet"):
        autopar.parallelize(model, 1, example_inputs=(x,),
                            plan={"zero": {"stage": 0, "offload": True}})
    with pytest.raises(autopar.PlanError, match="does not divide the world size 1"):
        autopar.parallelize(model, 1, example_inputs=(x,), plan={"tensor": {"size": 2}, "data": 1})
    with pytest.raises(autopar.WorldError, match="positive int"):
        autopar.parallelize(model, 0, example_inputs=(x,))
    with pytest.raises(autopar.WorldError, match="torchrun"):
        autopar.parallelize(model, 2, example_inputs=(x,))


def test_each_nccl_rank_computes_on_its_own_gpu():
    """Which device a rank trains on: its LOCAL_RANK's GPU under NCCL (the global rank
    modulo the node's GPUs without LOCAL_RANK), nothing moved under gloo, and clear errors
    when the GPUs do not match the processes."""
    from autopar.api import rank_device

    assert rank_device("gloo", {"LOCAL_RANK": "3"}, device_count=0) is None
    assert rank_device("nccl", {"LOCAL_RANK": "3", "RANK": "11"}, device_count=8) == \
        torch.device("cuda", 3)
    assert rank_device("nccl", {"RANK": "11"}, device_count=8) == torch.device("cuda", 3)
    with pytest.raises(autopar.WorldError, match="sees no GPU"):
        rank_device("nccl", {"LOCAL_RANK": "0"}, device_count=0)
    with pytest.raises(autopar.WorldError, match="LOCAL_RANK 4 but this process sees 4 GPUs"):
        rank_device("nccl", {"LOCAL_RANK": "4"}, device_count=4)


def test_cli_explain_json(capsys):
    from autopar.cli import main

    assert main(["explain", "gpt-tiny", "--world", "4", "--tp", "2", "--pp", "1", "--format",
                 "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mesh"] == {"pp": 1, "dp": 2, "cp": 1, "tp": 2}
    assert data["predicted"]["comm_bytes_per_device"] > 0
    assert [lr["name"] for lr in data["layers"]][:2] == ["root", "wte"]
    assert main(["explain", "gpt-tiny", "--world", "4", "--tp", "3"]) == 2
    assert "cannot tile a world of 4" in capsys.readouterr().err
