"""2D, 2.5D and 3D tensor parallelism (gloo, worlds 4 and 8) against the single-device run.

Every plan trains 2 AdamW steps (the second runs Adam on the state the first left); each
loss and the final weights equal the single-device run within 1e-5 relative, and the bytes
of every collective per (op, axis) equal the solution's prediction exactly. Also: a plan
mixing 1D and 2D blocks, 2D with data parallelism, the share of every parameter and of a
block's output activation each rank holds, and the sentences that refuse plans the grid
cannot take.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import assert_equal, build, compare, relative
from pretraced import forked_pool_fixture

import autopar
from autopar.sharding.axes import TensorMesh, role_spec

# worlds forked from the test process once it traced the models (tests/pretraced.py)
MODELS = ["gpt-tiny", "llama-tiny", "vit-tiny", "hf-gpt2"]
pool4 = forked_pool_fixture(4, MODELS, timeout_s=600)
pool8 = forked_pool_fixture(8, MODELS, timeout_s=900)

STEPS = 2
TWO_D = {"tensor": {"size": 4, "mode": "2d"}}
PLANS8 = {"2.5d": {"tensor": {"size": 8, "mode": "2.5d", "depth": 2}},
          "3d": {"tensor": {"size": 8, "mode": "3d"}},
          "2d x dp2": {"tensor": {"size": 4, "mode": "2d"}}}
AXES = {"2d": {"tp_i", "tp_j"}, "2.5d": {"tp_k", "tp_i", "tp_j", "tp_ki"},
        "3d": {"tp_a", "tp_b", "tp_c", "tp_ba", "tp_bc"}, "2d x dp2": {"tp_i", "tp_j", "dp"}}


# One run per (model, plan): the memory tests read the gpt-tiny 2D and 3D runs that the
# equivalence tests made (with the `_shares` probe, which reads the engine after the first
# step), instead of training the same plan again. A test run alone makes its own.
_RUNS: dict = {}


def _run(pool, model: str, plan: str) -> list[dict]:
    if (model, plan) not in _RUNS:
        probe = _shares if (model, plan) in (("gpt-tiny", "2d"), ("gpt-tiny", "3d")) else None
        _RUNS[model, plan] = pool.run(compare, model, TWO_D if plan == "2d" else PLANS8[plan],
                                      STEPS, probe=probe)
    return _RUNS[model, plan]


def _check_equal(results, mode: str) -> None:
    assert_equal(results)
    axes = {axis for (_, axis) in results[0]["measured"]}
    assert axes <= AXES[mode] and {"tp_i", "tp_a", "tp_j", "tp_c"} & axes, axes
    ops = {op for (op, _) in results[0]["measured"]}
    kernel = "all_gather" if mode == "3d" else "broadcast"  # 3D gathers, SUMMA broadcasts
    assert kernel in ops, ops


# ----------------------------------------------------------------------------- world 4

@pytest.mark.parametrize("model", MODELS)
def test_2d_equals_single_device(pool4, model):
    _check_equal(_run(pool4, model, "2d"), "2d")


def _layer_strategies(engine, inputs, target) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for node, strategy in engine.train_solution.strategies.items():
        info = node.meta["autopar"]
        if info.kind.value == "linear":
            out.setdefault(info.layer, []).append(strategy.name)
    return out


def test_mixed_1d_and_2d_blocks_equal_single_device(pool4):
    """blocks.0 in 1D over all four ranks, everything else in 2D; the layouts convert at
    the block boundaries."""
    plan = {"tensor": {"size": 4, "mode": "2d", "layers": {"blocks.0": "1d"}}}
    results = pool4.run(compare, "gpt-tiny", plan, STEPS, probe=_layer_strategies)
    for r in results:
        assert r["loss"] <= 1e-5 and r["weights"] <= 1e-5, (r["loss"], r["weights"])
        assert r["measured"] == r["predicted"]
    strategies = results[0]["probe"]
    assert strategies["blocks.0"] == ["column", "row", "column", "row"]
    assert set(strategies["blocks.1"]) == {"2d linear"}
    measured = results[0]["measured"]
    assert ("all_reduce", "tp") in measured and ("broadcast", "tp_j") in measured


def _shares(engine, inputs, target) -> dict:
    """Per parameter: bytes held, the layout and its number of pieces; the shape of the
    output of blocks.0 on this rank (the residual stream after the block); and how far the
    inference graph's output is from the original model loaded with full_state_dict()."""
    sizes = engine.mesh.sizes
    held = engine.parameter_bytes()
    params = {name: (held[name][0], repr(layout), layout.parts(sizes) if layout else 1)
              for name, layout in engine.parameter_layouts().items()}
    last = [n.name for n in engine.train_graph.graph.nodes
            if n.op == "call_function" and n.meta["autopar"].layer == "blocks.0"][-1]
    shapes = []

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            if node.name == last:
                shapes.append(tuple(out.shape))
            return out

    local = engine.batches.local(tuple(inputs) + (target,))
    with torch.no_grad():
        Recorder(engine.train_gm).run(*local)
        model, *_ = build("gpt-tiny", 8)
        model.load_state_dict(engine.full_state_dict())
        model.eval()
        forward = relative(engine(*inputs), model(*inputs))
    return {"params": params, "activation": shapes[0], "forward": forward}


