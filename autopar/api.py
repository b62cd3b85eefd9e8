"""The public entry points: `parallelize` (run) and `plan` (plan offline)."""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from autopar.errors import PlanError, WorldError
from autopar.kernels.float8 import ROWWISE, check_recipe
from autopar.kernels.moe_layers import expert_layers
from autopar.modes import BF16, CP, FP8, FP32, TP_1D
from autopar.passes.precision import compute_dtype
from autopar.plans import Plan
from autopar.plans.checks import check_context_dims, check_grid_dims, check_sequence_dims
from autopar.runtime.agree import check_ranks_agree, on_rank_zero
from autopar.runtime.checkpoint import Checkpointing
from autopar.runtime.checkpoint import latest as latest_checkpoint
from autopar.runtime.engine import Engine
from autopar.runtime.mesh import plan_groups
from autopar.runtime.metrics import StepMetrics
from autopar.runtime.startup import Startup, check_weights, on_meta
from autopar.runtime.watch import DEFAULT_TIMEOUT, Watch, check_timeout
from autopar.search.planner import pipeline_stages
from autopar.world import World, local_device


def parallelize(model: nn.Module, world, *, example_inputs, loss_fn=None, optimizer=None,
                plan=None, seed: int | None = None, max_grad_norm: float | None = None,
                precision: str = FP32, check_batches: bool = False, weights=None,
                metrics=None, metrics_every: int = 10, checkpoint_dir=None,
                checkpoint_every: int = 100, checkpoint_async: bool = True,
                checkpoint_keep: int = 2, timeout=DEFAULT_TIMEOUT,
                compile: bool = False, chunked_loss: bool = True,
                fp8_recipe: str = ROWWISE) -> Engine:
    """Turn `model` into a distributed training engine over `world` (an int or a World).

    `plan`: None (search), a Plan, a plan file or a Colossal-AI style dict such as
    dict(tensor=dict(size=4, mode="2d")). `optimizer`: a factory taking the parameters.
    `max_grad_norm`: clip by the global norm over every shard. `precision`: "fp32", "bf16"
    or "fp16" (16-bit compute on fp32 masters), or "fp8" (bf16, with the linears' GEMMs in
    float8: docs/fp8-training.md; `fp8_recipe`: "rowwise" or "tensorwise" scales).
    `check_batches`: compare every step's
    global batch across ranks (the first step always does). A model on the meta device
    gets only this rank's slices, of its own initialization under `seed` (None: the random
    state now, as one device would draw it), or of `weights`: a safetensors file or
    directory, an autopar checkpoint or a mapping, checked against the model first.
    `metrics`: a JSON-lines path (plus TensorBoard scalars in `<path>.tb` when tensorboard
    is installed) or a callable, given each step's measured figures beside the plan's;
    rank 0 writes, and prints a line every `metrics_every` steps (0: never).
    `checkpoint_dir`: resume from its latest checkpoint when it holds one (any plan or
    world wrote it; `engine.steps` says where the loop goes on), and save into it every
    `checkpoint_every` steps (in the background when `checkpoint_async`; the newest
    `checkpoint_keep` are kept). `timeout`: seconds (or a timedelta) any collective may
    wait for another rank; past it, or at once when a rank dies, every other rank raises
    RankStoppedError naming the rank that stopped and the step and phase where (None keeps
    torch's default of 30 minutes). `compile`: the training graph's compute between
    collectives compiled by inductor, one compiled region per repeated block
    (docs/compile.md). `chunked_loss`: a cross-entropy over a linear's logits runs fused,
    in chunks of tokens, never holding the whole logits (False: as traced)."""
    _check_arguments(model, loss_fn, optimizer, seed, max_grad_norm, check_batches)
    _check_checkpointing(checkpoint_dir, checkpoint_every, checkpoint_async, checkpoint_keep)
    seconds = check_timeout(timeout)
    _check_switches(compile=compile, chunked_loss=chunked_loss)
    sink = StepMetrics(metrics, metrics_every) if metrics is not None else None
    compute_dtype(precision)  # a bad name is refused before any process work
    check_recipe(fp8_recipe)
    size = _world_size(world)
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    _check_example_inputs(example_inputs)
    chosen, traced, failure, source = None, None, None, None
    try:
        if weights is not None:  # names, shapes and dtypes before any other work
            source = check_weights(model, weights)
        chosen, traced = _checked_plan(plan, size, world, model, tuple(example_inputs))
    except Exception as e:  # noqa: BLE001 - shared below, so no other rank waits for this one
        if not (dist.is_available() and dist.is_initialized()):
            raise
        failure = e
    if failure is None:
        _init_process_group(size, seconds)
        _check_process_group(size)
        example_inputs = _place_on_rank_device(model, tuple(example_inputs))
        chosen, traced, failure = _plan_and_trace(model, size, world, example_inputs, loss_fn,
            precision, fp8_recipe, chunked_loss, chosen, traced)
    watch = Watch(seconds, size)
    watch.bound([])
    with watch.guard(-1, "parallelize"):
        # one small all-gather: every rank stops here together when any rank failed above,
        # or when ranks differ in plan, model, weights or example inputs (before any group)
        check_ranks_agree(chosen, traced, tuple(example_inputs), failure)
        start = Startup(model, source, seed, _start_device(example_inputs)) \
            if source is not None or on_meta(model) else None
        groups = plan_groups(chosen)
        watch.bound(g.group for g in groups.values())
        engine = Engine(model, chosen, groups, tuple(example_inputs), loss_fn,
                        optimizer, seed=0 if seed is None else seed,
                        max_grad_norm=max_grad_norm, precision=precision,
                        forward_graph=traced, check_batches=check_batches,
                        stage_planner=pipeline_stages, start=start, compile=compile,
                        chunked_loss=chunked_loss, fp8_recipe=fp8_recipe)
    engine.watch, engine.metrics = watch, sink
    if checkpoint_dir is not None:
        _resume(engine, Checkpointing(os.fspath(checkpoint_dir), checkpoint_every,
                                      checkpoint_async, checkpoint_keep))
    return engine


