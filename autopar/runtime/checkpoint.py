"""Sharded checkpoints of an engine with torch.distributed.checkpoint (DCP), loadable under
any plan or world: each rank writes the boxes of the whole tensors it holds (tensor slices,
ZeRO pieces) under the original model's names; `latest` moves only after a complete save,
and loading runs no code from the files (`safe_metadata`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from autopar.errors import CheckpointError, PlanError
from autopar.json_file import read_json
from autopar.modes import PP
from autopar.runtime.agree import agree_with_rank_zero, process_rank
from autopar.runtime.regions import (
    Region,
    expert_runs,
    piece_region,
    slice_region,
    slice_runs,
    whole_shape,
)
from autopar.runtime.safe_metadata import METADATA, SafeReader, read_metadata
from autopar.runtime.zero_state import ZeroState

FORMAT = "autopar-dcp"
VERSION = 1
META = "autopar.json"
LATEST = "latest"
WEIGHT, STATE, SCALAR, VALUE = "model/", "optim/", "optim.scalar/", "optim.value/"
_STEP_DIR = re.compile(r"^step-(\d+)(?:-(\d+))?$")
_TMP_PREFIX = ".tmp-"


# ---------------------------------------------------------------------- planners
class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner (deduplication of replicas, global metadata, validation that
    the chunks tile every tensor) fed with each rank's boxes."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, region in self.state_dict.items():
            for i, (offsets, view) in enumerate(region.boxes):
                items.append(WriteItem(
                    index=MetadataIndex(fqn, offsets, i), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                   sizes=view.size()),
                        properties=TensorProperties.create_from_tensor(view),
                        size=torch.Size(region.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.state_dict[index.fqn].find(index)


class _LoadPlanner(DefaultLoadPlanner):
    """Each rank reads the overlaps of its boxes with the stored chunks (DCP resharding)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, region in self.state_dict.items():
            if region.boxes:
                items += create_read_items_for_chunk_list(
                    fqn, self.metadata.state_dict_metadata[fqn], region.chunks())
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].find(index)

    def load_bytes(self, read_item, value) -> None:
        """Never reached (the metadata reader admits only tensors); DCP's default would
        unpickle the bytes with code execution allowed."""
        raise CheckpointError(f"the checkpoint holds {read_item.dest_index.fqn} as pickled "
                              "bytes, which autopar never writes; load a checkpoint that "
                              "engine.save wrote.")


# ---------------------------------------------------------------------- the engine's tensors
def _geometry(engine, local: torch.Tensor):
    """(runs, whole shape) of a local slice of the engine."""
    params = engine.params
    layout = params.layout_of(local)
    shape = whole_shape(_local_shape(engine, local), layout, params.mesh)
    if not params.is_expert(local):
        return slice_runs(layout, params.mesh, params.coords, shape), shape
    # a stacked expert weight: this ep rank's block of experts of its tensor slice
    ep = params.ep
    shape = (shape[0] * ep.size,) + tuple(shape[1:])
    return expert_runs(slice_runs(layout, params.mesh, params.coords, shape), ep.size, ep.rank), \
        shape


def _local_shape(engine, local: torch.Tensor) -> tuple[int, ...]:
    """A local slice's shape, also while ZeRO-3 keeps only its pieces (and has emptied
    the whole parameter)."""
    shape = _zero(engine).local_shape(local) if engine.zero is not None else None
    return tuple(local.shape) if shape is None else shape


def _zero(engine) -> ZeroState:
    """The engine's ZeRO state, recognised by its interface (runtime.zero_state)."""
    zero = engine.zero
    if not isinstance(zero, ZeroState):
        raise CheckpointError(f"the engine's ZeRO state is a {type(zero).__name__}, not a "
                              "runtime.zero_state.ZeroState; build the engine with "
                              "autopar.parallelize.")
    return zero


def _pieces(engine) -> dict[int, tuple[torch.Tensor, int]]:
    """id(local parameter) -> (this rank's ZeRO piece of it, the piece's first flat
    position in the slice), when ZeRO shards the optimizer (an expert's piece is cut over
    its expert-data group, the rest's over dp)."""
    return _zero(engine).pieces() if engine.zero is not None else {}