def _check_shares(result: dict, q: int, weight_parts: int) -> None:
    """Every rank holds whole / pieces of each parameter; linear weights are split on both
    dims, norms and the embedding table on hidden only."""
    model, *_ = build("gpt-tiny", 8)
    whole = {k: v.numel() * v.element_size() for k, v in model.state_dict().items()}
    params = result["params"]
    for name, (held, layout, parts) in params.items():
        assert held * parts == whole[name], (name, layout)
    for name, (_held, layout, parts) in params.items():
        if name.endswith(("c_fc.weight", "c_proj.weight", "c_attn.weight")):
            assert parts == weight_parts, (name, layout)
        if ".ln_" in name or name == "wpe.weight":
            assert parts == q, (name, layout)
    total_held = sum(h for h, _, _ in params.values())
    assert total_held < sum(whole[name] for name in params) / q


def test_2d_memory_parameters_and_activations_are_split(pool4):
    results = _run(pool4, "gpt-tiny", "2d")
    for r in results:
        _check_shares(r["probe"], 2, 4)
        assert r["probe"]["forward"] <= 1e-5
        # batch 8 / q and hidden 64 / q (1D keeps the residual stream whole: 8 x 32 x 64)
        assert r["probe"]["activation"] == (4, 32, 32)


def _train_with_batch(batch: int) -> str:
    model, inputs, target, loss_fn = build("gpt-tiny", batch)
    engine = autopar.parallelize(model, 4, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, plan=TWO_D)
    try:
        engine.train_step(inputs, target)
    except autopar.PlanError as e:
        return str(e)
    return "no error"


def test_a_batch_the_grid_does_not_split_is_refused(pool4):
    messages = pool4.run(_train_with_batch, 3)
    assert len(set(messages)) == 1
    assert messages[0] == ("the batch per data-parallel replica (3 of 3 over 1) does not split "
                           "over the 2d batch split of 2; use a global batch that is a multiple "
                           "of 2."), messages[0]


# ----------------------------------------------------------------------------- world 8

@pytest.mark.parametrize("mode", ["2.5d", "3d"])
@pytest.mark.parametrize("model", MODELS)
def test_25d_and_3d_equal_single_device(pool8, model, mode):
    _check_equal(_run(pool8, model, mode), mode)


def test_2d_with_data_parallelism_equals_single_device(pool8):
    _check_equal(pool8.run(compare, "gpt-tiny", PLANS8["2d x dp2"], STEPS), "2d x dp2")



def _searched(name: str, world: int, constraints: dict):
    """The executable search's plan for `name`, searched once here (every rank would search
    alike: the search is deterministic and reads no process group)."""
    from autopar.search import planner
    from autopar.world import World

    model, inputs, target, loss_fn = build(name, 8)
    return planner.plan(model, inputs, World(world, per_node=world), loss_fn=loss_fn,
                        example_target=target, executable=True, constraints=constraints)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_searched_3d_plan_runs_and_equals_single_device(pool8, model):
    """What the executable search hands `parallelize` for a grid: 3D blocks between 1D
    embedding, norm and loss layers, converting at the block boundaries."""
    plan = _searched(model, 8, {"tp": 8, "tp_mode": "3d"})
    assert sorted({lp.tp_mode for lp in plan.layers}) == ["1d", "3d"]
    results = pool8.run(compare, model, plan, STEPS)
    for r in results:
        assert r["loss"] <= 1e-5 and r["weights"] <= 1e-5, (r["loss"], r["weights"])
        assert r["keys_equal"] and r["measured"] == r["predicted"]
    axes = {axis for (_, axis) in results[0]["measured"]}
    assert axes <= AXES["3d"] | {"tp"} and {"tp", "tp_a", "tp_c"} <= axes, axes


def test_3d_memory_parameters_and_activations_are_split(pool8):
    results = _run(pool8, "gpt-tiny", "3d")
    for r in results:
        _check_shares(r["probe"], 2, 8)
        assert r["probe"]["forward"] <= 1e-5
        assert r["probe"]["activation"] == (2, 32, 32)  # batch 8 / q^2, hidden 64 / q


