"""Pipeline schedules: each stage's idle share and the first stage's peak activations,
measured beside predicted.

    python benchmarks/bench_pipeline.py [--microbatches 8] [--steps 3]

A GPT of 8 identical blocks (`SPEC`) trains under `pipeline=dict(size=2, schedule=...)`
on a gloo world of 2 (one thread per process, so each rank has a core of this 2-core
machine), batch `--microbatches` x 4, for gpipe, 1f1b, interleaved (2 stages per rank)
and zero_bubble (ZB-V, 2 stages per rank in a V). The stages are the planner's (balanced
by predicted time under memory limits, `autopar.search.planner.pipeline_stages`).

(a) Idle. Per rank:
- step: median wall time of the pipeline's forward and backward (`PipelineRunner.step`,
  the optimizer step left out) over `--steps` steps after a warm-up;
- busy: the rank's stages run alone, without communication, each micro-batch's forward
  and backward (inputs made by running the earlier stages locally, with every stage's
  weights fetched for it); idle = 1 - busy / step;
- model: `autopar.cost.schedule.simulate` playing the schedule's own order (read from
  torch's schedule classes) with the stages' measured forward, backward and weight-gradient
  seconds and the measured point-to-point time of one boundary tensor;
- closed form: the search's formula (`autopar.cost.schedule.step_time`) on the same
  per-rank seconds, which is what the planner ranks candidates with.

(b) Memory. Per rank, the most bytes autograd holds saved at once during one pipeline
step (`measure_peak_saved_activations`: storages from when a tensor is saved until the
last tensor on it is freed), beside the prediction: `simulate`'s peak with each stage's
activations per micro-batch from `autopar.cost.memory.activation_bytes` on the engine's
own training graph (micro-batch size 4). The schedule decides how many micro-batches a
stage holds: GPipe all m, 1F1B p - r on rank r.

Writes benchmarks/results/pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_world import results_path, run_world  # noqa: E402

SPEC = "gpt:layers=8,hidden=256,heads=4,vocab=256,seq=128"
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 2))
SIZES = {k: int(v) for k, v in (kv.split("=") for kv in SPEC.split(":")[1].split(","))}
MICRO = 4  # samples per micro-batch


def _loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


def _tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _stage_costs(runner, micro_inputs: tuple, micro_target, reps: int = 3) -> dict:
    """Seconds of one micro-batch through each of this rank's stages, alone: forward,
    backward, and the share of the backward that is the weight gradient. Median of reps."""
    stages = runner.stages
    n = len(stages.modules)
    args, ins = micro_inputs, []
    with torch.no_grad():
        for module in stages.modules:
            ins.append(args)
            args = _tuple(module(*args))
    out = {}
    for k in runner.mine:
        module = stages.modules[k]

        def forward(k=k, module=module):
            x = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in ins[k])
            start = time.perf_counter()
            y = _tuple(module(*x))
            if k == n - 1:
                loss = stages.loss(*y, micro_target)
                y = (loss[0] if isinstance(loss, (tuple, list)) else loss,)
            seconds = time.perf_counter() - start
            outs = [o for o in y if o.requires_grad]
            return seconds, outs, [torch.ones_like(o) for o in outs], \
                [a for a in x if a.requires_grad]

        fwd, bwd, inp = [], [], []
        for _ in range(reps):
            seconds, outs, grads, wanted = forward()
            fwd.append(seconds)
            if wanted:  # the input gradient alone (what ZB-V runs as I), on its own forward:
                # the chunked loss's backward consumes its kept logits chunk in place, so
                # a second backward through one forward is refused by autograd
                start = time.perf_counter()
                torch.autograd.grad(outs, wanted, grads)
                inp.append(time.perf_counter() - start)
                _, outs, grads, _ = forward()
            else:
                inp.append(0.0)
            start = time.perf_counter()
            torch.autograd.backward(outs, grads)
            bwd.append(time.perf_counter() - start)
        b = statistics.median(bwd)
        out[k] = {"forward_s": statistics.median(fwd), "backward_s": b,
                  "weight_share": max(0.0, min(1.0, 1 - statistics.median(inp) / b))}
    for p in runner.parameters():
        p.grad = None
    return out


def _p2p_seconds(nbytes: int, reps: int = 10) -> float:
    """One transfer of `nbytes` between the two ranks: half a ping-pong, median."""
    t = torch.zeros(nbytes // 4)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def worker(rank: int, m: int, steps: int, out_path: str) -> None:
    import autopar
    from autopar.cost.memory import activation_bytes
    from autopar.cost.schedule import simulate, stage_owner, step_time
    from autopar.models import build
    from autopar.runtime.measure import measure_peak_saved_activations

    rows = []
    p2p = None
    for schedule, v in SCHEDULES:
        model, (x,) = build(SPEC, batch=MICRO * m, device="cpu", seed=0)
        target = torch.randint(0, 256, x.shape, generator=torch.Generator().manual_seed(1))
        plan = {"pipeline": {"size": 2, "schedule": schedule, "microbatches": m,
                             **({"chunks": v} if schedule == "interleaved" else {})}}
        engine = autopar.parallelize(model, 2, example_inputs=(x[:2],), loss_fn=_loss,
                                     optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                                     plan=plan)
        engine.train_step((x,), target)  # warm-up: traces, builds the schedule
        runner = engine.pipeline
        n = len(runner.stages.modules)
        if p2p is None:  # the boundary tensor: a micro-batch's [MICRO, seq, hidden] floats
            p2p = _p2p_seconds(MICRO * SIZES["seq"] * SIZES["hidden"] * 4)
        times = []
        for _ in range(steps):
            dist.barrier()
            for p in engine.parameters():
                p.grad = None
            start = time.perf_counter()
            runner.step((x,), target)
            times.append(time.perf_counter() - start)
        step = statistics.median(times)
        engine.fetch_pipeline_weights()  # every stage runs here: fetch the others' weights
        mine = _stage_costs(runner, (x[:MICRO],), target[:MICRO])
        costs: list = [None, None]
        dist.all_gather_object(costs, mine)
        stage_cost = {k: c for part in costs for k, c in part.items()}
        fwd = [stage_cost[k]["forward_s"] for k in range(n)]
        bwd = [stage_cost[k]["backward_s"] for k in range(n)]
        share = [stage_cost[k]["weight_share"] for k in range(n)]
        busy = m * sum(fwd[k] + bwd[k] for k in runner.mine)
        # memory: one more step with the saved-tensor tracker on (not timed)
        for p in engine.parameters():
            p.grad = None
        dist.barrier()
        peak = measure_peak_saved_activations(lambda r=runner, x=x, t=target: r.step((x,), t),
                                              exclude=list(engine.parameters()), inputs=(x,))
        acts = activation_bytes(engine.train_graph, engine.train_solution, micro_batch=MICRO)
        stage_acts = [sum(b for layer, b in acts.items()
                          if engine.stage_of_layer.get(layer) == k) for k in range(n)]
        model_run = simulate(schedule, 2, m, v, forward=fwd, backward=bwd, weight_share=share,
                             p2p=p2p, activations=stage_acts)
        device_s = [sum(fwd[k] + bwd[k] for k in range(n) if stage_owner(schedule, k, 2) == r)
                    + 2 * v * p2p for r in range(2)]
        closed = step_time(schedule, 2, m, device_s, v)
        row = {"schedule": schedule, "rank": rank, "stages": runner.mine,
               "layers": sorted(engine.pipeline_layers()),
               "step_s": step, "busy_s": busy, "idle_measured": 1 - busy / step,
               "idle_model": model_run.idle[rank], "step_model_s": model_run.step_s,
               "idle_closed_form": 1 - m * device_s[rank] / closed, "step_closed_form_s": closed,
               "stage_costs": {str(k): c for k, c in mine.items()},
               "peak_activations_measured": peak,
               "peak_activations_predicted": model_run.peak_bytes[rank],
               "microbatches_held_predicted": model_run.peak_microbatches[rank]}
        gathered = [None, None]
        dist.all_gather_object(gathered, row)
        rows.extend(gathered)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"spec": SPEC, "pp": 2, "microbatches": m, "micro_batch": MICRO,
                       "p2p_s": p2p, "rows": rows}, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    out_path = results_path("pipeline.json")
    t0 = time.perf_counter()
    run_world(worker, (args.microbatches, args.steps, out_path), 2)
    with open(out_path) as f:
        data = json.load(f)
    m = args.microbatches
    print(f"(a) idle per rank, {SPEC}, pp 2, {m} micro-batches of {MICRO} (CPU, gloo, one "
          f"thread per rank; one boundary transfer {data['p2p_s'] * 1e3:.2f} ms)")
    print(f"{'schedule':<12} {'rank':>4} {'stages':>7} {'step s':>7} {'busy s':>7} "
          f"{'idle meas':>9} {'idle model':>10} {'closed form':>11}")
    for r in data["rows"]:
        print(f"{r['schedule']:<12} {r['rank']:>4} {str(r['stages']):>7} {r['step_s']:>7.3f} "
              f"{r['busy_s']:>7.3f} {r['idle_measured']:>9.3f} {r['idle_model']:>10.3f} "
              f"{r['idle_closed_form']:>11.3f}")
    print(f"\n(b) peak saved activations per rank (MiB), micro-batch {MICRO}")
    print(f"{'schedule':<12} {'rank':>4} {'held':>5} {'measured':>9} {'predicted':>9} "
          f"{'pred/meas':>9}")
    for r in data["rows"]:
        meas, pred = r["peak_activations_measured"], r["peak_activations_predicted"]
        print(f"{r['schedule']:<12} {r['rank']:>4} {r['microbatches_held_predicted']:>5.1f} "
              f"{meas / 2**20:>9.2f} {pred / 2**20:>9.2f} {pred / meas:>9.3f}")
    first = {r["schedule"]: r for r in data["rows"] if r["rank"] == 0}
    g, o = first["gpipe"], first["1f1b"]
    print(f"\nfirst stage, GPipe / 1F1B: measured "
          f"{g['peak_activations_measured'] / o['peak_activations_measured']:.2f}x, predicted "
          f"{g['peak_activations_predicted'] / o['peak_activations_predicted']:.2f}x")
    print(f"\n{time.perf_counter() - t0:.0f} s; written to benchmarks/results/pipeline.json")


if __name__ == "__main__":
    main()
