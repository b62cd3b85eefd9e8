"""The planner's report: what `autopar explain` prints and `--format json` writes.

Per-layer strategy, each kind's collectives, each stage's time, each pipeline rank's memory
by kind, traffic per mesh axis and why the plan won, repriced with the search's own step
pricing (`autopar.cost.step`) so the detail adds up to the prediction.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from autopar.cost import chunked_loss, fp8
from autopar.cost.comm import placements
from autopar.cost.experts import alltoall_count
from autopar.cost.hybrid import SOURCE, hybrid_split
from autopar.cost.layer import LayerChain
from autopar.cost.model import (
    EFFECTS,
    Context,
    LayerState,
    StateCost,
    TensorMode,
    formulas,
    state_cost,
    tensor_modes,
)
from autopar.cost.precision import Precision, precision_of
from autopar.cost.schedule import stage_owner
from autopar.cost.state import STEP_SOURCE
from autopar.cost.step import (
    USABLE_MEMORY,
    conversion_s,
    expert_split,
    host_bytes,
    host_capacity,
    in_flight_of,
    memory_by_kind,
    optimizer_step_dev,
    stage_transfer,
    step_temps_dev,
    sync_bytes,
    zero3_held,
)
from autopar.kernels.float8 import TENSORWISE
from autopar.modes import (
    BF16,
    CP,
    DP,
    DP_REPLICATE,
    DP_SHARD,
    EP,
    FP8,
    FULL,
    MEGATRON_SP,
    NO_PIPELINE,
    NO_RECOMPUTE,
    ORDER,
    PP,
    TP,
    TP_1D,
    TP_25D,
    ZERO_BUBBLE,
    cp_layout,
)
from autopar.report.experts import expert_layout, expert_lines

if TYPE_CHECKING:  # annotations only: report sits below plans
    from autopar.plans import Plan

GiB = 1024 ** 3
MEMORY_KINDS = ("parameters", "gradients", "optimizer", "activations", "buffers",
                "optimizer_step")


def plan_report(plan: Plan, chain: LayerChain) -> dict:
    """The JSON object of the public contract, plus per-layer and per-kind costs, per-stage
    time (`stages`), per-rank memory (`ranks`), traffic per mesh axis (`comm_by_axis`) and
    the formulas."""
    data = plan.to_json()
    states = [LayerState(tensor_mode(lp.tp_mode, plan.mesh[TP], plan.tp_depth), lp.sp,
                         lp.recompute) for lp in plan.layers]
    ctx = pricing_context(plan, chain=chain)
    costs = layer_costs(chain, states, ctx, plan.pipeline.micro_batch_size or 1,
                        [lp.stage for lp in plan.layers] if plan.mesh[PP] > 1 else None)
    data["layers"] = [{"name": lp.name, "tp_mode": lp.tp_mode, "sp": lp.sp,
                       "recompute": lp.recompute, "stage": lp.stage, "kind": lt.name,
                       "time_s": c.time, "activation_bytes": int(c.activations),
                       "param_bytes": int(c.params)}
                      for lp, lt, c in zip(plan.layers, chain.layers(), costs)]
    data.update(pipeline_detail(plan, chain, states, costs))
    data["layer_kinds"] = _kinds(plan, chain, ctx)
    data["replicated_groups"] = []
    if plan.mesh[TP] > 1 and plan.tp_mode == TP_1D and chain.traced is not None:
        _add_strategies(data, plan, chain)
    data["chunked_loss"] = _chunked_loss(plan, chain)
    data["formulas"] = {k: str(v) for k, v in formulas().items()}
    data["model"] = {"parameters": int(chain.params), "tokens_per_sample": chain.tokens_per_sample}
    if ctx.dtype == FP8:
        data[FP8] = fp8_detail(chain, ctx, plan.zero.stage)
    return data


def fp8_detail(chain: LayerChain, ctx: Context, zero: int) -> dict:
    """What runs in float8 under this plan and how it is priced (autopar.cost.fp8)."""
    gemms = [(f"{lt.name} {g.k}x{g.n}", fp8.runs_fp8(ctx.dtype, g, lt, ctx.kept_high))
             for lt in chain.layers() for g in lt.gemms if g.weight and not g.expert]
    return {"fp8_gemms": sum(on for _, on in gemms), "weight_gemms": len(gemms),
            "kept_bf16": sorted({name for name, on in gemms if not on}),
            "fp8_flops": ctx.hw.flops(FP8), "recipe": ctx.fp8_recipe,
            "gemms": fp8.GEMMS if ctx.fp8_recipe == TENSORWISE else fp8.GEMMS_ROWWISE,
            "kept": fp8.KEPT,
            "gather": fp8.GATHER if zero == 3 else None, "mfu_peak": fp8.MFU_SOURCE}


def _fp8_lines(data: dict) -> list[str]:
    """The fp8 recipe of the plan, when it has one: what runs in float8, what stays bf16."""
    f = data.get(FP8)
    if not f:
        return []
    kept = ", ".join(f["kept_bf16"]) or "no GEMM"
    lines = [f"  fp8         {f['fp8_gemms']} of {f['weight_gemms']} linear GEMMs per model "
             f"pass at {f['fp8_flops'] / 1e12:.0f} TFLOP/s: {f['gemms']}",
             f"              bf16: {f['kept']}; sizes not multiples of {fp8.ALIGN} too "
             f"(the fp8 kernels need them); linear GEMMs kept bf16 (layer KxN): {kept}"]
    if f.get("gather"):
        lines.append(f"              {f['gather']}")
    return lines


def _mfu_line(pred: dict) -> str:
    """MFU with the peak it divides by, model TFLOP/s per device, tokens/s and FLOPs."""
    peak = pred.get("mfu_peak")
    of = f" of {peak['dtype']} dense peak {peak['flops'] / 1e12:.1f} TFLOP/s" if peak else ""
    rate = f"   {pred['model_tflops_per_device']:.0f} model TFLOP/s per device" \
        if "model_tflops_per_device" in pred else ""
    return (f"  MFU {100 * pred['mfu']:.1f}%{of}{rate}   {pred['tokens_per_s']:.0f} tokens/s   "
            f"model FLOPs per step {pred['model_flops_per_step']:.3e}")


def pricing_context(plan: Plan, world=None, dtype: str | None = None,
                    chain: LayerChain | None = None) -> Context:
    """The pricing context the search used for this plan's mesh (on `world`, in `dtype`
    where given; `chain`: the model, whose output projection stays bf16 under fp8)."""
    world = world or plan.world
    pl = placements(plan.mesh, ORDER, world.per_node)
    ep = expert_split(plan.mesh, plan.ep, world.per_node).dispatch if plan.ep > 1 \
        else None
    dtype = dtype or plan.search.get("dtype", BF16)
    kept = fp8.kept_high(chain.layers()) if dtype == FP8 and chain is not None else frozenset()
    return Context(world.profile, dtype, pl[TP], pl[CP], plan.sequence_mode,
                   plan.search.get("attention_kernel", "flash"), ep=ep, kept_high=kept,
                   compile=plan.search.get("compile", False),
                   fp8_recipe=plan.search.get("fp8_recipe", TENSORWISE))


def layer_costs(chain: LayerChain, states: list[LayerState], ctx: Context,
                b: int, stage_of: list | None = None) -> list[StateCost]:
    """Each layer's cost for one micro-batch of `b` under its state (priced once per kind
    and state). With `stage_of` (each layer's pipeline stage) the first layer of a stage
    is priced as its kind's twin that holds the tensors several layers read (a mask, rotary
    tables): each stage rebuilds them, and its first reader keeps them (effect: "each stage
    holds the shared tensors")."""
    seen: dict = {}
    out = []
    order = list(chain.order)
    if stage_of is not None:
        index_of = {lt.name: i for i, lt in enumerate(chain.types)}
        for i in range(1, len(order)):
            twin = chain.holding.get(chain.types[order[i]].name)
            if stage_of[i] != stage_of[i - 1] and twin in index_of:
                order[i] = index_of[twin]
    for index, state in zip(order, states):
        key = (index, state)
        if key not in seen:
            seen[key] = state_cost(chain.types[index], state, b, ctx)
        out.append(seen[key])
    return out


def pipeline_detail(plan: Plan, chain: LayerChain, states: list[LayerState],
                    costs: list[StateCost], *, names=None, stage_of=None, world=None,
                    m: int | None = None, b: int | None = None,
                    dp_comm_s: float | None = None) -> dict:
    """Per stage its time per micro-batch, per pipeline rank its memory by kind, and traffic
    per mesh axis on the slowest rank (a layer's comm counts half forward, half backward);
    names, stages, world, m, b and dp seconds are the plan's unless given."""
    mesh, pipe, zero = plan.mesh, plan.pipeline, plan.zero
    names = [lp.name for lp in plan.layers] if names is None else names
    stage_of = [lp.stage for lp in plan.layers] if stage_of is None else stage_of
    world = world or plan.world
    pp, v = mesh[PP], pipe.chunks
    m = pipe.microbatches if m is None else m
    b = (pipe.micro_batch_size or 1) if b is None else b
    hw = world.profile
    pl = placements(plan.mesh, ORDER, world.per_node)
    layers = chain.layers()
    conv = conversions(layers, states, b, pl, hw)
    n_stages = max(stage_of, default=0) + 1
    owner = [stage_owner(pipe.schedule, s, pp) if pp > 1 else 0 for s in range(n_stages)]
    stages = _stage_rows(names, stage_of, owner, costs, conv)
    device_of = np.array([owner[s] for s in stage_of], dtype=int)
    params_dev = np.bincount(device_of, weights=[c.params for c in costs], minlength=pp)
    acts_dev = np.bincount(device_of, weights=[c.activations for c in costs], minlength=pp)
    held = in_flight_of(pipe.schedule, pp, v, m)
    replicas = plan.dp_shard * mesh[CP]  # ZeRO's ranks (HSDP: the shard group)
    hybrid = hybrid_split(mesh, plan.dp_shard, world.per_node) if plan.dp_replicate > 1 \
        else None
    biggest = max((c.params for c in costs), default=0.0)
    precision = plan_precision(plan, chain)
    split = expert_split(mesh, plan.ep, world.per_node) if plan.ep > 1 else None
    experts_dev = np.bincount(device_of, weights=[c.expert_params for c in costs],
                              minlength=pp)
    temps = step_temps_dev(*zip(*((c.step_temps.peak, c.step_temps.first, c.step_temps.last)
                                  for c in costs)), device_of, pp) if costs else np.zeros(pp)
    step = optimizer_step_dev(params_dev, temps, replicas, zero.stage, zero.offload, precision,
                              hw.optimizer_implementation, experts_dev, split)
    kept = zero3_held([c.params for c in costs], [
        c.params * lt.held_bytes / lt.param_bytes if lt.param_bytes else 0.0
        for c, lt in zip(costs, layers)], precision, pp) if zero.stage == 3 else None
    parts = memory_by_kind(params_dev, acts_dev, biggest, replicas, zero.stage, zero.offload,
                           held, precision, max((c.workspace for c in costs), default=0.0),
                           experts_dev, split, step, kept)
    split = pp > 1 and pipe.schedule == ZERO_BUBBLE  # (the loss's backward in two)
    per_rank = np.bincount(device_of, weights=[c.time + t + split * c.split_backward
                                               for c, t in zip(costs, conv)], minlength=pp)
    ranks = [{"rank": r, "stages": [s["stage"] for s in stages if s["rank"] == r],
              "microbatches_in_flight": float(held[r]),
              "time_per_microbatch_s": float(per_rank[r]),
              "memory_bytes": {k: int(parts[k][r]) for k in MEMORY_KINDS},
              "optimizer_step_workspace_bytes": int(step[r])} for r in range(pp)]
    slow = [i for i, d in enumerate(device_of) if d == int(np.argmax(per_rank))]
    p2p_s, p2p_bytes = stage_transfer(layers, stage_of, b, pl, hw) if pp > 1 else (0.0, 0.0)
    if dp_comm_s is None:
        dp_comm_s = plan.predicted.get("dp_comm_s", 0.0)
    comm = _comm_by_axis(plan, costs, conv, slow, m, v, (p2p_s, p2p_bytes), dp_comm_s,
                         float(params_dev.max()), precision, hybrid)
    capacity = _memory_capacity(plan, world, float(params_dev.max()), precision)
    effects = [{"effect": name, "seconds": m * sum(costs[i].effects.get(name, 0.0) for i in slow),
                "priced_as": how} for name, how in EFFECTS.items()]
    if split:
        effects.append({"effect": chunked_loss.SPLIT_NAME, "priced_as": chunked_loss.SPLIT_SOURCE,
                        "seconds": m * sum(costs[i].split_backward for i in slow)})
    return {"stages": stages, "ranks": ranks, "comm_by_axis": comm, "memory_capacity": capacity,
            "effects": [e for e in effects if e["seconds"] != 0],  # fusion's: < 0
            "experts": expert_layout(plan, chain, costs, slow, m, b)}


def _stage_rows(names, stage_of, owner, costs: list[StateCost], conv) -> list[dict]:
    """Per stage: its rank, layers, time per micro-batch forward and backward (a layer's comm
    and conversions counted half in each) and its activation and parameter bytes."""
    stages = []
    for s, rank in enumerate(owner):
        idx = [i for i, st in enumerate(stage_of) if st == s]
        share = [costs[i].comm / 2 + conv[i] / 2 for i in idx]
        stages.append({
            "stage": s, "rank": rank, "layers": len(idx),
            "first": names[idx[0]] if idx else None,
            "last": names[idx[-1]] if idx else None,
            "forward_s": sum(costs[i].forward for i in idx) + sum(share),
            "backward_s": sum(costs[i].backward + costs[i].recompute for i in idx) + sum(share),
            "activation_bytes": int(sum(costs[i].activations for i in idx)),
            "param_bytes": int(sum(costs[i].params for i in idx)),
        })
    return stages


def _comm_by_axis(plan: Plan, costs: list[StateCost], conv, slow: list[int], m: int, v: int,
                  transfer: tuple[float, float], dp_comm_s: float, params_max: float,
                  precision: Precision, hybrid) -> dict:
    """Seconds, bytes, size and what it carries per mesh axis, on the slowest pipeline rank
    (its layers `slow`) over a step of `m` micro-batches through `v` chunks per stage;
    `transfer`: the seconds and bytes of one stage-to-stage transfer; `hybrid`: HSDP's
    groups (None without)."""
    mesh, zero = plan.mesh, plan.zero
    p2p_s, p2p_bytes = transfer
    replicas = plan.dp_shard * mesh[CP]  # ZeRO's ranks (HSDP: the shard group)
    comm = {
        TP: {"seconds": m * sum(costs[i].comm - costs[i].cp_comm - costs[i].ep_comm + conv[i]
                                for i in slow),
             "bytes": m * sum(costs[i].comm_bytes - costs[i].cp_comm_bytes -
                              costs[i].ep_comm_bytes for i in slow),
             "carries": "tensor-parallel collectives inside layers and layout conversions"},
        CP: {"seconds": m * sum(costs[i].cp_comm for i in slow),
             "bytes": m * sum(costs[i].cp_comm_bytes for i in slow),
             "carries": f"sequence parallelism around attention ({plan.sequence_mode})"
             if plan.sequence_mode else "sequence parallelism around attention"},
        DP: {"seconds": dp_comm_s,
             "bytes": sync_bytes(params_max, replicas, zero.stage, zero.offload, precision,
                                 hybrid)[1],
             "carries": "gradient sync over the dp x cp replicas" + (
                 f" (ZeRO-{zero.stage})" if zero.stage else "") + (
                 f"; HSDP: ZeRO inside {DP_SHARD} groups of {plan.dp_shard}, each piece "
                 f"all-reduced over {plan.dp_replicate} {DP_REPLICATE} copies ({SOURCE})"
                 if hybrid else "")},
        PP: {"seconds": m * 2 * v * p2p_s, "bytes": m * 2 * v * p2p_bytes,
             "per_transfer_s": p2p_s, "per_transfer_bytes": p2p_bytes,
             "carries": "activations forward and their gradients backward between stages"},
    }
    if plan.ep > 1:
        comm[EP] = {"seconds": m * sum(costs[i].ep_comm for i in slow),
                    "bytes": m * sum(costs[i].ep_comm_bytes for i in slow),
                    "carries": "MoE token dispatch and combine (all-to-alls, counts first)"}
    for axis, entry in comm.items():
        entry["size"] = mesh.get(axis, plan.ep)
    return comm


def _memory_capacity(plan: Plan, world, params_max: float, precision: Precision) -> dict:
    """What a device and its host hold, and what the plan offloads there per device."""
    hw, zero = world.profile, plan.zero
    replicas = plan.dp_shard * plan.mesh[CP]  # ZeRO's ranks (HSDP: the shard group)
    return {"device_bytes": int(hw.memory_bytes),
            "usable_bytes": int(hw.memory_bytes * USABLE_MEMORY),
            "host_bytes_per_node": int(hw.host_memory_bytes),
            "host_usable_bytes_per_device": int(host_capacity(hw, world.per_node,
                                                              world.devices)),
            "host_offloaded_bytes_per_device": int(host_bytes(
                params_max, replicas, zero.stage, zero.offload, precision)),
            "bytes_per_parameter": precision.to_json(),
            "optimizer_step": {"implementation": hw.optimizer_implementation,
                               "priced_as": STEP_SOURCE[hw.optimizer_implementation]}}


def conversions(layers, states: list[LayerState], b: int, pl: dict, hw) -> list[float]:
    """Seconds of the layout conversion before each layer (0 where its neighbour's layout
    is its own)."""
    return [0.0] + [conversion_s(layers[i - 1].boundary(b), pl, hw)
                    if states[i].layout != states[i - 1].layout else 0.0
                    for i in range(1, len(states))]


def plan_precision(plan: Plan, chain: LayerChain) -> Precision:
    """The state bytes per parameter the search priced this plan with (a plan saved before
    they were recorded: the offline rule on the chain's parameters)."""
    recorded = plan.search.get("precision")
    if recorded:
        return Precision.from_json(recorded)
    return precision_of(chain.param_dtype)


def _kinds(plan: Plan, chain: LayerChain, ctx: Context) -> list[dict]:
    b = plan.pipeline.micro_batch_size or 1
    tp = plan.mesh[TP]
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
    has_experts = any(t.experts is not None for t in chain.types)
    for index, entry in seen.items():
        lt = chain.types[index]
        (mode_name, sp, recompute), _ = entry["states"].most_common(1)[0]
        mode = tensor_mode(mode_name, tp, plan.tp_depth)
        cost = state_cost(lt, LayerState(mode, sp, recompute), b, ctx)
        sharded = lt.sharded.get(tp if mode.name == TP_1D else 1)
        comm = []
        if sharded is not None and mode.name == TP_1D and tp > 1:
            split = sharded.expert_comm if plan.mesh[CP] == 1 else []  # (whole beside cp)
            for op, phase, nbytes in sharded.comm + split:
                shown = op if not (sp == MEGATRON_SP and op == "all_reduce" and lt.is_block) else \
                    "reduce_scatter+all_gather"
                comm.append({"op": shown, "axis": TP, "phase": phase, "bytes": int(nbytes(b))})
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
            "ffn": _ffn_kind(lt, cost, plan.ep, recompute) if has_experts and lt.attention
            else None,
        })
    return rows


