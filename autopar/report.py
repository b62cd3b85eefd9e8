"""The planner's report: what `autopar explain` prints and `--format json` writes.

Built from the Plan the search returned and the layer chain it priced: per-layer strategy,
the collectives each kind of layer runs, memory per device, predicted time, and why this
plan beat the runners-up.
"""

from __future__ import annotations

from collections import Counter

from autopar.cost.comm import placements
from autopar.cost.layer import LayerChain
from autopar.cost.model import Context, LayerState, TensorMode, formulas, state_cost
from autopar.plan import Plan, cp_layout
from autopar.search.search import ORDER

GiB = 1024 ** 3


def plan_report(plan: Plan, chain: LayerChain) -> dict:
    """The JSON object of the public contract, plus per-kind detail and the formulas."""
    data = plan.to_json()
    data["layers"] = [{"name": lp.name, "tp_mode": lp.tp_mode, "sp": lp.sp,
                       "recompute": lp.recompute, "stage": lp.stage} for lp in plan.layers]
    data["layer_kinds"] = _kinds(plan, chain)
    data["replicated_groups"] = []
    if plan.mesh["tp"] > 1 and plan.tp_mode == "1d" and chain.traced is not None:
        _add_strategies(data, plan, chain)
    data["formulas"] = {k: str(v) for k, v in formulas().items()}
    return data


def _kinds(plan: Plan, chain: LayerChain) -> list[dict]:
    world = plan.world
    pl = placements(plan.mesh, ORDER, world.per_node)
    ctx = Context(world.profile, plan.search.get("dtype", "bf16"), pl["tp"], pl["cp"],
                  plan.sequence_mode, plan.search.get("attention_kernel", "flash"))
    b = plan.pipeline.micro_batch_size or 1
    tp = plan.mesh["tp"]
    out = []
    seen: dict[int, dict] = {}
    for index, layer in zip(chain.order, plan.layers):
        lt = chain.types[index]
        entry = seen.get(index)
        if entry is None:
            entry = seen[index] = {"kind": lt.name, "count": 0, "states": Counter(),
                                   "first": layer.name}
            out.append(entry)
        entry["count"] += 1
        entry["last"] = layer.name
        entry["states"][(layer.tp_mode, layer.sp, layer.recompute)] += 1
    rows = []
    for index, entry in seen.items():
        lt = chain.types[index]
        (mode_name, sp, recompute), _ = entry["states"].most_common(1)[0]
        mode = _mode(mode_name, tp, plan.tp_depth)
        cost = state_cost(lt, LayerState(mode, sp, recompute), b, ctx)
        sharded = lt.sharded.get(tp if mode.name == "1d" else 1)
        comm = []
        if sharded is not None and mode.name == "1d" and tp > 1:
            for op, phase, nbytes in sharded.comm:
                shown = op if not (sp == "megatron" and op == "all_reduce" and lt.is_block) else \
                    "reduce_scatter+all_gather"
                comm.append({"op": shown, "axis": "tp", "phase": phase, "bytes": int(nbytes(b))})
        rows.append({
            "kind": lt.name, "layers": entry["count"],
            "span": entry["first"] if entry["count"] == 1 else f"{entry['first']} .. {entry['last']}",
            "tp_mode": mode_name, "sp": sp, "recompute": recompute,
            "states": {"/".join(k): v for k, v in entry["states"].items()},
            "per_micro_batch": {"forward_s": cost.forward, "backward_s": cost.backward,
                                "recompute_s": cost.recompute, "comm_s": cost.comm,
                                "comm_bytes": cost.comm_bytes,
                                "activation_bytes": int(cost.activations)},
            "param_bytes_per_device": int(cost.params),
            "collectives": comm,
            "replicated_ops": sharded.replicated_ops if sharded is not None else [],
        })
    return rows


def _add_strategies(data: dict, plan: Plan, chain: LayerChain) -> None:
    """Per-op strategies of each kind of layer (column, row, heads, vocab-parallel, ...) and
    the ops that run replicated, from the catalog's 1D solution at this tensor size."""
    from autopar.explain import layer_reports, replicated_groups
    from autopar.sharding.solve import solve

    solution = solve(chain.traced, axis="tp", size=plan.mesh["tp"])
    reports = {lr.name: lr for lr in layer_reports(chain.traced, solution,
                                                   plan.pipeline.micro_batch_size or 1)}
    for row in data["layer_kinds"]:
        lr = reports.get(row["kind"])
        row["strategies"] = lr.strategies if lr is not None else []
    data["replicated_groups"] = replicated_groups(solution)


def _mode(name: str, size: int, depth: int) -> TensorMode:
    if size == 1 or name == "1d":
        return TensorMode("1d", size)
    from autopar.cost.model import tensor_modes

    for m in tensor_modes(size):
        if m.name == name and (name != "2.5d" or m.d == depth):
            return m
    return TensorMode("1d", size)


