"""A plan a person can read: per-layer strategy, collectives, memory per device.

Everything here is derived from the sharding solution, the same values the rewrite pass
emits and the runtime logs, so what explain prints is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import sympy
import torch

from autopar.cost.precision import runtime
from autopar.graph.analysis import OpKind, node_label
from autopar.graph.trace import BATCH, TracedGraph
from autopar.modes import DP, NO_RECOMPUTE, NO_SP, TP_1D
from autopar.sharding.solve import Solution

if TYPE_CHECKING:  # annotations only: report sits below plans
    from autopar.plans import Plan


@dataclass
class LayerReport:
    name: str
    tp_mode: str
    strategies: list[str]  # "c_attn: column", ...
    params_local_bytes: int
    params_bytes: int
    comm: dict  # (op, phase) -> bytes per device per micro-batch
    notes: list[str]


def layer_reports(traced: TracedGraph, solution: Solution, micro_batch: int) -> list[LayerReport]:
    by_name = {layer.name: layer for layer in traced.layers}
    comm_by_node: dict[str, list] = {}
    for c in solution.comm:
        comm_by_node.setdefault(c.where, []).append(c)
    out = []
    for layer in traced.layers:
        strategies, notes, comm = [], [], {}
        local = whole = 0
        for node in by_name[layer.name].nodes:
            info = node.meta["autopar"]
            if node.op == "get_attr":
                pinfo = traced.params.get(node.target)
                if pinfo is None:
                    continue
                nbytes = _numel(pinfo.shape) * torch.empty((), dtype=pinfo.dtype).element_size()
                layout = solution.params.get(node.target)
                parts = solution.size if layout is not None and layout.shards else 1
                local += nbytes // parts
                whole += nbytes
                continue
            strategy = solution.strategies.get(node)
            if strategy is None:
                continue
            if info.kind in (OpKind.LINEAR, OpKind.EMBEDDING, OpKind.ATTENTION, OpKind.LOSS,
                             OpKind.MATMUL, OpKind.GROUPED_MM, OpKind.MOE, OpKind.OTHER):
                where = info.module.rsplit(".", 1)[-1] if info.module and \
                    info.module != layer.name else info.kind.value
                strategies.append(f"{where}: {strategy.name}")
            if strategy.note and f"{node_label(node)}: {strategy.note}" not in notes:
                notes.append(f"{node_label(node)}: {strategy.note}")
            for c in comm_by_node.get(node.name, []):
                key = (c.op, c.phase)
                comm[key] = comm.get(key, 0) + int(sympy.sympify(c.bytes).subs(BATCH, micro_batch))
        out.append(LayerReport(layer.name, solution.modes.get(layer.name, TP_1D), strategies,
                               local, whole, comm, notes))
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def report(traced: TracedGraph, solution: Solution, plan: Plan, global_batch: int,
           tokens_per_sample: int) -> dict:
    """The plan as the JSON object of the public contract (fields that exist at this stage)."""
    dp = plan.mesh[DP]
    micro = global_batch // dp
    layers = layer_reports(traced, solution, micro)
    param_local = sum(lr.params_local_bytes for lr in layers)
    param_whole = sum(lr.params_bytes for lr in layers)
    tp_comm = sum(sum(lr.comm.values()) for lr in layers)
    dp_comm = param_local if dp > 1 else 0
    n_params = sum(_numel(p.shape) for p in traced.params.values() if p.is_parameter)
    held = runtime(next((p.dtype for p in traced.params.values() if p.is_parameter),
                        torch.float32))  # what the runtime's AdamW holds per weight byte
    plan.set_layer_modes({lr.name: lr.tp_mode for lr in layers})
    plan.pipeline.micro_batch_size = micro
    predicted = {
        "memory_per_device_bytes": param_local * held.total // held.weights,
        "parameter_bytes_per_device": param_local,
        "parameter_bytes": param_whole,
        "comm_bytes_per_device": tp_comm + dp_comm,
        # 6 FLOPs per parameter per token: forward 2, backward 4 (Kaplan et al. 2020)
        "model_flops_per_step": 6 * n_params * global_batch * tokens_per_sample,
    }
    plan.predicted = predicted
    data = plan.to_json()
    data["layers"] = [{"name": lr.name, "tp_mode": lr.tp_mode, "sp": NO_SP,
                       "recompute": NO_RECOMPUTE, "stage": 0, "strategies": lr.strategies,
                       "params_bytes_per_device": lr.params_local_bytes,
                       "comm_bytes_per_device": {f"{op}/{phase}": b
                                                 for (op, phase), b in lr.comm.items()},
                       "notes": lr.notes} for lr in layers]
    data["replicated_ops"] = solution.notes()
    data["replicated_groups"] = replicated_groups(solution)
    return data


def replicated_groups(solution: Solution) -> list[dict]:
    """Ops that run replicated, one entry per (op, reason) with its nodes (named by module,
    `node_label`) and layers (one entry for a model of many identical layers)."""
    groups: dict[tuple[str, str], dict] = {}
    for node, strategy in solution.strategies.items():
        if not strategy.note:
            continue
        op = str(node.target) if isinstance(node.target, torch._ops.OpOverload) else \
            getattr(node.target, "__name__", str(node.target))
        group = groups.setdefault((op, strategy.note), {"op": op, "note": strategy.note,
                                                        "nodes": [], "layers": []})
        group["nodes"].append(node_label(node))
        layer = node.meta["autopar"].layer
        if layer not in group["layers"]:
            group["layers"].append(layer)
    return list(groups.values())


def replicated_line(group: dict) -> str:
    nodes, layers = group["nodes"], group["layers"]
    if len(nodes) == 1:
        return f"{nodes[0]}: {group['note']}"
    names = list(dict.fromkeys(nodes))  # a module may run the op more than once
    if len(names) == 1:
        return f"{names[0]}, {len(nodes)} ops: {group['note']}"
    names = ", ".join(names) if len(names) == 2 else f"{names[0]} ... {names[-1]}"
    where = f"in {layers[0]}" if len(layers) == 1 else f"in {len(layers)} layers"
    return f"{names} ({len(nodes)} ops {where}): {group['note']}"


def as_text(data: dict, top: int | None = None) -> str:
    mesh = " x ".join(f"{a}={v}" for a, v in data["mesh"].items())
    world = data.get("world") or {}
    pred = data["predicted"]
    lines = [f"autopar plan: mesh {mesh}"
             + (f" on {world['devices']} x {world['device']} ({world['per_node']} per node)"
                if world else ""),
             f"  tensor mode {data['tensor']['mode']}, ZeRO {data['zero']['stage']}, "
             f"micro-batch {data['pipeline']['micro_batch_size']}",
             f"  parameters per device {_gib(pred['parameter_bytes_per_device'])} of "
             f"{_gib(pred['parameter_bytes'])}; with gradients and AdamW states "
             f"{_gib(pred['memory_per_device_bytes'])}",
             f"  communication per device per step {_gib(pred['comm_bytes_per_device'])}; "
             f"model FLOPs per step {pred['model_flops_per_step']:.3e}",
             "", f"  {'layer':<28} {'mode':<9} {'params/dev':>11} {'comm/dev':>11}  strategy"]
    rows = data["layers"] if top is None else data["layers"][:top]
    for lr in rows:
        comm = sum(lr["comm_bytes_per_device"].values())
        lines.append(f"  {lr['name']:<28} {lr['tp_mode']:<9} "
                     f"{_gib(lr['params_bytes_per_device']):>11} {_gib(comm):>11}  "
                     + ", ".join(lr["strategies"]))
    if top is not None and len(data["layers"]) > top:
        lines.append(f"  ... {len(data['layers']) - top} more layers")
    if data["replicated_groups"]:
        lines.append("")
        lines.append("  runs replicated:")
        lines.extend(f"    {replicated_line(g)}" for g in data["replicated_groups"])
    return "\n".join(lines)


def _gib(nbytes: int) -> str:
    if nbytes >= 1024 ** 3:
        return f"{nbytes / 1024 ** 3:.2f} GiB"
    if nbytes >= 1024 ** 2:
        return f"{nbytes / 1024 ** 2:.2f} MiB"
    return f"{nbytes / 1024:.1f} KiB"
