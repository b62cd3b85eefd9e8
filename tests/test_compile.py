"""parallelize(..., compile=True): inductor over each rank's graph, regionally.

Compiled runs equal one device (losses and weights within 1e-4 over 3 AdamW steps) under
tensor 1D + Megatron-SP, ZeRO-3, a pipeline, ring attention, Ulysses, experts, selective
recomputation beside tensor 1D and ZeRO-2, full recomputation beside tensor 1D at world 2,
2D and 2.5D at world 4, 3D at world 8, fp8 beside tensor 1D (against eager fp8); the collectives
stay autopar's own (comm_log equals the plan's bytes); dynamo breaks no graph and compiles
each distinct region once, however many blocks repeat it. Inductor's graph cache shares
the compiled blocks between the tests (the block of a data plan is ZeRO-3's block).
"""

import copy
import functools

import pytest
import torch
import torch.fx as fx
from equivalence import build, relative
from pretraced import forked_pool_fixture
from test_fp8_runtime import hf_gpt2

import autopar
from autopar.errors import PlanError
from autopar.models import build as zoo_build
from autopar.runtime.compile import PREFIX, Region, compilable, cpu_options


def _deep_gpt(batch: int):
    """The tiny GPT at 4 blocks: twice gpt-tiny's depth, the same block."""
    from autopar.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=4, n_head=8, n_embd=64, block_size=32))
    _, _, target, loss_fn = build("gpt-tiny", batch)
    return model, (torch.randint(0, 256, (batch, 32)),), target, loss_fn


# each world forked from the test process once it traced the world's models (tests/pretraced.py)
pool2 = forked_pool_fixture(2, ["gpt-tiny", _deep_gpt, ("moe-tiny", {"expert": 2}), hf_gpt2])
pool4 = forked_pool_fixture(4, ["gpt-tiny"], timeout_s=900)
pool8 = forked_pool_fixture(8, ["gpt-tiny"], timeout_s=900)


