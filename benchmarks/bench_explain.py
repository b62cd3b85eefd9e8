"""`engine.explain()` after training: predicted beside measured, per layer and mesh axis.

    python benchmarks/bench_explain.py [--world 4] [--steps 8] [--profile profile.json]
                                       [--model gpt:layers=4,hidden=256,...] [--batch 16]

One gloo world on this machine. For each plan (data with ZeRO-3, tensor 1D x data,
pipeline 1F1B x data) every rank trains the model a few steps and rank 0 prints
`engine.explain()`: per layer the predicted and measured forward and backward time,
bytes of its collectives (the plan's own: they equal the measurement) and activations
autograd saved per micro-batch, the parameters it holds; per mesh axis the bytes and the
time blocked in collectives. `--profile` prices the plan on a calibrated profile
(`autopar calibrate -o profile.json --world 4`) instead of the stock `cpu` one.

Then the cost of measuring: the same engine steps with its recorder on and off, taking
turns step by step, and the ratio of the medians (the marks, the saved-tensor hook and
the per-collective clock run on every step by default; `engine.recorder.enabled = False`
turns them off). Writes benchmarks/results/explain_world<N>.json.
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

MODEL = "gpt:layers=4,hidden=256,heads=8,vocab=2048,seq=64"


def plans(world: int) -> dict:
    return {f"data {world} zero 3": {"data": world, "zero": {"stage": 3}},
            f"tensor 2 x data {world // 2}": {"tensor": {"size": 2, "mode": "1d"}},
            f"pipeline 2 x data {world // 2}": {"pipeline": {"size": 2, "schedule": "1f1b",
                                                             "microbatches": 4}}}


def worker(rank, world, model_name, batch, steps, profile, out_path):
    import autopar
    from autopar.models import build

    priced_on = autopar.World(devices=world, per_node=world, device=profile) if profile \
        else None
    rows = []
    for name, plan in plans(world).items():
        model, (x,) = build(model_name, batch=batch, device="cpu", seed=0)
        y = torch.randint(0, 64, x.shape, generator=torch.Generator().manual_seed(1))
        engine = autopar.parallelize(model, world, example_inputs=(x[:2],), loss_fn=lm_loss,
                                     optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                     plan=plan)
        for _ in range(steps + 1):
            engine.train_step(x, y)
        data = engine.explain(format="json", world=priced_on)
        text = engine.explain(world=priced_on)
        on, off = [], []
        for step in range(2 * steps):  # recorder on and off, taking turns
            engine.recorder.enabled = step % 2 == 0
            dist.barrier()
            start = time.perf_counter()
            engine.train_step(x, y)
            (on if engine.recorder.enabled else off).append(time.perf_counter() - start)
        engine.recorder.enabled = True
        if rank == 0:
            rows.append({"plan": name, "explain": data, "text": text,
                         "measuring_on_s": statistics.median(on),
                         "measuring_off_s": statistics.median(off)})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "model": model_name, "batch": batch, "steps": steps,
                       "profile": profile or "cpu", "rows": rows}, f, indent=2)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", default=None,
                        help="a calibrated profile (autopar calibrate -o FILE --world N)")
    args = parser.parse_args()
    out_path = results_path(f"explain_world{args.world}.json")
    run_world(worker, (args.world, args.model, args.batch, args.steps, args.profile, out_path),
              args.world)
    with open(out_path) as f:
        data = json.load(f)
    print(f"{args.model}, world {args.world}, global batch {args.batch}, gloo on CPU")
    for row in data["rows"]:
        print(f"\n=== {row['plan']} ===")
        print(row["text"])
    print("\ncost of measuring (recorder on / off, medians of alternating steps)")
    for row in data["rows"]:
        on, off = row["measuring_on_s"], row["measuring_off_s"]
        print(f"  {row['plan']:<24} on {on * 1e3:8.1f} ms   off {off * 1e3:8.1f} ms   "
              f"ratio {on / off:.3f}")
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
