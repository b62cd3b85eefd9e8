"""The batches an engine is handed: checked against what its graphs were traced for, then
cut to this rank's part (its data-parallel slice, its tokens under cp)."""

from __future__ import annotations

import torch

from autopar.errors import BatchError, PlanError
from autopar.kernels.multid import check_index_range
from autopar.kernels.sequence import cut_sequence
from autopar.modes import TP_2D, TP_3D, TP_25D
from autopar.plans.checks import embedding_lookups
from autopar.runtime.agree import check_same_batch
from autopar.sharding.solve import tokens_per_sample

_BATCH_SPLIT_AXIS = {TP_2D: "tp_i", TP_25D: "tp_ki", TP_3D: "tp_ba"}


def kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return "a 0-dimensional tensor" if value.dim() == 0 else "a tensor"
    return "None" if value is None else f"a {type(value).__name__}"


def shape_text(shape_or_tensor) -> str:
    """(B, 32, 64) for a tensor, (*, 32, 64) for the sizes past the batch."""
    if isinstance(shape_or_tensor, torch.Tensor):
        return str(tuple(shape_or_tensor.shape))
    return "(" + ", ".join(["*"] + [str(n) for n in shape_or_tensor]) + ")"


def like(tensors) -> list[tuple[tuple, torch.dtype]]:
    """(shape past the batch, dtype) of each tensor."""
    return [(tuple(t.shape[1:]), t.dtype) for t in tensors]


def checked_inputs(inputs, where: str, count: int, traced_like) -> tuple:
    """The inputs as a tuple of `count` tensors shaped like `traced_like` past the batch
    (None: not traced yet), or a BatchError naming what differs."""
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) and t.dim() for t in inputs):
        kinds = ", ".join(kind(t) for t in inputs) or "nothing"
        raise BatchError(f"{where} takes tensors (or a tuple of them) with the global batch "
                         f"on dimension 0, not {kinds}.")
    if any(t.is_meta for t in inputs):
        raise BatchError(f"{where} got an input on the meta device, which holds no values; "
                         "a model may start on meta, but its batches must be real tensors.")
    if len(inputs) != count:
        raise BatchError(f"{where} got {len(inputs)} input tensor(s) but the engine was "
                         f"built for {count} (its example_inputs); pass the same number.")
    for i, (t, (shape, dtype)) in enumerate(zip(inputs, traced_like or ())):
        if tuple(t.shape[1:]) != shape or t.dtype != dtype:
            raise BatchError(f"{where}'s input {i} is {shape_text(t)} {t.dtype} but the "
                             f"graph was traced for {shape_text(shape)} {dtype} (batch "
                             "aside); pass inputs shaped alike at every call, or build the "
                             "engine with example inputs of this shape.")
    if any(t.shape[0] != inputs[0].shape[0] for t in inputs):
        raise BatchError(f"{where}'s inputs have different batch sizes "
                         f"({', '.join(str(t.shape[0]) for t in inputs)}); give every "
                         "input the same global batch on dimension 0.")
    return inputs


def check_targets(targets, inputs: tuple, traced_like) -> None:
    """train_step's targets: a tensor with the inputs' global batch, shaped as at the first
    step (`traced_like`: (shape past the batch, dtype), None before it)."""
    if not isinstance(targets, torch.Tensor) or targets.dim() == 0:
        raise BatchError(f"train_step's targets must be a tensor with the global batch on "
                         f"dimension 0, not {kind(targets)}.")
    if targets.is_meta:
        raise BatchError("train_step's targets are on the meta device, which holds no values; "
                         "pass real tensors.")
    if targets.shape[0] != inputs[0].shape[0]:
        raise BatchError(f"train_step got a batch of {inputs[0].shape[0]} inputs but "
                         f"{targets.shape[0]} targets; pass the same global batch of both.")
    if traced_like is not None and (tuple(targets.shape[1:]), targets.dtype) != traced_like:
        shape, dtype = traced_like
        raise BatchError(f"train_step's targets are {shape_text(targets)} {targets.dtype} "
                         f"but the training graph was traced at the first step for "
                         f"{shape_text(shape)} {dtype}; pass targets shaped alike at every "
                         "step.")


def id_inputs(traced) -> list[tuple[int, int, str]]:
    """(input position, rows, module) for each embedding that looks up an input directly."""
    places = [n for n in traced.graph.nodes if n.op == "placeholder"]
    out = []
    for node, rows, source in embedding_lookups(traced):
        if source in places:
            out.append((places.index(source), rows, node.meta["autopar"].module or "embedding"))
    return out


def check_ids(inputs: tuple, embeddings) -> None:
    """Refuse token ids outside an embedding's table as one device would (IndexError), on
    the global batch every rank holds, so every rank refuses alike."""
    for i, rows, module in embeddings:
        if i < len(inputs):
            check_index_range(inputs[i], rows, f"input {i} (the token ids of {module})")


