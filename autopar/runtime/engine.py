"""The training engine `autopar.parallelize` returns: sharded graphs, optimizer, data parallelism.

Each rank runs two rewritten graphs that share its parameter slices: the model followed by
the loss (traced at the first `train_step`, when the target's shape is known) and the model
alone for inference. Data parallelism is the engine's: it hands each rank its slice of the
global batch and averages gradients over the `dp` axis after the backward pass. Tensor
parallelism is the graphs': 1D on the `tp` axis, 2D, 2.5D and 3D on the axes of the plan's
`TensorMesh` (`autopar.sharding.axes`), which the groups passed in must hold. Mixed
precision (`precision="bf16" | "fp16"`) is a pass over both graphs right after the
sharding rewrite (`autopar.passes.precision`): 16-bit compute on the fp32 parameters, which
stay the optimizer's masters; fp16 adds dynamic loss scaling (`autopar.runtime.scaler`).
"""

from __future__ import annotations

import contextlib
import operator

import sympy
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.errors import BatchError, PlanError
from autopar.graph.trace import BATCH, trace
from autopar.passes.precision import cast_precision, comm_factors, compute_dtype
from autopar.passes.tensor_parallel import (apply_solution, local_slice, shard_parameters,
                                            shard_steps)
from autopar.plans import Plan
from autopar.runtime.agree import check_same_batch
from autopar.runtime.buckets import GradientBuckets, average_gradients
from autopar.kernels.collectives import AxisGroup, CommLog, bind
from autopar.kernels.modules import RandomStreams, bind_streams
from autopar.runtime.measure import STEP, Recorder, instrument
from autopar.runtime.scaler import LossScaler
from autopar.kernels.sequence import cut_sequence
from autopar.sharding.axes import MULTI_D, TensorMesh
from autopar.sharding.layout import Layout
from autopar.sharding.solve import Solution, solve


