"""The `autopar` command line: explain, search and calibrate.

    autopar explain MODEL --world 1024 --device a100-80gb [--tp 8 --pp 2 ...]
    autopar search  MODEL --world 1024 -o plan.json
    autopar calibrate -o profile.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import TYPE_CHECKING

from autopar.errors import AutoparError
from autopar.planner import DTYPES

if TYPE_CHECKING:  # annotations only
    import torch


class Progress:
    """A one-line progress bar on stderr, shown only once a search has run for a second."""

    def __init__(self, stream=sys.stderr, after_s: float = 1.0):
        self.stream, self.after, self.start, self.shown = stream, after_s, time.perf_counter(), False
        self.last = -1

    def __call__(self, done: int, total: int) -> None:
        if time.perf_counter() - self.start < self.after or total <= 0:
            return
        percent = 100 * done // total
        if percent == self.last:  # redraw only on change: a log file gets one bar per percent
            return
        self.shown, self.last = True, percent
        width = 30
        filled = int(width * done / total)
        self.stream.write(f"\rsearching [{'#' * filled}{'.' * (width - filled)}] "
                          f"{percent:3d}%")
        self.stream.flush()

    def close(self) -> None:
        if self.shown:
            self.stream.write("\r" + " " * 48 + "\r")
            self.stream.flush()


def load_model(spec: str, batch: int, seq: int | None, dtype: torch.dtype):
    """(model, inputs, loss_fn, target, layers) for a zoo name, a zoo spec or an import path.

    `layers` is (traced, real) for zoo models (two blocks are traced and counted as many),
    None for imported models (traced whole).
    """
    head = spec.split(":", 1)[0]
    if ":" in spec and "." in head and "=" not in spec:
        module, factory = spec.split(":", 1)
        try:
            made = getattr(importlib.import_module(module), factory)()
            model, inputs = made
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            raise AutoparError(f"cannot load {spec}: {e}; give package.module:factory where the "
                               "factory returns (model, example_inputs).") from e
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        return model, inputs, None, None, None
    from autopar.models import workload

    try:
        w = workload(spec, batch=2, seq=seq, dtype=dtype)
    except ValueError as e:
        raise AutoparError(str(e)) from e
    return w.model, w.inputs, w.loss_fn, w.target, (w.traced_layers, w.layers)


def constraints_of(args) -> dict:
    out = {}
    for name in ("tp", "pp", "dp", "cp", "zero", "microbatches", "schedule"):
        value = getattr(args, name, None)
        if value is not None:
            out[name] = value
    if args.tp_mode:
        out["tp_mode"] = args.tp_mode
    if args.sp:
        out["sp"] = args.sp
    if args.recompute:
        out["recompute"] = args.recompute
    if args.offload:
        out["offload"] = True
    if args.plan:
        from autopar.plan import Plan

        fixed = Plan.load(args.plan)
        out.update({axis: size for axis, size in fixed.mesh.items()})
        out.update(tp_mode=fixed.tp_mode, zero=fixed.zero.stage, offload=fixed.zero.offload,
                   recompute=fixed.recompute)
        if fixed.mesh["tp"] > 1:
            out["sp"] = "megatron" if fixed.sequence_parallel else "none"
        if fixed.mesh["cp"] > 1 and fixed.sequence_mode:
            out["sp"] = fixed.sequence_mode
        if fixed.mesh["pp"] > 1:
            out["schedule"] = fixed.pipeline.schedule
        if fixed.pipeline.micro_batch_size:
            out["micro_batch_size"] = fixed.pipeline.micro_batch_size
    return out


def _plan(args, world_size: int | None = None):
    from autopar import planner
    from autopar.search.search import divisors
    from autopar.world import World

    world = World(devices=world_size or args.world, per_node=args.per_node, device=args.device)
    model, inputs, loss_fn, target, layers = load_model(args.model, args.batch, args.seq,
                                                        DTYPES[args.dtype])
    constraints = constraints_of(args)
    sizes = [constraints["tp"]] if "tp" in constraints else divisors(world.devices)
    start = time.perf_counter()
    chain = planner.prepare(model, inputs, loss_fn=loss_fn, example_target=target,
                            tp_sizes=sizes, layers=layers)
    progress = Progress()
    try:
        result = planner.search(chain, world, global_batch=args.batch, constraints=constraints,
                                dtype=args.dtype, attention_kernel=args.attention,
                                executable=args.executable, top=args.top_alternatives,
                                progress=progress)
    finally:
        progress.close()
    plan = planner.to_plan(chain, world, result, args.batch, args.dtype,
                           time.perf_counter() - start)
    return plan, plan.detail


def _emit(args, data: dict) -> None:
    from autopar import report

    if args.format == "json":
        text = json.dumps(data, indent=2)
    elif args.format == "html":
        from autopar.report_html import plan_html

        text = plan_html(data, model=args.model).rstrip("\n")
    else:
        text = report.plan_text(data, top=args.top)
    if args.command == "explain" and args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


def explain(args) -> int:
    if args.min_devices:
        return min_devices(args)
    plan, data = _plan(args)
    _emit(args, data)
    return 0


def search(args) -> int:
    if args.min_devices:
        return min_devices(args)
    plan, data = _plan(args)
    if args.output:
        plan.save(args.output)
    _emit(args, data)
    if args.output:
        print(f"plan written to {args.output}", file=sys.stderr)
    return 0


def min_devices(args) -> int:
    """The fewest devices (at most --world) on which a plan fits, optionally at a floor of
    --min-throughput tokens (samples for non-sequence models) per second."""
    sizes = sorted({n for n in (1, 2, 4) if n < args.per_node} |
                   set(range(args.per_node, args.world + 1, args.per_node)) | {args.world})
    tried = []
    for n in sizes:
        try:
            plan, data = _plan(args, n)
        except AutoparError as e:
            tried.append(f"{n}: {e}")
            continue
        rate = plan.predicted["tokens_per_s"]
        if args.min_throughput and rate < args.min_throughput:
            tried.append(f"{n}: fits, {rate:.0f} tokens/s < {args.min_throughput:.0f}")
            continue
        data["min_devices"] = {"devices": n, "tried": tried}
        if args.output and args.command == "search":
            plan.save(args.output)
        _emit(args, data)
        return 0
    last = tried[-1] if tried else "nothing tried"
    raise AutoparError(f"no world of at most {args.world} devices fits this model"
                       + (f" at {args.min_throughput:.0f} tokens/s" if args.min_throughput else "")
                       + f" (largest tried: {last}); raise --world or relax the request.")


DEFAULTS = {"world": 8, "per_node": 8, "device": "a100-80gb", "batch": 8, "dtype": "bf16"}


def fill_defaults(args) -> None:
    """Fill the world, device, batch and dtype the command line left out: from the --plan
    file where it records them (so `autopar explain MODEL --plan plan.json` prices the plan
    on what it was searched for), else from DEFAULTS."""
    recorded = {}
    if args.plan:
        from autopar.plan import Plan

        fixed = Plan.load(args.plan)
        if fixed.world is not None:
            recorded.update(world=fixed.world.devices, per_node=fixed.world.per_node,
                            device=fixed.world.device)
        for name, key in (("batch", "global_batch"), ("dtype", "dtype")):
            if fixed.search.get(key) is not None:
                recorded[name] = fixed.search[key]
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, recorded.get(name, default))


def _add_plan_arguments(p) -> None:
    p.add_argument("model", help="zoo name (gpt3-175b, llama2-7b, ...), zoo spec "
                                 "(gpt:layers=..,hidden=..,heads=..) or package.module:factory")
    p.add_argument("--world", type=int, help="devices (the most, with --min-devices); "
                                               "default 8, or the --plan file's")
    p.add_argument("--per-node", type=int, help="devices per node; default 8, or the --plan file's")
    p.add_argument("--device", help="a device profile name or a profile JSON written by `autopar "
                                    "calibrate`; default a100-80gb, or the --plan file's")
    p.add_argument("--batch", type=int, help="global batch (sequences or samples); default 8, or "
                                             "the --plan file's")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16, or the --plan file's")
    p.add_argument("--tp", type=int)
    p.add_argument("--pp", type=int)
    p.add_argument("--dp", type=int)
    p.add_argument("--cp", type=int)
    p.add_argument("--tp-mode", choices=("1d", "2d", "2.5d", "3d"))
    p.add_argument("--sp", choices=("none", "megatron", "ulysses", "ring"))
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    p.add_argument("--offload", action="store_true", help="offload optimizer states to the host")
    p.add_argument("--recompute", choices=("none", "selective", "full"))
    p.add_argument("--microbatches", type=int)
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved", "zero_bubble"))
    p.add_argument("--attention", choices=("flash", "unfused"), default="flash",
                   help="attention kernel to price: fused (FlashAttention) or scores in memory")
    p.add_argument("--min-devices", action="store_true",
                   help="find the fewest devices (up to --world) that fit the model")
    p.add_argument("--min-throughput", type=float, default=None,
                   help="with --min-devices: tokens per second the plan must reach")
    p.add_argument("--plan", default=None, help="explain this plan file (its choices are fixed)")
    p.add_argument("--executable", action="store_true",
                   help="consider only what autopar.parallelize runs today (a plan to deploy)")
    p.add_argument("--format", choices=("text", "json", "html"), default="text",
                   help="html: one self-contained page with charts (open it in a browser)")
    p.add_argument("-o", "--output", default=None,
                   help="explain: write the report here; search: write the plan here")
    p.add_argument("--top", type=int, default=None, help="show only the first K layer rows")
    p.add_argument("--top-alternatives", type=int, default=5,
                   help="how many runner-up plans to keep, with why each lost")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_arguments(sub.add_parser("explain", help="plan a model on a world and explain it"))
    _add_plan_arguments(sub.add_parser("search", help="search the best plan and write it (-o)"))
    from autopar.cost import calibrate

    calibrate.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "calibrate":
            return calibrate.run(args)
        fill_defaults(args)
        return {"explain": explain, "search": search}[args.command](args)
    except AutoparError as e:
        print(f"autopar: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
