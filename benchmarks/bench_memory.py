"""Memory per rank: predicted by autopar.cost.memory against what the engine holds.

    python benchmarks/bench_memory.py [--models gpt-tiny llama-tiny ...] [--batch 8]
                                      [--worlds 4 8] [--plans 2d 3d ...]

Spawns a gloo world of 4 local processes (data with ZeRO 0, 1, 2 and 3, 1D and 2D plans),
then one of 8 (1D, 2.5D and 3D plans). For each model and plan, the prediction comes from the plan's own sharding
solution, solved as the engine solves it (`Plan.from_dict`, the inference graph first, then
the training graph with the parameter layouts the inference graph fixed, the plan's mesh
and per-layer modes), at the batch of one data-parallel replica (2D, 2.5D and 3D split
that batch further, as a layout on dim 0, which the prediction applies). Every rank then
trains one warm-up step and measures a second one: parameters, gradients (just before the
optimizer steps) and AdamW state from the tensors the engine holds, activations from the
storages autograd saves during `train_step`. A second table sets the search's own
parameter, gradient and optimizer bytes (`autopar.cost.precision` through
`memory_by_kind`, the plan's mesh and ZeRO stage fixed) beside the same measurement.
Prints the tables, the largest error per kind and plan, and writes
benchmarks/results/memory.json.
"""

import argparse
import functools
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import lm_loss, results_path, run_world  # noqa: E402

# name -> (world, plan); 1D rows at world 8 are the contrast: their activations stay whole.
PLANS = {"data 4": (4, {"data": 4}),
         "data 4 zero 1": (4, {"data": 4, "zero": {"stage": 1}}),
         "data 4 zero 2": (4, {"data": 4, "zero": {"stage": 2}}),
         "data 4 zero 3": (4, {"data": 4, "zero": {"stage": 3}}),
         "tensor 4": (4, {"tensor": {"size": 4, "mode": "1d"}}),
         "tensor 2 x data 2": (4, {"tensor": {"size": 2, "mode": "1d"}}),
         "2d 2x2": (4, {"tensor": {"size": 4, "mode": "2d"}}),
         "tensor 8": (8, {"tensor": {"size": 8, "mode": "1d"}}),
         "2.5d 2x2x2": (8, {"tensor": {"size": 8, "mode": "2.5d", "depth": 2}}),
         "3d 2x2x2": (8, {"tensor": {"size": 8, "mode": "3d"}})}
MODELS = ("gpt-tiny", "llama-tiny", "bert-tiny", "vit-tiny", "mlp-tiny")
KINDS = ("parameters", "gradients", "optimizer", "activations")
STATE = KINDS[:3]  # what the search prices from the precision policy
WORLDS = (4, 8)