def _plan_and_trace(model, size: int, world, example_inputs: tuple, loss_fn, precision: str,
                    fp8_recipe: str, chunked_loss: bool, chosen, traced):
    """(plan, its traced graph, None), searching the plan when none was given; a failure
    comes back as the third item, for every rank to learn of it together."""
    try:
        if chosen is None:
            chosen = _search_plan(model, size, world, example_inputs, loss_fn, precision,
                                  chunked_loss, fp8_recipe=fp8_recipe)
            _check_executable(chosen)
        return chosen, traced or Engine.trace_for(model, tuple(example_inputs), chosen), None
    except Exception as e:  # noqa: BLE001 - shared, so no other rank waits for this one
        return chosen, traced, e


def _resume(engine: Engine, checkpointing: Checkpointing) -> None:
    """Save by itself from now on, and start from the directory's latest checkpoint."""
    engine.checkpointing = checkpointing
    if latest_checkpoint(checkpointing.directory) is not None:
        engine.load(checkpointing.directory)


def _check_switches(**switches) -> None:
    """parallelize's on/off arguments, each True or False."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise PlanError(f"{name} must be True or False, not {value!r}.")


def _check_checkpointing(directory, every, asynchronous, keep) -> None:
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise PlanError(f"checkpoint_dir must be a directory path, not {directory!r}.")
    for name, value in (("checkpoint_every", every), ("checkpoint_keep", keep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a whole number >= 1, not {value!r}.")
    if not isinstance(asynchronous, bool):
        raise PlanError(f"checkpoint_async must be True or False, not {asynchronous!r}.")


def _start_device(example_inputs: tuple) -> torch.device:
    """Where a rank materializes its slices: its GPU under NCCL, else the example inputs'
    device (the CPU for meta ones)."""
    if dist.is_available() and dist.is_initialized():
        device = rank_device(dist.get_backend())
        if device is not None:
            return device
    device = example_inputs[0].device
    return torch.device("cpu") if device.type == "meta" else device


def _checked_plan(plan, size: int, world, model, example_inputs: tuple):
    """(plan, traced graph or None) for an explicit plan, refused before any process work
    when it cannot run on this model; (None, None) for plan=None."""
    if plan is None:
        return None, None
    chosen, traced = _resolve_plan(plan, size, world), None
    _check_executable(chosen)
    expert_layers(model, chosen)  # experts that do not split over ep, a bad top-k
    if chosen.tensor_mesh().mode != TP_1D:  # dims the grid splits, checked on the graph
        traced = Engine.trace_for(model, example_inputs, chosen)
        check_grid_dims(traced, chosen, chosen.tensor_mesh())
    if chosen.mesh[CP] > 1:  # the sequence must split over cp
        traced = traced or Engine.trace_for(model, example_inputs, chosen)
        check_context_dims(traced, chosen)
    if chosen.sequence_parallel_layers():  # the sequence must split over tp
        traced = traced or Engine.trace_for(model, example_inputs, chosen)
        check_sequence_dims(traced, chosen)
    return chosen, traced


def _check_arguments(model, loss_fn, optimizer, seed, max_grad_norm, check_batches) -> None:
    """Types and ranges of parallelize's arguments, each refused in one sentence naming it."""
    if not isinstance(model, nn.Module):
        raise PlanError(f"model must be a torch.nn.Module, not {type(model).__name__}.")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(
            max_grad_norm, (int, float)) or not max_grad_norm > 0):
        raise PlanError(f"max_grad_norm must be a positive number, not {max_grad_norm!r}.")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise PlanError(f"seed must be an int or None, not {seed!r}.")
    if not isinstance(check_batches, bool):
        raise PlanError(f"check_batches must be True or False, not {check_batches!r}.")
    if isinstance(loss_fn, type):
        raise PlanError(f"loss_fn is the class {loss_fn.__name__}, not a loss; pass an instance "
                        f"such as {loss_fn.__name__}() or a function (output, target) -> loss.")
    if loss_fn is not None and not callable(loss_fn):
        raise PlanError(f"loss_fn must be a function (output, target) -> loss, not "
                        f"{type(loss_fn).__name__}.")
    if isinstance(optimizer, torch.optim.Optimizer) or (optimizer is not None and
                                                        not callable(optimizer)):
        what = f"an {type(optimizer).__name__} instance" if isinstance(
            optimizer, torch.optim.Optimizer) else repr(optimizer)
        raise PlanError(f"optimizer must be a factory taking the parameters, such as "
                        f"functools.partial(torch.optim.AdamW, lr=3e-4), not {what}: the engine "
                        "builds the optimizer over this rank's shards.")


