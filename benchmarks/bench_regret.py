"""Regret: autopar's choice against every plan it could have run, measured on this machine.

    python benchmarks/bench_regret.py [--profile FILE] [--quick] [--steps 3] [--confirm 6]

1. Calibrate. `autopar calibrate -o benchmarks/results/regret-profile.json --world 4` runs
   as a subprocess (4 gloo processes: matmul, copy and every collective, fitted), unless
   `--profile FILE` reuses a calibration. The fitted figures are printed.
2. Enumerate. The model (`--model`, default a 4-block GPT, hidden 256, sequence 64, global
   batch 16) is traced once on the meta device and `autopar.search.planner.executable_candidates`
   prices, on the calibrated profile and in fp32 (what the runtime trains in), every plan
   the executable search can hand `parallelize` at world 4: the union over 1D alone, 1D
   with the 2x2 grid (as the search mixes them) and every block on the grid, and over
   Megatron-SP off and on, of every mesh pp x dp x cp x tp,
   micro-batch size, pipeline schedule (gpipe, 1f1b, interleaved, zero_bubble), ZeRO stage
   0-3 and offload (`Search.every`, no branch and bound), each layer's tensor mode by the
   search's dynamic program. Candidates with the same description are one plan, and so
   are what the runtime cannot tell apart (it never recomputes; without a pipeline it runs
   a replica's batch in one pass, which the executable search already knows). Plans that
   do not fit memory are dropped (none, for this model). cp meshes are not in the set: the
   search only chooses cp when each rank keeps 256 tokens or more. Each candidate becomes a
   Plan as the planner makes its winner's (`planner.candidate_plan`), with its predicted
   step time. For the default model and batch that is 147 plans.
3. Choose. autopar's choice is what `autopar.parallelize(model, World(4, per_node=4,
   device=PROFILE), plan=None)` picks; its entry in the list is run that way (plan=None,
   the runtime's own search on every rank) and checked to be the planner's winner.
4. Measure, in one gloo world of 4 processes (one thread each). Pass 1 runs every plan
   in chunks of `--chunk` engines built together and stepped round-robin (so a slow
   minute of the shared machine hits a chunk's plans alike): `--warmup` steps (the first
   traces the training graph), then `--steps` timed steps, each the slowest rank's wall
   time of one `train_step` (AdamW), the median kept. Pass 2 rebuilds the `--confirm`
   fastest of pass 1 and the choice, and times them round-robin for `--rounds` more steps
   each: one procedure, minutes apart at most, for the plans regret compares.
5. Report. A table: plan, predicted step, measured step (pass 1), ratio to the best of
   pass 1, rank predicted / measured, and the pass 2 figure where there is one. Regret =
   the choice's pass 2 step over the best pass 2 step (pass 2 holds the fastest plans of
   pass 1 and the choice; pass 1's own ratio is printed beside it). Spearman's rank
   correlation (average ranks for ties) between predicted and pass 1 measured step over
   every plan run. Goal: regret at most 1.10. Written to benchmarks/results/regret.json.

`--quick` is a smoke run: a quick calibration (unless --profile), 12 plans spread over the
predicted ranking plus the choice, fewer steps.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_world import lm_loss, results_path, run_world  # noqa: E402

WORLD = 4
SPEC = "gpt:layers=4,hidden=256,heads=8,vocab=2048,seq=64"
BATCH = 16
GOAL = 1.10


# ----------------------------------------------------------------------------- helpers


def ranks(values) -> list[float]:
    """1-based ranks of `values`, ties sharing the average of the ranks they span."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs, ys) -> float:
    """Spearman's rank correlation: Pearson's correlation of the average ranks (nan when
    either side has no spread)."""
    if len(xs) != len(ys):
        raise ValueError("spearman needs two sequences of one length.")
    rx, ry = ranks(xs), ranks(ys)
    n = len(rx)
    if n < 2:
        return float("nan")
    mx, my = sum(rx) / n, sum(ry) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else float("nan")


def short(description: str) -> str:
    """A candidate's description without what every plan here shares."""
    parts = [p for p in description.split(", ") if p != "recompute none"]
    return ", ".join(parts).replace(" cp1 ", " ")