def _optimizer_params(engine) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(optimizer parameter, the local parameter it is or is a ZeRO piece of) for every
    parameter this rank's optimizer steps (under a pipeline: its stages')."""
    if engine.optimizer is None:
        return []
    owner = _zero(engine).owners() if engine.zero is not None else {}
    trained = {id(p) for p in engine.grads.trained()}
    out = []
    for group in engine.optimizer.param_groups:
        for q in group["params"]:
            local = owner.get(id(q), q)
            if id(local) in trained and engine.params.holds(local):
                out.append((q, local))
    return out


def _state_region(engine, opt_param, local, tensor, pieces) -> Region:
    """The region of `tensor`, shaped like `opt_param` (a local slice or a ZeRO piece)."""
    runs, shape = _geometry(engine, local)
    if id(local) in pieces and pieces[id(local)][0] is opt_param:
        return piece_region(tensor, pieces[id(local)][1], _local_shape(engine, local), runs,
                             shape)
    return slice_region(tensor, runs, shape)


def _save_state(engine) -> dict[str, Region]:
    """fqn -> this rank's region for everything a checkpoint holds."""
    out: dict[str, Region] = {}
    pieces = _pieces(engine)
    trained = {id(p) for p in engine.grads.trained()} if engine.pipeline is not None \
        else None
    for names, local, _ in engine.params.entries():
        fqn = WEIGHT + names[0]
        if trained is not None and isinstance(local, nn.Parameter) and local.requires_grad \
                and id(local) not in trained:
            continue  # another pipeline rank trains it and writes it
        runs, shape = _geometry(engine, local)
        if id(local) in pieces:  # ZeRO: from the pieces, never the whole parameter
            piece, start = pieces[id(local)]
            out[fqn] = piece_region(piece.detach(), start, _local_shape(engine, local), runs,
                                     shape)
        else:
            out[fqn] = slice_region(local.detach(), runs, shape)
    for name, value in engine.params.untraced.items():
        out[WEIGHT + name] = slice_region(value, [[(0, n)] for n in value.shape],
                                           tuple(value.shape))
    held = engine.held_optimizer
    if held is not None:  # loaded, not yet handed to a pipeline's optimizer: as loaded
        for local, state in held[0].values():
            _state_entries(engine, local, local, state, pieces, out)
    else:
        for q, local in _optimizer_params(engine):
            _state_entries(engine, q, local, engine.optimizer.state.get(q, {}), pieces, out)
    return out


def _state_entries(engine, q, local, state: dict, pieces, out: dict) -> None:
    """The regions of one optimizer parameter's state (`q`: `local` or a ZeRO piece of it)
    by kind: shaped like `q` (sharded as it), a 0-dim tensor, or a Python number."""
    name = engine.params.name_of(local)
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.shape == q.shape:
            out[f"{STATE}{name}/{k}"] = _state_region(engine, q, local, v.detach(), pieces)
        elif isinstance(v, torch.Tensor) and v.dim() == 0:
            out[f"{SCALAR}{name}/{k}"] = Region((), [((), v.detach())])
        elif isinstance(v, (bool, int, float)):
            t = torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else torch.int64)
            out[f"{VALUE}{name}/{k}"] = Region((), [((), t)])
        else:
            raise PlanError(f"the optimizer state {k!r} of {name} is a {type(v).__name__} "
                            "that is neither shaped like its parameter nor a scalar, which "
                            "a checkpoint cannot reshard.")


# ---------------------------------------------------------------------- directories
def _is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA)) and \
        os.path.isfile(os.path.join(path, META))


