"""Starting and training a model larger than one rank should hold: memory and start time.

    python benchmarks/bench_scale.py [--world 4] [--model gpt:layers=30,...] [--batch 4]
                                     [--rows zero3 tp pp_tp fsdp2 single]

One gloo world on this machine per row (fresh processes, so each row's peak resident
memory is its own). Every rank builds the same zoo model on the meta device (1.58 GB of
fp32 weights by default) and starts it:

    autopar zero3    data 4, ZeRO-3     autopar.plan (constraints fixed) then parallelize
    autopar tp4      1D tensor 4        (trace + plan + materialize this rank's slices)
    autopar pp2xtp2  pipeline 2 x tensor 2, 1F1B
    FSDP2            fully_shard per block and on the model, to_empty, init_weights
    one device       the whole model materialized and trained in one process, run only
                     when this machine has the memory free for it (else the row says so)

then trains two AdamW steps on the same global batch. Per row, the largest over its
ranks of: resident memory at start (peak RSS, `ru_maxrss`, after parallelize or
fully_shard) and what the start added to the idle rank, live tensor bytes (every tensor
the garbage collector sees, each storage once) after the start and after the steps, the
peak RSS over the two steps, the start time and the time to the end of the first step.
Autopar rows put their plan's predicted bytes per rank (`memory_per_device_bytes`) beside
what they measure; the runtime's fixed overhead is the RSS of an idle rank (torch and
autopar imported, gloo initialized, nothing built), measured in every row's processes.

Goals (issue #19), judged and printed:
    zero3 start adds at most half the model's fp32 bytes to any rank
    zero3 peak RSS at most 1.1x FSDP2's
    tp4 and pp2xtp2 peak RSS within 10% of prediction + fixed overhead
Writes benchmarks/results/scale.json; exits 1 when a goal is not met.
"""

import argparse
import functools
import json
import os
import resource
import sys
import time
import warnings

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import live_tensor_bytes, lm_loss, results_path, run_world  # noqa: E402

MODEL = "gpt:layers=30,hidden=1024,heads=16,vocab=16384,seq=64"
ZERO3, TP, PP_TP, FSDP2, SINGLE = "zero3", "tp", "pp_tp", "fsdp2", "single"
ROWS = (ZERO3, TP, PP_TP, FSDP2, SINGLE)
# row -> the constraints autopar.plan fixes (world 4; the others scale tp and dp with it)
CONSTRAINTS = {
    ZERO3: lambda w: dict(dp=w, tp=1, pp=1, zero=3),
    TP: lambda w: dict(dp=1, tp=w, pp=1, zero=0, tp_mode="1d"),
    PP_TP: lambda w: dict(dp=1, tp=w // 2, pp=2, zero=0, tp_mode="1d", schedule="1f1b",
                          microbatches=2),
}
COMMON = dict(recompute="none", sp="none", offload=False)
GIB = 1024 ** 3


def label(row: str, world: int) -> str:
    return {ZERO3: f"autopar zero3 dp{world}", TP: f"autopar tp{world}",
            PP_TP: f"autopar pp2xtp{world // 2}", FSDP2: "FSDP2", SINGLE: "one device"}[row]


def rss_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _batch(spec: str, batch: int):
    from autopar.models import build

    meta, (x,) = build(spec, batch=batch)
    gen = torch.Generator().manual_seed(1)
    vocab = meta.config.vocab_size
    x = torch.randint(0, vocab, x.shape, generator=gen)
    return x, torch.randint(0, vocab, x.shape, generator=gen)


