"""Hybrid sharding (HSDP) against ZeRO-3 over all of dp: planned at scale, measured at world 4.

    python benchmarks/bench_hsdp.py [--world 4] [--no-measure]

Part 1 plans Llama-3 70B (seq 8192, batch 512, bf16) on 512 H100-80GB with ZeRO-3: the
search's winner (it chooses the shard size), then the winner's mesh repriced with every shard
size the search tries and with ZeRO-3 over all of dp: step time, the data-parallel sync's
seconds (gathers and reduce-scatters inside the shard group, plus the replicas' all-reduce),
memory per device. Part 2 runs the zoo's tiny GPT at world 4 as 2 replicas of 2-rank shard
groups (gloo, ZeRO 2 and 3) and prints the bytes `engine.comm_log` measured per (collective,
axis) beside `engine.predicted_comm`. Writes benchmarks/results/hsdp.json.
"""

import argparse
import functools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import lm_loss, results_path, run_world  # noqa: E402

GiB = 1 << 30
MODEL, SEQ, BATCH, DEVICES = "llama3-70b", 8192, 512, 512
TINY = "gpt-tiny"


def _row(label: str, cand) -> dict:
    return {"plan": label, "mesh": cand.mesh, "dp_shard": cand.dp_shard or cand.mesh["dp"],
            "step_time_s": cand.step_time, "dp_comm_s": cand.dp_comm_s,
            "memory_per_device_gib": cand.memory_per_device / GiB, "fits": cand.fits,
            "state_gib": sum(cand.memory[k] for k in ("parameters", "gradients", "optimizer"))
            / GiB}


def planned() -> list[dict]:
    """The search's ZeRO-3 winner, and its mesh under each shard size and over all of dp."""
    from autopar.cost.hybrid import shard_sizes
    from autopar.models import workload
    from autopar.search import planner
    from autopar.world import World

    w = workload(MODEL, seq=SEQ)
    chain = planner.prepare(w.model, w.inputs, loss_fn=w.loss_fn, example_target=w.target,
                            layers=w.layer_counts, tokens_per_sample=w.tokens_per_sample,
                            tp_sizes=[1, 2, 4, 8])
    world = World(DEVICES, per_node=8, device="h100-80gb")
    best = planner.search(chain, world, global_batch=BATCH, constraints={"zero": 3}).best
    rows = [_row("search, zero 3 (chooses the shard)", best)]
    mesh = {a: best.mesh[a] for a in ("pp", "dp", "cp", "tp")}
    for shard in [*shard_sizes(mesh, world.per_node), mesh["dp"]]:
        fixed = dict(mesh, zero=3, dp_shard=shard)
        res = planner.search(chain, world, global_batch=BATCH, constraints=fixed)
        cand = res.best or min((c for c, _ in res.alternatives),  # (none fits: the closest)
                               key=lambda c: c.memory_per_device)
        label = f"shard {shard}" if shard < mesh["dp"] else "ZeRO-3 over all of dp"
        rows.append(_row(label, cand))
    return rows


def _measure(rank: int, world: int, out: str) -> None:
    import torch

    import autopar
    from autopar.models import build

    rows = []
    for stage in (2, 3):
        model, (x,) = build(TINY, batch=8, device="cpu", seed=0)
        y = x.roll(-1, 1)  # next-token targets
        plan = {"data": {"size": world, "shard": world // 2}, "zero": {"stage": stage}}
        engine = autopar.parallelize(model, world, example_inputs=(x[:2],), loss_fn=lm_loss,
                                     optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                     plan=plan)
        engine.train_step(x, y)  # the backward's gather order is learnt at the first step
        engine.comm_log.clear()
        engine.train_step(x, y)
        measured = engine.comm_log.totals(phases=("forward", "backward", "step"))
        predicted = engine.predicted_comm(8)
        for op, axis in sorted(set(measured) | set(predicted)):
            rows.append({"zero": stage, "op": op, "axis": axis,
                         "measured_bytes": measured.get((op, axis), 0),
                         "predicted_bytes": predicted.get((op, axis), 0)})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def measured(world: int) -> list[dict]:
    out = results_path(f"hsdp_world{world}.json")
    run_world(_measure, (world, out), world)
    with open(out) as f:
        return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4, help="local gloo processes (even)")
    p.add_argument("--no-measure", action="store_true", help="plan only")
    args = p.parse_args()
    rows = planned()
    print(f"{MODEL} seq {SEQ} batch {BATCH} on {DEVICES} x h100-80gb, ZeRO-3")
    print(f"{'plan':38s} {'mesh':24s} {'shard':>5s} {'step s':>7s} {'dp sync s':>9s} "
          f"{'state GiB':>9s} {'mem GiB':>8s} fits")
    for r in rows:
        m = r["mesh"]
        mesh = f"pp{m['pp']} dp{m['dp']} cp{m['cp']} tp{m['tp']}"
        print(f"{r['plan']:38s} {mesh:24s} {r['dp_shard']:5d} {r['step_time_s']:7.3f} "
              f"{r['dp_comm_s']:9.3f} {r['state_gib']:9.2f} {r['memory_per_device_gib']:8.2f} "
              f"{r['fits']}")
    comm = [] if args.no_measure else measured(args.world)
    if comm:
        print(f"\nworld {args.world} as 2 x {args.world // 2} (gloo): bytes per step")
        print(f"{'zero':>4s} {'collective':15s} {'axis':13s} {'measured':>10s} {'predicted':>10s}")
        for r in comm:
            print(f"{r['zero']:4d} {r['op']:15s} {r['axis']:13s} {r['measured_bytes']:10d} "
                  f"{r['predicted_bytes']:10d}")
    with open(results_path("hsdp.json"), "w") as f:
        json.dump({"planned": rows, "measured_world": args.world, "measured": comm}, f,
                  indent=2)
    return int(any(r["measured_bytes"] != r["predicted_bytes"] for r in comm))


if __name__ == "__main__":
    sys.exit(main())
