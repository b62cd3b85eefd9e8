"""Step time of each executable plan at world 4, and communication predicted vs measured.

    python benchmarks/bench_plans.py [--steps 10] [--model gpt-tiny]

Spawns 4 gloo processes on this machine, trains the example model under each plan and
prints a table; the figures go to benchmarks/results/plans.json as well. Step times are
medians over the timed steps (after two warm-up steps); compare plans by their ratios in
one run, since the machine is shared.
"""

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import lm_loss, results_path, run_world  # noqa: E402

PLANS = {"data 4": {"data": 4},
         "tensor 4": {"tensor": {"size": 4, "mode": "1d"}},
         "tensor 2 x data 2": {"tensor": {"size": 2, "mode": "1d"}}}
WORLD = 4


def worker(rank, model_name, batch, steps, out_path):
    import autopar
    from autopar.models import build

    rows = []
    for name, plan in PLANS.items():
        model, (x,) = build(model_name, batch=batch, device="cpu", seed=0)
        engine = autopar.parallelize(model, WORLD, example_inputs=(x[:2],), loss_fn=lm_loss,
                                     optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                     plan=plan)
        y = torch.randint(0, 64, x.shape)
        times = []
        for step in range(steps + 2):
            engine.comm_log.clear()
            dist.barrier()
            start = time.perf_counter()
            engine.train_step(x, y)
            elapsed = time.perf_counter() - start
            if step >= 2:
                times.append(elapsed)
        measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
        predicted = engine.predicted_comm(batch)
        rows.append({"plan": name, "step_time_s": statistics.median(times),
                     "predicted_bytes": {f"{op}/{ax}": b for (op, ax), b in predicted.items()},
                     "measured_bytes": {f"{op}/{ax}": b for (op, ax), b in measured.items()},
                     "equal": predicted == measured})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": WORLD, "model": model_name, "batch": batch, "rows": rows}, f,
                      indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    out_path = results_path("plans.json")
    run_world(worker, (args.model, args.batch, args.steps, out_path), WORLD)
    with open(out_path) as f:
        data = json.load(f)
    base = data["rows"][0]["step_time_s"]
    print(f"{args.model}, world {WORLD}, global batch {args.batch} (gloo, CPU)")
    print(f"{'plan':<20} {'step ms':>9} {'vs data':>8} {'predicted B':>12} {'measured B':>12}  equal")
    for row in data["rows"]:
        pred = sum(row["predicted_bytes"].values())
        meas = sum(row["measured_bytes"].values())
        print(f"{row['plan']:<20} {row['step_time_s'] * 1e3:>9.2f} "
              f"{row['step_time_s'] / base:>8.2f} {pred:>12} {meas:>12}  {row['equal']}")
        for key in sorted(set(row["predicted_bytes"]) | set(row["measured_bytes"])):
            print(f"    {key:<24} predicted {row['predicted_bytes'].get(key, 0):>10}  "
                  f"measured {row['measured_bytes'].get(key, 0):>10}")
    print(f"written to {os.path.relpath(out_path, ROOT)}")


if __name__ == "__main__":
    main()
