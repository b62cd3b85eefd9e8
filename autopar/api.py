"""The public entry points: `parallelize` (run) and `plan` (plan offline)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import PlanError, WorldError
from autopar.plan import Plan
from autopar.runtime.engine import Engine
from autopar.runtime.mesh import axis_groups
from autopar.world import World


def parallelize(model: nn.Module, world, *, example_inputs, loss_fn=None, optimizer=None,
                plan=None, seed: int = 0) -> Engine:
    """Turn `model` into a distributed training engine over `world` (an int or a World).

    `plan`: None (choose one), a Plan, a path to a plan file, or a Colossal-AI style dict
    such as dict(tensor=dict(size=4, mode="1d")). `optimizer` is a factory taking the
    parameters, e.g. functools.partial(torch.optim.AdamW, lr=3e-4).
    """
    size = _world_size(world)
    _init_process_group(size)
    chosen = _resolve_plan(plan, size, world)
    missing = chosen.unsupported()
    if missing:
        raise PlanError(f"this plan uses {', '.join(missing)}, which the runtime cannot execute "
                        "yet; plan it offline with autopar.plan, or choose data and 1d tensor "
                        "parallelism.")
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    groups = axis_groups({"dp": chosen.mesh["dp"], "tp": chosen.mesh["tp"]})
    return Engine(model, chosen, groups, tuple(example_inputs), loss_fn, optimizer, seed=seed)


def _world_size(world) -> int:
    if isinstance(world, World):
        return world.devices
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise WorldError(f"world must be a positive int or an autopar.World, not {world!r}.")
    return world


def _init_process_group(size: int) -> None:
    """Join the launcher's process group when torchrun started us and nobody did yet."""
    if size == 1 or not dist.is_available() or dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)


def _resolve_plan(plan, size: int, world) -> Plan:
    if plan is None:
        return Plan(mesh={"dp": size}, world=world if isinstance(world, World) else None)
    if isinstance(plan, Plan):
        chosen = plan
    elif isinstance(plan, (str, os.PathLike)):
        chosen = Plan.load(plan)
    elif isinstance(plan, dict):
        chosen = Plan.from_dict(plan, size)
    else:
        raise PlanError(f"plan must be None, a Plan, a path or a dict, not {type(plan).__name__}.")
    if chosen.world_size != size:
        raise PlanError(f"the plan's mesh {chosen.mesh} needs {chosen.world_size} devices but the "
                        f"world has {size}.")
    return chosen
