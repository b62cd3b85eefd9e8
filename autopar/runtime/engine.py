"""The training engine `autopar.parallelize` returns: one rank's rewritten graphs, optimizer
and gradient path, put together and run step by step (the parts live beside it: params,
gradients, stages, batches, accounting, measure, zero, pipeline, checkpoint)."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from autopar.errors import PlanError
from autopar.graph.trace import release_tensors, trace
from autopar.kernels.collectives import AxisGroup, CommLog, bind
from autopar.kernels.float8 import ROWWISE, check_recipe
from autopar.kernels.modules import RandomStreams, bind_streams
from autopar.kernels.moe import ScheduleBalance, StepBalance
from autopar.kernels.moe_layers import ExpertLayer, expert_layers, opaque_moe
from autopar.modes import (
    CP,
    DP,
    DP_REPLICATE,
    DP_SHARD,
    EDP,
    EP,
    FP8,
    FP16,
    FP32,
    PP,
    RING,
    TP,
    ZERO_BUBBLE,
)
from autopar.passes.chunked_loss import chunk_loss
from autopar.passes.experts import (
    check_balance_loss,
    expert_weights,
    place_expert_layers,
    with_balance_loss,
)
from autopar.passes.float8 import EXPERTS_KEPT, Float8Report, float8_linears
from autopar.passes.precision import cast_precision, compute_dtype
from autopar.passes.tensor_parallel import apply_solution, shard_parameters
from autopar.plans import Plan
from autopar.plans.checks import check_divisible, check_graph
from autopar.plans.views import views
from autopar.runtime import accounting, batches
from autopar.runtime.checkpoint import Checkpointing
from autopar.runtime.compile import CompiledRegions, compile_graphs
from autopar.runtime.export import MAX_SHARD_BYTES
from autopar.runtime.gradients import Gradients, make_zero, zero_sharded
from autopar.runtime.hsdp import ShardGroup
from autopar.runtime.master import master_weights
from autopar.runtime.measure import Recorder, instrument
from autopar.runtime.metrics import PHASE as METRICS_PHASE
from autopar.runtime.params import ShardedParams
from autopar.runtime.recompute import Recompute
from autopar.runtime.scaler import LossScaler
from autopar.runtime.snapshot import memory_snapshot
from autopar.runtime.stages import PipelineWeights, build_pipeline, layers_here, pipeline_step
from autopar.runtime.startup import ModelCard, export, retarget
from autopar.runtime.watch import Watch
from autopar.runtime.zero_state import ZeroState
from autopar.sharding.axes import MULTI_D, TensorMesh
from autopar.sharding.solve import Solution, solve

CHUNKED_LOSSES = "autopar_chunked_losses"  # GraphModule.meta key: the losses chunk_loss fused


class Engine(nn.Module):
    """A model split over a mesh: `train_step`, forward, `comm_log`, `full_state_dict`.

    `after_backward` holds callables run after each step's backward, before the gradients
    are averaged over dp (autopar.runtime.measure samples memory there)."""

    float8: Float8Report | None = None  # precision="fp8": what runs in float8, and why not

    def __init__(self, model: nn.Module, plan: Plan, groups: dict[str, AxisGroup],
                 example_inputs: tuple, loss_fn, optimizer, seed: int = 0,
                 forward_graph=None, max_grad_norm: float | None = None,
                 precision: str = FP32, check_batches: bool = False, stage_planner=None,
                 start=None, compile: bool = False, chunked_loss: bool = True,
                 fp8_recipe: str = ROWWISE):
        super().__init__()
        self.chunked_loss = chunked_loss  # passes.chunked_loss
        self.plan, self.groups, self.loss_fn = plan, groups, loss_fn
        self.max_grad_norm, self.steps = max_grad_norm, 0
        self.check_batches = check_batches  # compare every step's batch across ranks
        self.stage_planner = stage_planner  # layers -> stages when the plan names none
        self.precision = precision  # 16-bit compute on fp32 masters (autopar.passes.precision)
        self.compute_dtype = compute_dtype(precision)  # None: fp32, no cast
        self.fp8_recipe = check_recipe(fp8_recipe)  # precision="fp8": the scaling recipe
        self.scaler = LossScaler() if precision == FP16 else None
        self.regions = CompiledRegions() if compile else None  # runtime.compile: inductor
        self.last_grad_norm: float | None = None  # the global norm of the last step's grads
        self.comm_log: CommLog = groups[TP].log
        self.recorder = Recorder()  # per-layer time, saved bytes, collectives' layers
        self.comm_log.recorder = self.recorder
        # what runs outside the training step's schedule: a pipeline's weight fetch (at the
        # run that finds the stages' shapes, before inference and export) and torch's
        # one-time pipeline handshake (docs/communication.md)
        self.startup_log, self.after_backward = CommLog(), []
        self.metrics = None  # a runtime.metrics.StepMetrics: one line per step
        self.checkpointing = Checkpointing()  # saves by itself (parallelize's checkpoint_dir)
        self.watch = Watch(None, 1)  # where this rank is (parallelize's timeout gives it a store)
        self.model_card = ModelCard(model)  # what export needs once the model is released
        self._tp, self._dp = groups[TP], groups[DP]
        self._cp = groups[CP] if CP in groups else AxisGroup(CP, 1, 0, None, self.comm_log)
        self._pp = groups[PP] if PP in groups else AxisGroup(PP, 1, 0, None, self.comm_log)
        self.mesh = plan.tensor_mesh()
        if self._cp.size > 1 and self.mesh.mode not in MULTI_D:  # cp beside the 1D tensor axis
            self.mesh = TensorMesh.with_cp(self._cp.size, self._tp.size)
        # ZeRO's group: dp, or under HSDP the shard group with its replicas
        self._zero_dp = ShardGroup(groups[DP_SHARD], groups[DP_REPLICATE]) \
            if DP_SHARD in groups else self._dp
        self.streams = RandomStreams(seed, self._dp.rank, self._tp.rank, self._cp.rank)
        self.params = ShardedParams(self.mesh, {a: groups[a].rank for a in self.mesh.physical},
                                    model, start)  # start: a meta model's or weights= values
        self.grads = Gradients(self.params, self._dp, self.comm_log)
        self.grads.replicas = plan.dp_replicate  # HSDP: ZeRO's pieces held this many times
        self.moe_layers = expert_layers(model, plan)  # MoE layers over ep or 1D tp
        self._model = model  # kept until the training graph is traced, then released
        self._device = start.device if start is not None else \
            next((p.device for p in model.parameters()), torch.device("cpu"))
        self.recorder.device = self._device  # CUDA events time a GPU's layers
        if start is not None:  # ZeRO-3 without a pipeline: only pieces, from the start
            start.expect_zero(plan.zero, self._zero_dp, self._pp.size,
                              groups[EDP] if self.moe_layers and plan.ep > 1 else None)
            # a pipeline rank makes only its stages' slices, once the stages are cut
            self.params.defer = self._pp.size > 1
        _build_forward(self, model, example_inputs, forward_graph, loss_fn)
        self.params.keep_untraced(model)
        self.train_graph = None
        self.train_solution: Solution | None = None
        self.train_gm: fx.GraphModule | None = None
        self.global_batch: int | None = None  # of the training graph's first step
        self._optimizer_factory = optimizer = master_weights(optimizer)  # 16-bit: fp32 masters
        self.stage_of_layer: dict[str, int] = {}
        self._weights: PipelineWeights | None = None
        self.train_units: list[int] = []  # ZeRO-3: the layers the training graph gathers
        self.recompute: Recompute | None = None  # the plan's, over the training graph
        self._held_optimizer = None  # optimizer state a load read before the stages existed
        self.optimizer = None
        if not zero_sharded(plan.zero, self._dp.size):
            self.optimizer = self.grads.with_norms(
                optimizer(self.params.parameters()) if optimizer is not None else None)
        elif self._pp.size == 1:  # a pipeline rank shards the parameters of its stages
            # a start's ZeRO-3 pieces become the shards (no second copy of them)
            pieces = start.take_pieces() if start is not None else None
            self._make_zero(self.params.parameters(), pieces=pieces)
            if start is not None:
                start.check_pieces(pieces)

    # ------------------------------------------------------------------ building
    @staticmethod
    def trace_for(model: nn.Module, example_inputs: tuple, plan: Plan | None = None):
        """The inference graph the engine starts from (parallelize checks a plan on it)."""
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        with opaque_moe(model, expert_layers(model, plan)):
            return trace(model, _blank(example_inputs, device), train=False)

    def _solve(self, traced, fixed) -> Solution:
        cp = self._cp.size > 1
        mesh = self.mesh if self.mesh.mode in MULTI_D or cp else None
        return solve(traced, axis=TP, size=self._tp.size, modes=self.plan.layer_modes(),
                     default_mode=self.plan.tp_mode, fixed_params=fixed, mesh=mesh,
                     sequence_parallel=self.plan.sequence_parallel_layers(),
                     sequence_mode=(self.plan.sequence_mode or RING) if cp else None,
                     sequence_layout=self.plan.cp_layout(), cp_grads=self.grads.cp_grads)

    def _build(self, traced, solution: Solution) -> fx.GraphModule:
        """Rewrite a traced graph and install this rank's slices (shared across graphs)."""
        gm = _rewrite(self, traced, solution)
        return _install(self, gm, _slices(self, traced, solution))

    @property
    def forward_gm(self) -> fx.GraphModule:
        """The inference graph, rewritten at its first read: a training run never runs it, so
        a start cuts only its parameter slices (`_build_forward`)."""
        if self._forward_gm is None:
            self._forward_gm = _rewrite_forward(self)
        return self._forward_gm

    @property
    def chunked_losses(self) -> int:
        """Classifier + cross-entropy chains fused (passes.chunked_loss) in the training
        graph, or before its first step in the inference graph."""
        gm = self.train_gm if self.train_gm is not None else self.forward_gm
        return gm.meta.get(CHUNKED_LOSSES, 0)

    def parameters(self, recurse: bool = True):
        return iter(self.params.parameters())

    def ensure_train_graph(self, inputs: tuple, target: torch.Tensor) -> None:
        """Trace and build the training graph for this rank's local batch, once (train_step
        calls it on its first step; `self.batches.local` cuts a global batch)."""
        if self.train_gm is not None:
            return
        if self.loss_fn is None:
            raise PlanError("train_step needs a loss_fn; pass loss_fn=... to autopar.parallelize.")
        at = next((p.device for p in self._model.parameters()), self._device)  # meta too
        with opaque_moe(self._model, self.moe_layers):
            self.train_graph = trace(self._model, _blank(inputs, at), loss_fn=self.loss_fn,
                                     example_target=_blank((target,), at)[0], train=True)
        _check_accumulation(self.microbatches, self._pp.size, self.train_graph.gm)
        fixed = {t: self.params.layout_for(p) for t, p in self.forward_graph.params.items()
                 if t in self.train_graph.params}
        self.train_solution = self._solve(self.train_graph, fixed=fixed)
        _note_replicated(self.plan, self.train_solution)
        self.train_gm = self._build(self.train_graph, self.train_solution)
        self.recompute = Recompute(self.plan, self.train_graph)
        self.batches.traced(inputs, target)
        self.global_batch = int(target.shape[0]) * self._dp.size
        self._model = None
        if self._pp.size > 1:
            # (again: a model may return its balance loss only while training)
            check_balance_loss(self.train_graph.gm, self.plan.pipeline.schedule)
            self._wire_pipeline()
            return
        instrument(self.train_gm, self.recorder, 0)  # (a pipeline's stages once cut)
        if self.zero is not None:  # (ZeRO-3: the gathers each layer needs)
            self.train_units = self.zero.rewrite(self.train_gm)
        self.recompute.apply(self.train_gm)  # (after the marks and gathers: they stay out)
        compile_graphs(self.regions, [self.train_gm])  # after every pass that adds modules
        if self.zero is None:  # the bucketed all-reduce (over dp, or dp x cp)
            self.grads.buckets = self.grads.make_buckets(self.train_gm, self.train_solution)

    def _wire_pipeline(self) -> None:
        """Cut the training graph into stages; ZeRO shards this rank's stages' parameters."""
        # without ZeRO the runner averages over dp too, overlapped with the last backward
        # (with experts split over ep, Gradients.average takes dp and edp after the schedule)
        averages = not zero_sharded(self.plan.zero, self._dp.size) and not self.moe_layers
        runner, self.stage_of_layer = build_pipeline(
            self.plan, self.train_graph, self.train_gm, self._pp, self._dp, self.global_batch,
            self._device, self.fetch_pipeline_weights, self._dp if averages else None,
            self.stage_planner)
        self.grads.pipeline = runner
        runner.startup_log = self.startup_log
        balanced = [m for m in self.train_gm.modules()
                    if isinstance(m, ExpertLayer) and m.with_aux]
        if balanced:  # (gpipe: check_balance_loss) the balance loss over the whole step
            for m in balanced:
                m.balance = ScheduleBalance(runner.microbatches)
            runner.loss_correction = StepBalance([m.balance for m in balanced])
        self.params.fill(runner.parameters())  # a start's slices of this rank's stages only
        self._weights = PipelineWeights(runner, self.params, self.train_graph, self._pp)
        self._weights.release()  # the other stages' slices: placeholders until fetched
        runner.release_weights = self._weights.release  # after the run that finds shapes
        for k, module in runner.held_modules():
            instrument(module, self.recorder, k, parameter_probes=False)
        if zero_sharded(self.plan.zero, self._dp.size):
            self._make_zero(runner.parameters(), runner.stage_parameters())
            self.train_units += self.zero.wire_pipeline(runner)
        for _, module in runner.held_modules():
            self.recompute.apply(module)
        runner.saving = _stacked(self.recorder.saving, runner.saving)
        compile_graphs(self.regions, [module for _, module in runner.held_modules()])
        if self._held_optimizer is not None:  # load() before the stages existed
            from autopar.runtime.checkpoint import adopt_held_optimizer

            adopt_held_optimizer(self, self.take_held_optimizer())

    def _make_zero(self, params, stages=None, pieces=None) -> None:
        """ZeRO: the optimizer runs on this rank's 1/dp of every parameter (`stages`: each
        pipeline stage's parameters, for stage 2's per-micro-batch reduction; `pieces`:
        ZeRO-3's pieces a start made, adopted as they are)."""
        self.grads.zero = make_zero(self.plan.zero, params, self._zero_dp,
                                    self._optimizer_factory, self.compute_dtype, stages,
                                    experts=self.grads, pieces=pieces,
                                    float8=self.float8 is not None)
        if self._forward_gm is not None:
            self.zero.rewrite(self._forward_gm)  # (ZeRO-3: each layer's gathers)
        elif self.zero.pieces_only:  # ZeRO-3 numbers the inference graph's units first:
            self.forward_gm  # noqa: B018 - rewritten now, with its gathers
        self.optimizer = self.grads.with_norms(self.zero.optimizer)

    def fetch_pipeline_weights(self) -> None:
        """A pipeline rank gets the trained weights of the stages other ranks run (logged in
        `startup_log`, as every collective the fetch runs, ZeRO-3's gathers included)."""
        if self._weights is not None:
            with self.comm_log.diverted(self.startup_log):
                self._weights.fetch(self.steps, self.zero)
        else:  # before the stages are cut: every slice a start deferred, made here
            self.params.fill()

    def pipeline_layers(self) -> set[str]:
        """The layers this pipeline rank's stages run."""
        return layers_here(self.pipeline, self.stage_of_layer, self._pp)

    # ------------------------------------------------------------------ running
    def batch_split(self) -> int:
        """Into how many slices the tensor ranks cut each replica's batch (1 under 1D)."""
        return self.batches.split

    def train_step(self, inputs, targets) -> float:
        """One optimizer step on a global batch; the loss equals the single-device loss."""
        with self.watch.guard(self.steps, "forward and backward"):
            return _run_step(self, inputs, targets)

    def _forward_backward(self, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
        """The step's loss, with its gradients in .grad (a pipeline's through its schedule)."""
        if self.pipeline is not None:
            return pipeline_step(self.pipeline, self._weights, self.zero, inputs, target,
                                 self.loss_scale)
        return _accumulate(self, inputs, target)

    @property
    def microbatches(self) -> int:
        """Micro-batches each replica's batch runs in per step: the pipeline's schedule's,
        or without a pipeline the plan's gradient accumulation (1: the batch in one pass)."""
        if self.pipeline is not None:
            return self.pipeline.microbatches
        return self.plan.pipeline.microbatches if self._pp.size == 1 else 1

    @property
    def loss_scale(self) -> float:
        """fp16's dynamic loss scale (`self.scaler`); 1.0 under bf16 and fp32."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def skipped_steps(self) -> int:
        """train_steps whose fp16 gradients overflowed somewhere, so no rank stepped."""
        return self.scaler.skipped_steps if self.scaler is not None else 0

    def forward(self, *inputs):
        """Inference on the whole batch on every rank; outputs are whole on every rank."""
        inputs = self.batches.for_forward(inputs)
        self.fetch_pipeline_weights()
        for layer in self.expert_layers():
            layer.reset_load()
        out = self.forward_gm(*self.batches.tokens(inputs, self.forward_graph))
        if self.zero is not None:
            self.zero.drain()
        return out

    def expert_load(self) -> dict[str, dict]:
        """The routing the last step (or forward) took, per MoE layer split over ep that ran
        on this rank: `routed`, this rank's token-expert assignments per expert (all E;
        summed over the data ranks, the step's tokens per expert), `computed`, the rows this
        rank's experts ran (E/ep, from `first_expert` on), over all micro-batches. Empty
        where the model's own MoE code runs (no ep axis and no 1D tensor axis)."""
        return {m.name: {"routed": m.routed.tolist(), "computed": m.computed.tolist(),
                         "first_expert": m.kernel.first_expert}
                for m in self.expert_layers() if m.routed is not None}

    def expert_layers(self) -> list[ExpertLayer]:
        """The ExpertLayer modules of this rank's graphs (none where the model's own MoE
        code runs)."""
        # (an inference graph not rewritten yet has never run: it holds no routing)
        graphs = [g for g in (self._forward_gm, self.train_gm) if g is not None]
        return [m for g in graphs for m in g.modules() if isinstance(m, ExpertLayer)]

    # ------------------------------------------------------------------ state, one owner each
    @property
    def zero(self) -> ZeroState | None:
        """ZeRO state over dp (runtime.zero_state's interface), owned by `self.grads`."""
        return self.grads.zero

    @property
    def pipeline(self):
        """This rank's PipelineRunner once the training graph is built (pp > 1), owned by
        `self.grads`."""
        return self.grads.pipeline

    @property
    def held_optimizer(self):
        """Optimizer state a load read before this pipeline rank's stages existed."""
        return self._held_optimizer

    def hold_optimizer(self, held) -> None:
        """Keep loaded optimizer state until the stages and their optimizer exist."""
        self._held_optimizer = held

    def take_held_optimizer(self):
        """The held optimizer state, no longer held (None: none)."""
        held, self._held_optimizer = self._held_optimizer, None
        return held

    def restore_progress(self, steps: int, scaler_state: dict | None) -> None:
        """A checkpoint's step count and fp16 loss scaler state (None: it saved none)."""
        self.steps = steps
        if self.scaler is not None and scaler_state is not None:
            self.scaler.load_state_dict(scaler_state)

    # ------------------------------------------------------------------ accounting
    def predicted_comm(self, global_batch: int) -> dict[tuple[str, str], int]:
        """Bytes per (collective, axis) of one train_step at this global batch, from the plan."""
        return accounting.predicted_comm(self, global_batch)

    def predicted_comm_by_layer(self, global_batch: int) -> dict[tuple[str, str, str], int]:
        """Bytes per (collective, axis, layer) of one train_step, from the plan; what the step
        sends outside the graph (gradient sync, ZeRO, norms) is under layer "(step)"."""
        return accounting.predicted_comm_by_layer(self, global_batch)

    @property
    def device(self) -> torch.device:
        """Where this rank computes (its GPU under NCCL, else where the model was)."""
        return self._device

    def step_prediction(self, world=None) -> dict:
        """The plan's step time, memory per device and model FLOPs per step as this engine
        runs it, and the peak rate its MFU divides by (after the first train_step)."""
        return views().step_prediction(self, world)

    @staticmethod
    def global_rank() -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def explain(self, format: str = "text", world=None):
        """The plan's prediction beside what this rank measured per layer and mesh axis over
        the steps run (the first is a warm-up); `format="json"` returns a dict. `world`: an
        autopar.World whose hardware profile prices the plan (default: this machine's)."""
        data = views().measured_report(self, world)
        if format == "json":
            return data
        if format != "text":
            raise PlanError(f"explain format must be 'text' or 'json', not {format!r}.")
        return views().measured_text(data)

    def memory_snapshot(self, path) -> dict:
        """This rank's live memory by layer and kind, written at `path` (`.pickle`: the
        snapshot pytorch.org/memory_viz opens, the CUDA allocator's own on a GPU; `.json`;
        else a text table); returns the table."""
        return memory_snapshot(self, path)

    def parameter_bytes(self) -> dict[str, tuple[int, int]]:
        """Per parameter name: (bytes held by this rank, bytes of the whole parameter)."""
        return self.params.byte_counts(self.zero)

    def parameter_layouts(self) -> dict:
        """Per parameter and buffer name: its layout on the tensor axes (see `self.mesh`)."""
        return self.params.layouts_by_name()

    def replicated_parameters(self) -> list[str]:
        """Names of the parameters and buffers every tensor-parallel rank holds whole."""
        return self.params.replicated()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole weights on every rank, keyed and ordered as the original model's state_dict."""
        self.fetch_pipeline_weights()
        return self.params.full_state(self.groups, self.zero)

    def export(self, directory, max_shard_bytes: int = MAX_SHARD_BYTES) -> str:
        """Safetensors shards, index and configs of the trained weights under `directory`
        (runtime.startup.export); every rank calls it, a failure keeps an earlier export."""
        return export(self, directory, max_shard_bytes)

    def save(self, path, keep: int = 2, asynchronous: bool = False):
        """Checkpoint under the directory `path` (any plan and world loads it; the newest
        `keep` are kept); every rank calls it. Returns the checkpoint's directory, or with
        `asynchronous` an AsyncSave once the state is staged in host memory (the files are
        written in the background; `wait_for_checkpoint()` joins it)."""
        from autopar.runtime.checkpoint import save

        return save(self, path, keep=keep, asynchronous=asynchronous)

    def wait_for_checkpoint(self) -> str | None:
        """Join the background save in flight, if any: its directory, or its error."""
        pending, self.checkpointing.pending = self.checkpointing.pending, None
        return pending.wait() if pending is not None else None

    def load(self, path) -> str:
        """Restore a checkpoint `save` wrote under any plan or world (its directory, or one of
        its step directories). Every rank calls it; returns the checkpoint's directory."""
        from autopar.runtime.checkpoint import load

        return load(self, path)


def _accumulate(engine: Engine, inputs: tuple, target: torch.Tensor) -> torch.Tensor:
    """Engine._forward_backward without a pipeline: the replica's batch in the plan's
    micro-batches (one pass when 1), returning the loss over the whole batch."""
    zero = engine.zero
    m = engine.microbatches
    # gradient accumulation: each micro-batch's forward and backward in turn (its
    # activations freed before the next), the gradients summed in .grad (ZeRO-2/3: in
    # the pieces, reduce-scattered per micro-batch as the plan prices), each micro-batch's
    # loss weighted 1/m: equal micro-batches' mean losses average to the batch's
    parts = batches.micro_batches(inputs + (target,), m, engine.batch_split(), engine._dp.size)
    total = None
    for i, (*xs, y) in enumerate(parts):
        # (ZeRO-3: saved parameters are gathered again in the backward)
        with engine.recorder.saving(), \
                zero.saving() if zero is not None else contextlib.nullcontext():
            loss = engine.train_gm(*xs, y)
        last = i == m - 1
        if engine.grads.buckets is not None and last:  # the all-reduce overlaps the
            engine.grads.buckets.armed = True  # last backward, once per step
        scaled = loss * engine.scaler.scale if engine.scaler is not None else loss
        (scaled / m if m > 1 else scaled).backward()
        engine.recorder.backward_done()
        if m > 1:
            engine.recorder.next_microbatch()
            if not last and zero is not None:
                zero.microbatch_done()  # (ZeRO-2: this micro-batch's pieces, landed)
        total = loss.detach() if total is None else total + loss.detach()
    if zero is not None:
        zero.end_backward()
    return total / m if m > 1 else total


def _check_accumulation(m: int, pp: int, gm) -> None:
    """Micro-batches without a pipeline run each backward right after its forward: an MoE
    balance loss (a sum over the whole batch's routing) cannot be taken exactly."""
    if pp == 1 and m > 1 and with_balance_loss(gm):
        raise PlanError(f"the model's MoE balance loss is a sum over the whole batch, which {m} "
                        "micro-batches without a pipeline (each backward right after its "
                        "forward) cannot take exactly; leave the balance loss out of the loss, "
                        "or use microbatches=1.")


def _run_step(engine: Engine, inputs, targets) -> float:
    """One optimizer step (Engine.train_step, inside its watch)."""
    started, mark = time.perf_counter(), len(engine.comm_log.records)
    inputs = engine.batches.for_step(inputs, targets, engine.steps, engine.check_batches)
    engine.recorder.begin_step(engine.comm_log)
    for layer in engine.expert_layers():
        layer.reset_load()
    *local_inputs, local_target = engine.batches.local(inputs + (targets,))
    engine.ensure_train_graph(tuple(local_inputs), local_target)
    *local_inputs, local_target = engine.batches.tokens(
        tuple(local_inputs) + (local_target,), engine.train_graph)
    engine.train_gm.train()
    engine.recorder.constant = frozenset(  # what explain() does not count as activations
        t.untyped_storage().data_ptr() for t in (*engine.params.parameters(),
                                                 *engine.train_gm.buffers()))
    loss = engine._forward_backward(tuple(local_inputs), local_target)
    for hook in engine.after_backward:
        hook()
    engine.watch.at(engine.steps, "gradient sync")
    engine.grads.average()
    engine.watch.at(engine.steps, "optimizer step")
    engine.last_grad_norm = engine.grads.step(
        engine.optimizer, engine.scaler, engine.max_grad_norm,
        norm_phase=METRICS_PHASE if engine.metrics is not None else None)
    engine.watch.at(engine.steps, "loss average")
    engine.steps += 1
    value = loss.detach().float().reshape(1)
    if engine._dp.size > 1:
        value = engine._dp.all_reduce(value, "step") / engine._dp.size
    engine.recorder.finish_step(engine.comm_log)
    value = float(value)  # (waits for the step's kernels on a GPU)
    engine.watch.at(engine.steps - 1, "checkpoint and metrics")
    _after_step(engine, value, time.perf_counter() - started, mark, inputs)
    engine.watch.at(engine.steps - 1, "done")
    return value


def _build_forward(engine: Engine, model: nn.Module, example_inputs: tuple, forward_graph,
                   loss_fn) -> None:
    """The engine's forward graph (traced unless given), checked against its plan and mesh,
    its batches, and its solution and rewritten module (Engine.__init__)."""
    plan, groups = engine.plan, engine.groups
    engine.forward_graph = forward_graph if forward_graph is not None else \
        engine.trace_for(model, example_inputs, plan)
    # a training engine's balance loss under a pipeline: checked before any graph is cut
    if engine.moe_layers and engine._pp.size > 1 and loss_fn is not None:
        check_balance_loss(engine.forward_graph.gm, plan.pipeline.schedule)
    if engine.moe_layers and plan.ep > 1:  # experts' stacked weights: this rank's E/ep
        graph = engine.forward_graph
        engine.params.split_experts({graph.params[t].names[0] for t in expert_weights(graph.gm)},
                                    groups[EP])
        engine.grads.split_experts(groups[EDP], groups[EP].size)
    if engine._cp.size > 1 and engine.mesh.mode in MULTI_D and engine._pp.size == 1 and \
            plan.ep == 1 and not zero_sharded(plan.zero, engine._dp.size):
        engine.grads.sum_over_cp(engine._dp, engine._cp)  # one sync over dp x cp
    check_graph(engine.forward_graph, plan, engine.mesh)
    engine.batches = batches.Batches(example_inputs, engine.forward_graph, plan, engine.mesh,
                                     engine._dp, engine._cp, engine._device)
    engine.forward_solution = engine._solve(engine.forward_graph, fixed=None)
    _note_replicated(engine.plan, engine.forward_solution)
    check_divisible(engine.forward_graph, engine.forward_solution)
    # a training run never runs the inference graph: its rewrite waits for the first read
    # (Engine.forward_gm), but this rank's slices are cut now; under fp8 the float8 report
    # lists the inference graph's linears first, so it is rewritten now
    engine._forward_slices = _slices(engine, engine.forward_graph, engine.forward_solution)
    engine._forward_gm = None
    if engine.precision == FP8:
        engine.forward_gm  # noqa: B018 - rewritten now


def _rewrite_forward(engine: Engine) -> fx.GraphModule:
    """The inference graph rewritten, on the slices `_build_forward` cut (Engine.forward_gm)."""
    gm = _install(engine, _rewrite(engine, engine.forward_graph, engine.forward_solution),
                  engine._forward_slices)
    engine._forward_slices = None
    if engine.zero is not None:  # (ZeRO-3: each layer's gathers)
        engine.zero.rewrite(gm)
    return gm


def _rewrite(engine: Engine, traced, solution: Solution) -> fx.GraphModule:
    """The traced graph with the solution's sharded ops and collectives and the plan's
    passes (Engine._build), its tensors not yet this rank's (`_install`)."""
    gm = apply_solution(traced.gm, solution)
    if engine.compute_dtype is not None:  # 16-bit model part, fp32 masters and loss
        gm = cast_precision(gm, engine.compute_dtype)
    gm, engine.float8 = _float8(gm, solution, engine.precision, engine.float8,
                                engine.moe_layers, engine.fp8_recipe)
    if engine.moe_layers:
        gm = place_expert_layers(gm)
    if engine.chunked_loss:
        gm.meta[CHUNKED_LOSSES] = chunk_loss(gm, split=_splits_backward(engine.plan,
                                                                      engine._pp.size))
    retarget(gm, engine._device)  # a graph traced on meta makes its constants here
    return gm


def _slices(engine: Engine, traced, solution: Solution) -> dict[str, torch.Tensor]:
    """This rank's slice of every tensor the traced graph reads, by target; the traced graph
    lets go of the whole ones (this rank's slices are cut: the whole weights may go)."""
    engine.params.prepare(traced.gm, traced.params, solution.params)
    local = {t: engine.params.slice_for(traced.gm, p, solution.params.get(t))
             for t, p in traced.params.items()}
    release_tensors(traced)
    return local


def _install(engine: Engine, gm: fx.GraphModule, local: dict[str, torch.Tensor]) -> fx.GraphModule:
    """gm reading this rank's slices, its collectives and random streams bound."""
    shard_parameters(gm, local)
    bind(gm, engine.groups)
    bind_streams(gm, engine.streams)
    return gm


def _after_step(engine: Engine, loss: float, seconds: float, mark: int, inputs) -> None:
    """Save when one is due (parallelize's checkpoint_dir) and write the step's metrics
    (`mark`: where the step's records begin in the comm log)."""
    ck = engine.checkpointing
    if ck.due(engine.steps):
        engine.save(ck.directory, keep=ck.keep, asynchronous=ck.asynchronous)
    if engine.metrics is not None:
        sent: dict[str, int] = {}
        for r in engine.comm_log.records[mark:]:
            sent[r.axis] = sent.get(r.axis, 0) + r.bytes
        engine.metrics.record(engine, engine.steps, loss, seconds, inputs, sent,
                              engine.last_grad_norm)


def _stacked(outer, inner):
    """A context factory entering `outer()` then `inner()`."""
    @contextlib.contextmanager
    def both():
        with outer(), inner():
            yield

    return both


def _float8(gm: fx.GraphModule, solution: Solution, precision: str,
            report: Float8Report | None, moe_layers,
            recipe: str) -> tuple[fx.GraphModule, Float8Report | None]:
    """Under precision="fp8": gm with its eligible linears' GEMMs in float8
    (autopar.passes.float8), and `report` (a new one for None) told which, and that the MoE
    layers (autopar.kernels.moe_layers) keep their experts' GEMMs in bf16; else gm, None."""
    if precision != FP8:
        return gm, None
    report = report if report is not None else Float8Report()
    gm, made = float8_linears(gm, solution.params, TP, solution.sizes, recipe)
    report.merge(made)
    for name in moe_layers:
        report.kept.setdefault(name, EXPERTS_KEPT)
    return gm, report
def _splits_backward(plan: Plan, pp: int) -> bool:
    """Whether the schedule splits each backward into its input and weight halves through
    autograd's graph (zero-bubble): the chunked loss then gives each half a node."""
    return pp > 1 and plan.pipeline.schedule == ZERO_BUBBLE


def _blank(tensors: tuple, device: torch.device) -> tuple:
    """Zero tensors shaped like the examples, on the model's device (tracing reads no values)."""
    return tuple(torch.zeros(t.shape, dtype=t.dtype, device=device)
                 if isinstance(t, torch.Tensor) else t for t in tensors)


def _note_replicated(plan: Plan, solution: Solution) -> None:
    """Name in `plan.notes` every module whose ops run replicated, and why."""
    for region in solution.replicated_regions():
        note = f"ran replicated: {region}"
        if note not in plan.notes:
            plan.notes.append(note)
