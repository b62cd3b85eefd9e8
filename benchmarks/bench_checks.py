"""What the ranks-agree checks cost: the plan digest at parallelize, the batch fingerprint.

    python benchmarks/bench_checks.py [--world 2] [--steps 12] [--model gpt:layers=4,...]

One gloo world on this machine. Each rank builds the model and times
`check_ranks_agree` (the digests of plan, graph, parameter shapes, sampled weights and
example inputs, and one all_gather_object) beside the whole `parallelize`; then the same
engine's `train_step` with `check_batches` off and on, taking turns step by step (the
fingerprint: a hash of shapes and sampled values, one 32-byte all-gather), and the ratio
of the medians. Writes benchmarks/results/checks_world<N>.json.
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


def _rank_main(rank: int, model_name: str, batch: int, steps: int, out_path: str) -> None:
    import autopar
    from autopar.models import build
    from autopar.runtime.agree import check_ranks_agree

    world = dist.get_world_size()
    model, (x,) = build(model_name, batch=batch, device="cpu", seed=0)
    y = torch.randint(0, int(x.max()) + 1, x.shape, generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    engine = autopar.parallelize(model, world, example_inputs=(x,), loss_fn=lm_loss,
                                 optimizer=functools.partial(torch.optim.SGD, lr=0.01),
                                 plan={"tensor": {"size": world, "mode": "1d"}})
    setup_s = time.perf_counter() - start
    digests = []
    for _ in range(5):
        start = time.perf_counter()
        check_ranks_agree(engine.plan, engine.forward_graph, (x,))
        digests.append(time.perf_counter() - start)
    engine.train_step(x, y)  # warm-up (traces the training graph)
    times = {False: [], True: []}
    for step in range(2 * steps):
        engine.check_batches = bool(step % 2)
        dist.barrier()
        start = time.perf_counter()
        engine.train_step(x, y)
        times[engine.check_batches].append(time.perf_counter() - start)
    if rank == 0:
        off, on = statistics.median(times[False]), statistics.median(times[True])
        digest = statistics.median(digests)
        rows = [("parallelize (whole)", setup_s), ("ranks-agree check", digest),
                ("train_step, check_batches=False", off),
                ("train_step, check_batches=True", on)]
        print(f"{model_name}, batch {batch}, world {world} (tensor 1d), medians")
        for name, s in rows:
            print(f"  {name:34s} {s * 1e3:10.2f} ms")
        print(f"  batch check per step: {100 * (on / off - 1):+.1f}% of a step; "
              f"ranks-agree check: {100 * digest / setup_s:.1f}% of parallelize")
        with open(out_path, "w") as f:
            json.dump({"world": world, "model": model_name, "batch": batch, "steps": steps,
                       "parallelize_s": setup_s, "agree_check_s": digest,
                       "step_s": {"check_batches_off": off, "check_batches_on": on},
                       "batch_check_overhead": on / off - 1}, f, indent=2)
        print(f"wrote {out_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per setting")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    out_path = results_path(f"checks_world{args.world}.json")
    run_world(_rank_main, (args.model, args.batch, args.steps, out_path), args.world)


if __name__ == "__main__":
    main()