def _published(root: str) -> list[str]:
    """Complete checkpoint directories under root in the order they were saved (autopar.json's
    time, then step and suffix): after a load of an older step, the new branch is newest."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _STEP_DIR.match(name)
        if m and _is_complete(os.path.join(root, name)):
            try:  # an unreadable record orders first: it is never chosen over a good one
                meta = read_json(os.path.join(root, name, META), "checkpoint record",
                                 CheckpointError, "save the checkpoint again")
                saved_at = float(meta.get("saved_at", 0.0))
            except (CheckpointError, ValueError, TypeError, AttributeError):
                saved_at = 0.0
            found.append(((saved_at, int(m.group(1)), int(m.group(2) or 0)), name))
    return [name for _, name in sorted(found)]


def resolve(path) -> str:
    """The checkpoint directory `path` names: itself when it is one, else the one its
    `latest` pointer names (or, without a pointer, its newest complete one)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise PlanError(f"there is no checkpoint directory {path}; pass a directory "
                        "engine.save wrote.")
    if _is_complete(path):
        return path
    pointer = os.path.join(path, LATEST)
    if os.path.isfile(pointer):
        try:
            with open(pointer, "rb") as f:
                name = f.read(256).decode("utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"the checkpoint pointer {pointer} could not be read ({e}); "
                                  "remove it to load the newest complete checkpoint.") from e
        if _STEP_DIR.match(name) and _is_complete(os.path.join(path, name)):
            return os.path.join(path, name)
    published = _published(path)
    if not published:
        raise PlanError(f"{path} holds no complete checkpoint (no `latest` pointer and no "
                        "step-* directory with DCP metadata and autopar.json); pass a "
                        "directory engine.save wrote.")
    return os.path.join(path, published[-1])


def latest(root) -> str | None:
    """The checkpoint a job resuming from directory `root` starts from, or None when it
    holds none (a fresh start); only complete, published checkpoints count."""
    root = os.fspath(root)
    if not os.path.isdir(root) or not (os.path.isfile(os.path.join(root, LATEST))
                                       or _published(root)):
        return None
    return resolve(root)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def _publish(root: str, tmp: str, step: int, meta: dict, keep: int) -> str:
    """Rank 0: make the written temporary directory a checkpoint, point `latest` at it,
    then drop checkpoints beyond the newest `keep`."""
    meta_path = os.path.join(tmp, META)
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    name, n = f"step-{step:08d}", 0
    while os.path.exists(os.path.join(root, name)):  # never replace a checkpoint
        n += 1
        name = f"step-{step:08d}-{n}"
    os.replace(tmp, os.path.join(root, name))
    fsync_dir(root)
    _write_atomic(os.path.join(root, LATEST), name + "\n")
    published = _published(root)
    for old in published[:max(0, len(published) - keep)]:
        if old != name:
            shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return os.path.join(root, name)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _single() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _dcp(call, state: dict, what: str, no_dist: bool = False, tail: str = "",
         **kwargs) -> None:
    """dcp.save or dcp.load; one process (no process group, or `no_dist`) says so without
    DCP's warning that it assumes so. DCP's failure (a BaseException, raised on every
    rank) becomes a CheckpointError naming the ranks and the first cause."""
    no_dist = no_dist or _single()
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            call(state, no_dist=no_dist, **kwargs)
        except CheckpointException as e:
            ranks = sorted(e.failures)
            cause = e.failures[ranks[0]][0] if ranks else e
            on = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            if isinstance(cause, CheckpointError):  # already names the file and the fix
                raise CheckpointError(f"{str(cause).rstrip('.')} (on {on}).") from e
            raise CheckpointError(f"{what} failed on {on} ({type(cause).__name__}: "
                                  f"{cause}){tail}.") from e


# ---------------------------------------------------------------------- save / load
@dataclass
class Checkpointing:
    """Where and how often an engine saves by itself (parallelize's checkpoint_dir), and the
    background save in flight with the process group its collectives run in."""

    directory: str | None = None
    every: int = 1
    asynchronous: bool = True
    keep: int = 2
    pending: AsyncSave | None = None
    group: object | None = None  # made at the first background save, kept

    def due(self, step: int) -> bool:
        return self.directory is not None and step % self.every == 0