def model_and_chain(spec: str, batch: int):
    """The model on the meta device, its inputs, target, and the planner's layer chain
    (as `parallelize(plan=None)` reads it: every tensor size of the world)."""
    from autopar.models import build
    from autopar.search import planner
    from autopar.search.search import divisors

    model, (x,) = build(spec, batch=batch, device="meta")
    target = torch.empty(x.shape, dtype=torch.long, device="meta")
    chain = planner.prepare(model, (x,), loss_fn=lm_loss, example_target=target,
                            tp_sizes=divisors(WORLD))
    return model, x, target, chain


def candidate_plans(spec: str, batch: int, world) -> list[dict]:
    """Every executable plan that fits, fastest predicted first: description, predicted
    seconds and the Plan's JSON (what the worker hands `parallelize`)."""
    from autopar.search import planner

    _, _, _, chain = model_and_chain(spec, batch)
    out = []
    for cand in planner.executable_candidates(chain, world, global_batch=batch, dtype="fp32"):
        if not cand.fits:
            continue
        plan = planner.candidate_plan(cand, chain, world, batch, "fp32")
        out.append({"plan": cand.describe(), "predicted_s": cand.step_time,
                    "json": plan.to_json()})
    return out


def choice(spec: str, batch: int, world) -> str:
    """The description of the plan `parallelize(plan=None)` chooses (its `_search_plan`:
    the executable search, fp32 from the parameters, the example batch as global batch)."""
    from autopar.search import planner

    model, x, target, _ = model_and_chain(spec, batch)
    made = planner.plan(model, (x,), world, loss_fn=lm_loss, example_target=target,
                        executable=True, top=3)
    return made.search["winner"]


# ----------------------------------------------------------------------------- measuring


def _engine(spec, batch, plan_json, profile):
    """An engine for one plan; plan_json None: parallelize chooses (plan=None)."""
    import autopar
    from autopar.models import build
    from autopar.plans import Plan

    model, (x,) = build(spec, batch=batch, device="cpu", seed=0)
    optimizer = functools.partial(torch.optim.AdamW, lr=1e-3)
    if plan_json is None:
        world = autopar.World(devices=WORLD, per_node=WORLD, device=profile)
        engine = autopar.parallelize(model, world, example_inputs=(x,), loss_fn=lm_loss,
                                     optimizer=optimizer, plan=None)
    else:
        engine = autopar.parallelize(model, WORLD, example_inputs=(x,), loss_fn=lm_loss,
                                     optimizer=optimizer, plan=Plan.from_json(plan_json))
    return engine, x


def _step_seconds(engine, x, y) -> float:
    """The slowest rank's wall time of one train_step."""
    dist.barrier()
    start = time.perf_counter()
    engine.train_step(x, y)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _round_robin(spec, batch, jobs, profile, warmup, steps) -> list[dict]:
    """Build the engines of `jobs` together, then step them in turn: `warmup` untimed
    rounds, `steps` timed ones. Each job's median and its timed steps."""
    engines = []
    for plan_json in jobs:
        engine, x = _engine(spec, batch, plan_json, profile)
        y = torch.randint(0, engine_vocab(spec), x.shape, generator=torch.Generator()
                          .manual_seed(1))
        engines.append((engine, x, y))
    times = [[] for _ in engines]
    for r in range(warmup + steps):
        for k, (engine, x, y) in enumerate(engines):
            t = _step_seconds(engine, x, y)
            if r >= warmup:
                times[k].append(t)
    out = [{"median_s": statistics.median(ts), "steps_s": ts,
            "winner": e.plan.search.get("winner") if e.plan.search else None}
           for ts, (e, _, _) in zip(times, engines)]
    del engines  # (engines with the same mesh share their process groups: runtime.mesh)
    gc.collect()
    return out


def engine_vocab(spec: str) -> int:
    from autopar.models.zoo import config_of

    return config_of(spec).vocab_size