def plan_text(data: dict, top: int | None = None) -> str:
    """The report as text a person reads top to bottom."""
    world, mesh, pred, search = data["world"], data["mesh"], data["predicted"], data["search"]
    pipe, zero, seq = data["pipeline"], data["zero"], data["sequence"]
    lines = [
        f"autopar plan for {world['devices']} x {world['device']} ({world['per_node']} per node)",
        f"  mesh        pp={mesh['pp']} dp={mesh['dp']} cp={mesh['cp']} tp={mesh['tp']}"
        f"  (tp innermost: tensor groups sit inside a node first)",
        f"  tensor      {data['tensor']['mode']}"
        + (f" depth {data['tensor']['depth']}" if data['tensor']['mode'] == "2.5d" else "")
        + (", Megatron sequence parallel" if data["tensor"]["sequence_parallel"] else "")
        + (f"; sequence {seq['mode']} over cp ({cp_layout(seq['mode'], seq.get('layout'))} "
           "tokens)" if seq["mode"] else ""),
        f"  pipeline    {pipe['schedule'] if mesh['pp'] > 1 else 'none'}"
        + (f" x{pipe['chunks']} chunks" if pipe["chunks"] > 1 else "")
        + f", {pipe['microbatches']} micro-batches of {pipe['micro_batch_size']}",
        f"  ZeRO        stage {zero['stage']}" + (" with optimizer offload" if zero["offload"]
                                                   else ""),
        f"  recompute   {data['recompute']}",
        "",
        f"  predicted step {pred['step_time_s']:.3f} s = pipeline/compute "
        f"{pred['compute_s']:.3f} s + tensor comm {pred['tp_comm_s']:.3f} s + bubble "
        f"{pred['bubble_s']:.3f} s + data-parallel sync {pred['dp_comm_s']:.3f} s + optimizer "
        f"{pred['optimizer_s']:.3f} s",
        f"  MFU {100 * pred['mfu']:.1f}%   {pred['tokens_per_s']:.0f} tokens/s   model FLOPs "
        f"per step {pred['model_flops_per_step']:.3e}",
        f"  memory per device {pred['memory_per_device_bytes'] / GiB:.2f} GiB: "
        + ", ".join(f"{k} {v / GiB:.2f}" for k, v in pred["memory_breakdown_bytes"].items()),
        f"  communication per device per step {pred['comm_bytes_per_device'] / GiB:.2f} GiB",
        "",
        f"  {'layers':<26} {'n':>4} {'strategy':<24} {'fwd+bwd ms':>10} {'comm ms':>8} "
        f"{'act/dev':>9} {'params/dev':>10}",
    ]
    kinds = data["layer_kinds"] if top is None else data["layer_kinds"][:top]
    for k in kinds:
        pm = k["per_micro_batch"]
        strategy = f"{k['tp_mode']}" + (" +sp" if k["sp"] == "megatron" else "") + \
            (f" rc:{k['recompute']}" if k["recompute"] != "none" else "")
        if len(k["states"]) > 1:
            strategy += " (" + ", ".join(f"{n}x {s}" for s, n in k["states"].items()) + ")"
        lines.append(f"  {k['span']:<26} {k['layers']:>4} {strategy:<24} "
                     f"{1e3 * (pm['forward_s'] + pm['backward_s'] + pm['recompute_s']):>10.2f} "
                     f"{1e3 * pm['comm_s']:>8.2f} {_size(pm['activation_bytes']):>9} "
                     f"{_size(k['param_bytes_per_device']):>10}")
        if k.get("strategies"):
            lines.append("      " + ", ".join(k["strategies"]))
        for c in k["collectives"]:
            lines.append(f"      {c['phase']:<8} {c['op']:<26} on {c['axis']}: "
                         f"{_size(c['bytes'])} per micro-batch")
    if top is not None and len(data["layer_kinds"]) > top:
        lines.append(f"  ... {len(data['layer_kinds']) - top} more kinds of layer")
    lines += ["", f"  why this plan: searched {search['candidates']} candidates in "
                  f"{search['time_s']:.2f} s ({search.get('total_s', 0):.2f} s with tracing)"]
    for alt in search["alternatives"]:
        lines.append(f"    {alt['plan']}: {alt['reason']}")
    for note in search.get("left_out", []):
        lines.append(f"  left out: {note}")
    if data.get("replicated_groups"):
        from autopar.explain import replicated_line

        lines += ["", "  ran replicated:"]
        lines.extend(f"    {replicated_line(g)}" for g in data["replicated_groups"])
    if data.get("notes"):
        lines.append("")
        lines.extend(f"  note: {n}" for n in data["notes"])
    if "min_devices" in data:
        lines.append(f"\n  fewest devices that fit: {data['min_devices']['devices']}")
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if nbytes >= 1024 ** 2:
        return f"{nbytes / 1024 ** 2:.1f} MiB"
    return f"{nbytes / 1024:.1f} KiB"