class AsyncSave:
    """A checkpoint being written in the background from host copies of the state (staged
    when `save(..., asynchronous=True)` returned); `wait()` joins it and returns the
    published directory, or raises what stopped it (`latest` then still names the last
    complete checkpoint)."""

    def __init__(self, write, step: int):
        self.step = step
        self.staged_s = 0.0  # how long the staging took (what the step waited for)
        self._result: str | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(write,), daemon=True,
                                        name=f"autopar-checkpoint-{step}")
        self._thread.start()

    def _run(self, write) -> None:
        try:
            self._result = write()
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def _staged(state: dict) -> dict:
    """Host copies of every box (pinned on a GPU's host, so the copies run at DMA speed):
    the step may change the live tensors while the copies are written."""
    out = {}
    for fqn, region in state.items():
        boxes = []
        for offsets, view in region.boxes:
            host = torch.empty(view.shape, dtype=view.dtype, device="cpu",
                               pin_memory=view.device.type == "cuda")
            host.copy_(view, non_blocking=view.device.type == "cuda")
            boxes.append((offsets, host))
        out[fqn] = Region(region.shape, boxes)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out


def checkpoint_group(engine):
    """The process group a background save's collectives run in (its own, made once per
    engine with gloo: the training's collectives go on meanwhile in theirs). None on one
    process."""
    if not _distributed():
        return None
    if engine.checkpointing.group is None:  # every rank is here: saves are collective
        engine.checkpointing.group = dist.new_group(backend="gloo")
    return engine.checkpointing.group


def save(engine, path, keep: int = 2, asynchronous: bool = False) -> str | AsyncSave:
    """Write a checkpoint of `engine` under the directory `path` (made if missing) and
    return the published checkpoint's directory; a collective: every rank calls it.

    `asynchronous`: return once the state is staged in host memory, and write it in a
    background thread (an AsyncSave; `engine.wait_for_checkpoint()` joins it). At most one
    is in flight: a save first joins the one before it."""
    if keep < 1:
        raise PlanError(f"keep must be at least 1 checkpoint, not {keep}.")
    engine.wait_for_checkpoint()  # never two in flight; its leftovers are its own
    root = os.path.abspath(os.fspath(path))
    engine.fetch_pipeline_weights()  # a pipeline rank fetches the weights it released
    step = int(engine.steps)
    tmp = os.path.join(root, f"{_TMP_PREFIX}step-{step:08d}")
    error = None
    if process_rank() == 0:  # leftovers of crashed saves go; nobody writes into them now
        try:
            os.makedirs(root, exist_ok=True)
            for name in os.listdir(root):
                if name.startswith(_TMP_PREFIX):
                    shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = str(e)
    agree_with_rank_zero(error)
    state = _save_state(engine)
    if not asynchronous:
        return _write(state, tmp, root, step, _metadata(engine, state), keep)
    started = time.perf_counter()
    group = checkpoint_group(engine)
    staged, meta = _staged(state), _metadata(engine, state)
    handle = AsyncSave(lambda: _write(staged, tmp, root, step, meta, keep, group), step)
    handle.staged_s = time.perf_counter() - started
    engine.checkpointing.pending = handle
    return handle


def _write(state: dict, tmp: str, root: str, step: int, meta: dict, keep: int,
           group=None) -> str:
    """Every rank writes its boxes into `tmp`; rank 0 publishes it (collectives in `group`,
    the default group when None)."""
    _dcp(dcp.save, state, f"writing the checkpoint of step {step} into {tmp}",
         tail="; `latest` still names the last complete checkpoint",
         storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), planner=_SavePlanner(),
         process_group=group)
    published, error = None, None
    if process_rank() == 0:
        try:
            published = _publish(root, tmp, step, meta, keep)
        except OSError as e:
            error = str(e)
    agree_with_rank_zero(error, group)
    return published or resolve(root)


