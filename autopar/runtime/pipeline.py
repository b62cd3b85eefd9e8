"""Run the stages of `autopar.passes.pipeline.split_stages` under a torch.distributed.pipelining
schedule (GPipe, 1F1B, interleaved 1F1B, zero-bubble): gradients averaged over the
micro-batches (and over dp when no ZeRO takes them), tied parameters summed over the
members holding a copy."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from autopar.cost.schedule import check_microbatches, stage_count, stage_owner
from autopar.errors import PlanError
from autopar.kernels.collectives import AxisGroup, CommLog, exchange_objects
from autopar.modes import GPIPE, INTERLEAVED, ONE_F_ONE_B, ZERO_BUBBLE
from autopar.passes.pipeline import Stages
from autopar.runtime.buckets import GradientBuckets, average_gradients
from autopar.runtime.mesh import shared_group

__all__ = ["PipelineRunner", "stage_count", "stage_owner"]

_SCHEDULES = {GPIPE: "ScheduleGPipe", ONE_F_ONE_B: "Schedule1F1B",
              INTERLEAVED: "ScheduleInterleaved1F1B", ZERO_BUBBLE: "ScheduleZBVZeroBubble"}


class PipelineRunner:
    def __init__(self, stages: Stages, group: AxisGroup, schedule: str, microbatches: int,
                 device: torch.device | str = "cpu", every_weight=None,
                 data: AxisGroup | None = None):
        p, rank = group.size, group.rank
        n = len(stages.modules)
        if n != stage_count(schedule, p, max(1, n // p)):
            raise PlanError(f"the {schedule} schedule on {p} pipeline ranks runs "
                            f"{stage_count(schedule, p, max(1, n // p))} stages, not {n}.")
        check_microbatches(schedule, p, microbatches, max(1, n // p))
        if stages.loss is None:
            raise PlanError("the pipeline runtime needs the stages cut with their targets "
                            "(split_stages(..., targets=1)).")
        self.group, self.schedule_name, self.microbatches = group, schedule, microbatches
        # fp16's loss scale (the engine sets it before each step): the schedule's loss
        # function returns loss * loss_scale, which the backward differentiates; `step`
        # reports the loss unscaled
        self.loss_scale = 1.0
        # called with j after this member's j-th stage has made one micro-batch's weight
        # gradients (ZeRO-2 sends them then)
        self.weights_done = None
        # called with the loss scale after the schedule on every member: (what its stages
        # add to the reported loss, summed over the members; whether that is exact), and
        # its `refusal`, raised on every member when some member's is not (an MoE balance
        # loss's step-wide value: autopar.kernels.moe.StepBalance)
        self.loss_correction = None
        # a context each stage's forward and the loss run in (ZeRO-3: saved parameters
        # are kept as references and gathered again in the backward)
        self.saving = contextlib.nullcontext
        # called (on every member) before the stages run once to find their shapes: a
        # member that holds only its stages' weights fetches the others for that run
        self._every_weight = every_weight
        # called after that run: the weights it fetched are given back before the schedule
        # (the engine's PipelineWeights.release), so the first step holds only this
        # member's stages, as every later one does
        self.release_weights = None
        # where the schedule's one-time traffic is logged (its warm-up handshake): the
        # engine's startup log; None: not logged
        self.startup_log: CommLog | None = None
        # per stage, at the micro-batch shape: (bytes of the values it sends on, bytes of
        # the gradients it sends back), from the run that finds the shapes
        self._transfers: list[tuple[int, int]] | None = None
        self.stages = stages
        self.mine = [k for k in range(n) if stage_owner(schedule, k, p) == rank]
        self.first_owner, self.last_owner = stage_owner(schedule, 0, p), \
            stage_owner(schedule, n - 1, p)
        self._device = torch.device(device)
        self.on_host = self._device.type == "cpu"  # the stages' tensors in the C heap
        self._schedule = None
        self._shapes = None  # the micro-batch shapes the schedule was built for
        # this member's modules share Parameter objects; each attribute read once
        modules = [stages.modules[k] for k in self.mine] + \
            ([stages.loss] if n - 1 in self.mine else [])
        held = {node.target: m for m in modules for node in m.graph.nodes
                if node.op == "get_attr"}
        self._by_name = {name: _attr(held[name], name)
                         for name in sorted(set().union(*(stages.params[k] for k in self.mine)))}
        self._params = _unique(list(self._by_name.values()))
        self._tied = []
        self._copies: dict[int, int] = {}  # tied parameter -> members holding a copy
        self._tie_groups(stages, schedule, group)
        # parameter attribute -> the member that trains it (fixed by the cut)
        self._owners: dict[str, int] = {}
        for k, names in enumerate(stages.params):
            owner = stage_owner(schedule, k, p)
            for name in names:
                self._owners[name] = min(self._owners.get(name, owner), owner)
        self.data = data if data is not None and data.size > 1 else None
        self._buckets = self._data_buckets() if self.data is not None else None

    def _tie_groups(self, stages: Stages, schedule: str, group: AxisGroup) -> None:
        """Tied parameters: a group per set of members that hold a copy, in every pipeline
        (each data- and tensor-parallel coordinate has its own pipeline; torch wants every
        rank of the world to create every group, so the sets are gathered first)."""
        p, rank, process_group = group.size, group.rank, group.group
        for name in sorted(stages.shared):
            owners = sorted({stage_owner(schedule, k, p) for k in stages.shared[name]})
            if len(owners) < 2:
                continue
            ranks = [dist.get_global_rank(process_group, o) for o in owners] \
                if process_group is not None else owners
            sets = tuple(sorted({tuple(r) for r in exchange_objects(ranks)}))
            tie = shared_group(("tie", sets),
                               lambda sets=sets: dist.new_subgroups_by_enumeration(sets)[0])
            if rank in owners:  # logged as the pipeline axis's
                self._tied.append((self._by_name[name], group.subgroup(tie)))
                self._copies[id(self._by_name[name])] = len(owners)

    def _data_buckets(self) -> list | None:
        """Per stage of this member, its parameters' data-parallel buckets; None (reduce
        after the schedule) under zero-bubble, whose W pass fires no accumulation hooks,
        or when two of this member's stages share a parameter."""
        if self.schedule_name == ZERO_BUBBLE:
            return None
        per_stage = []
        for k in self.mine:
            graphs = [self.stages.modules[k]] + \
                ([self.stages.loss] if k == len(self.stages.modules) - 1 else [])
            names = [node.target for m in graphs for node in m.graph.nodes
                     if node.op == "get_attr" and node.target in self.stages.params[k]]
            per_stage.append(_unique([self._by_name[name] for name in names]))
        ids = [id(q) for params in per_stage for q in params]
        if len(ids) != len(set(ids)):
            return None
        return [GradientBuckets(params, self.data) for params in per_stage]

    def _prepare(self, inputs: tuple) -> None:
        """Build the schedule for this micro-batch shape, with example inputs and outputs
        from one run of every stage (comm log off), so torch infers no shapes inside the
        schedule (its collectives would be logged, its integer inputs made up)."""
        micro = tuple(t[:t.shape[0] // self.microbatches] for t in inputs)
        shapes = tuple(tuple(t.shape) for t in micro)
        if shapes == self._shapes:
            return
        if self._every_weight is not None:
            self._every_weight()
        log = self.group.log
        enabled, log.enabled = log.enabled, False
        examples = []
        try:  # with autograd on, so the examples say which values carry gradients
            args = micro
            for module in self.stages.modules:
                out = module(*args)
                out = tuple(_example(o) for o in (out if isinstance(out, (tuple, list))
                                                 else (out,)))
                examples.append((args, out))
                args = out
        finally:
            log.enabled = enabled
        if self._every_weight is not None and self.release_weights is not None:
            self.release_weights()
        self._transfers = [(_nbytes(out), _nbytes(a for a in args if getattr(
            a, "requires_grad", False)))
                           for args, out in examples]
        n = len(self.stages.modules)
        split = self.schedule_name == ZERO_BUBBLE  # backward split into I and W
        stages = [(_SplitBackwardStage if split else _Stage)(
            self.stages.modules[k], k, n, self._device, input_args=examples[k][0],
            output_args=examples[k][1], group=self.group.group) for k in self.mine]
        for j, stage in enumerate(stages):
            stage.axis, stage.startup_log = self.group, self.startup_log
            if split and stage.is_last:
                stage.loss_weights = list(self.stages.loss.parameters())
            stage.weights_done = functools.partial(self._weights_done, j)
            stage.saving = lambda: self.saving()
            if self._buckets is not None:
                stage.last_backward_starts = functools.partial(self._arm, j)
        loss = self.stages.loss

        def loss_fn(output, target):
            with self.saving():
                out = loss(*(output if isinstance(output, tuple) else (output,)), target)
            out = out[0] if isinstance(out, (tuple, list)) else out
            return out * self.loss_scale if self.loss_scale != 1.0 else out

        cls = getattr(torch_schedules, _SCHEDULES[self.schedule_name])
        # scale_grads=False: the schedule would scale each stage's parameters, twice for a
        # parameter two stages on this member share (zero-bubble's V puts the tied
        # embedding's first and last stage on member 0); `step` scales each one once
        chosen = stages[0] if self.schedule_name in (GPIPE, ONE_F_ONE_B) else stages
        self._schedule = cls(chosen, n_microbatches=self.microbatches, loss_fn=loss_fn,
                             scale_grads=False)
        self._shapes = shapes

    def _arm(self, j: int) -> None:
        self._buckets[j].armed = True

    def _weights_done(self, j: int) -> None:
        if self.weights_done is not None:
            self.weights_done(j)

    def held_modules(self) -> list[tuple[int, torch.nn.Module]]:
        """(stage index, module) of this member's stages, then (n, the loss) on the last."""
        n = len(self.stages.modules)
        return [(k, self.stages.modules[k]) for k in self.mine] + \
            ([(n, self.stages.loss)] if self.last_owner == self.group.rank else [])

    def param_owners(self) -> dict[str, int]:
        """Parameter attribute -> the member whose stages train it (the lowest, for a tied
        parameter: every owner holds the same value)."""
        return dict(self._owners)

    def copies(self, param: torch.nn.Parameter) -> int:
        """On how many pipeline members `param` lives (2 or more for a tied parameter)."""
        return self._copies.get(id(param), 1)

    def parameters(self) -> list[torch.nn.Parameter]:
        """The parameters this member's stages read (each once)."""
        return list(self._params)

    def stage_parameters(self) -> list[list[torch.nn.Parameter]]:
        """For each of this member's stages, in order, the parameters it reads (a tied
        parameter under every stage of this member that reads it)."""
        return [_unique([self._by_name[name] for name in sorted(self.stages.params[k])])
                for k in self.mine]

    def sent_bytes(self) -> int:
        """Bytes this member's stages send point to point in one step (logged as "p2p" on
        the pipeline axis): per micro-batch, each stage's outputs to the next stage and the
        gradients of its inputs back to the one before, where that stage is on another
        member. Known once the first step has found the shapes."""
        if self._transfers is None:
            raise PlanError("the pipeline's transfers are known after its first step; run "
                            "train_step first.")
        n, p, me = len(self.stages.modules), self.group.size, self.group.rank
        total = 0
        for k in self.mine:
            forward, backward = self._transfers[k]
            if k < n - 1 and stage_owner(self.schedule_name, k + 1, p) != me:
                total += forward
            if k > 0 and stage_owner(self.schedule_name, k - 1, p) != me:
                total += backward
        return total * self.microbatches

    def tied(self) -> list[tuple[torch.nn.Parameter, AxisGroup]]:
        """(parameter, the members holding a copy, an AxisGroup logged as the pipeline
        axis's) for tied parameters."""
        return list(self._tied)

    def step(self, inputs: tuple, target: torch.Tensor) -> float:
        """One forward and backward of the whole batch through the pipeline (gradients
        accumulate into .grad; zero them before). Returns the batch's mean loss."""
        if target.shape[0] % self.microbatches:
            raise PlanError(f"a batch of {target.shape[0]} does not split into "
                            f"{self.microbatches} micro-batches; use a batch that is a "
                            f"multiple of {self.microbatches}.")
        self._prepare(tuple(inputs))
        args, kwargs = (), {}
        if 0 in self.mine:
            args = tuple(inputs)
        losses: list = []
        if len(self.stages.modules) - 1 in self.mine:
            kwargs = {"target": target, "losses": losses}
        # return_outputs=False: the last stage would keep every micro-batch's output, and
        # with it (under zero-bubble, whose input-gradient pass retains the graph) the
        # saved activations the weight-gradient pass does not free, to the end of the step
        self._schedule.step(*args, return_outputs=False, **kwargs)
        if self._buckets is not None:  # the mean over dp and over the micro-batches
            for buckets in self._buckets:
                buckets.finish(self.microbatches)
        elif self.data is not None:  # the mean over dp and the micro-batches at once
            average_gradients(self._params, self.data, self.microbatches)
        else:
            for param in self._params:  # the sum over micro-batches of their mean losses' grads
                if param.grad is not None:
                    param.grad.div_(self.microbatches)
        for param, tie in self._tied:
            if param.grad is not None:
                param.grad = tie.all_reduce(param.grad, "step")
        value = torch.zeros(1)
        if losses:
            value[0] = torch.stack([v.detach().float() for v in losses]).mean() / self.loss_scale
        if self.loss_correction is not None:
            extra, exact = self.loss_correction(self.loss_scale)
            both = torch.tensor([extra, 0.0 if exact else 1.0], dtype=torch.float64)
            both = self.group.all_reduce(both, "step")
            if both[1] > 0:
                raise PlanError(self.loss_correction.refusal)
            if losses:
                value += float(both[0])
        value = self.group.broadcast(value, self.last_owner, "step")
        return float(value[0])


class _Stage(PipelineStage):
    """A stage that says when one micro-batch's weight gradients are made: after a full
    backward, or after the weight-gradient pass when the backward is split (zero-bubble),
    which writes .grad itself rather than through autograd's accumulation; and that logs
    on the pipeline axis (`axis`) every tensor the schedule sends for it, as the schedule
    asks for its send operations, and the schedule's one-time warm-up handshake in
    `startup_log`."""

    axis: AxisGroup | None = None
    startup_log: CommLog | None = None
    weights_done = None
    saving = contextlib.nullcontext
    last_backward_starts = None  # called before the last micro-batch's full backward

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with self.saving():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def get_fwd_send_ops(self, fwd_chunk_id):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if self.axis is not None:
            self.axis.sent([op.tensor for op in ops], "forward")
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        if self.axis is not None:
            self.axis.sent([op.tensor for op in ops], "backward")
        return ops

    # torch's schedule runs a vote once, when it first steps: a small tensor to the next
    # stage's member, then one back (not to a stage on this same member)
    def _warmup_forward_vote(self, *args, **kwargs):
        out = super()._warmup_forward_vote(*args, **kwargs)
        if not self.is_last:
            self._handshake(out, self.stage_index + 1)
        return out

    def _warmup_backward_result(self, *args, **kwargs):
        out = super()._warmup_backward_result(*args, **kwargs)
        if not self.is_first:
            self._handshake(out, self.stage_index - 1)
        return out

    def _handshake(self, sent: torch.Tensor, peer: int) -> None:
        if self.axis is not None and self.startup_log is not None and \
                self.stage_index_to_group_rank[peer] != self.group_rank:
            with self.axis.log.diverted(self.startup_log):
                self.axis.sent([sent], "init")

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True,
                           last_backward=False):
        if last_backward and full_backward and self.last_backward_starts is not None:
            self.last_backward_starts()
        out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                         last_backward=last_backward)
        if full_backward and self.weights_done is not None:
            self.weights_done()
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        if self.weights_done is not None:
            self.weights_done()
        return out


