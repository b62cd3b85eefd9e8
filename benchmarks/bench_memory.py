"""Memory per rank at world 4: predicted by autopar.cost.memory against what the engine holds.

    python benchmarks/bench_memory.py [--models gpt-tiny llama-tiny ...] [--batch 8]

Spawns 4 gloo processes on this machine. For each model and executable plan, every rank
predicts its parameter, gradient, optimizer and activation bytes from the traced graph and
the plan's sharding solution, then trains one warm-up step and measures a second one:
parameters, gradients (just before the optimizer steps) and AdamW state from the tensors
the engine holds, activations from the storages autograd saves during `train_step`. Prints
a table and writes benchmarks/results/memory.json.
"""

import argparse
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import results_path, run_world  # noqa: E402

PLANS = {"data 4": {"data": 4},
         "tensor 4": {"tensor": {"size": 4, "mode": "1d"}},
         "tensor 2 x data 2": {"tensor": {"size": 2, "mode": "1d"}}}
MODELS = ("gpt-tiny", "llama-tiny", "bert-tiny", "vit-tiny", "mlp-tiny")
KINDS = ("parameters", "gradients", "optimizer", "activations")
WORLD = 4


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


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


def measure(name: str, plan: dict, batch: int) -> dict:
    """This rank's predicted and measured bytes under one plan."""
    import autopar
    from autopar.cost.memory import activation_bytes, measure_saved_activations, \
        measure_state_bytes, state_bytes
    from autopar.graph.trace import trace
    from autopar.sharding.solve import solve

    model, inputs, target, loss_fn = example(name, batch)
    tp = plan.get("tensor", {}).get("size", 1)
    micro_batch = batch * tp // WORLD
    sample = tuple(t[:2] for t in inputs)
    traced = trace(model, sample, loss_fn=loss_fn, example_target=target[:2])
    solution = solve(traced, axis="tp", size=tp)
    predicted = state_bytes(traced, solution, optimizer="adamw").to_json()
    predicted["activations"] = sum(activation_bytes(traced, solution, micro_batch).values())
    engine = autopar.parallelize(model, WORLD, example_inputs=sample, loss_fn=loss_fn,
                                 optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                 plan=plan)
    engine.train_step(inputs, target)  # traces the training graph, makes the optimizer state
    held = list(engine.parameters()) + [b for gm in (engine.forward_gm, engine.train_gm)
                                        for b in gm.buffers()]
    activations = []
    measured = measure_state_bytes(engine, lambda: activations.append(measure_saved_activations(
        lambda: engine.train_step(inputs, target), exclude=held,
        inputs=inputs + (target,)))).to_json()
    measured["activations"] = activations[0]
    return {"predicted": predicted, "measured": measured, "micro_batch": micro_batch}


def worker(rank, models, batch, out_path):
    rows = []
    for name in models:
        for plan_name, plan in PLANS.items():
            mine = measure(name, plan, batch)
            every = [None] * WORLD
            dist.all_gather_object(every, mine)
            for r, result in enumerate(every):
                ratios = {k: result["predicted"][k] / result["measured"][k] for k in KINDS}
                rows.append({"model": name, "plan": plan_name, "rank": r, **result,
                             "ratio": ratios})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": WORLD, "batch": batch, "device": "cpu (gloo)", "rows": rows},
                      f, indent=2)


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    out_path = results_path("memory.json")
    run_world(worker, (args.models, args.batch, out_path), WORLD)
    with open(out_path) as f:
        data = json.load(f)
    print(f"world {WORLD}, global batch {args.batch}, AdamW; KiB per rank, predicted / measured "
          "(ratio)")
    header = f"{'model':<11} {'plan':<18} {'rank':>4}" + "".join(f"  {k:>27}" for k in KINDS)
    print(header)
    worst = {k: 0.0 for k in KINDS}
    for row in data["rows"]:
        cells = []
        for k in KINDS:
            p, m, ratio = row["predicted"][k], row["measured"][k], row["ratio"][k]
            worst[k] = max(worst[k], abs(ratio - 1))
            cells.append(f"  {_kib(p):>9} / {_kib(m):>9} ({ratio:.4f})")
        print(f"{row['model']:<11} {row['plan']:<18} {row['rank']:>4}" + "".join(cells))
    print("largest error: " + ", ".join(f"{k} {worst[k]:.2%}" for k in KINDS))
    print(f"written to {os.path.relpath(out_path, ROOT)}")


if __name__ == "__main__":
    main()
