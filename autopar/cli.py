"""The `autopar` command line: `autopar explain MODEL ...`."""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.world import World


def _load_model(spec: str, batch: int, seq: int | None):
    if ":" in spec and "=" not in spec.split(":", 1)[1].split(",")[0] and "." in spec.split(":")[0]:
        module, factory = spec.split(":", 1)
        try:
            model, inputs = getattr(importlib.import_module(module), factory)()
        except (ImportError, AttributeError) as e:
            raise AutoparError(f"cannot load {spec}: {e}; give package.module:factory where the "
                               "factory returns (model, example_inputs).") from e
        return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    from autopar.models import build

    try:
        return build(spec, batch=batch, seq=seq, device="meta")
    except ValueError as e:
        raise AutoparError(str(e)) from e


def explain(args) -> int:
    from autopar import explain as report_mod
    from autopar.graph import trace
    from autopar.sharding.solve import solve

    world = World(devices=args.world, per_node=args.per_node, device=args.device)
    if args.plan:
        plan = Plan.load(args.plan)
    else:
        tp = args.tp or 1
        if args.world % tp:
            raise AutoparError(f"tensor size {tp} does not divide the world {args.world}; choose "
                               "a divisor of the world size.")
        plan = Plan(mesh={"tp": tp, "dp": args.world // tp}, world=world)
    if args.dp and args.dp != plan.mesh["dp"]:
        raise AutoparError(f"--dp {args.dp} does not match world {args.world} / tp "
                           f"{plan.mesh['tp']} = {plan.mesh['dp']}.")
    if args.batch % plan.mesh["dp"]:
        raise AutoparError(f"the global batch {args.batch} does not split over "
                           f"{plan.mesh['dp']} data-parallel ranks; use a multiple of "
                           f"{plan.mesh['dp']}.")
    model, inputs = _load_model(args.model, 2, args.seq)
    traced = trace(model, inputs, train=True)
    solution = solve(traced, axis="tp", size=plan.mesh["tp"], default_mode=plan.tp_mode)
    tokens = int(inputs[0].shape[1]) if inputs[0].dim() > 1 and not \
        inputs[0].dtype.is_floating_point else 1
    data = report_mod.report(traced, solution, plan, args.batch, tokens)
    text = json.dumps(data, indent=2) if args.format == "json" else \
        report_mod.as_text(data, args.top)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("explain", help="plan a model on a world and print the plan")
    p.add_argument("model", help="zoo name, zoo spec (gpt:layers=..,hidden=..) or "
                                 "package.module:factory")
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--device", default="a100-80gb")
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--tp", type=int, default=None)
    p.add_argument("--dp", type=int, default=None)
    p.add_argument("--plan", default=None, help="a plan JSON file")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("-o", "--output", default=None)
    p.add_argument("--top", type=int, default=None, help="show only the first K layers")
    args = parser.parse_args(argv)
    try:
        return explain(args)
    except AutoparError as e:
        print(f"autopar: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
