"""The plan's prediction beside what a running engine measured: `Engine.explain()`.

The prediction is the cost model's for exactly the engine's plan: each layer priced in
the state it runs (tensor mode, sequence parallelism, stage) at the engine's micro-batch,
on the hardware profile of `world` (this machine's by default, or a calibrated one:
`World(devices=4, device="profile.json")`); the step as the planner predicts it for this
mesh, schedule and ZeRO stage. Bytes are the plan's own collectives
(`Engine.predicted_comm_by_layer`), which the runtime sends byte for byte. The
measurement is `autopar.runtime.measure`'s: per-layer time from marks in the graphs,
saved activations from autograd's hooks, each collective's bytes and blocking time from
the comm log, all on this rank, averaged over the counted steps.
"""

from __future__ import annotations

import dataclasses
import os

from autopar.errors import PlanError
from autopar.plans import PipelinePlan, Plan, LayerPlan
from autopar.report.predicted import size_text
from autopar.runtime.measure import STEP
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
    runner = engine._pipeline
    m = runner.microbatches if runner is not None else 1
    global_batch = engine._global_batch
    mine = engine._pipeline_layers() if runner is not None else None
    names = [layer.name for layer in engine.train_graph.layers]
    pred = _priced(engine, world, global_batch, m)
    exact = engine.predicted_comm_by_layer(global_batch)
    bytes_by_layer: dict[str, int] = {}
    bytes_by_axis: dict[str, int] = {}
    for (op, axis, layer), nbytes in exact.items():
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
                       key=lambda a: ("pp", "dp", "cp", "tp", "world").index(a)
                       if a in ("pp", "dp", "cp", "tp", "world") else 9):
        got = measured_axes.get(axis, [0, 0.0])
        model = pred["axes"].get(axis, {}) if pred else {}
        axes.append({"axis": axis,
                     "predicted": {"bytes": bytes_by_axis.get(axis, 0),
                                   "seconds": model.get("seconds")},
                     "measured": {"bytes": got[0] // steps, "seconds": got[1] / steps}})
    return {
        "rank": engine._rank(),
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
    }


def _axis(name: str) -> str:
    """The cost model's axis for a runtime axis (2D/2.5D/3D split `tp` into several)."""
    return "tp" if name.startswith("tp") else name


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
    """The cost model's per-layer time and memory and per-axis time for the engine's plan."""
    from autopar.cost.model import LayerState
    from autopar.search.planner import chain_of
    from autopar.report.predicted import _context, _layer_costs, _mode, _pipeline_detail
    from autopar.search.search import Constraints, Options, Search
    from autopar.sharding.solve import tokens_per_sample

    plan: Plan = engine.plan
    size = plan.world_size
    if world is None:
        world = plan.world if isinstance(plan.world, World) else World(
            devices=size, per_node=min(size, int(os.environ.get("LOCAL_WORLD_SIZE", size))),
            device=local_device())
    dtype = engine.precision  # the planner's dtype names are the precision's
    tp = plan.mesh["tp"]
    traced = engine.train_graph
    chain = chain_of(traced, tokens_per_sample(traced) or 1, (tp,))
    modes = plan.layer_modes()
    sp = plan.sequence_parallel_layers()
    stage_of = getattr(engine, "_stage_of_layer", None) or {}
    b = max(1, global_batch // plan.mesh["dp"] // m)
    layers = [LayerPlan(name, tp_mode=modes.get(name, plan.tp_mode),
                        sp="megatron" if (sp is True or (sp and name in sp)) else "none",
                        stage=stage_of.get(name, 0))
              for name in chain.names]
    pipe = plan.pipeline
    priced = dataclasses.replace(
        plan, layers=layers, world=world, detail=None,
        pipeline=PipelinePlan(schedule=pipe.schedule, microbatches=m, chunks=pipe.chunks,
                              micro_batch_size=b),
        search={**plan.search, "dtype": dtype})
    out = {"device": world.device, "layers": {}, "axes": {}}
    try:  # the step: the planner's prediction for exactly this mesh and schedule
        fixed = Constraints(pp=plan.mesh["pp"], dp=plan.mesh["dp"], cp=plan.mesh["cp"], tp=tp,
                            tp_mode=plan.grid_mode() if tp > 1 else None,
                            sp=plan.sequence_mode if plan.mesh["cp"] > 1 else None,
                            zero=plan.zero.stage, offload=plan.zero.offload,
                            recompute="none", microbatches=m,
                            schedule=pipe.schedule if plan.mesh["pp"] > 1 else None,
                            chunks=pipe.chunks if pipe.schedule == "interleaved" else None)
        result = Search(chain, world, Options(global_batch=global_batch, dtype=dtype, top=1),
                        fixed).run()
        best = result.best or min((c for c, _ in result.alternatives),
                                  key=lambda c: c.step_time, default=None)
        if best is not None:
            out["step_time_s"] = best.step_time
            priced.predicted = {"dp_comm_s": best.dp_comm_s}
    except PlanError as e:
        out["error"] = str(e)
    states = [LayerState(_mode(lp.tp_mode, tp, plan.tp_depth), lp.sp, lp.recompute)
              for lp in layers]
    ctx = _context(priced)
    costs = _layer_costs(priced, chain, states, ctx)
    for name, c in zip(chain.names, costs):
        out["layers"][name] = {
            "forward_s": m * (c.forward + c.comm / 2),
            "backward_s": m * (c.backward + c.recompute + c.comm / 2),
            "comm_s": m * c.comm,
            "activation_bytes": int(c.activations),
            "param_bytes": int(c.params),
        }
    detail = _pipeline_detail(priced, chain, states, costs)
    out["axes"] = {axis: {"seconds": entry["seconds"]}
                   for axis, entry in detail["comm_by_axis"].items()}
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
    return "\n".join(lines)
