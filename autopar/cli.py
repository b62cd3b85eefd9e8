"""The `autopar` command line: explain, search and calibrate.

    autopar explain MODEL --world 1024 --device a100-80gb [--tp 8 --pp 2 ...]
    autopar search  MODEL --world 1024 -o plan.json
    autopar calibrate -o profile.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

from autopar.errors import AutoparError
from autopar.kernels.float8 import RECIPES, TENSORWISE
from autopar.modes import (
    BF16,
    CP,
    DP,
    DP_SHARD,
    EP,
    FP8,
    GRID_MODES,
    LAYER_SP,
    MEGATRON_SP,
    MESH_SIZES,
    NO_RECOMPUTE,
    NO_SP,
    PP,
    RECOMPUTE,
    SCHEDULES,
    SEQUENCE_MODES,
    TP,
    TP_25D,
    TP_MODES,
    ZERO_STAGES,
)
from autopar.search.planner import DTYPES

if TYPE_CHECKING:  # annotations only
    import torch


class Progress:
    """A one-line progress bar on stderr, shown only on a terminal (a redirected stderr gets
    no carriage-return redraws) and only once a search has run for a second."""

    def __init__(self, stream=None, after_s: float = 1.0):
        self.stream = sys.stderr if stream is None else stream
        self.after, self.start, self.shown = after_s, time.perf_counter(), False
        self.last = -1
        isatty = getattr(self.stream, "isatty", None)
        self.on_terminal = bool(isatty and isatty())

    def __call__(self, done: int, total: int) -> None:
        if not self.on_terminal or time.perf_counter() - self.start < self.after or total <= 0:
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
    """(model, inputs, loss_fn, target, layers) for a zoo name or spec, a transformers config,
    or a factory (`package.module:factory`, `path/file.py:factory`); `layers`: (traced, real)
    where two traced blocks stand for many, {block: copies} where one dense and one MoE block
    stand for theirs (`Workload.layer_counts`), None where the model is traced whole."""
    from autopar.models import ZOO_NAMES, hf, workload

    try:
        if spec not in ZOO_NAMES and hf.config_file(spec) is not None:
            w = hf.workload(spec, batch=2, seq=seq, dtype=dtype)
            return w.model, w.inputs, w.loss_fn, w.target, w.layer_counts
        if is_import_path(spec):
            return _from_factory(spec, batch, seq, dtype)
        w = workload(spec, batch=2, seq=seq, dtype=dtype)
    except ValueError as e:
        raise AutoparError(str(e)) from e
    return w.model, w.inputs, w.loss_fn, w.target, w.layer_counts


def is_import_path(spec: str) -> bool:
    """`module:factory` or `file.py:factory`; a zoo spec (`family:key=value,...`) has '='."""
    where, colon, name = spec.rpartition(":")
    return bool(colon and where and name) and "=" not in spec


def _import_factory(spec: str):
    """The callable `spec` names, from a file path or an importable module (the working
    directory importable, as `python -m` makes it)."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise AutoparError(f"factory file {where} (in {spec}) does not exist; give "
                               "path/to/file.py:factory with an existing file.")
        module_name = os.path.splitext(os.path.basename(where))[0]
        found = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(found)
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))  # its sibling imports
        try:
            found.loader.exec_module(module)
        finally:
            sys.path.pop(0)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise AutoparError(f"cannot import module {where} for {spec} ({e}); give an "
                               "importable package.module:factory, or path/to/file.py:factory."
                               ) from e
    factory = module
    for part in name.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise AutoparError(f"{where} has no attribute {name} (in {spec}); name a function "
                               "there that returns a model or (model, example_inputs).")
    if not callable(factory):
        raise AutoparError(f"{name} in {where} is a {type(factory).__name__}, not a callable; "
                           "name a function that returns a model or (model, example_inputs).")
    return factory


