"""A 2-rank job in which one rank stops, for the bounded-wait tests (tests/test_timeout.py).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python tests/stall_train.py --case CASE --out DIR [--timeout 10]

Cases, rank 1 unless named:
- `stall`: trains 2 steps, then stops calling train_step (sleeps) while rank 0 goes on;
- `die`: dies (os._exit) in the middle of step 2, after its backward;
- `absent`: joins the process group but never calls parallelize;
- `die0`: rank 0 dies in the middle of step 2 (it hosts the job's store).
Every rank writes DIR/rank<r>.json: what it raised (type and sentence) and when, and, for
the rank that stops, when it stopped. Plan: 1D tensor parallelism over the 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import autopar  # noqa: E402
from autopar.models import build  # noqa: E402

SPEC = "gpt:layers=2,hidden=32,heads=4,vocab=64,seq=16"


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, choices=("stall", "die", "absent", "die0"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    stopper = 0 if args.case == "die0" else 1
    report: dict = {"rank": rank}

    def write() -> None:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)

    def stop(how: str) -> None:
        report["stopped_at"] = time.time()
        write()
        if how == "die":
            os._exit(1)
        time.sleep(60)  # alive, but no longer in step with the others
        os._exit(0)

    if args.case == "absent" and rank == stopper:
        dist.init_process_group("gloo")
        stop("sleep")
    model, example = build(SPEC, batch=4, device="cpu", seed=0)
    try:
        engine = autopar.parallelize(model, 2, example_inputs=example, loss_fn=lm_loss,
                                     plan=dict(tensor=dict(size=2)), timeout=args.timeout)
        if args.case in ("die", "die0") and rank == stopper:
            engine.after_backward.append(lambda: stop("die") if engine.steps == 2 else None)
        gen = torch.Generator().manual_seed(0)
        for step in range(6):
            if args.case == "stall" and rank == stopper and step == 2:
                stop("sleep")
            x = torch.randint(0, 64, (4, 16), generator=gen)
            engine.train_step(x, x)
        report["finished"] = True
    except Exception as e:  # noqa: BLE001 - reported to the test, which judges it
        report.update(raised=type(e).__name__, message=str(e), at=time.time())
    write()
    os._exit(0)  # (gloo's threads may still wait on the stopped peer)


if __name__ == "__main__":
    main()