def _ffn_kind(lt, cost, ep: int, recompute: str) -> dict:
    """The feed-forward of a transformer block in an MoE model: "moe", its experts over ep and
    its all-to-alls per micro-batch, or "dense" (no experts: no all-to-all, no expert memory)."""
    if lt.experts is None:
        return {"kind": "dense", "all_to_alls": 0, "all_to_all_bytes": 0, "all_to_all_s": 0.0,
                "expert_param_bytes_per_device": 0}
    return {"kind": "moe", "experts": lt.experts.count, "top_k": lt.experts.top_k, EP: ep,
            "experts_per_rank": lt.experts.count // ep,
            "all_to_alls": alltoall_count(2 if recompute == FULL else 1) if ep > 1 else 0,
            "all_to_all_bytes": int(cost.ep_comm_bytes), "all_to_all_s": cost.ep_comm,
            "expert_param_bytes_per_device": int(cost.expert_params)}


def _ffn_line(ffn: dict) -> str:
    """`explain`'s line under a block of an MoE model: its FFN and its traffic on ep."""
    if ffn["kind"] == "dense":
        return "      dense FFN: no experts, no all-to-all on ep (0 B per micro-batch)"
    a2a = (f"{ffn['all_to_alls']} all-to-alls on ep per micro-batch, "
           f"{size_text(ffn['all_to_all_bytes'])}, {1e3 * ffn['all_to_all_s']:.2f} ms"
           if ffn["all_to_alls"] else "experts on every rank, no all-to-all")
    return (f"      MoE FFN: {ffn['experts']} experts top-{ffn['top_k']}, "
            f"{ffn['experts_per_rank']} per rank over ep={ffn[EP]} "
            f"({size_text(ffn['expert_param_bytes_per_device'])} of experts); {a2a}")


