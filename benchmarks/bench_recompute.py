"""Activation recomputation at run time: per-rank saved activations and peak memory, the
plan's beside the measured, and step time under each recompute mode against none.

    python benchmarks/bench_recompute.py [--model gpt:...] [--batch 16] [--steps 3]

One gloo world of 4 local processes runs the zoo's GPT with dropout (so the CPU's attention
takes the math path and saves its s x s tensors, what selective recomputation drops) under
data 4 and under data 2 x Megatron-SP tensor 2, once per mode. Per rank: the saved activations the plan prices
(engine.explain(), summed over the layers) beside those measured (every storage autograd
saves during a step, `measure_saved_activations`); the peak, the state bytes the plan prices
(`autopar.cost.state.state_bytes`) plus the activations, beside the state the engine holds
(`measure_state_bytes`) plus the most bytes autograd held saved at once
(`measure_peak_saved_activations`); the mean step time after a warm-up step, and its ratio to
none's; and whether the comm log equals `engine.predicted_comm`. Then the 1F1B case: 2
stages of 2 blocks beside data 2, per block the saved bytes per micro-batch the plan prices
beside those engine.explain() measures, per mode. Prints both tables and writes
benchmarks/results/recompute.json.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import lm_loss, results_path, run_world  # noqa: E402

WORLD = 4
PLANS = {"data 4": {"data": 4},
         "data 2 x SP 2": {"data": 2, "tensor": {"size": 2, "mode": "1d",
                                                 "sequence_parallel": True}}}
# 1F1B over two stages of two blocks, 2 micro-batches, beside data 2: per block, the saved
# bytes the plan prices (each stage's first block holds the mask and position tables it
# rebuilds) beside those engine.explain() measures
PIPELINE = {"1F1B pp 2 x data 2": {"pipeline": {"size": 2, "microbatches": 2}, "data": 2}}
MODEL = "layers=4,hidden=64,heads=4,vocab=256,seq=64"


def _model(spec: str, batch: int):
    """The zoo's GPT of `spec` (name=value pairs) with dropout 0.1, and a batch."""
    from autopar.models.gpt import GPT, GPTConfig

    f = {k: int(v) for k, v in (p.split("=") for p in spec.split(","))}
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=f["vocab"], n_layer=f["layers"], n_head=f["heads"],
                          n_embd=f["hidden"], block_size=f["seq"], dropout=0.1))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, f["vocab"], (batch, f["seq"]), generator=gen)
    return model, x, torch.randint(0, f["vocab"], x.shape, generator=gen)


def _one_mode(spec: str, batch: int, steps: int, plan: str, mode: str) -> dict:
    import autopar
    from autopar.cost.state import state_bytes
    from autopar.runtime.measure import (
        measure_peak_saved_activations,
        measure_saved_activations,
        measure_state_bytes,
    )

    model, x, y = _model(spec, batch)
    engine = autopar.parallelize(model, WORLD, example_inputs=(x[:2],), loss_fn=lm_loss,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                 plan={**PLANS[plan], "recompute": mode})
    engine.train_step(x, y)  # traces and builds the training graph
    params = list(engine.parameters())
    saved = measure_saved_activations(lambda: engine.train_step(x, y), exclude=params,
                                      inputs=(x, y))
    peak = measure_peak_saved_activations(lambda: engine.train_step(x, y), exclude=params,
                                          inputs=(x, y))
    step_s, exact = _timed_steps(engine, x, y, batch, steps)
    rows = engine.explain(format="json")["layers"]
    planned = sum(r["predicted"].get("activation_bytes", 0) for r in rows if r["here"])
    held = measure_state_bytes(engine)
    predicted_state = state_bytes(engine.train_graph, engine.train_solution,
                                  zero_stage=engine.plan.zero.stage, dp=PLANS[plan]["data"])
    held_total = held.parameters + held.gradients + held.optimizer + held.buffers
    predicted_total = predicted_state.parameters + predicted_state.gradients + \
        predicted_state.optimizer + predicted_state.buffers
    return {"plan": plan, "mode": mode, "rank": dist.get_rank(), "activations_planned": planned,
            "activations_measured": saved, "peak_planned": predicted_total + planned,
            "peak_measured": held_total + peak, "step_s": step_s, "comm_exact": exact}


def _timed_steps(engine, x, y, batch: int, steps: int) -> tuple[float, bool]:
    """Seconds a step over `steps` steps, and whether their comm log is the plan's."""
    engine.comm_log.clear()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        engine.train_step(x, y)
    step_s = (time.perf_counter() - start) / steps
    measured_comm = engine.comm_log.totals(phases=("forward", "backward", "step"))
    return step_s, measured_comm == {k: v * steps
                                     for k, v in engine.predicted_comm(batch).items()}


