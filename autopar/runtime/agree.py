"""Ranks agree or stop: plan, model, weights and batch compared across ranks with one small
all-gather, so a mismatch is an error, not a deadlock or a silent mixture."""

from __future__ import annotations

import copy
import hashlib
import json
import pickle

import torch
import torch.distributed as dist

from autopar.errors import AutoparError, BatchError, CheckpointError, PlanError, WorldError
from autopar.kernels.collectives import broadcast_object, exchange_objects

_SAMPLES = 64  # values per parameter or batch tensor read into a fingerprint


def _running() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _hash(parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def _sample(t: torch.Tensor) -> torch.Tensor:
    """Up to _SAMPLES values spread over `t`, exactly as stored (float64 holds every
    16- and 32-bit value and every id), for a fingerprint that reads no arithmetic."""
    flat = t.detach().reshape(-1)
    step = max(1, flat.numel() // _SAMPLES)
    return flat[::step][:_SAMPLES].to(torch.float64)


def _samples_bytes(tensors) -> bytes:
    picked = [_sample(t) for t in tensors if t.device.type != "meta" and t.numel()]
    if not picked:
        return b""
    return torch.cat(picked).cpu().numpy().tobytes()  # one transfer from a GPU


def _shape_text(shape, seen: dict) -> str:
    """str(shape), from `seen` when an equal shape of the same element types was printed."""
    if not isinstance(shape, tuple):
        return str(shape)
    key = (shape, tuple(map(type, shape)))
    if key not in seen:
        seen[key] = str(shape)
    return seen[key]


def plan_digests(plan, traced, example_inputs) -> dict[str, str]:
    """Short digests of what every rank must share at `parallelize`: the plan, the traced
    graph, the parameters' names and shapes, their values (sampled), and the example
    inputs' shapes past the batch dimension (the batch itself may differ)."""
    data = plan.to_json()
    essential = {k: data[k] for k in ("mesh", "tensor", "sequence", "layers", "pipeline",
                                      "zero", "recompute")}
    shapes: dict = {}  # a shape's text, printed once per distinct shape (sympy prints slowly)
    graph = [(n.op, str(n.target), _shape_text(getattr(n.meta.get("autopar"), "shape", ""),
                                               shapes)) for n in traced.graph.nodes]
    params = sorted((p.names, tuple(p.shape), str(p.dtype)) for p in traced.params.values())
    values = _samples_bytes([getattr_path(traced.gm, t) for t in sorted(traced.params)])
    inputs = [(tuple(t.shape[1:]), str(t.dtype)) for t in example_inputs]
    return {"plan": _hash([json.dumps(essential, sort_keys=True)]), "graph": _hash(graph),
            "parameter shapes": _hash(params), "initial weights": _hash([values]),
            "example input shapes": _hash(inputs)}


_FIX = {"plan": "pass the same plan on every rank (plan=None searches the same one everywhere)",
        "graph": "build the same model on every rank",
        "parameter shapes": "build the same model, with the same configuration, on every rank",
        "initial weights": "seed torch alike on every rank before building the model "
                           "(torch.manual_seed(0)), or load the same weights everywhere",
        "example input shapes": "pass example inputs of the same shape and dtype on every rank"}


def check_ranks_agree(plan, traced, example_inputs, failure: BaseException | None = None) -> None:
    """Refuse, on every rank at once, a job where some rank failed to make its plan
    (`failure`: this rank's error), or whose ranks differ in plan, model, weights or example
    inputs, naming the ranks that differ from rank 0 and what differs."""
    if not _running():
        if failure is not None:
            raise failure
        return
    mine = {"error": f"{type(failure).__name__}: {failure}"} if failure is not None else \
        plan_digests(plan, traced, example_inputs)
    every = exchange_objects(mine)
    if failure is not None:
        raise failure
    failed = [(r, d["error"]) for r, d in enumerate(every) if "error" in d]
    if failed:
        rank, error = failed[0]
        raise WorldError(f"rank {rank} could not set up parallelize ({error.rstrip('.')}), so "
                         "this rank stops too; fix that rank's arguments (every rank should "
                         "pass the same ones).")
    for what in mine:
        odd = [r for r, d in enumerate(every) if d[what] != every[0][what]]
        if odd:
            ranks = ", ".join(map(str, odd))
            raise WorldError(f"rank 0 and rank{'s' if len(odd) > 1 else ''} {ranks} disagree "
                             f"on the {what} at parallelize; {_FIX[what]}.")


def batch_fingerprint(tensors) -> torch.Tensor:
    """Four int64 words hashing the batch's shapes, dtypes and sampled values."""
    parts = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else type(t).__name__
             for t in tensors]
    values = _samples_bytes([t for t in tensors if isinstance(t, torch.Tensor)])
    digest = hashlib.sha256(repr(parts).encode() + values).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.int64).clone()


def check_same_batch(tensors, step: int) -> None:
    """Refuse, on every rank at once, a train_step whose batch differs across ranks."""
    if not _running():
        return
    every = exchange_objects(tuple(batch_fingerprint(tensors).tolist()))
    odd = [r for r, f in enumerate(every) if f != every[0]]
    if odd:
        ranks = ", ".join(map(str, odd))
        raise BatchError(f"train_step {step} got a different batch on rank"
                         f"{'s' if len(odd) > 1 else ''} {ranks} than on rank 0, but it takes "
                         "the global batch, the same on every rank (autopar gives each "
                         "data-parallel rank its slice): feed every rank the same batches, e.g. "
                         "a loader seeded alike everywhere (docs/parallelize.md, 'Feeding data'), instead of "
                         "a DistributedSampler.")


def getattr_path(module, target: str):
    obj = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def process_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def on_rank_zero(what: str, compute, *args, **kwargs):
    """`compute(*args, **kwargs)` on global rank 0 alone, its answer sent to every rank
    (control traffic), for work every rank would do alike (a plan search, a stage split):
    one pays for it and the others wait. Rank 0's error is every rank's: rank 0 raises its
    own, the others autopar's error as it was raised (its type and words), any other as a
    PlanError naming it and `what` failed, so no rank hangs waiting for the others."""
    answer, error = None, None
    if process_rank() == 0:
        try:
            answer = compute(*args, **kwargs)
        except Exception as failed:  # noqa: BLE001 - every rank raises what rank 0 met
            error = failed
    answer, sent = broadcast_object((answer, _portable(what, error)), src=0)
    if error is not None:
        raise error
    if sent is not None:
        raise sent
    return answer


def _portable(what: str, error: Exception | None) -> Exception | None:
    """The error the other ranks raise for rank 0's `error`."""
    if error is None:
        return None
    if isinstance(error, AutoparError):
        try:
            pickle.dumps(error)  # its state travels,
            copy.copy(error)  # and its reduce protocol rebuilds it, as the receivers do
            return error
        except Exception:  # noqa: BLE001 - an error whose state does not travel
            pass
    return PlanError(f"rank 0's {what} failed ({type(error).__name__}: {error}).")


def agree_with_rank_zero(error: str | None, group=None) -> None:
    """Rank 0's outcome on every rank (a barrier that also carries rank 0's error)."""
    error = broadcast_object(error, src=0, group=group)
    if error is not None:
        raise CheckpointError(f"rank 0 could not prepare or publish the checkpoint ({error}); "
                              "the last complete one, which `latest` names, is untouched.")