def _check_example_inputs(example_inputs) -> None:
    if not example_inputs or not all(isinstance(t, torch.Tensor) for t in example_inputs):
        kinds = ", ".join(type(t).__name__ for t in example_inputs) or "nothing"
        raise PlanError(f"example_inputs must be tensors (or a tuple of them) with the batch on "
                        f"dimension 0, not {kinds}; pass e.g. example_inputs=(x,).")


def _check_executable(chosen: Plan) -> None:
    chosen.check_grid()
    chosen.check_sequence_parallel()
    refusal = chosen.refusal()
    if refusal:
        raise PlanError(refusal)


def _world_size(world) -> int:
    if isinstance(world, World):
        return world.devices
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise WorldError(f"world must be a positive int or an autopar.World, not {world!r}.")
    return world


def _init_process_group(size: int, timeout: float | None) -> None:
    """Join the launcher's process group when torchrun started us and nobody did yet."""
    if size == 1 or not dist.is_available() or dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        bound = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
        if attempt is None or "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, **bound)
            return
        # torchrun keeps one store across restarts (--max-restarts): the keys a killed
        # attempt's ranks left there (their addresses) would be read by a rank that joins
        # before the others, so each attempt forms its group under its own prefix
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                              is_master=rank == 0 and not agent)
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                                rank=rank, world_size=size, **bound)


def rank_device(backend: str, environ=os.environ, device_count: int | None = None):
    """The device this rank computes on: under NCCL, its own GPU (LOCAL_RANK, which torchrun
    sets, else the global rank modulo the GPUs of this node); None under gloo, where the
    model stays where the user put it."""
    if backend != "nccl":
        return None
    count = torch.cuda.device_count() if device_count is None else device_count
    if count < 1:
        raise WorldError("the process group runs NCCL but this process sees no GPU; "
                         "initialise it with the gloo backend to train on the CPU.")
    if "LOCAL_RANK" in environ:
        local = int(environ["LOCAL_RANK"])
    else:
        local = int(environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0)) % count
    if local >= count:
        raise WorldError(f"LOCAL_RANK {local} but this process sees {count} GPU"
                         f"{'s' if count > 1 else ''}; start at most {count} processes per node "
                         "or widen CUDA_VISIBLE_DEVICES.")
    return torch.device("cuda", local)