def _chunked_loss(plan: Plan, chain: LayerChain) -> dict | None:
    """The chunked cross-entropy's effect on one device's peak at this plan's tensor size
    (None where nothing fuses: no classifier loss, a 2D/2.5D/3D grid or a cp axis)."""
    from autopar.sharding.solve import solve

    if chain.traced is None or not chain.chunked_loss or plan.mesh[CP] > 1 or \
            (plan.mesh[TP] > 1 and plan.tp_mode != TP_1D) or \
            (plan.mesh[PP] > 1 and plan.pipeline.schedule == ZERO_BUBBLE):
        return None
    solution = solve(chain.traced, axis=TP, size=plan.mesh[TP]) if plan.mesh[TP] > 1 else None
    return chunked_loss.effect(chain.traced, solution, plan.pipeline.micro_batch_size or 1)


def _chunked_lines(effect: dict | None) -> list[str]:
    if not effect:
        return []
    shapes = ", ".join(f"{c['whole_buffers']} x [{c['tokens']} x {c['vocab']}]"
                       for c in effect["losses"])
    return [f"  {effect['effect']}: peak -{size_text(effect['saving_bytes'])} "
            f"(whole fp32 logits {shapes} -> one chunk of {size_text(effect['chunk_bytes'])}; "
            f"saved logits out of activations): {effect['source']}"]