def _metadata(engine, state: dict) -> dict:
    """autopar.json: what a person (and load_full_state_dict) needs beside DCP's files."""
    groups = []
    if engine.optimizer is not None:
        for group in engine.optimizer.param_groups:
            groups.append({k: list(v) if isinstance(v, tuple) else v
                           for k, v in group.items() if k != "params"
                           and isinstance(v, (bool, int, float, str, tuple, type(None)))})
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return {"format": FORMAT, "version": VERSION, "step": int(engine.steps), "world": world,
            "plan": engine.plan.to_json(), "saved_at": time.time(),
            "names": {names[0]: list(names) for names, _, _ in engine.params.entries()},
            "state_keys": list(engine.params.state_keys), "param_groups": groups,
            "loss_scaler": _scaler_state(engine)}


def _scaler_state(engine) -> dict | None:
    """fp16's loss scaler (the same on every rank): kept so a resumed run goes on at the
    scale it reached instead of overflowing its way down from the initial one."""
    return engine.scaler.state_dict() if engine.scaler is not None else None


def _read(path) -> tuple[str, dict, SafeReader]:
    """(checkpoint directory, its autopar.json, a DCP reader of its checked metadata):
    every file read as data (JSON, and DCP's pickle through `safe_metadata`)."""
    ckpt = resolve(path)
    meta_path = os.path.join(ckpt, META)
    meta = read_json(meta_path, "checkpoint record", CheckpointError,
                     "save the checkpoint again or load an earlier one")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{ckpt} is not an autopar checkpoint ({meta_path} has format "
                              f"{got!r}); write it with engine.save.")
    _check_record(meta, meta_path)
    return ckpt, meta, SafeReader(ckpt, read_metadata(ckpt))