def _autopar_start(row: str, world: int, spec: str, x, y):
    """(engine, predicted bytes per rank): the plan fixed by CONSTRAINTS, the meta model
    started from its own initialization."""
    import autopar
    from autopar.models import build
    from autopar.world import World

    model, _ = build(spec, batch=x.shape[0])
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4)
    plan = autopar.plan(model, (x.to("meta"),), World(devices=world, per_node=world,
                                                      device="cpu"),
                        global_batch=x.shape[0], loss_fn=lm_loss,
                        example_target=y.to("meta"), executable=True, top=1,
                        constraints={**CONSTRAINTS[row](world), **COMMON})
    engine = autopar.parallelize(model, world, example_inputs=(x[:2],), loss_fn=lm_loss,
                                 optimizer=adamw, plan=plan, seed=0)
    return functools.partial(engine.train_step, x, y), \
        int(plan.predicted["memory_per_device_bytes"])


def _fsdp2_start(world: int, spec: str, x, y):
    """FSDP2 as torchtitan starts a model: built on meta, fully_shard per block and on the
    root, to_empty on the CPU, then the model's own init_weights on the shards."""
    from torch.distributed.fsdp import fully_shard

    from autopar.models import build

    model, _ = build(spec, batch=x.shape[0])
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rank, n = dist.get_rank(), x.shape[0] // world
    mine = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
    return functools.partial(_eager_step, model, opt, *mine), None


def _single_start(spec: str, x, y):
    from autopar.models import build
    from autopar.runtime.materialize import materialize

    model, _ = build(spec, batch=x.shape[0])
    materialize(model, "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return functools.partial(_eager_step, model, opt, x, y), None


def _eager_step(model, opt, x, y) -> float:
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def measure(rank: int, row: str, world: int, spec: str, batch: int) -> dict:
    """One rank's figures for one row (world 1 for the single device)."""
    warnings.filterwarnings("ignore")
    x, y = _batch(spec, batch)
    idle = rss_bytes()
    t0 = time.perf_counter()
    if row == FSDP2:
        step, predicted = _fsdp2_start(world, spec, x, y)
    elif row == SINGLE:
        step, predicted = _single_start(spec, x, y)
    else:
        step, predicted = _autopar_start(row, world, spec, x, y)
    started = time.perf_counter() - t0
    start_peak, start_live = peak_rss_bytes(), live_tensor_bytes()
    losses = [step()]
    first = time.perf_counter() - t0
    losses.append(step())
    return {"rank": rank, "idle_rss": idle, "start_peak_rss": start_peak,
            "start_added": start_peak - idle, "start_live": start_live,
            "peak_rss": peak_rss_bytes(), "end_live": live_tensor_bytes(),
            "start_s": started, "first_step_s": first, "predicted": predicted,
            "losses": losses}


def _world_worker(rank, row, world, spec, batch, out_path):
    figures = measure(rank, row, world, spec, batch)
    gathered = [None] * world
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)


def run_row(row: str, world: int, spec: str, batch: int) -> list[dict]:
    """Every rank's figures for one row, each row in processes of its own."""
    out_path = results_path(f"scale_{row}.part.json")
    if row == SINGLE:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            return [pool.apply(measure, (0, row, 1, spec, batch))]
    run_world(_world_worker, (row, world, spec, batch, out_path), world)
    with open(out_path) as f:
        ranks = json.load(f)
    os.remove(out_path)
    return ranks


def summarize(ranks: list[dict]) -> dict:
    """The largest figure over the ranks (the rank that bounds what a device must hold)."""
    out = {k: max(r[k] for r in ranks) for k in
           ("idle_rss", "start_peak_rss", "start_added", "start_live", "peak_rss",
            "end_live", "start_s", "first_step_s")}
    predicted = [r["predicted"] for r in ranks if r["predicted"] is not None]
    out["predicted"] = max(predicted) if predicted else None
    out["loss"] = ranks[0]["losses"][-1]
    return out


