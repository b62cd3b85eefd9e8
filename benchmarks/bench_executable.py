"""The free search's winner against the `--executable` search's, on the runs of issue 31.

    python benchmarks/bench_executable.py [--cases 8b-8k 70b-8k 405b-8k 8b-128k]

For each case the model is traced once on the meta device and searched twice on the same
world: free (everything the planner prices) and restricted to what `autopar.parallelize`
executes (`autopar.modes.RUNTIME`, the CLI's `--executable`). The table gives both winners,
their predicted step times and MFU, the ratio executable / free (1.000 when the runtime
runs the free winner) and, where it is above 1, what the free winner uses that the runtime
still refuses (`Plan.unsupported`). Offline: no devices, a minute or so per case.

Global batches (sequences) follow the token budgets of Llama 3's pre-training (Llama Team
2024, arXiv 2407.21783, section 3.4.1): 4M tokens for 8B, 8M for 70B, 16M for the 405B
shape; at 131072 tokens the 8B shape (Llama 3.1's, whose rotary tables reach that far) takes 32
sequences (4M tokens).

Writes benchmarks/results/executable.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from gloo_world import results_path  # noqa: E402

from autopar.cli import DTYPES, load_model  # noqa: E402
from autopar.search import planner  # noqa: E402
from autopar.search.search import divisors  # noqa: E402
from autopar.world import World  # noqa: E402

# name: (zoo model, sequence, devices, global batch)
CASES = {
    "8b-8k": ("llama3-8b", 8192, 64, 512),
    "70b-8k": ("llama3-70b", 8192, 512, 1024),
    "405b-8k": ("llama3.1-405b", 8192, 16384, 2048),
    "8b-128k": ("llama3.1-8b", 131072, 64, 32),
}
DEVICE, PER_NODE, DTYPE = "h100-80gb", 8, "bf16"


def _winner(chain, world, batch: int, executable: bool) -> dict:
    start = time.perf_counter()
    result = planner.search(chain, world, global_batch=batch, dtype=DTYPE,
                            executable=executable, top=1)
    plan = planner.to_plan(chain, world, result, batch, DTYPE, time.perf_counter() - start)
    return {"plan": result.best.describe(), "step_time_s": plan.predicted["step_time_s"],
            "mfu": plan.predicted["mfu"], "refused": plan.unsupported(),
            "search_s": time.perf_counter() - start}


def run_case(name: str) -> dict:
    model_name, seq, devices, batch = CASES[name]
    model, inputs, loss_fn, target, layers = load_model(model_name, batch, seq, DTYPES[DTYPE])
    world = World(devices=devices, per_node=PER_NODE, device=DEVICE)
    chain = planner.prepare(model, inputs, loss_fn=loss_fn, example_target=target,
                            tp_sizes=divisors(devices), layers=layers)
    free = _winner(chain, world, batch, executable=False)
    runnable = _winner(chain, world, batch, executable=True)
    return {"case": name, "model": model_name, "seq": seq, "devices": devices,
            "global_batch": batch, "free": free, "executable": runnable,
            "ratio": runnable["step_time_s"] / free["step_time_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    args = parser.parse_args()
    rows = [run_case(name) for name in args.cases]
    print(f"{'case':<9} {'model':<14} {'seq':>6} {'devices':>7} {'batch':>5}  "
          f"{'free step s':>11} {'MFU':>6}  {'exec step s':>11} {'MFU':>6}  {'ratio':>6}")
    for r in rows:
        f, e = r["free"], r["executable"]
        print(f"{r['case']:<9} {r['model']:<14} {r['seq']:>6} {r['devices']:>7} "
              f"{r['global_batch']:>5}  {f['step_time_s']:11.3f} {f['mfu']:6.1%}  "
              f"{e['step_time_s']:11.3f} {e['mfu']:6.1%}  {r['ratio']:6.3f}")
    for r in rows:
        same = r["free"]["plan"] == r["executable"]["plan"]
        print(f"{r['case']}: free {r['free']['plan']}" + (" (executable: the same)" if same
              else f"\n{'':<{len(r['case'])}}  executable {r['executable']['plan']}"))
        if r["free"]["refused"]:
            print(f"{'':<{len(r['case'])}}  the free winner still needs "
                  f"{', '.join(r['free']['refused'])}")
    out = results_path("executable.json")
    with open(out, "w") as fh:
        json.dump({"device": DEVICE, "per_node": PER_NODE, "dtype": DTYPE, "rows": rows}, fh,
                  indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