def compiled_against_one_device(name, plan, steps: int = 3, batch: int = 8) -> dict:
    """Train `name` compiled under `plan` and on one device eagerly, in this process."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, inputs, target, loss_fn = build(name, batch)
    reference = copy.deepcopy(model)
    opt = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5)
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine = autopar.parallelize(model, world, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, optimizer=opt, plan=plan, compile=True)
    ref_opt = opt(reference.parameters())
    losses, measured, predicted = [], None, None
    for step in range(steps):
        engine.comm_log.clear()
        loss = engine.train_step(inputs, target)
        if step == 0:
            measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
            predicted = engine.predicted_comm(batch)  # (experts: this step's routing)
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference(*inputs), target)
        ref_loss.backward()
        ref_opt.step()
        losses.append(abs(loss - ref_loss.item()) / abs(ref_loss.item()))
    full, ref = engine.full_state_dict(), reference.state_dict()
    weights = max(relative(full[k], ref[k]) for k in ref
                  if ref[k].dtype.is_floating_point and ref[k].norm() > 1e-6)
    graphs = [m for m in (engine.train_gm, *(
        [] if engine.pipeline is None else [m for _, m in engine.pipeline.held_modules()]))]
    return {"loss": max(losses), "weights": weights, "measured": measured,
            "predicted": predicted,
            "breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"],
            "compiled": engine.regions.compiled, "regions": engine.regions.regions,
            "explained": engine.explain(format="json")["compile"] if steps > 1 else None,
            "in_regions": sorted({str(n.target) for g in graphs for n in _region_nodes(g)
                                  if n.op == "call_function"})}


def _region_nodes(gm):
    for module in gm.modules():
        if isinstance(module, Region):
            yield from module.function._orig_mod.graph.nodes


PLANS = {
    "tensor-1d-sp": {"tensor": {"size": 2, "mode": "1d", "sequence_parallel": True}},
    "zero3": {"data": 2, "zero": {"stage": 3}},
    "pipeline": {"pipeline": {"size": 2, "schedule": "1f1b", "microbatches": 2}},
    "ring": {"sequence": {"size": 2, "mode": "ring"}},
    "experts": {"expert": 2},
    "ulysses": {"sequence": {"size": 2, "mode": "ulysses"}},
    "selective-tensor": {"tensor": {"size": 2, "mode": "1d"}, "recompute": "selective"},
    "selective-zero2": {"data": 2, "zero": {"stage": 2}, "recompute": "selective"},
    "full-tensor": {"tensor": {"size": 2, "mode": "1d"}, "recompute": "full"},
}
PLANS4 = {"2d": {"tensor": {"size": 4, "mode": "2d"}},
          "2.5d": {"tensor": {"size": 4, "mode": "2.5d", "depth": 1}}}
# a pipeline rank runs half the blocks: four, so that each rank repeats one
MODEL_OF = {"pipeline": _deep_gpt, "experts": "moe-tiny"}


def _check_compiled(results, fused: bool = True):
    for r in results:
        assert r["loss"] <= 1e-4 and r["weights"] <= 1e-4, r
        assert r["measured"] == r["predicted"]
        assert r["breaks"] == 0
        assert r["explained"]["compiled_functions"] == r["compiled"]
        if not fused:
            continue
        # the second block reuses the first's function (a function may compile once more
        # for inputs of other shapes: dynamo's guards)
        assert 1 <= r["compiled"] <= r["graphs"] < r["regions"]
        assert "linear" in str(r["in_regions"])
        # engine.explain: the compiled regions beside the fusion the plan prices
        assert r["explained"]["predicted_fusion_s"] < 0


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_compiled_plans_equal_one_device(pool2, plan):
    results = pool2.run(compiled_against_one_device, MODEL_OF.get(plan, "gpt-tiny"),
                        PLANS[plan])
    _check_compiled(results)
    if plan == "pipeline":
        # a stage's graph reads its weights with get_attr nodes between its ops; they do
        # not cut a block: each rank's two blocks are one region each, norms included, as
        # a data plan's (they were four regions each, the norms left eager, before)
        for r in results:
            assert r["regions"] == 2 and r["compiled"] == 1, r
            assert "aten.layer_norm.default" in r["in_regions"], r


@pytest.mark.parametrize("plan", sorted(PLANS4))
def test_compiled_grid_plans_equal_one_device(pool4, plan):
    """2D (SUMMA on 2 x 2) and 2.5D (2 x 2 x 1) train compiled as one device: the grid
    kernels (linears, norms, attention) are autopar's modules, outside the regions, and
    what lies between two of them in a block is one elementwise op (an activation, a
    residual add), which stays eager: nothing to fuse, no graph to break."""
    for r in pool4.run(compiled_against_one_device, "gpt-tiny", PLANS4[plan]):
        assert r["regions"] == r["compiled"] == 0, r
        _check_compiled([r], fused=False)


def test_compiled_3d_equals_one_device(pool8):
    """3D (a 2 x 2 x 2 cube): like the other grids, its kernels stay eager and nothing
    between them fuses, so compile changes nothing and the run equals one device."""
    for r in pool8.run(compiled_against_one_device, "gpt-tiny",
                       {"tensor": {"size": 8, "mode": "3d"}}):
        assert r["regions"] == r["compiled"] == 0, r
        _check_compiled([r], fused=False)


def compiled_fp8_against_eager_fp8(plan, steps: int = 3, batch: int = 8) -> dict:
    """Train the fp8 tests' GPT-2 in fp8 compiled under `plan`, and in fp8 eagerly on one
    device, in this process."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, inputs, target, loss_fn = hf_gpt2(batch)
    one = copy.deepcopy(model)
    opt = functools.partial(torch.optim.SGD, lr=0.1)
    small = tuple(t[:2] for t in inputs)
    engine = autopar.parallelize(model, dist.get_world_size(), example_inputs=small,
                                 loss_fn=loss_fn, optimizer=opt, plan=plan, precision="fp8",
                                 compile=True)
    reference = autopar.parallelize(one, 1, example_inputs=small, loss_fn=loss_fn,
                                    optimizer=opt, plan={}, precision="fp8")
    engine.comm_log.clear()
    losses = [engine.train_step(inputs, target)]
    measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
    losses += [engine.train_step(inputs, target) for _ in range(steps - 1)]
    ref = [reference.train_step(inputs, target) for _ in range(steps)]
    full, exact = engine.full_state_dict(), reference.full_state_dict()
    keys = [k for k in exact if exact[k].dtype.is_floating_point and exact[k].norm() > 1e-6]
    flat = lambda state: torch.cat([state[k].reshape(-1).float() for k in keys])  # noqa: E731
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref)),
            "model": relative(flat(full), flat(exact)), "measured": measured,
            "predicted": engine.predicted_comm(batch),
            "breaks": sum(counters["graph_break"].values()), "regions": engine.regions.regions,
            "converted": len(engine.float8.converted)}


def test_compiled_fp8_equals_eager_fp8_on_one_device(pool2):
    """fp8 under tensor 1D, compiled: the float8 linears are autopar's modules (their casts
    and scaled GEMMs eager), the norms, activations and residuals between them compiled;
    losses and weights within the fp8 tests' bounds of the eager fp8 run on one device."""
    from test_fp8_runtime import LOSS_TOL, MODEL_TOL

    for r in pool2.run(compiled_fp8_against_eager_fp8, {"tensor": {"size": 2, "mode": "1d"}}):
        assert r["loss"] <= LOSS_TOL and r["model"] <= MODEL_TOL, r
        assert r["measured"] == r["predicted"]
        assert r["breaks"] == 0 and r["regions"] > 0 and r["converted"] > 0, r


def test_compile_time_does_not_grow_with_depth():
    """Two and four blocks: the same compiled functions, one per distinct region."""
    shallow = compiled_against_one_device("gpt-tiny", {}, steps=1, batch=4)
    deep = compiled_against_one_device(_deep_gpt, {}, steps=1, batch=4)
    assert deep["compiled"] == shallow["compiled"]
    assert deep["graphs"] == shallow["graphs"]
    assert deep["regions"] == shallow["regions"] + 2  # one region per block
    assert deep["breaks"] == 0 and deep["loss"] <= 1e-4 and deep["weights"] <= 1e-4