def _from_factory(spec: str, batch: int, seq: int | None, dtype: torch.dtype):
    """Call the factory with `batch=` and `seq=` where its signature takes them; a
    transformers model it returns keeps two blocks to trace (the planner counts the rest)
    and, returned alone, gets example inputs from its config."""
    import inspect

    import torch
    from torch import nn

    from autopar.models import hf

    factory = _import_factory(spec)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or extension callable: call it bare
        params = {}
    anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {}
    if anything or "batch" in params:
        kwargs["batch"] = batch
    if seq is not None:
        if not (anything or "seq" in params):
            raise AutoparError(f"--seq {seq} was given but the factory {spec} takes no seq "
                               "argument; add a seq parameter to it or leave --seq out.")
        kwargs["seq"] = seq
    made = factory(**kwargs)
    config = getattr(made, "config", None)
    if isinstance(made, nn.Module) and hasattr(config, "model_type"):
        device = next((p.device for p in made.parameters()), torch.device("meta"))
        inputs, loss_fn, target, _ = hf.example_batch(config, 2, seq, dtype, device)
        return made, inputs, loss_fn, target, hf.keep_blocks(made)
    if not (isinstance(made, (tuple, list)) and len(made) == 2 and
            isinstance(made[0], nn.Module)):
        raise AutoparError(f"the factory {spec} returned {type(made).__name__}, not a model or "
                           "(model, example_inputs); return one of those.")
    model, inputs = made
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise AutoparError(f"the factory {spec} returned example inputs that are not tensors; "
                           "return (model, tensor) or (model, (tensor, ...)).")
    loss_fn, target, layers = None, None, None
    if hasattr(getattr(model, "config", None), "model_type"):
        loss_fn, target = hf.loss_for(inputs[0])
        layers = hf.keep_blocks(model)
    return model, inputs, loss_fn, target, layers


def constraints_of(args) -> dict:
    out = {}
    for name in (*_sizes(), "zero", "microbatches", "schedule"):
        value = getattr(args, name, None)
        if value is not None:
            out[name] = value
    if args.tp_mode:
        out["tp_mode"] = args.tp_mode
    if args.sp:
        out["sp"] = args.sp
    if args.recompute:
        out["recompute"] = args.recompute
    if args.offload is not None:
        out["offload"] = args.offload
    if args.plan:
        from autopar.plans import Plan

        fixed = Plan.load(args.plan)
        out.update({axis: size for axis, size in fixed.mesh.items()})
        out[EP] = fixed.ep
        out.update(tp_mode=fixed.tp_mode, zero=fixed.zero.stage, offload=fixed.zero.offload,
                   recompute=fixed.recompute)
        if fixed.zero.stage:
            out[DP_SHARD] = fixed.dp_shard
        if fixed.recompute == NO_RECOMPUTE and any(lp.recompute != NO_RECOMPUTE
                                                   for lp in fixed.layers):
            del out["recompute"]  # a per-layer mix: the search finds it again
        where = fixed.sequence_parallel_layers()
        if fixed.mesh[TP] > 1 and (where is True or not where):  # (a per-layer mix: found again)
            out["sp"] = MEGATRON_SP if where else NO_SP
        if fixed.mesh[CP] > 1 and fixed.sequence_mode:
            out["cp_mode"] = fixed.sequence_mode  # beside the layers' sp, which it keeps
        if fixed.mesh[PP] > 1:
            out["schedule"] = fixed.pipeline.schedule
        if fixed.pipeline.micro_batch_size:
            out["micro_batch_size"] = fixed.pipeline.micro_batch_size
        if fixed.pipeline.microbatches > 1:  # (with pp 1: gradient accumulation)
            out["microbatches"] = fixed.pipeline.microbatches
    return out