def _add_strategies(data: dict, plan: Plan, chain: LayerChain) -> None:
    """Per-op strategies of each kind of layer (column, row, heads, vocab-parallel, ...) and
    the ops that run replicated, from the catalog's 1D solution at this tensor size."""
    from autopar.report.layers import layer_reports, replicated_groups
    from autopar.sharding.solve import solve

    solution = solve(chain.traced, axis=TP, size=plan.mesh[TP])
    reports = {lr.name: lr for lr in layer_reports(chain.traced, solution,
                                                   plan.pipeline.micro_batch_size or 1)}
    for row in data["layer_kinds"]:
        lr = reports.get(row["kind"])
        row["strategies"] = lr.strategies if lr is not None else []
    data["replicated_groups"] = replicated_groups(solution)


def tensor_mode(name: str, size: int, depth: int) -> TensorMode:
    """The cost model's tensor mode of a plan's mode name at tensor size `size`."""
    if size == 1 or name == TP_1D:
        return TensorMode(TP_1D, size)
    for m in tensor_modes(size):
        if m.name == name and (name != TP_25D or m.d == depth):
            return m
    return TensorMode(TP_1D, size)


def _effect_lines(effects: list[dict]) -> list[str]:
    """One line per physical effect priced into the slowest rank's step."""
    if not effects:
        return []
    return ["  physical effects in the slowest rank's step (seconds included above):"] + [
        f"    {e['effect']:<34} {signed_seconds(e['seconds']):>9}  {e['priced_as']}"
        for e in effects]