def test_collectives_and_draws_stay_outside_regions():
    """What compiles: functional aten ops, attention without dropout; what does not: the
    collectives' modules, random draws, in-place ops."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    nodes = {
        "gelu": graph.call_function(torch.ops.aten.gelu.default, (x,)),
        "sdpa": graph.call_function(torch.ops.aten.scaled_dot_product_attention.default,
                                    (x, x, x), {"dropout_p": 0.0}),
        "sdpa_drop": graph.call_function(torch.ops.aten.scaled_dot_product_attention.default,
                                         (x, x, x, None, 0.1)),
        "rand": graph.call_function(torch.ops.aten.rand_like.default, (x,)),
        "add_": graph.call_function(torch.ops.aten.add_.Tensor, (x, x)),
        "module": graph.call_module("collective", (x,)),
    }
    assert {k for k, n in nodes.items() if compilable(n)} == {"gelu", "sdpa"}


def test_compile_argument_is_checked():
    model, (x,) = zoo_build("gpt-tiny", batch=2, device="cpu", seed=0)
    with pytest.raises(PlanError, match="compile must be True or False"):
        autopar.parallelize(model, 1, example_inputs=(x,), plan={}, compile="yes")
    assert PREFIX == "autopar_region"


def test_regions_name_the_vector_width():
    """Inductor's graph cache key does not hold the vector width of the C++ it generates, so
    the regions name it (cpp.simdlen): a process whose width probe failed (scalar loops) and
    one whose probe worked never share compiled regions. Where ATen runs AVX2 kernels the
    probe must find a width too, else inductor's kernels here are scalar."""
    width = cpu_options()["cpp.simdlen"]
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    assert width == pick_vec_isa().bit_width()
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert width >= 256


def test_planner_prices_fusion():
    """compile=True: a block's memory-bound ops fuse into fewer kernels moving fewer bytes,
    the predicted step is shorter by the named effect, and explain shows it."""
    from autopar.cost.model import FUSION
    from autopar.models.zoo import workload
    from autopar.search.planner import prepare

    w = workload("llama2-7b", batch=1)
    chain = prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                    repeat=w.repeat, tp_sizes=[1])
    block = next(lt for lt in chain.types if lt.is_block)
    assert block.fused_kernels < block.kernels - len(block.gemms) - len(block.attention)
    assert 0 < block.fused_share(1) < 1
    embedding = next(lt for lt in chain.types if not lt.is_block and lt.traffic(1) > 0)
    assert embedding.fused_share(1) == 1.0  # one op: nothing to fuse
    world = autopar.World(devices=8, device="h100-80gb")
    eager, compiled = (autopar.plan(w.model, w.inputs, world, loss_fn=w.loss_fn,
                                    example_target=w.target, repeat=w.repeat, global_batch=8,
                                    constraints={"tp": 1, "pp": 1, "zero": 1}, compile=c)
                       for c in (False, True))
    assert compiled.search["compile"] and not eager.search["compile"]
    assert compiled.predicted["step_time_s"] < eager.predicted["step_time_s"]
    assert FUSION in compiled.explain() and FUSION not in eager.explain()


def test_recomputed_region_replays_without_recompiling():
    """A fully recomputed layer's regions run again in the backward with the inputs of the
    forward: its parameters as themselves, not as the plain tensors its saved inputs unpack
    to, so dynamo does not compile the region a second time (the second graph would save its
    tensors in another order than the forward's, and the replay would refuse them)."""
    from torch._dynamo.utils import counters

    from autopar.kernels.recompute import Recomputed
    from autopar.runtime.compile import CompiledRegions

    torch._dynamo.reset()
    counters.clear()
    aten = torch.ops.aten
    graph = fx.Graph()
    x, w, b = (graph.placeholder(n) for n in ("x", "w", "b"))
    h = graph.call_function(aten.gelu.default, (graph.call_function(aten.linear.default,
                                                                     (x, w, b)),))
    graph.output((graph.call_function(aten.mul.Tensor, (h, h)),))
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    inputs = torch.randn(4, 8, requires_grad=True)
    regions = CompiledRegions()
    layer = Recomputed(fx.GraphModule(torch.nn.Module(), graph), "block", "full")
    assert regions.compile_graph(layer.inner) == 1
    layer(inputs, lin.weight, lin.bias)[0].sum().backward()
    got = [t.grad.clone() for t in (inputs, lin.weight, lin.bias)]
    for t in (inputs, lin.weight, lin.bias):
        t.grad = None
    (torch.nn.functional.gelu(lin(inputs)) ** 2).sum().backward()
    for g, t in zip(got, (inputs, lin.weight, lin.bias)):
        assert relative(g, t.grad) <= 1e-5
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