def _plan(args, world_size: int | None = None):
    from autopar.search import planner
    from autopar.search.search import divisors
    from autopar.world import World

    world = World(devices=world_size or args.world, per_node=args.per_node, device=args.device)
    model, inputs, loss_fn, target, layers = load_model(args.model, args.batch, args.seq,
                                                        DTYPES[args.dtype])
    constraints = constraints_of(args)
    sizes = [constraints[TP]] if TP in constraints else divisors(world.devices)
    start = time.perf_counter()
    chain = planner.prepare(model, inputs, loss_fn=loss_fn, example_target=target,
                            tp_sizes=sizes, layers=layers, chunked_loss=args.chunked_loss)
    progress = Progress()
    try:
        result = planner.search(chain, world, global_batch=args.batch, constraints=constraints,
                                dtype=args.dtype, attention_kernel=args.attention,
                                executable=args.executable, top=args.top_alternatives,
                                progress=progress, compile=args.compile,
                                fp8_recipe=args.fp8_recipe)
    finally:
        progress.close()
    plan = planner.to_plan(chain, world, result, args.batch, args.dtype,
                           time.perf_counter() - start)
    return plan, plan.detail


def _emit(args, data: dict) -> None:
    from autopar.report import predicted as report

    if args.format == "json":
        text = json.dumps(data, indent=2)
    elif args.format == "html":
        from autopar.report.html import plan_html

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
    """The fewest devices (at most --world) on which a plan fits (at --min-throughput tokens
    per second, if given): the model traced once, each world searched as `explain` does."""
    from autopar.search import planner
    from autopar.search.search import divisors
    from autopar.world import World

    sizes = sorted({n for n in (1, 2, 4) if n < args.per_node} |
                   set(range(args.per_node, args.world + 1, args.per_node)) | {args.world})
    constraints = constraints_of(args)
    tp_sizes = [constraints[TP]] if TP in constraints else \
        sorted({d for n in sizes for d in divisors(n)})
    start = time.perf_counter()
    model, inputs, loss_fn, target, layers = load_model(args.model, args.batch, args.seq,
                                                        DTYPES[args.dtype])
    chain = planner.prepare(model, inputs, loss_fn=loss_fn, example_target=target,
                            tp_sizes=tp_sizes, layers=layers, chunked_loss=args.chunked_loss)
    tried = []
    for n in sizes:
        world = World(devices=n, per_node=args.per_node, device=args.device)
        try:
            result = planner.search(chain, world, global_batch=args.batch,
                                    constraints=constraints, dtype=args.dtype,
                                    attention_kernel=args.attention, compile=args.compile,
                                    executable=args.executable, top=args.top_alternatives,
                                    fp8_recipe=args.fp8_recipe)
            plan = planner.to_plan(chain, world, result, args.batch, args.dtype,
                                   time.perf_counter() - start)
        except AutoparError as e:
            tried.append(f"{n}: {e}")
            continue
        rate = plan.predicted["tokens_per_s"]
        if args.min_throughput and rate < args.min_throughput:
            tried.append(f"{n}: fits, {rate:.0f} tokens/s < {args.min_throughput:.0f}")
            continue
        data = plan.detail
        data["min_devices"] = {"devices": n, "tried": tried}
        if args.output and args.command == "search":
            plan.save(args.output)
        _emit(args, data)
        return 0
    last = tried[-1] if tried else "nothing tried"
    raise AutoparError(f"no world of at most {args.world} devices fits this model"
                       + (f" at {args.min_throughput:.0f} tokens/s" if args.min_throughput else "")
                       + f" (largest tried: {last}); raise --world or relax the request.")


DEFAULTS = {"world": 8, "per_node": 8, "device": "a100-80gb", "batch": 8, "dtype": BF16,
            "fp8_recipe": TENSORWISE}


def fill_defaults(args) -> None:
    """Fill the world, device, batch and dtype the command line left out: from the --plan
    file where it records them (so `autopar explain MODEL --plan plan.json` prices the plan
    on what it was searched for), else from DEFAULTS."""
    recorded = {}
    args.recipe_given = args.fp8_recipe  # (a recipe of the user's, checked against the dtype)
    if args.plan:
        from autopar.plans import Plan

        fixed = Plan.load(args.plan)
        if fixed.world is not None:
            recorded.update(world=fixed.world.devices, per_node=fixed.world.per_node,
                            device=fixed.world.device)
        for name, key in (("batch", "global_batch"), ("dtype", "dtype"),
                          ("fp8_recipe", "fp8_recipe")):
            if fixed.search.get(key) is not None:
                recorded[name] = fixed.search[key]
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, recorded.get(name, default))