def counted(n: int, one: str, many: str) -> str:
    """`n` and the noun in agreement: "1 micro-batch", "8 micro-batches"."""
    return f"{n} {one if n == 1 else many}"


def _hybrid_text(zero: dict, mesh: dict) -> str:
    """HSDP's two groups, as the ZeRO line names them ('' without a shard size)."""
    shard = zero.get("shard")
    if not shard or shard == mesh[DP]:
        return ""
    return (f", hybrid: state cut over {DP_SHARD}={shard} neighbouring dp ranks (gathers and "
            f"reduce-scatters inside them), replicated over {DP_REPLICATE}="
            f"{mesh[DP] // shard} (one all-reduce of each piece)")


def plan_text(data: dict, top: int | None = None) -> str:
    """The report as text a person reads top to bottom."""
    world, mesh, pred, search = data["world"], data["mesh"], data["predicted"], data["search"]
    pipe, zero, seq = data["pipeline"], data["zero"], data["sequence"]
    lines = [
        f"autopar plan for {world['devices']} x {world['device']} ({world['per_node']} per node)",
        *_model_line(data.get("model")),
        f"  mesh        pp={mesh[PP]} dp={mesh[DP]} cp={mesh[CP]} tp={mesh[TP]}"
        + (f" ep={mesh[EP]} (experts over ep ranks inside dp x cp)" if mesh.get(EP, 1) > 1
           else "") + "  (tp innermost: tensor groups sit inside a node first)",
        f"  tensor      {data['tensor']['mode']}"
        + (f" depth {data['tensor']['depth']}" if data['tensor']['mode'] == TP_25D else "")
        + (", Megatron sequence parallel" if data["tensor"]["sequence_parallel"] else "")
        + (f"; sequence {seq['mode']} over cp ({cp_layout(seq['mode'], seq.get('layout'))} "
           "tokens)" if seq["mode"] else ""),
        f"  pipeline    {pipe['schedule'] if mesh[PP] > 1 else NO_PIPELINE}"
        + (f" x{pipe['chunks']} chunks" if pipe["chunks"] > 1 else "")
        + f", {counted(pipe['microbatches'], 'micro-batch', 'micro-batches')} of "
          f"{pipe['micro_batch_size']}",
        f"  ZeRO        stage {zero['stage']}" + (" with optimizer offload" if zero["offload"]
                                                   else "") + _hybrid_text(zero, mesh),
        f"  recompute   {data['recompute']}",
        *_fp8_lines(data),
        *expert_lines(data),
        "",
        f"  predicted step {pred['step_time_s']:.3f} s = pipeline/compute "
        f"{pred['compute_s']:.3f} s + tensor comm {pred['tp_comm_s']:.3f} s + bubble "
        f"{pred['bubble_s']:.3f} s + data-parallel sync {pred['dp_comm_s']:.3f} s + optimizer "
        f"{pred['optimizer_s']:.3f} s",
        _mfu_line(pred),
        f"  memory per device {pred['memory_per_device_bytes'] / GiB:.2f} GiB: "
        + ", ".join(f"{k} {v / GiB:.2f}" for k, v in pred["memory_breakdown_bytes"].items()),
        *_state_lines(data),
        *_step_lines(data),
        f"  communication per device per step {pred['comm_bytes_per_device'] / GiB:.2f} GiB"
        + _axes_text(data.get("comm_by_axis")),
        *_effect_lines(data.get("effects", [])),
        *_chunked_lines(data.get("chunked_loss")),
        "",
        f"  {'layers':<26} {'n':>4} {'strategy':<24} {'fwd+bwd ms':>10} {'comm ms':>8} "
        f"{'act/dev':>9} {'params/dev':>10}",
    ]
    kinds = data["layer_kinds"] if top is None else data["layer_kinds"][:top]
    for k in kinds:
        lines += _kind_lines(k)
    if top is not None and len(data["layer_kinds"]) > top:
        lines.append(f"  ... {len(data['layer_kinds']) - top} more kinds of layer")
    lines += _why_lines(search, pred)
    if data.get("replicated_groups"):
        from autopar.report.layers import replicated_line

        lines += ["", "  runs replicated:"]
        lines.extend(f"    {replicated_line(g)}" for g in data["replicated_groups"])
    if data.get("notes"):
        lines.append("")
        lines.extend(f"  note: {n}" for n in data["notes"])
    if "min_devices" in data:
        lines.append(f"\n  fewest devices that fit: {data['min_devices']['devices']}")
    return "\n".join(lines)