def _pipeline_mode(spec: str, batch: int, steps: int, plan: str, mode: str) -> list[dict]:
    """Per block this pipeline rank runs: the saved bytes planned and measured (per
    micro-batch, engine.explain()), the step time and whether the comm log is the plan's."""
    import autopar

    model, x, y = _model(spec, batch)
    engine = autopar.parallelize(model, WORLD, example_inputs=(x[:2],), loss_fn=lm_loss,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                 plan={**PIPELINE[plan], "recompute": mode})
    engine.train_step(x, y)  # the warm-up step explain() leaves out
    step_s, exact = _timed_steps(engine, x, y, batch, steps)
    return [{"plan": plan, "mode": mode, "rank": dist.get_rank(), "block": r["name"],
             "planned": r["predicted"]["activation_bytes"],
             "measured": r["measured"]["activation_bytes"], "step_s": step_s,
             "comm_exact": exact}
            for r in engine.explain(format="json")["layers"]
            if r["here"] and r["measured"] and r["name"][-1].isdigit()]


def _rank(rank: int, spec: str, batch: int, steps: int, out: str) -> None:
    from autopar.modes import RECOMPUTE

    torch.manual_seed(0)
    mine = [_one_mode(spec, batch, steps, plan, mode) for plan in PLANS for mode in RECOMPUTE]
    blocks = [row for plan in PIPELINE for mode in RECOMPUTE
              for row in _pipeline_mode(spec, batch, steps, plan, mode)]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, blocks))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": [row for rows, _ in gathered for row in rows],
                       "blocks": [row for _, rows in gathered for row in rows]}, f)


def _print_blocks(blocks: list[dict]) -> None:
    """The pipeline's table: per block, saved bytes planned / measured and the error."""
    print(f"\n{', '.join(PIPELINE)}: saved bytes per block and micro-batch, KiB, "
          "planned / measured")
    print(f"{'mode':<10} {'rank':>4} {'block':<10} {'saved':>15} {'error %':>8} "
          f"{'step ms':>8} {'comm = plan':>11}")
    order = {mode: i for i, mode in enumerate(("none", "selective", "full"))}
    for r in sorted(blocks, key=lambda r: (order[r["mode"]], r["rank"], r["block"])):
        saved = f"{r['planned'] / 1024:.1f} / {r['measured'] / 1024:.1f}"
        print(f"{r['mode']:<10} {r['rank']:>4} {r['block']:<10} {saved:>15} "
              f"{r['error_percent']:>8.2f} {1e3 * r['step_s']:>8.1f} {str(r['comm_exact']):>11}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    part = results_path("recompute_ranks.json")
    run_world(_rank, (args.model, args.batch, args.steps, part), WORLD)
    with open(part) as f:
        ranks = json.load(f)
    os.remove(part)
    rows, blocks = ranks["rows"], ranks["blocks"]
    for r in blocks:
        r["error_percent"] = 100 * (r["planned"] / r["measured"] - 1)
    none = {(r["plan"], r["rank"]): r["step_s"] for r in rows if r["mode"] == "none"}
    for r in rows:
        r["step_vs_none"] = r["step_s"] / none[(r["plan"], r["rank"])]
        r["activations_error_percent"] = 100 * (r["activations_planned"] /
                                                r["activations_measured"] - 1)
        r["peak_error_percent"] = 100 * (r["peak_planned"] / r["peak_measured"] - 1)
    print(f"GPT {args.model} with dropout 0.1, batch {args.batch}, on {WORLD} gloo ranks; "
          "KiB per rank, planned / measured")
    print(f"{'plan':<14} {'mode':<10} {'rank':>4} {'activations':>23} {'peak':>23} {'step ms':>8} "
          f"{'vs none':>8} {'comm = plan':>11}")
    order = {mode: i for i, mode in enumerate(("none", "selective", "full"))}
    for r in sorted(rows, key=lambda r: (list(PLANS).index(r["plan"]), order[r["mode"]],
                                         r["rank"])):
        acts = f"{r['activations_planned'] / 1024:.0f} / {r['activations_measured'] / 1024:.0f}"
        peak = f"{r['peak_planned'] / 1024:.0f} / {r['peak_measured'] / 1024:.0f}"
        print(f"{r['plan']:<14} {r['mode']:<10} {r['rank']:>4} {acts:>23} {peak:>23} {1e3 * r['step_s']:>8.1f} "
              f"{r['step_vs_none']:>8.3f} {str(r['comm_exact']):>11}")
    _print_blocks(blocks)
    out = results_path("recompute.json")
    with open(out, "w") as f:
        json.dump({"model": args.model, "batch": args.batch, "plans": PLANS, "world": WORLD,
                   "device": "cpu (gloo)", "rows": rows, "pipeline": PIPELINE,
                   "pipeline_blocks": blocks}, f, indent=2)
    print(f"written to {os.path.relpath(out, ROOT)}")
    return 0 if all(r["comm_exact"] for r in rows + blocks) else 1


if __name__ == "__main__":
    sys.exit(main())