def _check_record(meta: dict, path: str) -> None:
    """The fields of autopar.json that loading uses have the types engine.save writes."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    groups = meta.get("param_groups") or []
    scaler = meta.get("loss_scaler")
    checks = {
        "step": isinstance(meta.get("step"), int) and not isinstance(meta["step"], bool)
        and meta["step"] >= 0,
        "names": isinstance(meta.get("names", {}), dict) and all(
            isinstance(v, list) and all(isinstance(n, str) for n in v)
            for v in meta.get("names", {}).values()),
        "state_keys": isinstance(meta.get("state_keys", []), list)
        and all(isinstance(k, str) for k in meta.get("state_keys", [])),
        "param_groups": isinstance(groups, list) and all(
            isinstance(g, dict) and all(
                v is None or isinstance(v, (bool, int, float, str))
                or (isinstance(v, list) and all(number(x) for x in v)) for v in g.values())
            for g in groups),
        "loss_scaler": scaler is None or (isinstance(scaler, dict) and all(
            number(scaler.get(k)) for k in ("scale", "good_steps", "skipped_steps")))}
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise CheckpointError(f"the checkpoint record {path} has a malformed {bad[0]!r} "
                              "(not what engine.save writes); save the checkpoint again or "
                              "load an earlier one.")


def load(engine, path) -> str:
    """Load weights, optimizer state and step into `engine` from the checkpoint `path` names,
    whatever plan and world wrote it (a collective). A pipeline rank loaded before it built
    its optimizer holds the state (`engine.held_optimizer`) until it does."""
    ckpt, meta, reader = _read(path)
    stored = reader.read_metadata().state_dict_metadata
    engine.fetch_pipeline_weights()  # every slice held again, to be overwritten
    targets = _weight_targets(engine, stored)
    hold = engine.plan.mesh[PP] > 1 and engine.pipeline is None
    pairs = [(p, p) for p in engine.params.parameters() if p.requires_grad] if hold else \
        _optimizer_params(engine)
    fill = _optimizer_targets(engine, stored, targets, pairs)
    _dcp(dcp.load, targets, f"reading the checkpoint {ckpt}", storage_reader=reader,
         planner=_LoadPlanner())
    groups = meta.get("param_groups") or []
    engine.take_held_optimizer()
    if hold:
        engine.hold_optimizer(({id(local): (local, _values(state)) for local, state in fill},
                               groups))
    else:
        _restore(engine.optimizer,
                 [(q, _values(state)) for (q, _), (_, state) in zip(pairs, fill)], groups)
    # (a bf16/fp32 checkpoint has no loss scaler)
    engine.restore_progress(int(meta["step"]), meta.get("loss_scaler"))
    return ckpt


def adopt_held_optimizer(engine, held) -> None:
    """Give the optimizer a pipeline rank has just built the state `load` held (`held`,
    taken from the engine): each parameter's slice state, cut to this rank's ZeRO piece
    where ZeRO shards it."""
    if held is None or engine.optimizer is None:
        return
    states, groups = held
    pieces = _pieces(engine)
    fill = []
    for q, local in _optimizer_params(engine):
        _, state = states.get(id(local), (None, {}))
        if id(local) in pieces and pieces[id(local)][0] is q:
            start = pieces[id(local)][1]
            state = {k: v.reshape(-1)[start:start + q.numel()].clone()
                     if isinstance(v, torch.Tensor) and v.shape == local.shape else v
                     for k, v in state.items()}
        fill.append((q, state))
    _restore(engine.optimizer, fill, groups)


def _restore(optimizer, fill: list, groups: list) -> None:
    """Put loaded state in place: `fill` is (optimizer parameter, {key: value}); the
    saved hyperparameters (lr, betas, ...; a scheduler may have moved them) too."""
    if optimizer is None:
        return
    for q, state in fill:
        optimizer.state.pop(q, None)
        if state:
            optimizer.state[q] = dict(state)
    if len(groups) == len(optimizer.param_groups):
        for group, values in zip(optimizer.param_groups, groups):
            for k, v in values.items():
                if k in group:
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v


def _weight_targets(engine, stored: dict) -> dict[str, Region]:
    """fqn -> the region of this rank's tensor each weight is read into; refuses a
    checkpoint whose weights' names or shapes differ from the model's."""
    targets: dict[str, Region] = {}
    pieces = _pieces(engine)
    wanted = set()
    for names, local, _ in engine.params.entries():
        fqn = next((WEIGHT + n for n in names if WEIGHT + n in stored), None)
        if fqn is None:
            raise PlanError(f"the checkpoint has no weight {names[0]}, which the model has; "
                            "load a checkpoint of this model.")
        wanted.add(fqn)
        runs, shape = _geometry(engine, local)
        _check_shape(fqn[len(WEIGHT):], stored[fqn], shape)
        whole = tuple(local.shape) == _local_shape(engine, local) and _holds_whole(local)
        region = slice_region(local.data, runs, shape) if whole else Region(shape, [])
        if id(local) in pieces:
            piece, start = pieces[id(local)]
            if not _aliases(piece, local):  # pieces of their own (ZeRO-3): filled too
                extra = piece_region(piece.data, start, _local_shape(engine, local), runs,
                                      shape)
                region = Region(shape, region.boxes + extra.boxes)
        targets[fqn] = region
    for name, value in engine.params.untraced.items():
        fqn = WEIGHT + name
        if fqn not in stored:
            raise PlanError(f"the checkpoint has no weight {name}, which the model has; "
                            "load a checkpoint of this model.")
        wanted.add(fqn)
        _check_shape(name, stored[fqn], tuple(value.shape))
        targets[fqn] = slice_region(value, [[(0, n)] for n in value.shape],
                                     tuple(value.shape))
    extra = sorted(k for k in stored if k.startswith(WEIGHT) and k not in wanted)
    if extra:
        raise PlanError(f"the checkpoint holds {extra[0][len(WEIGHT):]}, which the model does "
                        "not have; load a checkpoint of this model.")
    return targets


def _check_shape(what: str, md, shape) -> None:
    if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(shape):
        got = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "not a tensor"
        raise PlanError(f"the checkpoint's {what} has shape {got} but the model's has "
                        f"{tuple(shape)}; load a checkpoint of this model.")


def _holds_whole(t: torch.Tensor) -> bool:
    """Whether a local parameter's storage holds its values (ZeRO-3 frees it)."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def _aliases(piece: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether a ZeRO piece is a view of its whole parameter (stages 1 and 2)."""
    return piece.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def _optimizer_targets(engine, stored: dict, targets: dict, pairs: list) -> list:
    """Add to `targets` the regions each (optimizer parameter, local parameter) pair's state
    is read into (new tensors shaped like the optimizer parameter); returns (local parameter,
    {key: (kind, tensor)}) per pair, filled once DCP has read."""
    by_name: dict[str, list] = {}
    for fqn in stored:
        for kind in (STATE, SCALAR, VALUE):
            if fqn.startswith(kind):
                name, key = fqn[len(kind):].split("/", 1)
                by_name.setdefault(name, []).append((kind, key, fqn))
    pieces = _pieces(engine)
    fill = []
    for q, local in pairs:
        names = engine.params.names_of(local)
        state = {}
        for kind, key, fqn in next((by_name[n] for n in names if n in by_name), []):
            md = stored[fqn]
            if kind == STATE:
                _check_shape(f"{names[0]} state {key!r}", md, _geometry(engine, local)[1])
                t = torch.empty(q.shape, dtype=md.properties.dtype, device=q.device)
                targets[fqn] = _state_region(engine, q, local, t, pieces)
            else:
                t = torch.empty((), dtype=md.properties.dtype)
                targets[fqn] = Region((), [((), t)])
            state[key] = (kind, t)
        fill.append((local, state))
    return fill