def example(name: str, batch: int):
    """(model, inputs, target, loss_fn): token models predict every token, others a class."""
    from autopar.models import build

    model, (x,) = build(name, batch=batch, device="cpu", seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        out = model(x)
    if out.dim() == 2:
        target = torch.randint(0, out.shape[-1], (batch,), generator=gen)
        return model, (x,), target, F.cross_entropy
    return model, (x,), torch.randint(0, out.shape[-1], x.shape, generator=gen), lm_loss


def plan_solution(model, sample: tuple, target, loss_fn, plan):
    """(training graph, its solution) for `plan`, solved as `autopar.runtime.engine` does."""
    from autopar.graph.trace import trace
    from autopar.sharding.axes import MULTI_D
    from autopar.sharding.solve import solve

    tensor = plan.tensor_mesh()

    def solve_as_engine(traced, fixed):
        return solve(traced, axis="tp", size=plan.mesh["tp"], modes=plan.layer_modes(),
                     default_mode=plan.tp_mode, fixed_params=fixed,
                     mesh=tensor if tensor.mode in MULTI_D else None)

    forward = trace(model, sample, train=False)
    fixed = dict(solve_as_engine(forward, None).params)
    traced = trace(model, sample, loss_fn=loss_fn, example_target=target, train=True)
    fixed = {t: layout for t, layout in fixed.items() if t in traced.params}
    return traced, solve_as_engine(traced, fixed)


def predict(name: str, plan_spec: dict, world: int, batch: int) -> dict:
    """Predicted bytes per rank of one plan, and what it was predicted from."""
    from autopar.cost.memory import activation_bytes
    from autopar.cost.state import state_bytes
    from autopar.plans import Plan

    model, inputs, target, loss_fn = example(name, batch)
    plan = Plan.from_dict(plan_spec, world)
    sample = tuple(t[:2] for t in inputs)
    traced, solution = plan_solution(model, sample, target[:2], loss_fn, plan)
    replica_batch = batch // plan.mesh["dp"]  # multi-D batch splits are layouts on dim 0
    predicted = state_bytes(traced, solution, optimizer="adamw", zero_stage=plan.zero.stage,
                            dp=plan.mesh["dp"]).to_json()
    predicted["activations"] = sum(activation_bytes(traced, solution, replica_batch).values())
    layouts = {t: str(layout) for t, layout in solution.params.items()}
    return {"predicted": predicted, "replica_batch": replica_batch, "layouts": layouts,
            "planner": planner_state(model, sample, target[:2], loss_fn, plan, batch)}


def planner_state(model, sample: tuple, target, loss_fn, plan, batch: int) -> dict:
    """Parameter, gradient and optimizer bytes per rank as the search prices this plan
    (`autopar.cost.precision` through `memory_by_kind`), for runtime plans."""
    from autopar.modes import RUNTIME
    from autopar.search import planner
    from autopar.search.search import Constraints, Options, Search
    from autopar.world import World

    tp = plan.mesh["tp"]
    chain = planner.prepare(model, sample, loss_fn=loss_fn, example_target=target,
                            tp_sizes=(tp,))
    world = World(plan.world_size, per_node=plan.world_size, device="cpu")
    fixed = Constraints(pp=1, cp=1, tp=tp, dp=plan.mesh["dp"], zero=plan.zero.stage,
                        offload=False, sp="none", tp_mode=plan.tp_mode if tp > 1 else None)
    options = Options(global_batch=batch, dtype="fp32", executable=RUNTIME)
    cand = Search(chain, world, options, fixed).every()[0]
    return {k: cand.memory[k] for k in ("parameters", "gradients", "optimizer")}


def measure(name: str, plan_spec: dict, world: int, batch: int) -> dict:
    """This rank's measured bytes under one plan, and the parameter layouts it ran."""
    import autopar
    from autopar.runtime.measure import measure_saved_activations, measure_state_bytes

    model, inputs, target, loss_fn = example(name, batch)
    sample = tuple(t[:2] for t in inputs)
    engine = autopar.parallelize(model, world, example_inputs=sample, loss_fn=loss_fn,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                 plan=plan_spec)
    engine.train_step(inputs, target)  # traces the training graph, makes the optimizer state
    held = list(engine.parameters()) + [b for gm in (engine.forward_gm, engine.train_gm)
                                        for b in gm.buffers()]
    activations = []
    measured = measure_state_bytes(engine, lambda: activations.append(measure_saved_activations(
        lambda: engine.train_step(inputs, target), exclude=held,
        inputs=inputs + (target,)))).to_json()
    measured["activations"] = activations[0]
    layouts = {t: str(layout) for t, layout in engine.train_solution.params.items()}
    return {"measured": measured, "layouts": layouts, "batch_split": engine.batch_split()}


def worker(rank, world, models, plan_names, batch, out_path):
    from autopar.errors import PlanError

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's collective renames
    rows = []
    for name in models:
        for plan_name in plan_names:
            plan_spec = PLANS[plan_name][1]
            # every rank of a plan holds the same shares: rank 0 predicts, all measure
            try:
                mine = predict(name, plan_spec, world, batch) if rank == 0 else {}
                mine.update(measure(name, plan_spec, world, batch))
            except PlanError as error:  # refused the same way on every rank
                mine = {"refused": str(error)}
            every = [None] * world
            dist.all_gather_object(every, mine)
            prediction = every[0]
            if "refused" in prediction:
                rows.append({"model": name, "plan": plan_name, "world": world,
                             "plan_spec": plan_spec, "refused": prediction["refused"]})
                continue
            for r, result in enumerate(every):
                predicted, measured = prediction["predicted"], result["measured"]
                ratios = {k: predicted[k] / measured[k] for k in KINDS}
                searched = prediction["planner"]
                rows.append({"model": name, "plan": plan_name, "world": world, "rank": r,
                             "plan_spec": plan_spec, "predicted": predicted,
                             "measured": measured, "ratio": ratios, "planner": searched,
                             "planner_ratio": {k: searched[k] / measured[k] for k in STATE},
                             "replica_batch": prediction["replica_batch"],
                             "batch_split": result["batch_split"],
                             "same_solution": result["layouts"] == prediction["layouts"]})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "batch": batch, "device": "cpu (gloo)", "rows": rows},
                      f, indent=2)


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--worlds", nargs="+", type=int, default=list(WORLDS),
                        choices=sorted({w for w, _ in PLANS.values()}))
    parser.add_argument("--plans", nargs="+", default=None,
                        help="plan names or mode words to keep (e.g. 2d 3d 'tensor 8'); "
                             "default every plan")
    args = parser.parse_args()
    chosen = [p for p in PLANS if args.plans is None or
              any(p == k or k in p.split() for k in args.plans)]
    rows = []
    for world in args.worlds:
        plan_names = [p for p in chosen if PLANS[p][0] == world]
        if not plan_names:
            continue
        part = results_path(f"memory_world{world}.json")
        run_world(worker, (world, args.models, plan_names, args.batch, part), world)
        with open(part) as f:
            rows += json.load(f)["rows"]
        os.remove(part)
    out_path = results_path("memory.json")
    with open(out_path, "w") as f:
        json.dump({"worlds": args.worlds, "batch": args.batch, "device": "cpu (gloo)",
                   "rows": rows}, f, indent=2)
    print(f"global batch {args.batch}, AdamW; KiB per rank, predicted / measured (ratio)")
    header = f"{'model':<11} {'plan':<18} {'rank':>4}" + "".join(f"  {k:>27}" for k in KINDS)
    print(header)
    worst: dict = {}
    refused = [row for row in rows if "refused" in row]
    rows = [row for row in rows if "refused" not in row]
    for row in rows:
        cells = []
        per_plan = worst.setdefault((row["world"], row["plan"]), {k: 0.0 for k in KINDS})
        for k in KINDS:
            p, m, ratio = row["predicted"][k], row["measured"][k], row["ratio"][k]
            per_plan[k] = max(per_plan[k], abs(ratio - 1))
            cells.append(f"  {_kib(p):>9} / {_kib(m):>9} ({ratio:.4f})")
        flag = "" if row["same_solution"] else "  (engine solved other layouts)"
        print(f"{row['model']:<11} {row['plan']:<18} {row['rank']:>4}" + "".join(cells) + flag)
    for row in refused:
        print(f"{row['model']:<11} {row['plan']:<18}  refused by parallelize: {row['refused']}")
    print("\nthe search's own state bytes (autopar.cost.precision), KiB per rank, planner / "
          "measured (ratio)")
    print(f"{'model':<11} {'plan':<18} {'rank':>4}" + "".join(f"  {k:>27}" for k in STATE))
    searched_worst = {k: 0.0 for k in STATE}
    for row in rows:
        cells = []
        for k in STATE:
            p, m, ratio = row["planner"][k], row["measured"][k], row["planner_ratio"][k]
            searched_worst[k] = max(searched_worst[k], abs(ratio - 1))
            cells.append(f"  {_kib(p):>9} / {_kib(m):>9} ({ratio:.4f})")
        print(f"{row['model']:<11} {row['plan']:<18} {row['rank']:>4}" + "".join(cells))
    print("\nlargest error per plan (all models and ranks):")
    for (world, plan), errors in worst.items():
        print(f"  world {world} {plan:<18} " + ", ".join(f"{k} {errors[k]:.2%}" for k in KINDS))
    print("largest error: " + ", ".join(
        f"{k} {max(e[k] for e in worst.values()):.2%}" for k in KINDS))
    print("largest error of the search's state bytes: " + ", ".join(
        f"{k} {searched_worst[k]:.2%}" for k in STATE))
    print(f"written to {os.path.relpath(out_path, ROOT)}")


if __name__ == "__main__":
    main()