class _SplitBackwardStage(_Stage):
    """A zero-bubble stage that frees a micro-batch's saved activations right after its
    weight-gradient pass (W): the input-gradient pass keeps the whole autograd graph, and W
    walks only part of it, so each forward saves through a box that W empties.

    The last stage's B and W also take the loss's own parameters (`loss_weights`: a chunked
    loss holds the classifier's weight), which the stage's module does not hold."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._boxes: dict[int, list] = {}
        self.loss_weights: list[torch.nn.Parameter] = []

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
        if not self.loss_weights or backward_type == "full":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs,
                                                      last_backward=last_backward)
        weights = _unique([*self.submod.parameters(), *self.loss_weights])
        if backward_type == "input":
            return stage_backward_input(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                        bwd_kwargs["input_values"], iter(weights))
        return stage_backward_weight(iter(weights), bwd_kwargs["param_groups"]), None

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        box = self._boxes.setdefault(fwd_chunk_id, [])
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer else (None, None)

        def pack(t):
            box.append(outer_pack(t) if outer_pack else t)
            return len(box) - 1

        def unpack(i):
            value = box[i]
            return outer_unpack(value) if outer_unpack else value

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        out = super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        box = self._boxes.pop(bwd_chunk_id, None)
        if box is not None:
            box.clear()
        return out


def _example(t):
    """A detached copy of a stage's output that keeps whether it needs a gradient."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().clone().requires_grad_(t.requires_grad)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _attr(module: torch.nn.Module, target: str):
    out = module
    for part in target.split("."):
        out = getattr(out, part)
    return out


def _unique(params: list) -> list:
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