class Engine(nn.Module):
    """A model split over a mesh: `train_step`, forward, `comm_log`, `full_state_dict`."""

    def __init__(self, model: nn.Module, plan: Plan, groups: dict[str, AxisGroup],
                 example_inputs: tuple, loss_fn, optimizer, seed: int = 0,
                 forward_graph=None, max_grad_norm: float | None = None,
                 precision: str = "fp32", check_batches: bool = False):
        super().__init__()
        self.plan = plan
        # every train_step compares the batch across ranks (the first one always does)
        self.check_batches = check_batches
        self._batch_checked = False
        self._inputs_like = [(tuple(t.shape[1:]), t.dtype) for t in example_inputs]
        # what the training graph was traced for at the first step: input and target
        # (shape past the batch, dtype)
        self._train_like: list | None = None
        self._target_like = None
        self.groups = groups
        self.max_grad_norm = max_grad_norm
        # mixed precision (autopar.passes.precision): the graphs compute in this dtype (None:
        # fp32, no cast), the parameters stay fp32 masters; fp16 scales the loss
        self.precision = precision
        self._compute_dtype = compute_dtype(precision)
        self.scaler = LossScaler() if precision == "fp16" else None
        self.last_grad_norm: float | None = None  # the global norm of the last step's grads
        self.comm_log: CommLog = groups["tp"].log
        # per-layer time, saved bytes and the layer of each collective (runtime.measure)
        self.recorder = Recorder()
        self.comm_log.recorder = self.recorder
        self.loss_fn = loss_fn
        self._model = model  # kept until the training graph is traced, then released
        self._tp, self._dp = groups["tp"], groups["dp"]
        self._cp = groups["cp"] if "cp" in groups else AxisGroup("cp", 1, 0, None, self.comm_log)
        self._pp = groups["pp"] if "pp" in groups else AxisGroup("pp", 1, 0, None, self.comm_log)
        self._pipeline = None  # a PipelineRunner once the training graph is built (pp > 1)
        self._synced_at = -1  # the step at which pipeline ranks last shared their weights
        self._released: dict = {}  # parameter -> (shape, dtype) freed on this pipeline rank
        self._refilled: set = set()  # ZeRO-3 parameters made whole for a pipeline sync
        self.mesh = plan.tensor_mesh()
        if self._cp.size > 1:  # context parallelism: cp beside the 1D tensor axis
            self.mesh = TensorMesh("1d", (("cp", self._cp.size), ("tp", self._tp.size)))
        self._coords = {a: groups[a].rank for a in self.mesh.physical}
        self._streams = RandomStreams(seed, self._dp.rank, self._tp.rank, self._cp.rank)
        self._state_keys = list(model.state_dict().keys())
        self._untraced_state = {}
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.forward_graph = forward_graph if forward_graph is not None else \
            trace(model, _blank(example_inputs, self._device), train=False)
        check_positions(self.forward_graph)
        self._id_inputs = id_inputs(self.forward_graph)
        check_grid_dims(self.forward_graph, plan, self.mesh)
        check_sequence_dims(self.forward_graph, plan)
        check_context_dims(self.forward_graph, plan)
        self.forward_solution = self._solve(self.forward_graph, fixed=None)
        check_divisible(self.forward_graph, self.forward_solution)
        self._local: dict[int, torch.Tensor] = {}  # id(full tensor) -> this rank's slice
        self._names: dict[int, tuple] = {}
        self._layouts: dict[int, Layout] = {}
        self.forward_gm = self._build(self.forward_graph, self.forward_solution)
        self._keep_untraced(model)
        self.train_graph = None
        self.train_solution: Solution | None = None
        self.train_gm: fx.GraphModule | None = None
        self._optimizer_factory = optimizer
        self._zero = None  # ZeRO state over dp (runtime.zero: 1/2, runtime.zero3: 3)
        self._train_units: list[int] = []  # ZeRO-3: the layers the training graph gathers
        self._buckets = None  # plain dp without a pipeline: the bucketed all-reduce
        self.optimizer = None
        if not self._zero_sharded():
            self._adopt(optimizer(self._unique_params()) if optimizer is not None else None)
        elif self._pp.size == 1:  # a pipeline rank shards the parameters of its stages
            self._make_zero(self._unique_params())
        self.steps = 0

    # ------------------------------------------------------------------ building
    @staticmethod
    def trace_for(model: nn.Module, example_inputs: tuple):
        """The inference graph the engine starts from (`parallelize` checks a plan on it
        before it starts any process work, then hands it over)."""
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        return trace(model, _blank(example_inputs, device), train=False)

    def _solve(self, traced, fixed) -> Solution:
        cp = self._cp.size > 1
        mesh = self.mesh if self.mesh.mode in MULTI_D or cp else None
        return solve(traced, axis="tp", size=self._tp.size, modes=self.plan.layer_modes(),
                     default_mode=self.plan.tp_mode, fixed_params=fixed, mesh=mesh,
                     sequence_parallel=self.plan.sequence_parallel_layers(),
                     sequence_mode=(self.plan.sequence_mode or "ring") if cp else None,
                     sequence_layout=self.plan.cp_layout())

    def _cut_sequence(self, tensors: tuple, graph) -> tuple:
        """This cp rank's tokens (dim 1, in the plan's layout: a contiguous block, or the
        zigzag pair of chunks) of every [batch, tokens, ...] input and target (the graph,
        traced on the whole sequence, says which)."""
        if self._cp.size == 1:
            return tuple(tensors)
        from autopar.sharding.solve import tokens_per_sample

        seq = tokens_per_sample(graph)
        out = []
        for t in tensors:
            if isinstance(t, torch.Tensor) and seq is not None and t.dim() >= 2 and \
                    t.shape[1] == seq:
                t = cut_sequence(t, self._cp, dim=1, layout=self.plan.cp_layout())
            out.append(t)
        return tuple(out)

    def _build(self, traced, solution: Solution) -> fx.GraphModule:
        """Rewrite a traced graph and install this rank's slices (shared across graphs)."""
        gm = apply_solution(traced.gm, solution, coords=None)
        if self._compute_dtype is not None:  # 16-bit model part, fp32 masters and loss
            gm = cast_precision(gm, self._compute_dtype)
        shard_parameters(gm, {target: self._local_tensor(traced.gm, pinfo, solution)
                              for target, pinfo in traced.params.items()})
        bind(gm, self.groups)
        bind_streams(gm, self._streams)
        return gm

    def _local_tensor(self, gm: fx.GraphModule, pinfo, solution: Solution) -> torch.Tensor:
        """This rank's slice of one parameter or buffer, cut the first time a graph reads it."""
        key = _key(pinfo)
        layout = solution.params.get(pinfo.target)
        if key not in self._local:
            full = operator.attrgetter(pinfo.target)(gm)
            if full.device.type == "meta":
                raise PlanError(f"parameter {pinfo.names[0]} is on the meta device; "
                                "parallelize needs real weights (autopar.plan works on meta).")
            self._local[key] = local_slice(full, layout, self._coords, self.mesh)
            self._names[key] = pinfo.names
            self._layouts[key] = layout
        elif self._layouts[key] != layout:
            raise PlanError(f"parameter {pinfo.names[0]} is laid out as {self._layouts[key]} "
                            f"for inference but {layout} for training.")
        return self._local[key]

    def _keep_untraced(self, model: nn.Module) -> None:
        """State the graphs never read is kept whole, so full_state_dict loses nothing."""
        read = {name for names in self._names.values() for name in names}
        for key, value in model.state_dict().items():
            if key not in read:
                self._untraced_state[key] = value.detach().clone()

    def _unique_params(self) -> list[nn.Parameter]:
        return [p for p in self._local.values() if isinstance(p, nn.Parameter)]

    def parameters(self, recurse: bool = True):
        return iter(self._unique_params())

    def _ensure_train_graph(self, inputs: tuple, target: torch.Tensor) -> None:
        if self.train_gm is not None:
            return
        if self.loss_fn is None:
            raise PlanError("train_step needs a loss_fn; pass loss_fn=... to autopar.parallelize.")
        fixed = {t: self._layouts[_key(p)] for t, p in self.forward_graph.params.items()}
        self.train_graph = trace(self._model, _blank(inputs, self._device), loss_fn=self.loss_fn,
                                 example_target=_blank((target,), self._device)[0], train=True)
        fixed = {t: fixed[t] for t in fixed if t in self.train_graph.params}
        self.train_solution = self._solve(self.train_graph, fixed=fixed)
        self.train_gm = self._build(self.train_graph, self.train_solution)
        self._target_like = (tuple(target.shape[1:]), target.dtype)
        self._train_like = [(tuple(t.shape[1:]), t.dtype) for t in inputs]
        self._global_batch = int(target.shape[0]) * self._dp.size
        if self._pp.size == 1:  # (a pipeline's stages are instrumented once cut)
            instrument(self.train_gm, self.recorder, 0)
        self._train_units = self._zero.rewrite(self.train_gm) if self._zero_three() else []
        self._model = None
        if self._dp.size > 1 and self._pp.size == 1 and self._zero is None:
            self._buckets = GradientBuckets(self._unique_params(), self._dp)
        if self._pp.size > 1:
            self._pipeline = self._build_pipeline(int(target.shape[0]) * self._dp.size)
            runner = self._pipeline
            for k in runner.mine:
                instrument(runner.stages.modules[k], self.recorder, k, parameter_probes=False)
            if runner.last_owner == self._pp.rank:
                instrument(runner.stages.loss, self.recorder, len(runner.stages.modules),
                           parameter_probes=False)
            if self._zero_sharded():
                self._make_zero(self._pipeline.parameters(),
                                self._pipeline.stage_parameters())
                if self._zero.stage == 2:
                    self._pipeline.weights_done = self._zero.stage_done
                if self._zero.stage == 3:  # this rank's stages (and the loss) gather
                    runner = self._pipeline
                    for module in [runner.stages.modules[k] for k in runner.mine] + \
                            ([runner.stages.loss] if runner.last_owner == self._pp.rank
                             else []):
                        self._train_units += self._zero.rewrite(module)
                    runner.saving = self._zero.saving
                    self._zero.overlap = False
            runner.saving = _stacked(self.recorder.saving, runner.saving)
            if getattr(self, "_held_optimizer", None):  # load() before the stages existed
                from autopar.runtime.checkpoint import adopt_held_optimizer

                adopt_held_optimizer(self)

    def _zero_sharded(self) -> bool:
        """Whether the optimizer runs on ZeRO's pieces: over two or more data-parallel
        ranks, or offloaded (one rank's piece is then the whole parameter, on the host)."""
        return self.plan.zero.stage >= 1 and (self._dp.size > 1 or self.plan.zero.offload)

    def _zero_three(self) -> bool:
        return self._zero is not None and self._zero.stage == 3

    def _make_zero(self, params, stages=None) -> None:
        """ZeRO: the optimizer runs on this rank's 1/dp of every parameter (with stage 2,
        the gradients are cut to those pieces during the backward, under a pipeline
        (`stages`: each stage's parameters) once per micro-batch; with stage 3 the pieces
        are all a rank keeps, and the graphs gather each layer's parameters)."""
        from autopar.runtime.zero import ShardedOptimizerState
        from autopar.runtime.zero3 import ZeroThree

        offload = self.plan.zero.offload
        if self.plan.zero.stage == 3:
            self._zero = ZeroThree(list(params), self._dp, self._optimizer_factory, offload,
                                   self._compute_dtype)
            self._zero.rewrite(self.forward_gm)
        else:
            self._zero = ShardedOptimizerState(list(params), self._dp, self._optimizer_factory,
                                               self.plan.zero.stage, offload=offload,
                                               stages=stages)
        self._adopt(self._zero.optimizer)

    def _adopt(self, optimizer) -> None:
        """Keep the optimizer; one that asks for whole-parameter norms (autopar.optim's LAMB
        and LARS) gets them across this plan's shards."""
        self.optimizer = optimizer
        if optimizer is not None and hasattr(optimizer, "whole_norms"):
            optimizer.whole_norms = self._whole_norms

    def _whole_norms(self, params, tensors) -> list[torch.Tensor]:
        """For each optimizer parameter (a local parameter, or a ZeRO piece of one), the norm
        of the whole tensor `tensors[i]` is this rank's piece of: squared norms weighed by
        their copies, in one vector indexed by parameter name, summed over the world."""
        owner = {id(s): p for s, p in zip(self._zero.shards, self._zero.params)} \
            if self._zero is not None else {}
        slots = []
        vec = torch.zeros(len(self._norm_index), dtype=torch.float64)
        for param, t in zip(params, tensors):
            local = owner.get(id(param), param)
            slot = self._norm_index[self._names[self._key_of[id(local)]][0]]
            vec[slot] += self._squares_once(t, local)
            slots.append(slot)
        self._sum_over_world(vec)
        return [vec[slot].sqrt() for slot in slots]

    def _squares_once(self, t: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
        """This rank's share of the squared norm of `t` (a piece of `param` or of its
        gradient): its squares over the number of ranks holding the same values, so that
        summing over the world counts each value once."""
        return t.detach().double().pow(2).sum() / self._copies(param)

    def _sum_over_world(self, vec: torch.Tensor) -> torch.Tensor:
        """Sum `vec` over every rank in place (logged as an all-reduce on axis 'world')."""
        self.comm_log.add("all_reduce", "world", vec.numel() * vec.element_size(), "step")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(vec)
        return vec

    @property
    def _norm_index(self) -> dict[str, int]:
        """Every parameter's name (the same list on every rank) -> its slot in the norms."""
        if not hasattr(self, "_norm_index_cache"):
            names = sorted({self._names[key][0] for key, t in self._local.items()
                            if isinstance(t, nn.Parameter)})
            self._norm_index_cache = {name: i for i, name in enumerate(names)}
        return self._norm_index_cache

    @property
    def _key_of(self) -> dict[int, int]:
        """id of a local parameter -> its key in self._local."""
        if not hasattr(self, "_key_of_cache"):
            self._key_of_cache = {id(t): key for key, t in self._local.items()}
        return self._key_of_cache

    def _build_pipeline(self, global_batch: int):
        """The local training graph cut into stages, this rank's placed under the plan's
        schedule on the pipeline axis. The stages are the plan's when it names them (a
        plan from `autopar.plan`), else the planner's split for this plan: balanced by
        predicted time under each stage's memory limit."""
        from autopar.cost.schedule import check_microbatches
        from autopar.passes.pipeline import check_stage_count, split_stages
        from autopar.runtime.pipeline import PipelineRunner, stage_count

        pipe = self.plan.pipeline
        n = stage_count(pipe.schedule, self._pp.size, pipe.chunks)
        microbatches = pipe.microbatches if pipe.microbatches > 1 else n
        layers = [layer.name for layer in self.train_graph.layers]
        check_stage_count(layers, n)
        check_microbatches(pipe.schedule, self._pp.size, microbatches, pipe.chunks)
        dp = self._dp.size
        if (global_batch // dp) % microbatches:
            raise PlanError(f"a batch of {global_batch} does not split into {microbatches} "
                            "micro-batches" + (f" on each of {dp} data-parallel replicas"
                                               if dp > 1 else "")
                            + f"; use a batch that is a multiple of {microbatches * dp}.")
        self._stage_of_layer = self._planned_stages(layers, n) or \
            self._balanced_stages(layers, n, global_batch, microbatches)
        stages = split_stages(self.train_gm, self._stage_of_layer, n, targets=1)
        # without ZeRO the runner averages over dp too, overlapped with the last backward
        return PipelineRunner(stages, self._pp, pipe.schedule, microbatches, self._device,
                              every_weight=self._sync_pipeline_params,
                              data=None if self._zero_sharded() else self._dp)

    def _planned_stages(self, layers: list[str], n: int) -> dict[str, int] | None:
        """The plan's own stage per layer, when it gives one for every layer of this
        graph, in order, using every one of the n stages."""
        planned = {lp.name: lp.stage for lp in self.plan.layers}
        if not layers or any(name not in planned for name in layers):
            return None
        stages = [planned[name] for name in layers]
        if sorted(set(stages)) != list(range(n)) or stages != sorted(stages):
            return None
        return dict(zip(layers, stages))

    def _balanced_stages(self, layers: list[str], n: int, global_batch: int,
                         microbatches: int) -> dict[str, int]:
        from autopar.search.planner import pipeline_stages
        from autopar.sharding.solve import tokens_per_sample

        stages = pipeline_stages(self.train_graph, self.plan, global_batch,
                                 tokens_per_sample(self.train_graph) or 1, microbatches)
        if len(stages) != len(layers) or max(stages) != n - 1:
            raise PlanError(f"the planner split {len(stages)} layers into {max(stages) + 1} "
                            f"stages; the graph has {len(layers)} layers for {n} stages.")
        return dict(zip(layers, stages))

    def _pipeline_layers(self) -> set[str]:
        """The layers this pipeline rank's stages run."""
        from autopar.runtime.pipeline import stage_owner

        runner = self._pipeline
        return {layer for layer, k in self._stage_of_layer.items()
                if stage_owner(runner.schedule_name, k, self._pp.size) == self._pp.rank}

    def _sync_pipeline_params(self) -> None:
        """Every pipeline rank gets the trained values of the parameters other ranks own
        (each rank trains only its stages' parameters, and holds no others while it
        trains); once per optimizer step, not per inference call (every rank has taken
        the same number of steps)."""
        if self._pipeline is None or (self._synced_at == self.steps and not self._released):
            return
        self._synced_at = self.steps
        group = self._pp.group
        for target, owner in sorted(self._pipeline.param_owners().items()):
            local = self._local[_key(self.train_graph.params[target])]
            held = self._released.pop(target, None)
            if held is not None:  # made again, to be filled by its owner
                local.data = torch.empty(held[0], dtype=held[1], device=local.device)
            if self._zero_three() and self._zero.index_of(local) is not None:
                # ZeRO-3 keeps pieces: made whole (over dp) to send, and for the other
                # stages' graphs this rank runs to find their shapes, until the next step
                local.data = self._zero.whole(local)
                self._refilled.add(target)
            with torch.no_grad():
                dist.broadcast(local.data, src=dist.get_global_rank(group, owner), group=group)

    def _release_pipeline_params(self) -> None:
        """Free the parameters only other pipeline ranks' stages read: a rank holds its
        stages' weights (a tied embedding on every rank whose stages read it), as the
        planner's memory per stage assumes. Inference, full_state_dict and a new micro-batch
        shape (whose stages are rebuilt) fetch them again from their owners."""
        for target in self._refilled:  # ZeRO-3's pieces are what this rank keeps
            local = self._local[_key(self.train_graph.params[target])]
            local.data = torch.empty(0, dtype=local.dtype, device=local.device)
        self._refilled.clear()
        mine = {id(p) for p in self._pipeline.parameters()}
        for target in self._pipeline.param_owners():
            local = self._local[_key(self.train_graph.params[target])]
            if id(local) in mine or target in self._released or local.numel() == 0:
                continue
            self._released[target] = (tuple(local.shape), local.dtype)
            local.data = torch.empty(0, dtype=local.dtype, device=local.device)

    # ------------------------------------------------------------------ running
    def batch_split(self) -> int:
        """Into how many slices the tensor ranks cut each data-parallel replica's batch (q in
        2D, d*q in 2.5D, q*q in 3D; 1 with 1D layers only)."""
        modes = set(self.plan.layer_modes().values()) | {self.plan.tp_mode}
        if self.mesh.mode not in modes or self.mesh.mode not in MULTI_D:
            return 1
        return {"2d": lambda m: m.size("tp_i"), "2.5d": lambda m: m.size("tp_ki"),
                "3d": lambda m: m.size("tp_ba")}[self.mesh.mode](self.mesh)

    def _local_batch(self, tensors: tuple) -> tuple:
        dp = self._dp.size
        split = self.batch_split()
        out = []
        for t in tensors:
            if t.shape[0] % (dp * split):
                if split > 1:
                    per = t.shape[0] / dp
                    per = int(per) if per == int(per) else per
                    raise PlanError(f"the batch per data-parallel replica ({per} of {t.shape[0]} "
                                    f"over {dp}) does not split over the {self.mesh.mode} batch "
                                    f"split of {split}; use a global batch that is a multiple "
                                    f"of {dp * split}.")
                raise PlanError(f"the global batch {t.shape[0]} does not split over {dp} "
                                f"data-parallel ranks; use a multiple of {dp}.")
            n = t.shape[0] // dp
            # a batch from a CPU data loader goes to the model's device (NCCL: this rank's GPU)
            out.append(t[self._dp.rank * n:(self._dp.rank + 1) * n].to(self._device))
        return tuple(out)

    def train_step(self, inputs, targets) -> float:
        """One optimizer step on a global batch; the loss equals the single-device loss."""
        inputs = self._checked_inputs(inputs, "train_step", self._train_like)
        if not isinstance(targets, torch.Tensor) or targets.dim() == 0:
            raise BatchError(f"train_step's targets must be a tensor with the global batch on "
                             f"dimension 0, not {_kind(targets)}.")
        if targets.shape[0] != inputs[0].shape[0]:
            raise BatchError(f"train_step got a batch of {inputs[0].shape[0]} inputs but "
                             f"{targets.shape[0]} targets; pass the same global batch of both.")
        if self._target_like is not None and \
                (tuple(targets.shape[1:]), targets.dtype) != self._target_like:
            shape, dtype = self._target_like
            raise BatchError(f"train_step's targets are {_shape_text(targets)} "
                             f"{targets.dtype} but the training graph was traced at the first "
                             f"step for {_shape_text(shape)} {dtype}; pass targets shaped "
                             "alike at every step.")
        if not self._batch_checked or self.check_batches:  # a per-rank batch: a mixture
            check_same_batch(inputs + (targets,), self.steps)
            self._batch_checked = True
        check_ids(inputs, self._id_inputs)
        self.recorder.begin_step(self.comm_log)
        *local_inputs, local_target = self._local_batch(inputs + (targets,))
        self._ensure_train_graph(tuple(local_inputs), local_target)
        *local_inputs, local_target = self._cut_sequence(tuple(local_inputs) + (local_target,),
                                                         self.train_graph)
        self.train_gm.train()
        if self._pipeline is not None:  # forward and backward through the schedule
            self._release_pipeline_params()  # (inference may have fetched them)
            # the schedule's loss function scales what it differentiates (fp16), not the
            # loss it reports
            self._pipeline.loss_scale = self.loss_scale
            loss = torch.tensor(self._pipeline.step(tuple(local_inputs), local_target))
            if self._zero is not None and self._zero.stage >= 2:
                self._zero.after_pipeline(self._pipeline.microbatches, self._pipeline.tied())
            if self._zero_three():
                self._zero.end_backward()
            self._release_pipeline_params()
        elif self._zero_three():  # saved parameters are gathered again in the backward
            with self.recorder.saving(), self._zero.saving():
                loss = self.train_gm(*local_inputs, local_target)
            self._backward(loss)
            self.recorder.backward_done()
            self._zero.end_backward()
        else:
            with self.recorder.saving():
                loss = self.train_gm(*local_inputs, local_target)
            if self._buckets is not None:  # the all-reduce overlaps the backward
                self._buckets.armed = True
            self._backward(loss)
            self.recorder.backward_done()
        self._average_gradients()
        if self._overflowed():  # fp16: every rank skips this step alike
            self._drop_gradients()
            if self.max_grad_norm is not None:
                self.last_grad_norm = float("inf")
        else:
            if self.max_grad_norm is not None:
                self.last_grad_norm = self._clip_gradients(self.max_grad_norm)
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            if self._zero is not None:
                self._zero.gather_parameters()
        self.steps += 1
        value = loss.detach().float().reshape(1)
        if self._dp.size > 1:
            value = self._dp.all_reduce(value, "step") / self._dp.size
        self.recorder.finish_step(self.comm_log)
        return float(value)

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before the backward (fp16's dynamic loss
        scale, `self.scaler`; 1.0 under bf16 and fp32, which need none)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """train_steps whose fp16 gradients overflowed somewhere, so no rank stepped."""
        return self.scaler.skipped_steps if self.scaler is not None else 0

    def _backward(self, loss: torch.Tensor) -> None:
        (loss * self.scaler.scale if self.scaler is not None else loss).backward()

    def _overflowed(self) -> bool:
        """fp16: unscale the gradients this rank holds (after the data-parallel reduction,
        before clipping and the step: scales are powers of two, so this is exact) and say
        whether any rank's hold an inf or a nan (one flag summed over the world); updates
        the scale. False without a scaler."""
        if self.scaler is None:
            return False
        overflow = self.scaler.unscale_([g for g, _ in self._gradients()],
                                        self._sum_over_world)
        self.scaler.update(overflow)
        return overflow

    def _drop_gradients(self) -> None:
        """Forget a skipped step's gradients: the parameters' and the ZeRO pieces'."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        for p in self._trained_params():
            p.grad = None
        for piece in getattr(self._zero, "shards", ()):
            piece.grad = None

    def _gradients(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(gradient, the local parameter it belongs to) for every gradient this rank holds
        for its optimizer: ZeRO pieces, or its (stages') whole local parameters."""
        if self._zero is not None:
            return [(s.grad, p) for s, p in zip(self._zero.shards, self._zero.params)
                    if s.grad is not None]
        return [(p.grad, p) for p in self._trained_params() if p.grad is not None]

    def _trained_params(self) -> list[nn.Parameter]:
        """The local parameters this rank trains (under a pipeline: its stages')."""
        return self._pipeline.parameters() if self._pipeline is not None else \
            self._unique_params()

    def _copies(self, param: nn.Parameter) -> int:
        """On how many ranks of the world the same gradient values of `param` (or of this
        rank's ZeRO piece of it) lie: its copies over the tensor axes (a layout that splits
        it into k pieces over a mesh of n ranks leaves n/k copies of each; cp keeps whole
        copies), over dp (none under ZeRO, whose pieces differ), and over the pipeline
        ranks that share a tied parameter."""
        key = self._key_of.get(id(param))
        layout = self._layouts.get(key)
        parts = layout.parts(self.mesh.sizes) if layout is not None else 1
        copies = self.mesh.total // parts
        if self._zero is None:
            copies *= self._dp.size
        if self._pipeline is not None:
            copies *= self._pipeline.copies(param)
        return copies

    def _clip_gradients(self, max_norm: float) -> float:
        """Scale every gradient by max_norm / (global norm + 1e-6) when that is below 1, the
        norm taken over every shard of every parameter once (one scalar all-reduce over the
        world), as torch.nn.utils.clip_grad_norm_ does on one device. Returns the norm."""
        grads = self._gradients()
        total = torch.zeros(1, dtype=torch.float64)
        for grad, param in grads:
            total += self._squares_once(grad, param)
        norm = float(self._sum_over_world(total).sqrt())
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for grad, _ in grads:
                grad.mul_(coef)
        return norm

    def _average_gradients(self) -> None:
        if self._zero is not None:  # each rank receives the mean of its pieces only
            self._zero.reduce_gradients()  # (one rank, offloaded: the host copies)
            return
        if self._dp.size == 1 or (self._pipeline is not None and self._pipeline.data is not None):
            return  # (a pipeline without ZeRO averaged over dp in its step)
        if self._buckets is not None:
            self._buckets.finish()
            return
        average_gradients(self._unique_params(), self._dp)

    def forward(self, *inputs):
        """Inference on the whole batch on every rank; outputs are whole on every rank."""
        inputs = self._checked_inputs(inputs, "the engine's forward", self._inputs_like)
        check_ids(inputs, self._id_inputs)
        split = self.batch_split()
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] % split:
                raise PlanError(f"the batch {t.shape[0]} does not split over the "
                                f"{self.mesh.mode} batch split of {split}; use a multiple of "
                                f"{split}.")
        self._sync_pipeline_params()
        inputs = tuple(t.to(self._device) if isinstance(t, torch.Tensor) else t
                       for t in inputs)
        out = self.forward_gm(*self._cut_sequence(inputs, self.forward_graph))
        if self._zero_three():
            self._zero.drain()
        return out

    def _checked_inputs(self, inputs, where: str, like) -> tuple:
        """The inputs as a tuple of tensors, as many as the example inputs, shaped like
        `like` past the batch (what the graph was traced for; None: not traced yet), or a
        BatchError naming what differs."""
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if not inputs or not all(isinstance(t, torch.Tensor) and t.dim() for t in inputs):
            kinds = ", ".join(_kind(t) for t in inputs) or "nothing"
            raise BatchError(f"{where} takes tensors (or a tuple of them) with the global batch "
                             f"on dimension 0, not {kinds}.")
        if len(inputs) != len(self._inputs_like):
            raise BatchError(f"{where} got {len(inputs)} input tensor(s) but the engine was "
                             f"built for {len(self._inputs_like)} (its example_inputs); pass "
                             "the same number.")
        for i, (t, (shape, dtype)) in enumerate(zip(inputs, like or ())):
            if tuple(t.shape[1:]) != shape or t.dtype != dtype:
                raise BatchError(f"{where}'s input {i} is {_shape_text(t)} {t.dtype} but the "
                                 f"graph was traced for {_shape_text(shape)} {dtype} (batch "
                                 "aside); pass inputs shaped alike at every call, or build the "
                                 "engine with example inputs of this shape.")
        if any(t.shape[0] != inputs[0].shape[0] for t in inputs):
            raise BatchError(f"{where}'s inputs have different batch sizes "
                             f"({', '.join(str(t.shape[0]) for t in inputs)}); give every "
                             "input the same global batch on dimension 0.")
        return inputs

    # ------------------------------------------------------------------ accounting
    def predicted_comm(self, global_batch: int) -> dict[tuple[str, str], int]:
        """Bytes per (collective, axis) of one train_step at this global batch, from the plan."""
        out: dict[tuple[str, str], int] = {}
        for (op, axis, _), nbytes in self.predicted_comm_by_layer(global_batch).items():
            out[(op, axis)] = out.get((op, axis), 0) + nbytes
        return out

    def predicted_comm_by_layer(self, global_batch: int) -> dict[tuple[str, str, str], int]:
        """Bytes per (collective, axis, layer) of one train_step at this global batch, from
        the plan; what the step sends outside the graph (the data-parallel gradient sync,
        ZeRO, the world's norms) is under layer "(step)", ZeRO-3's gathers included."""
        if self.train_solution is None:
            raise PlanError("the training graph is traced at the first train_step; call it first.")
        local = global_batch // self._dp.size
        by_layer: dict[tuple[str, str, str], int] = {}
        out: dict[tuple[str, str], int] = {}  # what the step sends outside the graph
        mine = self._pipeline_layers() if self._pipeline is not None else None
        # a pipeline runs every collective once per micro-batch, at the micro-batch's size
        runs = self._pipeline.microbatches if self._pipeline is not None else 1
        layer_of = {n.name: n.meta["autopar"].layer for n in self.train_graph.graph.nodes}
        # under bf16/fp16 the model part's collectives move 16-bit values
        for c, factor in comm_factors(self.train_solution, self._compute_dtype):
            if mine is not None and layer_of.get(c.where) not in mine:  # another rank's stage
                continue
            key = (c.op, c.axis, layer_of.get(c.where) or STEP)
            nbytes = runs * int((sympy.sympify(c.bytes) * factor).subs(BATCH, local // runs))
            by_layer[key] = by_layer.get(key, 0) + nbytes
        if self._dp.size > 1:
            grad_bytes = sum(p.numel() * p.element_size() for p in self._trained_params()
                             if p.requires_grad)
            out[("all_reduce", "dp")] = grad_bytes + 4  # the gradients, then the loss
            if self._zero_three():  # each layer gathered for its forward, again where its
                # backward needs it (an embedding's does not), its gradients reduce-scattered
                # (under a pipeline, for each micro-batch)
                z = self._zero
                once = sum(z.unit_bytes(u) for u in self._train_units)
                out[("all_reduce", "dp")] = 4
                out[("reduce_scatter", "dp")] = runs * once
                out[("all_gather", "dp")] = \
                    runs * sum(z.gather_bytes(u) for u in self._train_units) + \
                    sum(z.gather_bytes(u) for u in z.backward_gathers or ())
            elif self._zero is not None:  # ZeRO-1/2: the all-reduce's two halves, padded
                out[("all_reduce", "dp")] = 4
                # (stage 2 under a pipeline reduce-scatters each micro-batch's gradients)
                sends = runs if self._zero.stage == 2 else 1
                out[("reduce_scatter", "dp")] = sends * self._zero.padded_bytes()
                out[("all_gather", "dp")] = self._zero.padded_bytes()
        world = 0
        if self.max_grad_norm is not None:  # the squared norm, summed over the world
            world += 8
        if self.optimizer is not None and \
                getattr(self.optimizer, "whole_norms", None) == self._whole_norms:
            # LAMB/LARS: two vectors of squared norms (one per parameter) per group
            world += 2 * len(self.optimizer.param_groups) * 8 * len(self._norm_index)
        if self.scaler is not None:  # fp16: the overflow flag, summed over the world
            world += 4
        if world:
            out[("all_reduce", "world")] = world
        for (op, axis), nbytes in out.items():
            key = (op, axis, STEP)
            by_layer[key] = by_layer.get(key, 0) + nbytes
        return by_layer

    @staticmethod
    def _rank() -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def explain(self, format: str = "text", world=None):
        """The plan's prediction beside what this rank measured over the steps run so far
        (the first is a warm-up and not counted; `engine.recorder.reset()` starts afresh):
        per layer the forward and backward time, the bytes its collectives moved and the
        activations autograd saved, with the parameters it holds; per mesh axis the bytes
        and the time blocked in collectives; the step time. `format="json"` returns the
        numbers as a dict (autopar.report.measured). `world`: an autopar.World whose hardware
        profile prices the plan (default: this machine's, `World(devices=..., device=
        "profile.json")` for one from `autopar calibrate`)."""
        from autopar.report.measured import measured_report, measured_text

        data = measured_report(self, world)
        if format == "json":
            return data
        if format != "text":
            raise PlanError(f"explain format must be 'text' or 'json', not {format!r}.")
        return measured_text(data)

    def parameter_bytes(self) -> dict[str, tuple[int, int]]:
        """Per parameter name: (bytes held by this rank, bytes of the whole parameter)."""
        out = {}
        for key, local in self._local.items():
            layout = self._layouts[key]
            parts = layout.parts(self.mesh.sizes) if layout is not None else 1
            i = self._zero.index_of(local) if self._zero_three() else None
            numel = local.numel() if i is None else self._zero.numels[i]  # (ZeRO-3: whole)
            nbytes = numel * local.element_size()
            out[self._names[key][0]] = (nbytes, nbytes * parts)
        return out

    def parameter_layouts(self) -> dict[str, Layout | None]:
        """Per parameter and buffer name: its layout on the tensor axes (see `self.mesh`)."""
        return {self._names[key][0]: layout for key, layout in self._layouts.items()}

    def replicated_parameters(self) -> list[str]:
        """Names of the parameters and buffers every tensor-parallel rank holds whole."""
        return sorted(self._names[k][0] for k, lay in self._layouts.items()
                      if lay is None or not lay.shards)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole weights on every rank, keyed and ordered as the original model's state_dict."""
        self._sync_pipeline_params()
        whole = {}
        for key, local in self._local.items():
            layout = self._layouts[key]
            value = local.detach()
            if self._zero_three() and self._zero.index_of(local) is not None:
                value = self._zero.whole(local)  # ZeRO-3 keeps pieces only
            if layout is not None:
                for shard in layout.shards:  # composites: minor component first
                    for axis, groups in reversed(shard_steps(shard, self.mesh)):
                        value = self.groups[axis].all_gather(value, shard.dim, groups, "state")
            for name in self._names[key]:
                whole[name] = value.clone()
        whole.update(self._untraced_state)
        return {k: whole[k] for k in self._state_keys if k in whole}

    def save(self, path, keep: int = 2) -> str:
        """Checkpoint weights, optimizer state and step counter under the directory `path`,
        each rank writing only the part it holds, in a form any plan and world can load
        (`autopar.runtime.checkpoint`); atomic: `path/latest` names the newest complete
        checkpoint, the newest `keep` are kept. Every rank calls it; returns the
        checkpoint's directory."""
        from autopar.runtime.checkpoint import save

        return save(self, path, keep=keep)

    def load(self, path) -> str:
        """Restore weights, optimizer state and step counter from a checkpoint written by
        `save` under any plan or world (`path`: the directory given to save, or one of its
        step directories). Every rank calls it; returns the checkpoint's directory."""
        from autopar.runtime.checkpoint import load

        return load(self, path)


def check_divisible(traced, solution: Solution) -> None:
    """Attention heads and block widths must split evenly over the tensor axis."""
    from autopar.sharding.divisible import indivisible

    problem = indivisible(traced, solution)
    if problem:
        raise PlanError(problem)


def _kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return "a 0-dimensional tensor" if value.dim() == 0 else "a tensor"
    return "None" if value is None else f"a {type(value).__name__}"


def _shape_text(shape_or_tensor) -> str:
    """(B, 32, 64) for a tensor, (*, 32, 64) for the sizes past the batch."""
    if isinstance(shape_or_tensor, torch.Tensor):
        return str(tuple(shape_or_tensor.shape))
    return "(" + ", ".join(["*"] + [str(n) for n in shape_or_tensor]) + ")"


_PASS_THROUGH = {torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                 torch.ops.aten._unsafe_view.default, torch.ops.aten.unsqueeze.default,
                 torch.ops.aten.expand.default, torch.ops.aten.clone.default,
                 torch.ops.aten.slice.Tensor, torch.ops.aten.contiguous.default,
                 torch.ops.aten.alias.default}


def _embedding_index_source(node):
    """The node an embedding's index tensor is read from, through reshapes and slices."""
    while isinstance(node, fx.Node) and node.op == "call_function" and \
            node.target in _PASS_THROUGH:
        node = node.args[0]
    return node


def _embeddings(traced):
    """(embedding node, rows of its table, where its indices come from) for each lookup."""
    for node in traced.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.embedding.default:
            weight = node.args[0]
            pinfo = traced.params.get(weight.target) if weight.op == "get_attr" else None
            if pinfo is not None:
                yield node, int(pinfo.shape[0]), _embedding_index_source(node.args[1])


def id_inputs(traced) -> list[tuple[int, int, str]]:
    """(input position, rows, module) for each embedding that looks up an input directly:
    its ids are checked on the global batch before any rank's collective."""
    places = [n for n in traced.graph.nodes if n.op == "placeholder"]
    out = []
    for node, rows, source in _embeddings(traced):
        if source in places:
            out.append((places.index(source), rows, node.meta["autopar"].module or "embedding"))
    return out


def check_ids(inputs: tuple, embeddings) -> None:
    """Refuse token ids outside an embedding's table as one device would (IndexError), on
    the global batch every rank holds, so every rank refuses alike (no rank left waiting in
    a collective); on a GPU as an asynchronous device-side assertion (no host sync)."""
    from autopar.kernels.multid import check_index_range

    for i, rows, module in embeddings:
        if i < len(inputs):
            check_index_range(inputs[i], rows, f"input {i} (the token ids of {module})")


def check_positions(traced) -> None:
    """Refuse example inputs longer than a position table: a lookup of arange(n) in a table
    of fewer rows, which meta tensors trace without complaint and the first step would hit."""
    for node, rows, source in _embeddings(traced):
        if isinstance(source, fx.Node) and source.op == "call_function" and \
                source.target in (torch.ops.aten.arange.default, torch.ops.aten.arange.start):
            ends = [a for a in source.args if isinstance(a, int)]
            length = ends[-1] - (ends[0] if len(ends) > 1 else 0) if ends else None
            if length is not None and length > rows:
                module = node.meta["autopar"].module or "a position embedding"
                raise PlanError(f"the example inputs have {length} positions but {module} has "
                                f"{rows} rows; use sequences of at most {rows} tokens (or a "
                                "model with more positions).")


def _check_tokens_divide(traced, parts: int, no_sequence: str, splits: str,
                         other: str) -> None:
    """Refuse a model without token sequences, or whose sequence length does not divide
    into `parts`, naming the lengths that would."""
    from autopar.sharding.solve import tokens_per_sample

    seq = tokens_per_sample(traced)
    if seq is None:
        raise PlanError(no_sequence)
    if seq % parts:
        lo = seq - seq % parts
        ok = " or ".join(str(n) for n in (lo, lo + parts) if n > 0)
        raise PlanError(f"{splits.format(seq=seq)}, and {seq} does not divide by {parts}: use "
                        f"a sequence length of {ok}, or {other.format(seq=seq)}.")


def check_sequence_dims(traced, plan: Plan) -> None:
    """Megatron sequence parallelism splits each sample's tokens over tp: refuse a sequence
    length that does not divide, naming the lengths that would."""
    tp = plan.mesh["tp"]
    if not plan.sequence_parallel_layers() or tp == 1:
        return
    _check_tokens_divide(
        traced, tp, "sequence_parallel needs token sequences, but the model's first input "
        "is not [batch, tokens, ...]; drop sequence_parallel for this model.",
        f"sequence_parallel splits each sample's {{seq}} tokens over tensor size {tp}",
        "a tensor size that divides {seq}")


def check_context_dims(traced, plan: Plan) -> None:
    """Context parallelism splits each sample's tokens over cp: refuse a sequence length that
    does not divide, naming the lengths that would."""
    cp = plan.mesh["cp"]
    if cp == 1:
        return
    zigzag = plan.cp_layout() == "zigzag"
    _check_tokens_divide(
        traced, 2 * cp if zigzag else cp, "sequence parallelism over cp needs token sequences, "
        "but the model's first input is not [batch, tokens, ...]; use a sequence size of 1.",
        f"sequence size {cp} splits each sample's {{seq}} tokens over cp" +
        (f" in the zigzag layout (2 x {cp} chunks)" if zigzag else ""),
        "layout='contiguous' (chunks of S / cp), or a sequence size whose double divides "
        "{seq}" if zigzag else "a sequence size that divides {seq}")


_WHAT = {"out": "output features", "in": "input features", "hidden": "hidden size",
         "heads": "attention heads"}


def check_grid_dims(traced, plan: Plan, mesh) -> None:
    """Every dim a 2D, 2.5D or 3D layer splits must divide by its grid: refuse with the dim,
    the layer and the nearest sizes that would."""
    from autopar.graph.analysis import OpKind

    if mesh.mode not in MULTI_D or plan.mesh["tp"] == 1:
        return
    modes = plan.layer_modes()
    q = mesh.size(mesh.physical[-1])
    out_parts = q * q if mesh.mode == "3d" else q
    for node in traced.graph.nodes:
        info = node.meta.get("autopar")
        if info is None or modes.get(info.layer, plan.tp_mode) != mesh.mode:
            continue
        checks = []
        if info.kind is OpKind.LINEAR:
            w = node.args[2] if node.target is torch.ops.aten.addmm.default else node.args[1]
            shape = w.meta["autopar"].shape
            out_f, in_f = (shape[1], shape[0]) if node.target is torch.ops.aten.addmm.default \
                else (shape[0], shape[1])
            checks += [("out", int(out_f), out_parts), ("in", int(in_f), q)]
        elif info.kind in (OpKind.NORM, OpKind.EMBEDDING):
            checks.append(("hidden", int(info.shape[-1]), q))
        elif info.kind is OpKind.ATTENTION:
            checks.append(("heads", int(info.shape[1]), q))
        for what, n, parts in checks:
            if n % parts:
                ok = [m for m in (n - n % parts, n - n % parts + parts) if m > 0]
                raise PlanError(f"{mesh.mode} tensor parallelism over {plan.mesh['tp']} ranks "
                                f"splits the {_WHAT[what]} of {info.module or info.layer} into "
                                f"{parts}, and {n} does not divide: use "
                                f"{' or '.join(map(str, ok))} {_WHAT[what]}, or another tensor "
                                "size.")


def _key(pinfo) -> int:
    return hash(pinfo.names)


def _stacked(outer, inner):
    """A context factory entering `outer()` then `inner()`."""
    @contextlib.contextmanager
    def both():
        with outer(), inner():
            yield

    return both


def _blank(tensors: tuple, device: torch.device) -> tuple:
    """Zero tensors shaped like the examples, on the model's device (tracing reads no values)."""
    return tuple(torch.zeros(t.shape, dtype=t.dtype, device=device)
                 if isinstance(t, torch.Tensor) else t for t in tensors)
