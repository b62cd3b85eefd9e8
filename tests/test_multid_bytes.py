"""The planner's per-rank state bytes equal what the runtime holds under 2D, 2.5D and 3D
tensor plans: parameters (weights, biases and norms, each split as the grid kernels split
it), gradients and AdamW's moments, fp32, one rank's worst, compared with
`engine.parameter_bytes()`, the gradients after a step and the optimizer's state."""

import functools

import pytest
import torch
from distributed import dist_pool_fixture
from equivalence import build

pool4 = dist_pool_fixture(4)
pool8 = dist_pool_fixture(8)

GPT = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"  # biases and layer norms
LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,ffn=64,vocab=64,seq=16"  # RMS norms


def _plan(name: str, mode: str, depth: int, world: int):
    """The plan the planner gives for `mode` over `world` ranks, searched once here (every
    rank would search alike: the search is deterministic and reads no process group)."""
    import autopar
    from autopar.world import World

    model, inputs, target, loss_fn = build(name, 8)
    constraints = {"tp": world, "tp_mode": mode, "pp": 1, "zero": 0, "recompute": "none"}
    plan = autopar.plan(model, tuple(t[:2] for t in inputs), World(world, device="cpu"),
                        global_batch=8, constraints=constraints, loss_fn=loss_fn,
                        example_target=target[:2], dtype="fp32")
    assert plan.tp_depth == depth
    return plan


def _held(name: str, plan) -> dict:
    """This rank's state bytes under `plan`, beside the planner's prediction for it."""
    import torch.distributed as dist

    import autopar

    model, inputs, target, loss_fn = build(name, 8)
    trained = {n for n, _ in model.named_parameters()}  # (not the rope tables: buffers)
    world = dist.get_world_size()
    engine = autopar.parallelize(model, world, example_inputs=tuple(t[:2] for t in inputs),
                                 loss_fn=loss_fn, plan=plan,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    engine.train_step(inputs, target)
    params = [p for p in engine.parameters() if p.requires_grad]
    state = [v for per in engine.optimizer.state.values() for v in per.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"parameters": sum(held for n, (held, _) in engine.parameter_bytes().items()
                              if n in trained),
            "gradients": sum(p.numel() * p.element_size() for p in params),
            "optimizer": sum(v.numel() * v.element_size() for v in state),
            "predicted": plan.predicted["memory_breakdown_bytes"]}


@pytest.mark.parametrize("name", [GPT, LLAMA])
def test_2d_state_bytes_equal_the_runtime(pool4, name):
    _assert_equal(pool4.run(_held, name, _plan(name, "2d", 1, 4)))


@pytest.mark.parametrize("mode, depth", [("2.5d", 2), ("3d", 1)])
def test_25d_and_3d_state_bytes_equal_the_runtime(pool8, mode, depth):
    _assert_equal(pool8.run(_held, GPT, _plan(GPT, mode, depth, 8)))


def _assert_equal(results: list[dict]) -> None:
    predicted = results[0]["predicted"]
    for kind in ("parameters", "gradients", "optimizer"):
        held = max(r[kind] for r in results)
        assert predicted[kind] == held, (kind, predicted[kind], held)
