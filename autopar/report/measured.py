"""The plan's prediction beside what a running engine measured: `Engine.explain()`.

Predicted: the cost model's for the engine's plan as it runs, on `world`'s profile.
Measured: per-layer time, saved activations and collectives on this rank, per step.
"""

from __future__ import annotations

import os

import numpy as np

from autopar.cost.chunked_loss import REMADE_NAME, SPLIT_NAME
from autopar.cost.comm import placements
from autopar.cost.experts import imbalance_of, tokens_per_expert
from autopar.cost.hybrid import hybrid_split
from autopar.cost.model import FUSION, LayerState
from autopar.cost.schedule import stage_owner
from autopar.cost.step import chain_of, grad_placement, stage_transfer, step_parts
from autopar.errors import PlanError
from autopar.kernels.chunked_loss import REMADE, SPLIT
from autopar.modes import (
    AXES,
    BF16,
    DP,
    EP,
    FP8,
    FP32,
    MEGATRON_SP,
    NO_PIPELINE,
    NO_SP,
    ORDER,
    PP,
    STEP,
    TP,
    ZERO_BUBBLE,
)
from autopar.report.predicted import (
    conversions,
    layer_costs,
    pipeline_detail,
    plan_precision,
    pricing_context,
    size_text,
    tensor_mode,
)
from autopar.sharding.solve import tokens_per_sample
from autopar.world import World, local_device