def judge(rows: dict, model_bytes: int, overhead: int, world: int) -> list[dict]:
    """The issue's goals, each with its figures and whether it was met (None: not run)."""
    goals = []
    z, f = rows.get(ZERO3), rows.get(FSDP2)
    if z is not None:
        goals.append({"goal": "zero3 start adds <= 0.5x model fp32 bytes",
                      "value": z["start_added"] / model_bytes, "limit": 0.5})
    if z is not None and f is not None:
        goals.append({"goal": "zero3 peak RSS <= 1.1x FSDP2",
                      "value": z["peak_rss"] / f["peak_rss"], "limit": 1.1})
    for row in (TP, PP_TP):
        r = rows.get(row)
        if r is not None:
            expected = r["predicted"] + overhead
            goals.append({"goal": f"{label(row, world)} peak RSS within 10% of "
                                  "prediction + fixed overhead",
                          "value": r["peak_rss"] / expected, "limit": 1.1, "floor": 0.9})
    for g in goals:
        g["met"] = g.get("floor", 0.0) <= g["value"] <= g["limit"]
    return goals


def single_fits(model_bytes: int) -> tuple[bool, int]:
    """(whether one process may train the whole model here, bytes it needs): weights,
    gradients and AdamW's two moments (4x the fp32 weights) plus 1 GiB, against half the
    memory now available (the machine is shared)."""
    need = 4 * model_bytes + GIB
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemAvailable:"))
    return need <= available // 2, need


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def print_table(result: dict) -> None:
    world = result["world"]
    print(f"{result['model']}: {result['model_bytes'] / 1e9:.2f} GB fp32, world {world} "
          f"(gloo, CPU), global batch {result['batch']}, two AdamW steps; per row the "
          "largest over its ranks (GB, s)")
    print(f"fixed overhead (idle rank: torch + autopar imported, gloo up): "
          f"{_gb(result['fixed_overhead'])} GB RSS")
    head = (f"{'engine':<20} {'start RSS':>9} {'added':>7} {'live':>7} {'peak RSS':>9} "
            f"{'end live':>9} {'predicted':>9} {'pred+ovh':>9} {'start s':>8} {'1st step s':>10}")
    print(head)
    for row, r in result["rows"].items():
        if r.get("skipped"):
            print(f"{label(row, world):<20} not run: {r['skipped']}")
            continue
        p = r["predicted"]
        print(f"{label(row, world):<20} {_gb(r['start_peak_rss']):>9} {_gb(r['start_added']):>7} "
              f"{_gb(r['start_live']):>7} {_gb(r['peak_rss']):>9} {_gb(r['end_live']):>9} "
              f"{_gb(p):>9} {_gb(None if p is None else p + result['fixed_overhead']):>9} "
              f"{r['start_s']:>8.1f} {r['first_step_s']:>10.1f}")
    for g in result["goals"]:
        print(f"{'PASS' if g['met'] else 'FAIL'}  {g['goal']}: {g['value']:.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    args = parser.parse_args()
    from autopar.models import build

    meta, _ = build(args.model, batch=args.batch)
    unique = {id(t): t for t in list(meta.parameters()) + list(meta.buffers())}
    model_bytes = sum(t.numel() * t.element_size() for t in unique.values())  # tied: once
    rows, raw = {}, {}
    for row in args.rows:
        if row == SINGLE:
            fits, need = single_fits(model_bytes)
            if not fits:
                rows[row] = {"skipped": f"needs about {need / 1e9:.1f} GB, over half the "
                                        "memory this shared machine has free"}
                continue
        raw[row] = run_row(row, args.world, args.model, args.batch)
        rows[row] = summarize(raw[row])
    idle = [r["idle_rss"] for ranks in raw.values() for r in ranks]
    overhead = max(idle) if idle else 0
    result = {"model": args.model, "model_bytes": model_bytes, "world": args.world,
              "batch": args.batch, "fixed_overhead": overhead, "rows": rows, "ranks": raw,
              "goals": judge(rows, model_bytes, overhead, args.world)}
    path = results_path("scale.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print_table(result)
    print(f"written to {path}")
    return 0 if all(g["met"] for g in result["goals"]) else 1


if __name__ == "__main__":
    sys.exit(main())
