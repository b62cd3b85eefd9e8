"""The engine's pipeline wiring: each layer's stage, the runner over the pipeline axis, and
the weights a pipeline rank releases while it trains and fetches for everything else."""

from __future__ import annotations

import torch

from autopar.cost.schedule import check_microbatches, stage_count, stage_owner
from autopar.errors import PlanError
from autopar.passes.pipeline import check_stage_count, split_stages
from autopar.runtime.agree import on_rank_zero
from autopar.runtime.host_memory import trim
from autopar.runtime.pipeline import PipelineRunner
from autopar.sharding.solve import tokens_per_sample


def stage_of_layers(plan, train_graph, n: int, global_batch: int, microbatches: int,
                    stage_planner=None) -> dict[str, int]:
    """The plan's stage per layer when it names one for every layer (in order, all n
    used), else `stage_planner`'s split (autopar.search.planner.pipeline_stages)."""
    layers = [layer.name for layer in train_graph.layers]
    planned = {lp.name: lp.stage for lp in plan.layers}
    if layers and all(name in planned for name in layers):
        stages = [planned[name] for name in layers]
        if sorted(set(stages)) == list(range(n)) and stages == sorted(stages):
            return dict(zip(layers, stages))
    if stage_planner is None:
        raise PlanError("the plan names no pipeline stage for every layer and the engine has "
                        "no stage planner; build it with autopar.parallelize, or give each "
                        "layer its stage in the plan.")
    stages = _rank_zeros_stages(stage_planner, train_graph, plan, global_batch,
                                tokens_per_sample(train_graph) or 1, microbatches)
    if len(stages) != len(layers) or max(stages) != n - 1:
        raise PlanError(f"the planner split {len(stages)} layers into {max(stages) + 1} "
                        f"stages; the graph has {len(layers)} layers for {n} stages.")
    return dict(zip(layers, stages))


def _rank_zeros_stages(stage_planner, *args) -> list[int]:
    """Global rank 0's split, sent to every rank (`on_rank_zero`): the split is the same on
    every rank, and the planner's activation analysis costs seconds of CPU a start."""
    return on_rank_zero("pipeline stage planner", lambda: list(stage_planner(*args)))


def build_pipeline(plan, train_graph, train_gm, pp, dp, global_batch: int, device,
                   every_weight, data, stage_planner=None):
    """(PipelineRunner of this rank's stages under the plan's schedule, stage per layer)."""
    pipe = plan.pipeline
    n = stage_count(pipe.schedule, pp.size, pipe.chunks)
    microbatches = pipe.microbatches if pipe.microbatches > 1 else n
    check_stage_count([layer.name for layer in train_graph.layers], n)
    check_microbatches(pipe.schedule, pp.size, microbatches, pipe.chunks)
    if (global_batch // dp.size) % microbatches:
        raise PlanError(f"a batch of {global_batch} does not split into {microbatches} "
                        "micro-batches" + (f" on each of {dp.size} data-parallel replicas"
                                           if dp.size > 1 else "")
                        + f"; use a batch that is a multiple of {microbatches * dp.size}.")
    stage_of = stage_of_layers(plan, train_graph, n, global_batch, microbatches, stage_planner)
    stages = split_stages(train_gm, stage_of, n, targets=1)
    runner = PipelineRunner(stages, pp, pipe.schedule, microbatches, device,
                            every_weight=every_weight, data=data)
    return runner, stage_of


def layers_here(runner, stage_of: dict[str, int], pp) -> set[str]:
    """The layers this pipeline rank's stages run."""
    return {layer for layer, k in stage_of.items()
            if stage_owner(runner.schedule_name, k, pp.size) == pp.rank}


def pipeline_step(runner, weights, zero, inputs: tuple, target, loss_scale: float):
    """One forward and backward through the schedule, the weights this rank does not train
    released around it (inference may have fetched them); returns the loss."""
    weights.release()
    runner.loss_scale = loss_scale  # what the schedule differentiates, not what it reports
    loss = torch.tensor(runner.step(inputs, target))
    if runner.on_host:
        # a micro-batch's activations under glibc's mmap threshold (runtime.host_memory)
        # come from the heap, which keeps the schedule's freed ones resident, scattered
        # between live blocks, through the optimizer step: given back (0.2 ms a step with
        # the threshold at 128 KiB, where little is left to give; 2.5-7 ms at 1 MiB)
        trim()
    if zero is not None:  # (ZeRO-2/3: the pieces summed the micro-batches' gradients)
        zero.after_pipeline(runner.microbatches, runner.tied())
        zero.end_backward()
    weights.release()
    return loss


class PipelineWeights:
    """A pipeline rank holds its stages' weights while it trains (as the planner's memory
    per stage assumes) and fetches the others from their owners for anything else."""

    def __init__(self, runner, params, train_graph, pp):
        self.runner, self.params, self.train_graph, self.pp = runner, params, train_graph, pp
        self.synced_at = -1  # the step at which the ranks last shared their weights
        self.released: dict = {}  # target -> (shape, dtype) freed on this rank
        self.refilled: set = set()  # ZeRO-3 parameters made whole for a sync

    def _local(self, target: str) -> torch.Tensor:
        return self.params.of(self.train_graph.params[target])

    def fetch(self, steps: int, zero=None) -> None:
        """Every rank gets the trained values of the parameters other ranks own, once per
        optimizer step (every rank has taken the same number of steps)."""
        if self.synced_at == steps and not self.released:
            return
        self.synced_at = steps
        for target, owner in sorted(self.runner.param_owners().items()):
            local = self._local(target)
            held = self.released.pop(target, None)
            if held is not None:  # made again, to be filled by its owner
                local.data = torch.empty(held[0], dtype=held[1], device=local.device)
            if zero is not None and zero.keeps_only_piece(local):
                # ZeRO-3 keeps pieces: made whole to send, and for the other stages' graphs
                # this rank runs to find their shapes, until the next step
                local.data = zero.whole(local)
                self.refilled.add(target)
            value = local.data
            with torch.no_grad():
                out = self.pp.broadcast(value, owner, "init")
                if out is not value:  # (a strided value: sent from a contiguous copy)
                    value.copy_(out)

    def release(self) -> None:
        """Free the parameters only other ranks' stages read (a tied embedding stays on
        every rank whose stages read it)."""
        for target in self.refilled:  # ZeRO-3's pieces are what this rank keeps
            local = self._local(target)
            local.data = torch.empty(0, dtype=local.dtype, device=local.device)
        self.refilled.clear()
        mine = {id(p) for p in self.runner.parameters()}
        for target in self.runner.param_owners():
            local = self._local(target)
            if id(local) in mine or target in self.released or local.numel() == 0:
                continue
            self.released[target] = (tuple(local.shape), local.dtype)
            local.data = torch.empty(0, dtype=local.dtype, device=local.device)