def _values(state: dict) -> dict:
    """A state read by DCP as the optimizer holds it: Python numbers back from 0-dim."""
    return {k: t.item() if kind == VALUE else t for k, (kind, t) in state.items()}


def load_full_state_dict(path) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint as the original model's state_dict (every name of a tied
    weight, in the model's order), read in this one process: no process group needed."""
    ckpt, meta, reader = _read(path)
    whole = _read_whole(ckpt, reader, (WEIGHT,))
    out = {}
    for fqn, value in whole.items():
        name = fqn[len(WEIGHT):]
        for alias in meta.get("names", {}).get(name, [name]):
            out[alias] = value
    order = [k for k in meta.get("state_keys", []) if k in out]
    return {k: out[k] for k in order + sorted(set(out) - set(order))}


def load_full_optimizer_state(path) -> dict[str, dict]:
    """The optimizer state of a checkpoint as whole tensors, per parameter name (the first
    of a tied weight's names) and state key, read in this one process: what one device's
    optimizer would hold for the whole model, to inspect or compare."""
    ckpt, _, reader = _read(path)
    whole = _read_whole(ckpt, reader, (STATE, SCALAR, VALUE))
    out: dict[str, dict] = {}
    for fqn, value in sorted(whole.items()):
        kind = next(k for k in (STATE, SCALAR, VALUE) if fqn.startswith(k))
        name, key = fqn[len(kind):].split("/", 1)
        out.setdefault(name, {})[key] = value.item() if kind == VALUE else value
    return out


def read_weight_boxes(path, boxes: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]) \
        -> None:
    """Fill tensors with boxes of a checkpoint's weights, in this one process: `boxes` maps a
    stored weight's name to (offsets in the whole tensor, tensor to fill) pairs; only the
    stored chunks they overlap are read."""
    ckpt, _, reader = _read(path)
    stored = reader.read_metadata().state_dict_metadata
    regions = {WEIGHT + name: Region(tuple(stored[WEIGHT + name].size), list(pairs))
               for name, pairs in boxes.items()}
    _dcp(dcp.load, regions, f"reading the checkpoint {ckpt}", no_dist=True,
         storage_reader=reader, planner=_LoadPlanner())


def _read_whole(ckpt: str, reader: SafeReader, kinds: tuple[str, ...]) -> dict:
    """fqn -> the whole stored tensor, for the entries whose names start with `kinds`,
    read in this one process through autopar's planner (tensors only)."""
    stored = reader.read_metadata().state_dict_metadata
    whole = {fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for fqn, md in stored.items() if fqn.startswith(kinds)}
    regions = {fqn: slice_region(t, [[(0, n)] for n in t.shape], tuple(t.shape))
               for fqn, t in whole.items()}
    _dcp(dcp.load, regions, f"reading the checkpoint {ckpt}", no_dist=True,
         storage_reader=reader, planner=_LoadPlanner())
    return whole
