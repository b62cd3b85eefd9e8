"""Process groups per mesh axis on torch's DeviceMesh (`axis_groups`; `tensor_groups` for
2D, 2.5D and 3D grids), shared by every engine that asks for the same ranks (a gloo group
keeps its threads)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import WorldError
from autopar.kernels.collectives import AxisGroup, CommLog, exchange_objects
from autopar.modes import AXES, CP, DP, DP_REPLICATE, DP_SHARD, EDP, EP, PP, TOKENS, TP, TP_1D
from autopar.sharding.axes import TensorMesh

_SHARED: dict = {}  # key -> device mesh or group, for the default group under "world"


def shared_group(key: tuple, make):
    """`make()` once per default process group and `key`, the same object after (every
    rank asks for the same keys in the same order, so `make` stays collective)."""
    world = dist.group.WORLD
    if _SHARED.get("world") is not world:
        _SHARED.clear()
        _SHARED["world"] = world
    if key not in _SHARED:
        _SHARED[key] = make()
    return _SHARED[key]


def _device_mesh(device: str, sizes: tuple, names: tuple):
    return shared_group(("mesh", device, sizes, names),
                        lambda: torch.distributed.device_mesh.init_device_mesh(
                            device, sizes, mesh_dim_names=names))


def plan_groups(plan) -> dict[str, AxisGroup]:
    """The process groups a Plan runs on, per mesh axis: one DeviceMesh (pp, dp, cp, tp; pp
    and cp only when split) under 1D tensor parallelism, the grid's groups under 2D, 2.5D
    and 3D (a cp axis is the grid mesh's outermost dim, `Plan.tensor_mesh`). A new axis's
    groups are made here, where every engine gets its groups."""
    tensor = plan.tensor_mesh()
    if tensor.mode != TP_1D:
        groups = tensor_groups(plan.mesh[DP], tensor, pp=plan.mesh[PP])
    else:
        groups = axis_groups({a: plan.mesh[a] for a in AXES
                              if a in (DP, TP) or plan.mesh[a] > 1})
    groups.update(expert_groups(groups[DP], plan.ep, groups.get(CP)))
    if plan.dp_replicate > 1:  # HSDP: ZeRO's shard and replica groups inside dp
        groups.update(hybrid_groups(groups[DP], plan.dp_shard))
    return groups


def axis_groups(mesh: dict[str, int], log: CommLog | None = None) -> dict[str, AxisGroup]:
    """One AxisGroup per axis of `mesh` (e.g. {"dp": 2, "tp": 2}) for the calling rank
    (with a world of one every axis has size 1, no process group)."""
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
    device_mesh = _device_mesh(device, tuple(mesh[a] for a in names), names)
    out = {}
    for axis in names:
        out[axis] = AxisGroup(axis, mesh[axis], device_mesh.get_local_rank(axis),
                              device_mesh.get_group(axis) if mesh[axis] > 1 else None, log)
    return out


def tensor_groups(dp: int, mesh: TensorMesh, log: CommLog | None = None,
                  pp: int = 1) -> dict[str, AxisGroup]:
    """AxisGroups for `dp` and every tensor axis of `mesh` that is a process group (cp too,
    where the grid holds one), and for `pp` (outermost) when the plan has a pipeline."""
    log = log if log is not None else CommLog()
    dims = (((PP, pp),) if pp > 1 else ()) + ((DP, dp),) + mesh.dims
    names = tuple(name for name, _ in dims)
    sizes = tuple(size for _, size in dims)
    world = pp * dp * mesh.total
    if world == 1 or not dist.is_available() or not dist.is_initialized():
        if world > 1:  # raises the launcher sentence
            axis_groups({PP: pp, DP: dp, TP: mesh.total}, log)
        return {a: AxisGroup(a, 1, 0, None, log) for a in (DP,) + mesh.axes}
    if dist.get_world_size() != world:
        raise WorldError(f"the plan needs {world} processes but this job has "
                         f"{dist.get_world_size()}; launch with --nproc-per-node {world} or "
                         f"pass world={dist.get_world_size()}.")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    device_mesh = _device_mesh(device, sizes, names)
    out = {}
    for name, size in dims:
        out[name] = AxisGroup(name, size, device_mesh.get_local_rank(name),
                              device_mesh.get_group(name) if size > 1 else None, log)
    coords = {name: device_mesh.get_local_rank(name) for name in names}
    ranks = torch.arange(world).reshape(sizes)
    for axis in mesh.axes:
        comps = mesh.components(axis)
        if axis in out or not mesh.has_group(axis):
            continue
        out[axis] = _composite_group(axis, comps, names, ranks, coords, mesh, log)
    return out


def _composite_group(axis: str, comps: tuple, names: tuple, ranks: torch.Tensor,
                     coords: dict[str, int], mesh: TensorMesh, log: CommLog) -> AxisGroup:
    """The group of the ranks that differ only in `comps`; every rank creates every such group
    in the same order, as new_group requires, and keeps its own."""
    keep = [names.index(c) for c in comps]
    others = [d for d in range(len(names)) if d not in keep]
    moved = ranks.permute(others + keep).reshape(-1, mesh.size(axis))
    rows = tuple(tuple(sorted(row)) for row in moved.tolist())
    groups = shared_group(("rows", rows), lambda: [dist.new_group(list(row)) for row in rows])
    mine = next(g for row, g in zip(rows, groups) if dist.get_rank() in row)
    rank = dist.get_rank(mine)
    index = mesh.index(axis, coords)
    if rank != index:
        raise RuntimeError(f"the process group of axis '{axis}' ranks this process {rank}, but "
                           f"the kernels expect index {index} (components {comps})")
    return AxisGroup(axis, mesh.size(axis), rank, mine, log)


def expert_groups(dp: AxisGroup, ep: int, cp: AxisGroup | None = None) -> dict[str, AxisGroup]:
    """The expert axis inside dp x cp (Megatron-Core's layout: a sequence's shards are more
    tokens to route): the ranks of one dp group and its members' cp groups, in rank order
    (dp major, cp minor: index i = d * cp + c), split into ep groups of `ep` neighbours (the
    ranks that split the experts, ep index i % ep) and expert-data groups of the ranks
    holding the same experts (index i // ep); and, with cp split, the group of all of them
    (TOKENS, logged as dp), which sums the balance loss's statistics. Collective: every
    rank learns every dp and cp group, so all create the same groups in the same order."""
    cp_size = cp.size if cp is not None else 1
    if ep == 1:
        return {EP: AxisGroup(EP, 1, 0, None, dp.log), EDP: dp}
    if (dp.size * cp_size) % ep:
        raise WorldError(f"expert size {ep} does not divide the {dp.size} x {cp_size} data x "
                         "sequence ranks.")
    me = dist.get_rank()
    mine = (tuple(dist.get_process_group_ranks(dp.group)) if dp.size > 1 else (me,),
            tuple(dist.get_process_group_ranks(cp.group)) if cp_size > 1 else (me,))
    pairs = exchange_objects(mine)
    cp_of = {r: pairs[r][1] for r in range(len(pairs))}
    rows = sorted({tuple(sorted({m for d in dp_row for m in cp_of[d]}))
                   for dp_row, _ in pairs})
    ep_rows = [row[i:i + ep] for row in rows for i in range(0, len(row), ep)]
    edp_rows = [row[i::ep] for row in rows for i in range(ep)]
    tokens = tuple(rows) if cp_size > 1 else None  # (the same ranks without cp: no group)
    made = shared_group(("experts", tuple(ep_rows), tuple(edp_rows), tokens), lambda: (
        [dist.new_group(list(r)) for r in ep_rows], [dist.new_group(list(r)) for r in edp_rows],
        [dist.new_group(list(r)) for r in rows] if cp_size > 1 else []))
    out = {}
    kinds = [(EP, EP, ep_rows, made[0]), (EDP, EDP, edp_rows, made[1])]
    if cp_size > 1:
        kinds.append((TOKENS, DP, rows, made[2]))
    for key, axis, rows_, groups in kinds:
        row, group = next((r, g) for r, g in zip(rows_, groups, strict=True) if me in r)
        out[key] = AxisGroup(axis, len(row), row.index(me), group if len(row) > 1 else None,
                             dp.log)
    return out


def data_context_group(dp: AxisGroup, cp: AxisGroup) -> AxisGroup:
    """The ranks of this rank's dp group and their cp groups as one group, logged as dp:
    Megatron's data-and-context group, over which gradients that cp's ranks hold partial
    sums of are summed in one all-reduce. Collective: every rank learns every dp and cp
    group, so all create the same groups in the same order."""
    me = dist.get_rank()
    mine = (tuple(dist.get_process_group_ranks(dp.group)) if dp.size > 1 else (me,),
            tuple(dist.get_process_group_ranks(cp.group)) if cp.size > 1 else (me,))
    pairs = exchange_objects(mine)
    rows = sorted({tuple(sorted({m for d in dp_row for m in pairs[d][1]}))
                   for dp_row, _ in pairs})
    made = shared_group(("data_context", tuple(rows)),
                        lambda: [dist.new_group(list(r)) for r in rows])
    row, group = next((r, g) for r, g in zip(rows, made, strict=True) if me in r)
    return AxisGroup(DP, len(row), row.index(me), group if len(row) > 1 else None, dp.log)


def hybrid_groups(dp: AxisGroup, shard: int) -> dict[str, AxisGroup]:
    """The dp_shard groups (runs of `shard` consecutive members of each dp group, dp index
    i // shard) and the dp_replicate groups (the members at the same place of every run, dp
    index i % shard). Collective: every rank learns every dp group, so all create the same
    groups in the same order."""
    if dp.size % shard:
        raise WorldError(f"data shard size {shard} does not divide the {dp.size} data-parallel "
                         "ranks; choose a divisor.")
    mine = tuple(dist.get_process_group_ranks(dp.group)) if dp.size > 1 else (dist.get_rank(),)
    rows = sorted(set(exchange_objects(mine)))
    shard_rows = [row[i:i + shard] for row in rows for i in range(0, len(row), shard)]
    replicate_rows = [row[i::shard] for row in rows for i in range(shard)]
    made = shared_group(("hybrid", tuple(shard_rows), tuple(replicate_rows)), lambda: (
        [dist.new_group(list(r)) for r in shard_rows],
        [dist.new_group(list(r)) for r in replicate_rows]))
    me, out = dist.get_rank(), {}
    for axis, rows_, groups in ((DP_SHARD, shard_rows, made[0]),
                                (DP_REPLICATE, replicate_rows, made[1])):
        row, group = next((r, g) for r, g in zip(rows_, groups, strict=True) if me in r)
        out[axis] = AxisGroup(axis, len(row), row.index(me), group if len(row) > 1 else None,
                              dp.log)
    return out