def measured_report(engine, world: World | None = None) -> dict:
    """Per layer and per mesh axis: predicted and measured time, bytes and memory."""
    rec = engine.recorder
    if engine.train_graph is None or rec.steps == 0:
        raise PlanError("engine.explain() puts measured steps beside the plan: run train_step "
                        f"at least {rec.warmup + 1} times first (the first "
                        f"{'step is' if rec.warmup == 1 else f'{rec.warmup} steps are'} a "
                        "warm-up, not counted).")
    steps = rec.steps
    runner = engine.pipeline
    m = engine.microbatches  # a pipeline's, or gradient accumulation's
    global_batch = engine.global_batch
    mine = engine.pipeline_layers() if runner is not None else None
    names = [layer.name for layer in engine.train_graph.layers]
    pred = _priced(engine, world, global_batch, m)
    exact = engine.predicted_comm_by_layer(global_batch)
    bytes_by_layer: dict[str, int] = {}
    bytes_by_axis: dict[str, int] = {}
    for (_, axis, layer), nbytes in exact.items():
        bytes_by_layer[layer] = bytes_by_layer.get(layer, 0) + nbytes
        bytes_by_axis[_axis(axis)] = bytes_by_axis.get(_axis(axis), 0) + nbytes
    held = _held_bytes(engine)
    layers = []
    for name in names + [STEP]:
        fig = rec.layers.get(name)
        runs_here = name == STEP or mine is None or name in mine
        row = {"name": name, "here": runs_here,
               "predicted": {"comm_bytes": bytes_by_layer.get(name, 0)},
               "measured": None}
        p = pred["layers"].get(name) if pred else None
        if p is not None:
            row["predicted"].update(p)
        if runs_here:
            row["measured"] = {
                "forward_s": fig.forward_s / steps if fig else 0.0,
                "backward_s": fig.backward_s / steps if fig else 0.0,
                "backward_timed": fig.backward_timed if fig else True,
                "comm_bytes": (fig.comm_bytes if fig else 0) // steps,
                "comm_s": fig.comm_s / steps if fig else 0.0,
                "activation_bytes": (fig.saved_bytes if fig else 0) // (steps * m),
                "param_bytes": held.get(name, 0),
            }
        layers.append(row)
    axes = []
    measured_axes: dict[str, list] = {}
    for axis, (nbytes, seconds) in rec.axes.items():
        entry = measured_axes.setdefault(_axis(axis), [0, 0.0])
        entry[0] += nbytes
        entry[1] += seconds
    for axis in sorted(set(bytes_by_axis) | set(measured_axes),
                       key=lambda a: (*AXES, "world").index(a)
                       if a in (*AXES, "world") else 9):
        got = measured_axes.get(axis, [0, 0.0])
        model = pred["axes"].get(axis, {}) if pred else {}
        axes.append({"axis": axis,
                     "predicted": {"bytes": bytes_by_axis.get(axis, 0),
                                   "seconds": model.get("seconds")},
                     "measured": {"bytes": got[0] // steps, "seconds": got[1] / steps}})
    return {
        "rank": engine.global_rank(),
        "mesh": dict(engine.plan.mesh),
        "steps": steps,
        "warmup": rec.warmup,
        "global_batch": global_batch,
        "microbatches": m,
        "device": pred["device"] if pred else None,
        "prediction_error": pred.get("error") if pred else None,
        "step": {"predicted_s": pred.get("step_time_s") if pred else None,
                 "measured_s": rec.step_s / steps},
        "layers": layers,
        "axes": axes,
        "experts": _experts(engine, pred, exact, steps),
        "compile": None if engine.regions is None else {
            "regions": engine.regions.regions, "compiled_functions": engine.regions.compiled,
            "predicted_fusion_s": pred.get("fusion_s") if pred else None},
        "float8": engine.float8.to_json() if engine.float8 is not None else None,
        "logits_remade": _remade(engine, pred, mine, steps),
    }


def _remade(engine, pred: dict | None, mine, steps: int) -> list[dict]:
    """The chunked loss's logits its backward makes again on this rank, per step: the
    seconds the plan prices (REMADE_NAME; SPLIT_NAME once more under zero-bubble) beside the
    seconds the kernel timed making them (`Recorder.span`)."""
    if not engine.chunked_losses:
        return []
    rec, planned = engine.recorder, pred["layers"] if pred else {}
    here = [name for name in planned if mine is None or name in mine]
    out = []
    for name, tag in ((REMADE_NAME, REMADE), (SPLIT_NAME, SPLIT)):
        priced = sum(planned[n].get("effects", {}).get(name, 0.0) for n in here)
        timed = rec.kernels.get(tag, 0.0) / steps
        if priced or timed:
            out.append({"effect": name, "predicted_s": priced if pred else None,
                        "measured_s": timed})
    return out


def step_prediction(engine, world: World | None = None) -> dict:
    """What the plan says one step of `engine` takes, as it runs: step seconds (None where
    the cost model cannot price it), memory per device (a searched plan's), model FLOPs per
    step (forward + backward at twice the forward, no recomputation) and the peak FLOP/s of
    one device at the engine's precision, which a measured MFU divides by."""
    if engine.train_graph is None:
        raise PlanError("the training graph is traced at the first train_step; call it first.")
    runner = engine.pipeline
    m = runner.microbatches if runner is not None else 1
    world = _world_of(engine, world)
    pred = _priced(engine, world, engine.global_batch, m)
    traced = engine.train_graph
    chain = chain_of(traced, tokens_per_sample(traced) or 1, (engine.plan.mesh[TP],))
    fwd = sum(lt.forward_flops(1) for lt in chain.layers())
    dtype = engine.precision if engine.precision in world.profile.peak_flops else FP32
    return {"device": world.device, "step_time_s": pred.get("step_time_s"),
            "memory_per_device_bytes": engine.plan.predicted.get("memory_per_device_bytes"),
            "model_flops_per_step": int(3 * fwd * engine.global_batch),
            "peak_flops": world.profile.flops(dtype), "peak_dtype": dtype}


def _world_of(engine, world: World | None) -> World:
    """`world`, else the plan's, else this machine's at the plan's size."""
    if world is not None:
        return world
    plan = engine.plan
    if isinstance(plan.world, World):
        return plan.world
    size = plan.world_size
    return World(devices=size, per_node=min(size, int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                      size))),
                 device=local_device())


def _experts(engine, pred: dict | None, exact: dict, steps: int) -> list[dict]:
    """Per MoE layer split over ep that ran on this rank: the planner's tokens per expert
    (balanced routing; its busiest rank's at the routing imbalance the planner prices)
    beside the routing the last step took (`engine.expert_load()`), and the layer's
    all-to-all bytes on ep from that routing (`predicted_comm_by_layer`) beside those sent
    (per step over the measured steps)."""
    load = engine.expert_load()
    planned = pred.get("experts", {}) if pred else {}
    rec = engine.recorder
    out = []
    # as expert_load: per module path, the graph that ran last (training after inference)
    modules = {m.name: m for m in engine.expert_layers() if m.name in load}
    for module in modules.values():
        got = load[module.name]
        layer = module.layer
        fig = rec.layers.get(layer)
        routed, computed = sum(got["routed"]), sum(got["computed"])
        out.append({
            "layer": layer, "module": module.name, "experts": module.spec.experts,
            "top_k": module.spec.top_k, EP: engine.plan.ep,
            "predicted": dict(planned.get(layer, {}), alltoall_bytes=sum(
                nbytes for (_, axis, at), nbytes in exact.items()
                if axis == EP and at == layer)),
            "measured": dict(got, tokens_per_expert=computed / max(1, len(got["computed"])),
                             load=computed / routed if routed else None,
                             alltoall_bytes=(fig.comm_by_axis.get(EP, 0) if fig else 0)
                             // steps),
        })
    return out


def _axis(name: str) -> str:
    """The cost model's axis for a runtime axis (2D/2.5D/3D split `tp` into several)."""
    return TP if name.startswith(TP) else name


def _held_bytes(engine) -> dict[str, int]:
    """Bytes of the parameters each layer reads, as this rank holds them (tensor-parallel
    slices; whole under ZeRO-3, which gathers them for the layer)."""
    held = engine.parameter_bytes()
    out: dict[str, int] = {}
    params = engine.train_graph.params
    for layer in engine.train_graph.layers:
        total = 0
        for target in layer.params:
            pinfo = params.get(target)
            if pinfo is not None and pinfo.is_parameter and pinfo.names[0] in held:
                total += held[pinfo.names[0]][0]
        out[layer.name] = total
    return out


def _priced(engine, world: World | None, global_batch: int, m: int) -> dict | None:
    """The cost model's per-layer time and memory, per-axis time and step for the engine's
    plan as it runs: its layers' states and stages (`autopar.cost.step`)."""
    plan = engine.plan
    world = _world_of(engine, world)
    mesh, pipe, zero = plan.mesh, plan.pipeline, plan.zero
    tp = mesh[TP]
    traced = engine.train_graph
    chain = chain_of(traced, tokens_per_sample(traced) or 1, (tp,))
    modes = plan.layer_modes()
    sp = plan.sequence_parallel_layers()
    stage_of_layer = engine.stage_of_layer
    b = max(1, global_batch // mesh[DP] // m)
    names = chain.names
    recompute = plan.recompute_modes(names)
    states = [LayerState(tensor_mode(modes.get(name, plan.tp_mode), tp, plan.tp_depth),
                         MEGATRON_SP if (sp is True or (sp and name in sp)) else NO_SP,
                         recompute[name]) for name in names]
    stage_of = [stage_of_layer.get(name, 0) for name in names]
    # its dtype names are the planner's; fp8 at bf16's rate where the profile has no fp8 peak
    precision = engine.precision if engine.precision != FP8 or \
        FP8 in world.profile.peak_flops else BF16
    ctx = pricing_context(plan, world, precision, chain)
    ctx.compile = engine.regions is not None  # priced as it runs, whatever the plan says
    costs = layer_costs(chain, states, ctx, b, stage_of if mesh[PP] > 1 else None)
    split = mesh[PP] > 1 and pipe.schedule == ZERO_BUBBLE  # the loss's backward in two
    out = {"device": world.device, "layers": {}, "axes": {},
           "fusion_s": m * sum(c.effects.get(FUSION, 0.0) for c in costs)}
    for name, c in zip(names, costs):
        out["layers"][name] = {
            "forward_s": m * (c.forward + c.comm / 2),
            "backward_s": m * (c.backward + c.recompute + c.comm / 2 + split * c.split_backward),
            "comm_s": m * c.comm,
            "activation_bytes": int(c.activations),
            "param_bytes": int(c.params),
            "effects": {REMADE_NAME: m * c.effects.get(REMADE_NAME, 0.0),
                        SPLIT_NAME: m * split * c.split_backward},
        }
    pp = mesh[PP]
    schedule = pipe.schedule if pp > 1 else NO_PIPELINE
    v = pipe.chunks if pp > 1 else 1
    device_of = [stage_owner(schedule, s, pp) if pp > 1 else 0 for s in stage_of]
    pl = placements(mesh, ORDER, world.per_node)
    params_dev = np.bincount(device_of, weights=[c.params for c in costs], minlength=pp)
    heaviest = int(np.argmax(params_dev))
    units = sum(1 for d, c in zip(device_of, costs) if d == heaviest and c.params > 0)
    layer_time = np.array([c.time + split * c.split_backward for c in costs]) + \
        np.array(conversions(chain.layers(), states, b, pl, world.profile))
    try:
        transfer = stage_transfer(chain.layers(), stage_of, b, pl, world.profile)[0] \
            if pp > 1 else 0.0
        step = step_parts(layer_time, device_of, stage_of, params_dev, units, transfer=transfer,
                          grad_pl=grad_placement(mesh, world.per_node), hw=world.profile,
                          schedule=schedule, v=v, m=m, zero=zero.stage,
                          offload=zero.offload, precision=plan_precision(plan, chain),
                          hybrid=hybrid_split(mesh, plan.dp_shard, world.per_node)
                          if plan.dp_replicate > 1 else None)
    except PlanError as e:
        out["error"] = str(e)
        step = None
    if step is not None:
        out["step_time_s"] = step["step_s"]
    out["experts"] = _planned_experts(chain, plan, b, m)
    detail = pipeline_detail(plan, chain, states, costs, names=names, stage_of=stage_of,
                             world=world, m=m, b=b,
                             dp_comm_s=step["dp_s"] if step is not None else None)
    out["axes"] = {axis: {"seconds": entry["seconds"]}
                   for axis, entry in detail["comm_by_axis"].items()}
    return out


def _planned_experts(chain, plan, b: int, m: int) -> dict[str, dict]:
    """Per MoE layer: the rows each expert computes per step under balanced routing (its ep
    group's tokens, top_k over the experts, every micro-batch of `b` samples), the routing
    imbalance the planner prices the busiest ep rank at, and that rank's rows per expert."""
    out = {}
    ep = plan.ep
    for lt in chain.types:
        if lt.experts is None or ep <= 1:
            continue
        balanced = m * tokens_per_expert(lt.experts, b, 1, ep)
        imbalance = imbalance_of(lt.experts, b, 1, ep)
        for name in lt.names:
            out[name] = {"tokens_per_expert": balanced, "imbalance": imbalance,
                         "busiest_tokens_per_expert": balanced * imbalance}
    return out


def _t(seconds) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.2f}"


def _b(nbytes) -> str:
    return "-" if nbytes is None else size_text(nbytes)


def _ratio(measured, predicted) -> str:
    if not measured or not predicted:
        return "-"
    return f"x{measured / predicted:.2f}"


def measured_text(data: dict) -> str:
    """`measured_report`'s numbers as tables a person reads."""
    mesh = " x ".join(f"{a}{v}" for a, v in data["mesh"].items() if v > 1) or "1 device"
    step = data["step"]
    lines = [f"predicted beside measured on rank {data['rank']} ({mesh}; global batch "
             f"{data['global_batch']}, {data['microbatches']} micro-batch"
             f"{'es' if data['microbatches'] > 1 else ''}; {data['steps']} steps measured "
             f"after {data['warmup']} warm-up; predicted on the '{data['device']}' profile)",
             f"step: predicted {_t(step['predicted_s'])} ms, measured {_t(step['measured_s'])} "
             f"ms ({_ratio(step['measured_s'], step['predicted_s'])})"]
    if data.get("prediction_error"):
        lines.append(f"(no step prediction: {data['prediction_error']})")
    lines += ["", "per layer, one step on this rank (times in ms; activations per micro-batch)",
              f"  {'layer':<14}{'forward':>17}{'backward':>17}{'comm bytes':>21}"
              f"{'activations':>21}{'params':>21}",
              f"  {'':<14}{'pred':>8} {'meas':>8}{'pred':>8} {'meas':>8}{'pred':>10} {'meas':>10}"
              f"{'pred':>10} {'meas':>10}{'pred':>10} {'meas':>10}"]
    for row in data["layers"]:
        p, mm = row["predicted"], row["measured"]
        if row["name"] == STEP and not p.get("comm_bytes") and not (mm and mm["comm_bytes"]):
            continue  # nothing is sent outside the layers
        if mm is None:
            lines.append(f"  {row['name']:<14}{_t(p.get('forward_s')):>8} {'':>8}"
                         f"{_t(p.get('backward_s')):>8} {'':>8}  (another pipeline rank)")
            continue
        bwd = _t(mm["backward_s"]) + ("" if mm["backward_timed"] else "*")
        lines.append(
            f"  {row['name']:<14}{_t(p.get('forward_s')):>8} {_t(mm['forward_s']):>8}"
            f"{_t(p.get('backward_s')):>8} {bwd:>8}"
            f"{_b(p.get('comm_bytes')):>10} {_b(mm['comm_bytes']):>10}"
            f"{_b(p.get('activation_bytes')):>10} {_b(mm['activation_bytes']):>10}"
            f"{_b(p.get('param_bytes')):>10} {_b(mm['param_bytes']):>10}")
    if any(r["measured"] and not r["measured"]["backward_timed"] for r in data["layers"]):
        lines.append("  * its inputs take no gradient: part of its backward is counted with "
                     "the layer run before it in the backward")
    lines += ["", "per mesh axis, one step on this rank (time: blocked in collectives, ms)",
              f"  {'axis':<8}{'bytes pred':>12}{'bytes meas':>12}{'time pred':>11}"
              f"{'time meas':>11}"]
    for a in data["axes"]:
        lines.append(f"  {a['axis']:<8}{_b(a['predicted']['bytes']):>12}"
                     f"{_b(a['measured']['bytes']):>12}{_t(a['predicted']['seconds']):>11}"
                     f"{_t(a['measured']['seconds']):>11}")
    if data.get("compile"):
        c = data["compile"]
        lines += ["", f"compiled (inductor): {c['regions']} regions between collectives, "
                  f"{c['compiled_functions']} compiled functions (repeated blocks share one); "
                  f"fused memory-bound ops save {_t(-(c['predicted_fusion_s'] or 0.0))} ms "
                  "of the predicted step (the layers' times above are measured compiled)"]
    if data.get("logits_remade"):
        lines += ["", "the chunked loss's logits made again in its backward, one step on this "
                  "rank (ms; measured: the kernel's own time making them)"]
        lines += [f"  {e['effect']:<34} predicted {_t(e['predicted_s']):>8}  measured "
                  f"{_t(e['measured_s']):>8} ({_ratio(e['measured_s'], e['predicted_s'])})"
                  for e in data["logits_remade"]]
    if data.get("experts"):
        lines += ["", "per MoE layer, one step on this rank (rows each expert computed: predicted"
                  " for balanced routing, and for the busiest ep rank at the planner's "
                  "imbalance; measured: the last step's routing, engine.expert_load())",
                  f"  {'layer':<14}{'experts':>8}{'rows/expert pred':>18}{'busiest':>9}"
                  f"{'meas':>9}{'load':>7}{'a2a bytes pred':>16}{'meas':>10}"]
        for e in data["experts"]:
            p, mm = e["predicted"], e["measured"]
            busiest = p.get("busiest_tokens_per_expert")
            load = "-" if mm["load"] is None else f"x{mm['load']:.2f}"
            lines.append(
                f"  {e['layer']:<14}{e['experts']:>5}/{e[EP]:<2}"
                f"{_n(p.get('tokens_per_expert')):>18}{_n(busiest):>9}"
                f"{_n(mm['tokens_per_expert']):>9}"
                f"{load:>7}"
                f"{_b(p['alltoall_bytes']):>16}{_b(mm['alltoall_bytes']):>10}")
            lines.append(f"  {'':<14}routed here per expert {mm['routed']}; computed by experts "
                         f"{mm['first_expert']}.. {mm['computed']}")
    return "\n".join(lines + _float8_lines(data.get("float8")))


def _float8_lines(fp8: dict | None) -> list[str]:
    """precision="fp8": which linears ran their GEMMs in float8, which stayed bf16 and why."""
    if fp8 is None:
        return []
    recipe = fp8.get("recipe", "e4m3 activations and weights, e5m2 gradients, tensorwise "
                             "power-of-two scales")
    lines = ["", f"float8 ({recipe}): {len(fp8['converted'])} linear modules in float8"]
    lines += [f"  stayed bf16: {module}: {why}" for module, why in fp8["kept"].items()]
    return lines


def _n(value) -> str:
    return "-" if value is None else f"{value:.1f}"