def _kind_lines(k: dict) -> list[str]:
    """One kind of layer: its row of the table, then its FFN, strategies and collectives."""
    pm = k["per_micro_batch"]
    strategy = f"{k['tp_mode']}" + (" +sp" if k["sp"] == MEGATRON_SP else "") + \
        (f" rc:{k['recompute']}" if k["recompute"] != NO_RECOMPUTE else "")
    if len(k["states"]) > 1:
        strategy += " (" + ", ".join(f"{n}x {s}" for s, n in k["states"].items()) + ")"
    lines = [f"  {k['span']:<26} {k['layers']:>4} {strategy:<24} "
             f"{1e3 * (pm['forward_s'] + pm['backward_s'] + pm['recompute_s']):>10.2f} "
             f"{1e3 * pm['comm_s']:>8.2f} {size_text(pm['activation_bytes']):>9} "
             f"{size_text(k['param_bytes_per_device']):>10}"]
    if k.get("ffn"):
        lines.append(_ffn_line(k["ffn"]))
    if k.get("strategies"):
        lines.append("      " + ", ".join(k["strategies"]))
    for c in k["collectives"]:
        lines.append(f"      {c['phase']:<8} {c['op']:<26} on {c['axis']}: "
                     f"{size_text(c['bytes'])} per micro-batch")
    return lines