def add_plan_arguments(p) -> None:
    """The arguments explain and search share (a mesh size flag per `modes.MESH_SIZES`)."""
    p.add_argument("model", help="zoo name (gpt3-175b, llama2-7b, ...), zoo spec "
                                 "(gpt:layers=..,hidden=..,heads=..), a transformers config "
                                 "directory or config.json, or package.module:factory / "
                                 "path/to/file.py:factory (given batch= and seq= if it takes "
                                 "them)")
    p.add_argument("--world", type=int, help="devices (the most, with --min-devices); "
                                               "default 8, or the --plan file's")
    p.add_argument("--per-node", type=int, help="devices per node; default 8, or the --plan file's")
    p.add_argument("--device", help="a device profile name or a profile JSON written by `autopar "
                                    "calibrate`; default a100-80gb, or the --plan file's")
    p.add_argument("--batch", type=int, help="global batch (sequences or samples); default 8, or "
                                             "the --plan file's")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16, or the --plan file's")
    for size in MESH_SIZES:
        p.add_argument(_flag(size.axis), type=int, help=size.help)
    p.add_argument("--tp-mode", choices=TP_MODES)
    p.add_argument("--sp", choices=LAYER_SP + SEQUENCE_MODES)
    p.add_argument("--zero", type=int, choices=ZERO_STAGES)
    p.add_argument("--offload", action=argparse.BooleanOptionalAction, default=None,
                   help="offload optimizer states to the host (--no-offload: never); default: "
                        "the search decides")
    p.add_argument("--recompute", choices=RECOMPUTE)
    p.add_argument("--microbatches", type=int,
                   help="micro-batches per data-parallel replica per step: the pipeline's, or "
                        "with --pp 1 gradient accumulation (one gradient sync per step)")
    p.add_argument("--schedule", choices=SCHEDULES)
    p.add_argument("--fp8-recipe", choices=RECIPES,
                   help="with --dtype fp8, the scaling recipe to price: tensorwise (one scale a "
                        "tensor, the published fp8 runs') or rowwise (parallelize's default); "
                        "default tensorwise, or the --plan file's")
    p.add_argument("--attention", choices=("flash", "flash1", "unfused"), default="flash",
                   help="attention kernel to price: FlashAttention-2, FlashAttention v1, or "
                        "scores in memory")
    p.add_argument("--compile", action="store_true",
                   help="price the plan as parallelize(compile=True) runs it: inductor fuses "
                        "each layer's memory-bound ops into one kernel per connected group")
    p.add_argument("--min-devices", action="store_true",
                   help="find the fewest devices (up to --world) that fit the model")
    p.add_argument("--min-throughput", type=float, default=None,
                   help="with --min-devices: tokens per second the plan must reach")
    p.add_argument("--chunked-loss", action=argparse.BooleanOptionalAction, default=True,
                   help="price a classifier's cross-entropy chunked, as parallelize runs it "
                        "(--no-chunked-loss: as parallelize(..., chunked_loss=False))")
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


_POSITIVE = ("world", "per_node", "batch", "seq", "microbatches", "top")  # and each mesh size


def _sizes() -> tuple[str, ...]:
    """The mesh sizes a user may fix (--tp, --pp, ...): one per `modes.MESH_SIZES` entry."""
    return tuple(size.axis for size in MESH_SIZES)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate_args(args) -> None:
    """Refuse a flag of the wrong range, or flags that contradict each other, before any
    work (loading, searching, calibrating), naming the flag, its value and what works."""
    for name in (*_POSITIVE, *_sizes()):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise AutoparError(f"{_flag(name)} {value} is out of range; give a whole number "
                               ">= 1.")
    if getattr(args, "top_alternatives", 1) < 1:
        raise AutoparError(f"--top-alternatives {args.top_alternatives} is out of range; give "
                           "a whole number >= 1.")
    rate = getattr(args, "min_throughput", None)
    if rate is not None and not rate > 0:
        raise AutoparError(f"--min-throughput {rate} is out of range; give a positive number "
                           "of tokens per second.")
    _validate_combinations(args)
    _validate_seq(args)
    output = getattr(args, "output", None)
    if output:
        folder = os.path.dirname(os.path.abspath(output))
        if os.path.isdir(output):
            raise AutoparError(f"-o {output} is a directory; give a file path, such as "
                               f"{os.path.join(output, 'plan.json')}.")
        if not os.path.isdir(folder):
            raise AutoparError(f"-o {output}: the directory {folder} does not exist; create it "
                               "first or write elsewhere.")
        if not os.access(folder, os.W_OK):
            raise AutoparError(f"-o {output}: the directory {folder} is not writable; write "
                               "elsewhere.")


