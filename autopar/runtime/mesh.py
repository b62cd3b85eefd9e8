"""Process groups per mesh axis, built on torch's DeviceMesh."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import WorldError
from autopar.runtime.collectives import AxisGroup, CommLog


def axis_groups(mesh: dict[str, int], log: CommLog | None = None) -> dict[str, AxisGroup]:
    """One AxisGroup per axis of `mesh` (e.g. {"dp": 2, "tp": 2}) for the calling rank.

    With a world of one, no process group is needed and every axis has size 1.
    """
    log = log if log is not None else CommLog()
    size = 1
    for v in mesh.values():
        size *= v
    if size == 1:
        return {axis: AxisGroup(axis, 1, 0, None, log) for axis in mesh}
    if not dist.is_available() or not dist.is_initialized():
        raise WorldError(f"a world of {size} needs torch.distributed; launch with "
                         f"`torchrun --nproc-per-node {size} ...` (autopar initialises the "
                         "process group when the launcher's environment is present).")
    if dist.get_world_size() != size:
        raise WorldError(f"the plan needs {size} processes but this job has "
                         f"{dist.get_world_size()}; launch with --nproc-per-node {size} or "
                         f"pass world={dist.get_world_size()}.")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    names = tuple(mesh)
    device_mesh = torch.distributed.device_mesh.init_device_mesh(
        device, tuple(mesh[a] for a in names), mesh_dim_names=names)
    out = {}
    for axis in names:
        out[axis] = AxisGroup(axis, mesh[axis], device_mesh.get_local_rank(axis),
                              device_mesh.get_group(axis) if mesh[axis] > 1 else None, log)
    return out