def _why_lines(search: dict, pred: dict) -> list[str]:
    """How long the search took, and each runner-up beside the winner with why it lost."""
    lines = ["", f"  why this plan: searched {search['candidates']} candidates in "
              f"{search['time_s']:.2f} s ({search.get('total_s', 0):.2f} s with tracing)"]
    if search.get("alternatives"):
        lines.append(f"    {'step':>9} {'mem/dev':>9}  plan: why it lost")
        if "winner" in search:
            lines.append(f"    {seconds_text(pred['step_time_s']):>9} "
                         f"{size_text(pred['memory_per_device_bytes']):>9}  "
                         f"{search['winner']}: chosen")
    for alt in search["alternatives"]:
        step, mem = alt.get("step_time_s"), alt.get("memory_per_device_bytes")
        # a runner-up known only by its lower bound was never priced: no memory figure
        lines.append(f"    {seconds_text(step) if step else '-':>9} "
                     f"{size_text(mem) if mem else '-':>9}  {alt['plan']}: {alt['reason']}")
    for note in search.get("left_out", []):
        lines.append(f"  left out: {note}")
    return lines


def _state_lines(data: dict) -> list[str]:
    """How the training state is counted: bytes per parameter before sharding, and what
    offload puts on the host against the profile's host memory."""
    cap = data.get("memory_capacity")
    if not cap or "bytes_per_parameter" not in cap:
        return []
    precision = Precision.from_json(cap["bytes_per_parameter"])
    zero = data["zero"]["stage"]
    shards = {0: "", 1: "; ZeRO-1 shards master and moments over dp x cp",
              2: "; ZeRO-2 also gradients", 3: "; ZeRO-3 all of it"}[zero]
    where = " (mixed precision as ZeRO and Megatron-LM)" if precision.master else \
        " (as the runtime's optimizer holds them)" if precision.convention == "runtime" else ""
    lines = [f"  state       {precision.text()}{where}{shards}"]
    if data["zero"]["offload"]:
        lines.append(f"  host        {size_text(cap['host_offloaded_bytes_per_device'])} "
                     f"offloaded per device ({precision.offloaded} B/parameter of its shard) of "
                     f"{size_text(cap['host_usable_bytes_per_device'])}: the profile's "
                     f"host_memory_bytes {size_text(cap['host_bytes_per_node'])} per node "
                     f"shared by its {min(data['world']['per_node'], data['world']['devices'])}"
                     " devices")
    return lines


