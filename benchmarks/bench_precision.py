"""Mixed precision on this CPU: fp32 beside bf16 (and fp16) under data and tensor parallelism.

    python benchmarks/bench_precision.py [--steps 8] [--batch 8]

Spawns 2 gloo processes (one thread each) and trains a small GPT under dp2 and tp2 with
`parallelize(..., precision=...)`, the same weights and batches for every precision. Per
plan and precision it prints:

* step time: the median of the timed steps (after two warm-up steps), and its ratio to
  fp32 in the same run (the machine is shared: compare ratios, not absolute times). On a
  CPU the 16-bit GEMMs run through oneDNN (AVX512-BF16 where the CPU has it) while casts
  and element-wise ops cost extra passes, so the ratio says little about a GPU;
* peak saved activations of one step (`autopar.runtime.measure.measure_peak_saved_activations`,
  the fp32 parameters excluded): under 16 bits this includes the 16-bit weight casts the
  linears save for their backward, which fp32 does not need since it saves the
  parameters themselves; "acts" takes them out (the rank's parameters at 2 bytes each:
  the tied embedding's cast is saved once, by the classifier, as an embedding's backward
  needs only the indices);
* bytes communicated per step, measured (comm_log) and whether they equal the engine's
  prediction: tensor-parallel activations move in 16 bits, the data-parallel gradient
  all-reduce stays fp32;
* the loss after the last step and its relative difference from fp32's.

Writes benchmarks/results/precision.json.
"""

from __future__ import annotations

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

SPEC = "gpt:layers=4,hidden=256,heads=8,vocab=1024,seq=128"
PLANS = {"dp2": {"data": 2}, "tp2": {"tensor": {"size": 2, "mode": "1d"}}}
PRECISIONS = ("fp32", "bf16", "fp16")
WORLD = 2


def worker(rank: int, batch: int, steps: int, out_path: str) -> None:
    import autopar
    from autopar.models import build
    from autopar.runtime.measure import measure_peak_saved_activations

    rows = []
    for plan_name, plan in PLANS.items():
        for precision in PRECISIONS:
            model, (x,) = build(SPEC, batch=batch, device="cpu", seed=0)
            target = torch.randint(0, 1024, x.shape, generator=torch.Generator().manual_seed(1))
            engine = autopar.parallelize(
                model, WORLD, example_inputs=(x[:2],), loss_fn=lm_loss, plan=plan,
                optimizer=functools.partial(torch.optim.AdamW, lr=1e-3), precision=precision)
            times, loss = [], None
            for step in range(steps + 2):
                engine.comm_log.clear()
                dist.barrier()
                start = time.perf_counter()
                loss = engine.train_step(x, target)
                if step >= 2:
                    times.append(time.perf_counter() - start)
            measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
            predicted = engine.predicted_comm(batch)
            dist.barrier()
            params = list(engine.parameters())
            peak = measure_peak_saved_activations(lambda e=engine, x=x, t=target: e.train_step(x, t),
                                                  exclude=params, inputs=(x, target))
            rows.append({"plan": plan_name, "precision": precision,
                         "step_time_s": statistics.median(times),
                         "peak_saved_bytes": peak,
                         "comm_bytes": sum(measured.values()),
                         "comm_by_op": {f"{op}/{ax}": b for (op, ax), b in measured.items()},
                         "comm_equals_prediction": measured == predicted,
                         "final_loss": loss, "loss_scale": engine.loss_scale,
                         "skipped_steps": engine.skipped_steps,
                         "param_bytes": sum(p.numel() * p.element_size() for p in params)})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": WORLD, "model": SPEC, "batch": batch, "steps": steps + 2,
                       "threads_per_rank": torch.get_num_threads(), "rows": rows}, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    out_path = results_path("precision.json")
    run_world(worker, (args.batch, args.steps, out_path), WORLD)
    with open(out_path) as f:
        data = json.load(f)
    print(f"{data['model']}, world {WORLD} (gloo, CPU, 1 thread a rank), global batch "
          f"{args.batch}, {data['steps']} steps")
    print(f"{'plan':<5} {'prec':<5} {'step ms':>8} {'vs fp32':>8} {'saved MiB':>10} "
          f"{'acts MiB':>9} {'vs fp32':>8} {'comm MiB':>9} {'vs fp32':>8} {'=pred':>6} "
          f"{'loss':>8} {'d loss':>9}")
    for row in data["rows"]:
        base = next(r for r in data["rows"] if r["plan"] == row["plan"]
                    and r["precision"] == "fp32")
        casts = 0 if row["precision"] == "fp32" else row["param_bytes"] // 2
        acts = row["peak_saved_bytes"] - casts
        print(f"{row['plan']:<5} {row['precision']:<5} {row['step_time_s'] * 1e3:>8.1f} "
              f"{row['step_time_s'] / base['step_time_s']:>8.2f} "
              f"{row['peak_saved_bytes'] / 2 ** 20:>10.2f} {acts / 2 ** 20:>9.2f} "
              f"{acts / base['peak_saved_bytes']:>8.2f} "
              f"{row['comm_bytes'] / 2 ** 20:>9.3f} "
              f"{row['comm_bytes'] / base['comm_bytes']:>8.2f} "
              f"{str(row['comm_equals_prediction']):>6} {row['final_loss']:>8.4f} "
              f"{abs(row['final_loss'] - base['final_loss']) / base['final_loss']:>9.2e}")
    print("saved: peak saved tensors (16 bits: with the weight casts the linears save); acts: "
          "less the casts (the rank's parameters at 2 bytes); comm: bytes a rank logs per "
          "step; =pred: equal to engine.predicted_comm; d loss: |loss - fp32's| / fp32's "
          "after the last step")
    print(f"written to {os.path.relpath(out_path, ROOT)}")


if __name__ == "__main__":
    main()