def worker(rank, spec, batch, plans, chosen, profile, args, out_path):
    """Pass 1 over every plan in chunks, then pass 2 over the fastest and the choice."""
    jobs = [None if i == chosen else p["json"] for i, p in enumerate(plans)]
    first: list[dict] = []
    start = time.perf_counter()
    for lo in range(0, len(jobs), args["chunk"]):
        first += _round_robin(spec, batch, jobs[lo:lo + args["chunk"]], profile,
                              args["warmup"], args["steps"])
        if rank == 0:
            print(f"  pass 1: {len(first)}/{len(jobs)} plans, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    fastest = sorted(range(len(jobs)), key=lambda i: first[i]["median_s"])[:args["confirm"]]
    confirm = sorted(set(fastest) | {chosen})
    second = _round_robin(spec, batch, [jobs[i] for i in confirm], profile, 1, args["rounds"])
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"first": first, "confirm": confirm, "second": second}, f)


# ----------------------------------------------------------------------------- driver


def calibrate(path: str, quick: bool) -> None:
    """`autopar calibrate -o path --world 4` in a subprocess, as a user runs it."""
    cmd = [sys.executable, "-m", "autopar.cli", "calibrate", "-o", path, "--world", str(WORLD)]
    if quick:
        cmd.append("--quick")
    print("calibrating:", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def figures(profile: str) -> dict:
    """The fitted figures of a calibrated profile that price these plans."""
    from autopar.cost.calibrate import summary
    from autopar.cost.hardware import load_hardware

    hw = load_hardware(profile)
    coll = hw.extra.get("collectives", {})
    return {"summary": summary(hw) if "matmul" in hw.extra else hw.name,
            "fp32_flops": hw.flops("fp32"), "gemm_efficiency": hw.gemm_efficiency,
            "gemm_half_flops": hw.gemm_half_flops, "memory_bandwidth": hw.memory_bandwidth,
            "link_latency_s": hw.intra_node_latency, "link_bandwidth": hw.intra_node_bandwidth,
            "host_bandwidth": hw.host_bandwidth, "compute_share": hw.compute_share,
            "per_collective": {op: {"alpha_s": r["alpha"], "beta_s_per_byte": r["beta"]}
                               for op, r in coll.items() if "alpha" in r}}


def report(data: dict) -> str:
    rows = data["rows"]
    lines = [f"{data['model']}, global batch {data['batch']}, world {WORLD} (gloo, CPU, fp32), "
             f"{len(rows)} plans",
             f"{'plan':<62} {'pred ms':>8} {'meas ms':>8} {'/best':>6} {'rank p/m':>9} "
             f"{'pass 2':>7}"]
    for row in sorted(rows, key=lambda r: r["measured_s"]):
        again = f"{row['pass2_s'] * 1e3:7.1f}" if row["pass2_s"] is not None else " " * 7
        tag = ("  <- autopar" if row["chosen"] else "") + \
            ("  <- best (pass 2)" if row["plan"] == data["best"] else "")
        lines.append(f"{short(row['plan']):<62} {row['predicted_s'] * 1e3:>8.1f} "
                     f"{row['measured_s'] * 1e3:>8.1f} {row['ratio']:>6.3f} "
                     f"{row['rank_predicted']:>4.0f}/{row['rank_measured']:<4.0f} {again}{tag}")
    lines.append("meas: pass 1 median (every plan); pass 2: the fastest of pass 1 and the "
                 "choice, measured again round-robin")
    lines.append(f"choice: {short(data['choice'])}")
    lines.append(f"best measured: {short(data['best'])}")
    lines.append(f"regret (choice / best measured, pass 2): {data['regret']:.3f}  goal <= "
                 f"{GOAL}: {'met' if data['goal_met'] else 'NOT met'}   (pass 1 alone: "
                 f"{data['regret_pass1']:.3f})")
    lines.append(f"Spearman rank correlation, predicted vs measured ({len(rows)} plans): "
                 f"{data['spearman']:.3f}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="reuse this calibrated profile instead of calibrating")
    parser.add_argument("--quick", action="store_true", help="a smoke run: minutes, not tens")
    parser.add_argument("--model", default=SPEC)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps, the first traces the training graph (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 3)")
    parser.add_argument("--chunk", type=int, default=8, help="engines stepped round-robin")
    parser.add_argument("--confirm", type=int, default=None,
                        help="fastest plans of pass 1 measured again (default 6)")
    parser.add_argument("--rounds", type=int, default=None, help="pass 2 steps (default 5)")
    args = parser.parse_args()
    quick = args.quick
    steps = {"warmup": args.warmup if args.warmup is not None else 1,
             "steps": args.steps if args.steps is not None else (2 if quick else 3),
             "confirm": args.confirm if args.confirm is not None else (3 if quick else 6),
             "rounds": args.rounds if args.rounds is not None else (3 if quick else 5),
             "chunk": args.chunk}
    start = time.perf_counter()

    from autopar.world import World

    profile = args.profile
    if profile is None:
        profile = results_path("regret-profile.json")
        calibrate(profile, quick)
    profile = os.path.abspath(profile)
    fig = figures(profile)
    print(f"profile {os.path.relpath(profile, ROOT)}: {fig['summary']}")
    for op, ab in fig["per_collective"].items():
        print(f"    {op:<15} alpha {ab['alpha_s'] * 1e6:8.1f} us   "
              f"{1 / ab['beta_s_per_byte'] / 1e9:6.2f} GB/s")
    print(f"    host (offload) {fig['host_bandwidth'] / 1e9:.2f} GB/s, compute share "
          f"{fig['compute_share']:.2f} (each rank's share of a core with all computing)")

    world = World(devices=WORLD, per_node=WORLD, device=profile)
    plans = candidate_plans(args.model, args.batch, world)
    winner = choice(args.model, args.batch, world)
    names = [p["plan"] for p in plans]
    if winner not in names:
        raise SystemExit(f"the choice {winner!r} is not among the {len(plans)} candidates.")
    if quick:  # 12 plans spread over the predicted ranking, and the choice
        keep = sorted({round(i * (len(plans) - 1) / 11) for i in range(12)}
                      | {names.index(winner)})
        plans = [plans[i] for i in keep]
        names = [p["plan"] for p in plans]
    chosen = names.index(winner)
    print(f"{len(plans)} plans to run; autopar chooses: {short(winner)} "
          f"(predicted {plans[chosen]['predicted_s'] * 1e3:.1f} ms)", flush=True)

    raw_path = results_path("regret-raw.json")
    run_world(worker, (args.model, args.batch, plans, chosen, profile, steps, raw_path), WORLD)
    with open(raw_path) as f:
        raw = json.load(f)
    os.remove(raw_path)
    if raw["second"][raw["confirm"].index(chosen)]["winner"] != winner:
        raise SystemExit("parallelize(plan=None) chose another plan than the planner's winner.")

    second = dict(zip(raw["confirm"], raw["second"]))
    measured = [r["median_s"] for r in raw["first"]]
    best = min(second, key=lambda i: second[i]["median_s"])
    regret = second[chosen]["median_s"] / second[best]["median_s"]
    predicted = [p["predicted_s"] for p in plans]
    rho = spearman(predicted, measured)
    rank_p, rank_m = ranks(predicted), ranks(measured)
    rows = [{"plan": p["plan"], "predicted_s": p["predicted_s"], "measured_s": measured[i],
             "steps_s": raw["first"][i]["steps_s"], "ratio": measured[i] / min(measured),
             "pass2_s": second[i]["median_s"] if i in second else None,
             "pass2_steps_s": second[i]["steps_s"] if i in second else None,
             "rank_predicted": rank_p[i], "rank_measured": rank_m[i], "chosen": i == chosen}
            for i, p in enumerate(plans)]
    data = {"model": args.model, "batch": args.batch, "world": WORLD, "quick": quick,
            "profile": profile, "calibration": fig, "settings": steps, "rows": rows,
            "choice": winner, "best": plans[best]["plan"], "regret": regret,
            "regret_pass1": measured[chosen] / min(measured),
            "spearman": rho, "goal": GOAL, "goal_met": regret <= GOAL,
            "seconds": time.perf_counter() - start}
    print(report(data))
    out_path = results_path("regret.json")
    with open(out_path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"{time.perf_counter() - start:.0f} s; written to {os.path.relpath(out_path, ROOT)}")


if __name__ == "__main__":
    main()