def _place_on_rank_device(model: nn.Module, example_inputs: tuple) -> tuple:
    """Under NCCL, make this rank's GPU current and move the model (in place, unless it is
    on meta) and the example inputs onto it; nothing changes under gloo or on one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return example_inputs
    device = rank_device(dist.get_backend())
    if device is None:
        return example_inputs
    torch.cuda.set_device(device)
    # a meta model stays: each rank materializes only its own slices on `device`
    if not on_meta(model) and (any(p.device.type == "cpu" for p in model.parameters()) or
                               any(b.device.type == "cpu" for b in model.buffers())):
        model.to(device)
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in example_inputs)


def _check_process_group(size: int) -> None:
    """Refuse a world that differs from the running job before any planning or collective."""
    if size == 1 or not dist.is_available() or not dist.is_initialized():
        return
    job = dist.get_world_size()
    if job != size:
        raise WorldError(f"world={size} needs {size} processes but this job has {job}; launch "
                         f"with --nproc-per-node {size} or pass world={job}.")


def _search_plan(model, size: int, world, example_inputs, loss_fn,
                 precision: str = FP32, chunked_loss: bool = True,
                 fp8_recipe: str = ROWWISE) -> Plan:
    """plan=None: search among the modes the runtime executes (and say what was left out),
    timing the compute at `precision`'s rate (the planner's `dtype`, same names; fp32
    leaves it to the parameters' dtype, as before)."""
    from autopar.search.planner import plan as make_plan

    if not isinstance(world, World):
        world = World(devices=size, per_node=int(os.environ.get("LOCAL_WORLD_SIZE", size)),
                      device=local_device())
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else \
        (example_inputs,)
    if on_meta(model):  # planning reads shapes only
        inputs = tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)
    # contiguous, as the engine traces its training graph (zeros shaped like the batch), so
    # that trace is the planner's copy from the trace cache (a strided view such as
    # `data[:, :-1]` keyed another graph: a third export at the first step)
    inputs = tuple(t.contiguous() if isinstance(t, torch.Tensor) else t for t in inputs)
    target = None
    if loss_fn is not None:
        with torch.no_grad():
            target = _example_target(model(*inputs), loss_fn)
    dtype = None if precision == FP32 else precision
    if precision == FP8 and FP8 not in world.profile.peak_flops:  # (a CPU's profile)
        dtype = BF16
    chosen = _rank_zeros_plan(make_plan, model, inputs, world,
                              loss_fn=loss_fn if target is not None else None,
                              example_target=target, executable=True, top=3, dtype=dtype,
                              chunked_loss=chunked_loss, fp8_recipe=fp8_recipe)
    if dtype != precision and precision == FP8:
        chosen.notes.append(f"fp8: the '{world.device}' profile has no fp8 peak, so the "
                            "search priced the GEMMs at bf16's rate")
    chosen.notes.extend(f"left out: {n}" for n in chosen.search.get("left_out", []))
    return chosen


def _rank_zeros_plan(make_plan, *args, **kwargs) -> Plan:
    """Global rank 0's search, sent to every rank (`on_rank_zero`): every rank would search
    the same model, world and inputs (check_ranks_agree then compares what they traced). The
    search draws nothing from the random state a meta start initializes from."""
    def search():
        with torch.random.fork_rng(devices=[]):
            return make_plan(*args, **kwargs)

    return on_rank_zero("plan search", search)


def _example_target(out, loss_fn):
    """A target the loss accepts, for tracing: class indices over the output's last dim
    (cross-entropy), else a tensor shaped like the output (regression losses)."""
    logits = _main_output(out)
    if logits is None or logits.dim() == 0:
        raise PlanError(f"plan=None guesses a target from the model's output, but the output "
                        f"is {type(out).__name__} with no batched tensor in it; pass a plan.")
    for target in (torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device),
                   torch.zeros_like(logits)):
        try:
            with warnings.catch_warnings():  # a loss that broadcasts a wrong guess warns
                warnings.simplefilter("error")
                loss_fn(out, target)
            return target
        except Exception:  # noqa: BLE001 - any failure: try the next guess
            continue
    raise PlanError("cannot make an example target for loss_fn (tried class indices and a "
                    "tensor shaped like the output); pass a plan instead of plan=None.")


def _main_output(out):
    """The tensor a loss most likely reads: `logits` of a ModelOutput or dict, else the
    first tensor of a dict, tuple or list, else the output itself."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(getattr(out, "logits", None), torch.Tensor):
        return out.logits
    values = list(out.values()) if isinstance(out, dict) else \
        list(out) if isinstance(out, (tuple, list)) else []
    if isinstance(out, dict) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _resolve_plan(plan, size: int, world) -> Plan:
    if isinstance(plan, Plan):
        chosen = plan
    elif isinstance(plan, (str, os.PathLike)):
        chosen = Plan.load(plan)
    elif isinstance(plan, dict):
        chosen = Plan.from_dict(plan, size)
    else:
        raise PlanError(f"plan must be None, a Plan, a path or a dict, not {type(plan).__name__}.")
    if chosen.world_size != size:
        raise PlanError(f"the plan's mesh {chosen.mesh} needs {chosen.world_size} devices but the "
                        f"world has {size}.")
    return chosen