def _step_lines(data: dict) -> list[str]:
    """The optimizer step's temporaries on the worst device, how they are priced, and what
    they add: the step runs after the backward has freed activations and buffers."""
    how = (data.get("memory_capacity") or {}).get("optimizer_step")
    pred = data["predicted"]
    if how is None or "optimizer_step_workspace_bytes" not in pred:
        return []
    if data["zero"]["offload"]:
        return ["  opt step    on the host (offloaded): its temporaries take no device memory"]
    adds = pred["memory_breakdown_bytes"].get("optimizer_step", 0)
    return [f"  opt step    {how['implementation']} temporaries "
            f"{size_text(pred['optimizer_step_workspace_bytes'])} after the backward, adding "
            f"{size_text(adds)} (peak = state + max(activations + buffers, step)): "
            f"{how['priced_as']}"]


def _model_line(model: dict | None) -> list[str]:
    """The model's size: its parameters (every repeated block counted) and tokens per sample."""
    if not model:
        return []
    tokens = model["tokens_per_sample"]
    return [f"  model       {model['parameters']:.3e} parameters"
            + (f", {tokens} tokens per sample" if tokens > 1 else "")]


def _axes_text(comm: dict | None) -> str:
    """`; tp 0.23 s 12.0 GiB, dp ...`: the mesh axes that carry traffic (size > 1)."""
    if not comm:
        return ""
    parts = [f"{axis} {seconds_text(entry['seconds'])} {size_text(entry['bytes'])}"
             for axis, entry in comm.items() if entry["size"] > 1]
    if not parts:
        return ""
    return "; by axis (seconds, bytes on the slowest rank): " + ", ".join(parts)


def signed_seconds(s: float) -> str:
    """`seconds_text` with a minus sign for seconds an effect saves."""
    return "-" + seconds_text(-s) if s < 0 else seconds_text(s)


def seconds_text(s: float) -> str:
    """Seconds at a scale a person reads: 15.038 s, 1.41 ms, 70.7 us."""
    if s == 0:
        return "0 s"
    return f"{s:.3f} s" if s >= 1 else f"{1e3 * s:.2f} ms" if s >= 1e-3 else f"{1e6 * s:.1f} us"


def size_text(nbytes: float) -> str:
    """Bytes in GiB, MiB, KiB or bytes, whichever reads best."""
    if nbytes >= GiB:
        return f"{nbytes / GiB:.2f} GiB"
    if nbytes >= 1024 ** 2:
        return f"{nbytes / 1024 ** 2:.1f} MiB"
    if nbytes >= 1024:
        return f"{nbytes / 1024:.1f} KiB"
    return f"{int(nbytes)} B"