def batch_split(plan, mesh) -> int:
    """Into how many slices the tensor ranks cut each data-parallel replica's batch (q in
    2D, d*q in 2.5D, q*q in 3D; 1 with 1D layers only)."""
    modes = set(plan.layer_modes().values()) | {plan.tp_mode}
    if mesh.mode not in modes or mesh.mode not in _BATCH_SPLIT_AXIS:
        return 1
    return mesh.size(_BATCH_SPLIT_AXIS[mesh.mode])


def check_split(inputs: tuple, split: int, mode: str) -> None:
    """Inference: the batch must split over the grid's batch split."""
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] % split:
            raise PlanError(f"the batch {t.shape[0]} does not split over the {mode} batch "
                            f"split of {split}; use a multiple of {split}.")


def local_batch(tensors: tuple, dp, split: int, mode: str, device) -> tuple:
    """This data-parallel rank's slice of each global batch tensor, on `device`."""
    out = []
    for t in tensors:
        if t.shape[0] % (dp.size * split):
            if split > 1:
                per = t.shape[0] / dp.size
                per = int(per) if per == int(per) else per
                raise PlanError(f"the batch per data-parallel replica ({per} of {t.shape[0]} "
                                f"over {dp.size}) does not split over the {mode} batch "
                                f"split of {split}; use a global batch that is a multiple "
                                f"of {dp.size * split}.")
            raise PlanError(f"the global batch {t.shape[0]} does not split over {dp.size} "
                            f"data-parallel ranks; use a multiple of {dp.size}.")
        n = t.shape[0] // dp.size
        # a batch from a CPU data loader goes to the model's device (NCCL: this rank's GPU)
        out.append(t[dp.rank * n:(dp.rank + 1) * n].to(device))
    return tuple(out)


def cut_tokens(tensors: tuple, graph, cp, layout: str) -> tuple:
    """This cp rank's tokens (dim 1, in the plan's layout) of every [batch, tokens, ...]
    tensor (the graph, traced on the whole sequence, says which)."""
    if cp.size == 1:
        return tuple(tensors)
    seq = tokens_per_sample(graph)
    return tuple(cut_sequence(t, cp, dim=1, layout=layout)
                 if isinstance(t, torch.Tensor) and seq is not None and t.dim() >= 2
                 and t.shape[1] == seq else t for t in tensors)


class Batches:
    """An engine's batches: checked against what its graphs were traced for, then cut to
    this rank's part (`like` of the training graph's inputs and target once traced)."""

    def __init__(self, example_inputs: tuple, forward_graph, plan, mesh, dp, cp, device):
        self.inputs_like = like(example_inputs)
        self.train_like = self.target_like = None  # traced for at the first train_step
        self.ids = id_inputs(forward_graph)
        self.split, self.mode = batch_split(plan, mesh), mesh.mode
        self.dp, self.cp, self.cp_layout, self.device = dp, cp, plan.cp_layout(), device
        self._compared = False

    def for_step(self, inputs, targets, step: int, compare: bool) -> tuple:
        """train_step's inputs, checked; the batch is compared across ranks at the first step
        (a per-rank batch would train on a mixture), and at every step with `compare`."""
        inputs = checked_inputs(inputs, "train_step", len(self.inputs_like), self.train_like)
        check_targets(targets, inputs, self.target_like)
        if not self._compared or compare:
            check_same_batch(inputs + (targets,), step)
            self._compared = True
        check_ids(inputs, self.ids)
        return inputs

    def for_forward(self, inputs) -> tuple:
        """The forward's inputs, checked, on the model's device."""
        inputs = checked_inputs(inputs, "the engine's forward", len(self.inputs_like),
                                self.inputs_like)
        check_ids(inputs, self.ids)
        check_split(inputs, self.split, self.mode)
        return tuple(t.to(self.device) if isinstance(t, torch.Tensor) else t for t in inputs)

    def traced(self, inputs: tuple, target: torch.Tensor) -> None:
        """The training graph was traced for these (local) inputs and target."""
        self.train_like, self.target_like = like(inputs), like((target,))[0]

    def local(self, tensors: tuple) -> tuple:
        """This data-parallel rank's slice of each global batch tensor."""
        return local_batch(tensors, self.dp, self.split, self.mode, self.device)

    def tokens(self, tensors: tuple, graph) -> tuple:
        """This cp rank's tokens of each [batch, tokens, ...] tensor."""
        return cut_tokens(tensors, graph, self.cp, self.cp_layout)


def micro_batches(tensors: tuple, m: int, split: int, dp_size: int) -> list[tuple]:
    """A replica's batch tensors cut into `m` equal micro-batches on dimension 0 (gradient
    accumulation without a pipeline); each must still split over the grid's batch split."""
    if m == 1:
        return [tuple(tensors)]
    n = tensors[0].shape[0]
    if n % m or (n // m) % split:
        unit = m * split
        raise PlanError(f"the batch of {n} sample(s) per data-parallel replica (global batch "
                        f"{n * dp_size} over {dp_size}) does not split into {m} micro-batches"
                        + (f" of a multiple of the {split}-way batch split" if split > 1 else "")
                        + f"; use a global batch that is a multiple of {unit * dp_size}, or "
                        "another number of micro-batches.")
    size = n // m
    return [tuple(t[i * size:(i + 1) * size] for t in tensors) for i in range(m)]
