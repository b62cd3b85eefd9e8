"""Pipeline bubbles: the idle fraction of each stage per schedule, measured beside predicted.

    python benchmarks/bench_pipeline.py [--microbatches 8] [--steps 3]

A GPT of 8 identical blocks (`SPEC`) trains under `pipeline=dict(size=2, schedule=...)`
on a gloo world of 2 (one thread per process, so each stage has a core of this 2-core
machine), batch `--microbatches` x 4, for gpipe, 1f1b, interleaved (2 virtual stages per
rank) and zero_bubble (ZBV). Per rank:

- step: the median wall time of `train_step` over `--steps` steps after one warm-up
  (forward, backward, the optimizer step excluded by timing the pipeline runner alone);
- busy: the same rank's stages run alone, with no communication, forward and backward of
  every micro-batch (each stage's inputs made by running the stages before it locally:
  every rank holds all weights), median of 3;
- idle = 1 - busy / step.

Predicted idle is the planner's pipeline model (`autopar.search.search`) for balanced
stages, p ranks, m micro-batches and v virtual stages per rank: (p-1)/(m+p-1) for GPipe
and 1F1B, ((p-1)/v)/(m+(p-1)/v) interleaved, and for zero-bubble the ZB-H1 estimate
((p-1)/3)/(m+(p-1)/3) (Qi et al. 2024). The runtime's zero_bubble is torch's ZBV schedule,
whose bubble is smaller than ZB-H1's: the row says how far. The measured idle also holds
the point-to-point transfers, which the model prices separately (`p2p`, not bubble).

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


def _loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1))


def predicted_idle(schedule: str, p: int, m: int, v: int) -> float:
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    extra = (p - 1) / v if schedule == "interleaved" else (p - 1) / 3
    return extra / (m + extra)


def _busy(engine, micro_inputs: tuple, micro_target, m: int) -> float:
    """Seconds this rank's stages compute m micro-batches, forward and backward, alone."""
    runner = engine._pipeline
    stages = runner.stages
    args, ins = micro_inputs, []
    with torch.no_grad():
        for module in stages.modules:
            ins.append(args)
            out = module(*args)
            args = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    total = 0.0
    for k in runner.mine:
        module = stages.modules[k]
        x = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in ins[k])
        start = time.perf_counter()
        for _ in range(m):
            out = module(*x)
            out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            if k == len(stages.modules) - 1:
                loss = stages.loss(*out, micro_target)
                loss = loss[0] if isinstance(loss, (tuple, list)) else loss
                loss.backward()
            else:
                torch.autograd.backward([o for o in out if o.requires_grad],
                                        [torch.ones_like(o) for o in out if o.requires_grad])
        total += time.perf_counter() - start
    for p in engine.parameters():
        p.grad = None
    return total


def worker(rank: int, m: int, steps: int, out_path: str) -> None:
    import autopar
    from autopar.models import build

    rows = []
    for schedule, v in SCHEDULES:
        model, (x,) = build(SPEC, batch=4 * m, device="cpu", seed=0)
        target = torch.randint(0, 256, x.shape, generator=torch.Generator().manual_seed(1))
        plan = {"pipeline": {"size": 2, "schedule": schedule, "microbatches": m,
                             **({"chunks": v} if schedule == "interleaved" else {})}}
        engine = autopar.parallelize(model, 2, example_inputs=(x[:2],), loss_fn=_loss,
                                     optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                                     plan=plan)
        engine.train_step((x,), target)  # warm-up: traces, builds the schedule
        times = []
        for _ in range(steps):
            dist.barrier()
            for p in engine.parameters():
                p.grad = None
            start = time.perf_counter()
            engine._pipeline.step((x,), target)
            times.append(time.perf_counter() - start)
        step = statistics.median(times)
        micro = 4
        busy = statistics.median(_busy(engine, (x[:micro],), target[:micro], m)
                                 for _ in range(3))
        row = {"schedule": schedule, "rank": rank, "stages": engine._pipeline.mine,
               "step_s": step, "busy_s": busy, "idle_measured": 1 - busy / step,
               "idle_predicted": predicted_idle(schedule, 2, m, v)}
        gathered = [None, None]
        dist.all_gather_object(gathered, row)
        rows.extend(gathered)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"spec": SPEC, "pp": 2, "microbatches": m, "rows": rows}, f, indent=2)


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
    print(f"pipeline idle per stage, {SPEC}, pp 2, {args.microbatches} micro-batches of 4 "
          "(CPU, gloo, one thread per rank)")
    print(f"{'schedule':<12} {'rank':>4} {'stages':>8} {'step s':>8} {'busy s':>8} "
          f"{'idle meas':>10} {'idle pred':>10}")
    for r in data["rows"]:
        print(f"{r['schedule']:<12} {r['rank']:>4} {str(r['stages']):>8} {r['step_s']:>8.3f} "
              f"{r['busy_s']:>8.3f} {r['idle_measured']:>10.3f} {r['idle_predicted']:>10.3f}")
    print(f"\n{time.perf_counter() - t0:.0f} s; written to benchmarks/results/pipeline.json")


if __name__ == "__main__":
    main()