def _validate_seq(args) -> None:
    """A zoo model's sequence length, checked against the longest it takes before the model
    is built (a transformers config or a factory is checked as it loads)."""
    model, seq = getattr(args, "model", None), getattr(args, "seq", None)
    if model is None or seq is None:
        return
    from autopar.models import ZOO_NAMES, check_seq

    if model in ZOO_NAMES or ("=" in model and not os.path.exists(model)):
        try:
            check_seq(model, seq)
        except ValueError as e:
            raise AutoparError(str(e)) from e


def _validate_combinations(args) -> None:
    recipe, dtype = getattr(args, "recipe_given", None), getattr(args, "dtype", None)
    if recipe is not None and dtype != FP8:
        raise AutoparError(f"--fp8-recipe {recipe} scales fp8 matmuls, but --dtype is {dtype}; "
                           "give --dtype fp8, or leave --fp8-recipe out.")
    tp, cp, sp = getattr(args, TP, None), getattr(args, CP, None), getattr(args, "sp", None)
    if sp == MEGATRON_SP and tp == 1:
        raise AutoparError("--sp megatron splits the sequence over the tensor axis, but --tp is "
                           "1; give --tp 2 or more, or --sp none.")
    if sp in SEQUENCE_MODES and cp == 1:
        raise AutoparError(f"--sp {sp} splits the sequence over a cp axis, but --cp is 1; give "
                           "--cp 2 or more, or leave --sp out.")
    mode = getattr(args, "tp_mode", None)
    if mode in GRID_MODES and tp is not None and tp > 1:
        from autopar.sharding.axes import grid_size_error

        depths = [d for d in range(1, tp + 1) if tp % d == 0] if mode == TP_25D else [1]
        errors = [grid_size_error(mode, tp, d) for d in depths]
        if all(errors):
            raise AutoparError(f"--tp {tp} cannot run --tp-mode {mode}: {errors[0]}")
    batch, dp, m = getattr(args, "batch", None), getattr(args, DP, None), \
        getattr(args, "microbatches", None)
    if batch is not None and dp is not None and m is not None and batch % dp == 0 and \
            (batch // dp) % m:
        per = batch // dp
        raise AutoparError(f"--microbatches {m} does not divide the {per} sample(s) per "
                           f"data-parallel replica (--batch {batch} over --dp {dp}); give a "
                           f"number of micro-batches that divides {per}.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="autopar", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_arguments(sub.add_parser("explain", help="plan a model on a world and explain it"))
    add_plan_arguments(sub.add_parser("search", help="search the best plan and write it (-o)"))
    from autopar.cost import calibrate

    calibrate.add_parser(sub)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true",
                             help="print the traceback of an error (for a bug report)")
    args = parser.parse_args(argv)
    try:
        if args.command == "calibrate":
            validate_args(args)
            return calibrate.run(args)
        fill_defaults(args)
        validate_args(args)
        return {"explain": explain, "search": search}[args.command](args)
    except (AutoparError, OSError) as e:  # the user's input or file system: one sentence
        if args.debug:
            traceback.print_exc()
        print(f"autopar: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a bug, or an input nothing checks yet
        if args.debug:
            raise
        print(f"autopar: unexpected {type(e).__name__}: {e}; this is a bug in autopar or an "
              "input it does not check yet: rerun with --debug for the traceback.",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