# ----------------------------------------------------------------- no processes needed

@pytest.mark.parametrize("tensor, message", [
    ({"size": 8, "mode": "2d"}, "2d needs a square tensor size; 8 is not one: use 4 or 16."),
    ({"size": 8, "mode": "3d", "layers": {}}, None),
    ({"size": 4, "mode": "3d"}, "3d needs a cube tensor size; 4 is not one: use 8."),
    ({"size": 16, "mode": "3d"}, "3d needs a cube tensor size; 16 is not one: use 8 or 64."),
    ({"size": 8, "mode": "2.5d", "depth": 3},
     "2.5d with depth 3 needs a tensor size of q x q x 3; 8 is not one: use 12, or a depth "
     "that divides 8 and leaves a square."),
    ({"size": 4, "mode": "2d", "layers": {"blocks.0": "3d"}},
     "a plan's layers may mix 1d with one of 2d, 2.5d and 3d, not 2d and 3d; give every "
     "multi-dimensional layer the same mode."),
])
def test_tensor_sizes_that_are_no_grid_are_refused(tensor, message):
    plan = autopar.Plan.from_dict({"tensor": tensor}, tensor["size"])
    if message is None:
        plan.check_grid()
        return
    with pytest.raises(autopar.PlanError) as e:
        plan.check_grid()
    assert str(e.value) == message


def test_a_bad_size_is_refused_before_any_process_work():
    """No process group exists here: the refusal comes first."""
    model, inputs, _, loss_fn = build("gpt-tiny", 2)
    with pytest.raises(autopar.PlanError, match="2d needs a square tensor size"):
        autopar.parallelize(model, 8, example_inputs=inputs, plan=TWO_D | {
            "tensor": {"size": 8, "mode": "2d"}})


@pytest.mark.parametrize("spec, tensor, message", [
    ("gpt:layers=1,hidden=48,heads=6,vocab=64,seq=16", {"size": 16, "mode": "2d"},
     "2d tensor parallelism over 16 ranks splits the attention heads of blocks.0.attn into 4, "
     "and 6 does not divide: use 4 or 8 attention heads, or another tensor size."),
    ("llama:layers=1,hidden=64,heads=8,ffn=102,vocab=64,seq=16", {"size": 8, "mode": "3d"},
     "3d tensor parallelism over 8 ranks splits the output features of "
     "blocks.0.feed_forward.w1 into 4, and 102 does not divide: use 100 or 104 output "
     "features, or another tensor size."),
])
def test_dims_the_grid_does_not_divide_are_refused(spec, tensor, message):
    from autopar.models import build as zoo_build

    model, (x,) = zoo_build(spec, batch=2, device="cpu", seed=0)
    with pytest.raises(autopar.PlanError) as e:
        autopar.parallelize(model, tensor["size"], example_inputs=(x,),
                            plan={"tensor": tensor})
    assert str(e.value) == message


@pytest.mark.parametrize("mode, grid", [("2d", ("tp_j", "tp_i")),
                                        ("2.5d", ("tp_j", "tp_i", "tp_k")),
                                        ("3d", ("tp_a", "tp_b", "tp_c")),
                                        ("3d", ("tp_c", "tp_b", "tp_a"))])
def test_solver_block_layouts_match_the_kernels(mode, grid):
    """The solver's role table (autopar.sharding.axes) is the kernels' (Grid.spec)."""
    from autopar.kernels.collectives import AxisGroup, CommLog
    from autopar.kernels.multid import ROLES, Grid2D, Grid2p5D, Grid3D

    groups = [AxisGroup(a, 2, 0, None, CommLog()) for a in grid]
    kernel_grid = {"2d": Grid2D, "2.5d": Grid2p5D, "3d": Grid3D}[mode](*groups)
    for role in ROLES:
        kernel = {d: tuple(g.axis for g in gs) for d, gs in kernel_grid.spec(role).items()}
        assert role_spec(mode, grid, role) == kernel, role


def test_composite_axes_name_their_components():
    mesh = TensorMesh.for_mode("3d", 8)
    assert mesh.physical == ("tp_b", "tp_a", "tp_c")
    assert mesh.size("tp_ba") == 4 and mesh.has_group("tp_ba") and not mesh.has_group("tp_ab")
    assert mesh.index("tp_ab", {"tp_a": 1, "tp_b": 0, "tp_c": 1}) == 2
    assert mesh.overlap("tp_ba", "tp_a") and not mesh.overlap("tp_ba", "tp_c")
    mesh = TensorMesh.for_mode("2.5d", 8, depth=2)
    assert mesh.dims == (("tp_k", 2), ("tp_i", 2), ("tp_j", 2)) and mesh.size("tp") == 8
